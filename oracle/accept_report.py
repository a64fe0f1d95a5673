"""Rendering an acceptance measurement: the text table, the summary line, the JSON file and the PNG plot."""

import json
from pathlib import Path

import numpy as np

from oracle.accept import AcceptResult
from oracle.output import agg_figure, atomic_output

SCHEMA = "mtp-accept/1"
TARGET_NOTES = {
    "greedy": "target greedy: the main model's own argmax at each position, lm_head(H), teacher-forced on x; "
              "exactly what greedy verification checks when x is the main model's greedy output",
    "text": "target text: the sequence's own next tokens; a proxy for acceptance unless x is the main model's "
            "own greedy output",
}


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def render_report(result: AcceptResult) -> str:
    """The side-by-side table of p_j and α_j with their counts, then E[len] and the naive upper bound."""
    m = result.metrics
    lines = [f"acceptance: k={m.k} drafts per chain, {m.chains} chains (one after each bridge step "
             f"0..{m.chains - 1} of N={len(result.sequence)} tokens)",
             TARGET_NOTES[result.target], "",
             f"{'depth':>5}  {'p_j (unconditional)':<24}{'alpha_j (given drafts 1..j-1 right)'}"]
    for j in range(m.k):
        p = f"{_rate(m.p[j])}  ({m.hits[j]}/{m.chains})"
        alpha = f"{_rate(m.alpha[j])}  ({m.runs[j]}/{m.alpha_den[j]})"
        lines.append(f"{j + 1:>5}  {p:<24}{alpha}")
    lines += ["",
              f"E[len] = {m.e_len:.3f} tokens per round (chain-break: 1 + sum_j prod_(m<=j) alpha_m)",
              f"naive  = {m.e_len_naive:.3f} (1 + sum_j p_j: an upper bound; it ignores that draft j is only "
              f"checked when drafts 1..j-1 were accepted)"]
    return "\n".join(lines)


def summary_line(result: AcceptResult) -> str:
    """The greppable last line: `ACCEPT | k=4 chains=169 | E[len]=2.107 (naive upper bound 2.310) | ...`."""
    m = result.metrics
    alpha = ",".join("-" if a is None else f"{a:.2f}" for a in m.alpha)
    return (f"ACCEPT | k={m.k} chains={m.chains} | E[len]={m.e_len:.3f} (naive upper bound {m.e_len_naive:.3f}) "
            f"| alpha={alpha} | target={result.target}")


def result_json(result: AcceptResult, command: str = "") -> dict:
    """Everything measured: rates with their counts, and per chain its drafts and targets."""
    m = result.metrics
    accepted = np.logical_and.accumulate(result.drafts == result.targets, axis=1).sum(axis=1)  # (C,)
    return {
        "schema": SCHEMA, "k": m.k, "chains": m.chains, "target": result.target,
        "target_note": TARGET_NOTES[result.target],
        "p": list(m.p), "p_hits": list(m.hits),
        "alpha": list(m.alpha), "alpha_num": list(m.runs), "alpha_den": list(m.alpha_den),
        "e_len": m.e_len, "e_len_naive": m.e_len_naive,
        "sequence": result.sequence.tolist(),
        "per_chain": [{"position": i, "drafts": d.tolist(), "targets": t.tolist(), "accepted": int(a)}
                       for i, (d, t, a) in enumerate(zip(result.drafts, result.targets, accepted))],
        "source": result.source, "command": command,
    }


def write_json(result: AcceptResult, path: Path, command: str = "") -> None:
    with atomic_output(path, "--json") as tmp:
        tmp.write_text(json.dumps(result_json(result, command), indent=1, allow_nan=False) + "\n")


def write_plot(result: AcceptResult, path: Path) -> None:
    """A PNG of α_j and p_j by depth, with E[len] and the naive bound in the title."""
    m = result.metrics
    depth = np.arange(1, m.k + 1)
    fig = agg_figure((5, 3.5))  # the Agg canvas, without pyplot's global state
    ax = fig.add_subplot()
    alpha = [np.nan if a is None else a for a in m.alpha]  # undefined α_j leaves a gap
    ax.plot(depth, alpha, "o-", label="α_j (conditional)")
    ax.plot(depth, m.p, "s--", label="p_j (unconditional)")
    ax.set_xticks(depth)
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("draft depth j")
    ax.set_ylabel("acceptance rate")
    ax.set_title(f"E[len]={m.e_len:.3f} (naive {m.e_len_naive:.3f}), {m.chains} chains, target={result.target}",
                 fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    with atomic_output(path, "--plot") as tmp:
        fig.savefig(tmp, format="png", dpi=100)
