"""Rendering an acceptance measurement: the text table, the summary line, the JSON file and the PNG plot."""

import json
import re
from pathlib import Path

import numpy as np

from oracle.accept import AcceptMetrics, AcceptResult, QuantizeComparison
from oracle.output import agg_figure, atomic_output, figure_format
from oracle.quantize_sim import SCHEMES, QuantizedTensor

SCHEMA = "mtp-accept/1"  # extended compatibly: `quantize` is present only with --quantize (see result_json)
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
    if result.quantize is not None:
        lines += ["", *quantization_lines(result)]
    return "\n".join(lines)


def quantization_lines(result: AcceptResult) -> list[str]:
    """The quantized tensors with their errors, then α_j of both heads side by side with the drafts they share."""
    q, m = result.quantize, result.metrics
    base = q.baseline
    lines = ["quantization (simulated: quantized then dequantized to float32; the rates above are the quantized "
             "head's; the unquantized head drafted the same chains from the same H against the same targets):"]
    for spec in q.head.specs:
        lines.append(f"  {spec}: {SCHEMES[spec.scheme]}")
    rows = _tensor_rows(q.head.tensors)
    width = max(len(name) for name, _, _ in rows)
    lines.append(f"  {'tensor':<{width}}  {'scheme':<8}  rel. error |Wq-W|/|W|")
    lines += [f"  {name:<{width}}  {scheme:<8}  {error}" for name, scheme, error in rows]
    lines += [f"  kept as stored: {len(q.head.kept)} head tensors (1-D norms/biases, FP8 scales, those no GLOB "
              f"matched)", "",
              f"{'depth':>5}  {'alpha_j unquantized':<22}{'alpha_j quantized':<22}{'change':<9}drafts identical"]
    same = result.drafts == q.baseline_drafts  # (C, k)
    for j in range(m.k):
        change = "-" if m.alpha[j] is None or base.alpha[j] is None else f"{m.alpha[j] - base.alpha[j]:+.3f}"
        lines.append(f"{j + 1:>5}  {_rate_with_counts(base, j):<22}{_rate_with_counts(m, j):<22}{change:<9}"
                     f"{same[:, j].mean():.3f}  ({int(same[:, j].sum())}/{m.chains})")
    changed = int((~same).sum())
    lines += ["", f"E[len] {base.e_len:.3f} unquantized -> {m.e_len:.3f} quantized ({m.e_len - base.e_len:+.3f} "
                  f"+- {e_len_change_se(result):.3f} paired s.e., {(m.e_len - base.e_len) / base.e_len:+.1%}); "
                  f"drafts changed: {changed} of {same.size} ({changed / same.size:.1%}) in "
                  f"{int((~same).any(axis=1).sum())} of {m.chains} chains",
              "(E[len] - 1 is the mean accepted run per chain, so its change is the mean of the per-chain changes; "
              "the s.e. is theirs over chains, an underestimate as neighbouring chains share tokens: read a change "
              "within ~2 s.e. as no measured cost)"]
    return lines


def _tensor_rows(tensors: tuple[QuantizedTensor, ...]) -> list[tuple[str, str, str]]:
    """(name, scheme, error) per tensor; tensors whose names differ only in numbered parts (experts, layers) under
    one scheme share a row, `experts.*.up_proj.weight x256` with the range of their errors (the JSON has each)."""
    groups: dict[tuple[str, str], list[QuantizedTensor]] = {}
    for t in tensors:
        groups.setdefault((re.sub(r"(?<=\.)\d+(?=\.)", "*", t.name), t.spec.scheme), []).append(t)
    rows = []
    for (pattern, scheme), members in groups.items():
        errors = [t.rel_error for t in members]
        if len(members) == 1:
            rows.append((members[0].name, scheme, f"{errors[0]:.2e}"))
        else:
            rows.append((f"{pattern} x{len(members)}", scheme, f"{min(errors):.2e} .. {max(errors):.2e}"))
    return rows


def _accepted(drafts: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """Per chain, the drafts accepted before the first wrong one (C,)."""
    return np.logical_and.accumulate(drafts == targets, axis=1).sum(axis=1)


def e_len_change_se(result: AcceptResult) -> float:
    """Standard error of the quantized-minus-unquantized E[len], from the paired per-chain accepted lengths."""
    diff = _accepted(result.drafts, result.targets) - _accepted(result.quantize.baseline_drafts, result.targets)
    return float(diff.std(ddof=1) / np.sqrt(len(diff))) if len(diff) > 1 else float("nan")


def _rate_with_counts(m: AcceptMetrics, j: int) -> str:
    return f"{_rate(m.alpha[j])}  ({m.runs[j]}/{m.alpha_den[j]})"


def summary_line(result: AcceptResult) -> str:
    """The greppable last line: `ACCEPT | k=4 chains=169 | E[len]=2.107 (naive upper bound 2.310) | ...`."""
    m = result.metrics
    alpha = ",".join("-" if a is None else f"{a:.2f}" for a in m.alpha)
    line = (f"ACCEPT | k={m.k} chains={m.chains} | E[len]={m.e_len:.3f} (naive upper bound {m.e_len_naive:.3f}) "
            f"| alpha={alpha} | target={result.target}")
    if result.quantize is None:
        return line
    q = result.quantize
    changed = int((result.drafts != q.baseline_drafts).sum())
    return (f"{line} | quantized: {' '.join(map(str, q.head.specs))} | unquantized E[len]={q.baseline.e_len:.3f} "
            f"| drafts changed {changed}/{result.drafts.size}")


def result_json(result: AcceptResult, command: str = "") -> dict:
    """Everything measured: rates with their counts, and per chain its drafts and targets."""
    m = result.metrics
    accepted = _accepted(result.drafts, result.targets)  # (C,)
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
    } | ({} if result.quantize is None else {"quantize": quantize_json(result)})


def quantize_json(result: AcceptResult) -> dict:
    """With --quantize (the top-level figures are then the quantized head's): the specs, each quantized tensor
    with its relative error, the tensors kept, and the unquantized head's figures and drafts on the same chains."""
    q: QuantizeComparison = result.quantize
    base, same = q.baseline, result.drafts == q.baseline_drafts  # (C, k)
    return {
        "specs": [{"glob": s.glob, "scheme": s.scheme, "description": SCHEMES[s.scheme]} for s in q.head.specs],
        "tensors": [{"name": t.name, "shape": list(t.shape), "scheme": t.spec.scheme, "glob": t.spec.glob,
                     "rel_error": t.rel_error} for t in q.head.tensors],
        "kept": list(q.head.kept),
        "baseline": {"p": list(base.p), "p_hits": list(base.hits), "alpha": list(base.alpha),
                     "alpha_num": list(base.runs), "alpha_den": list(base.alpha_den), "e_len": base.e_len,
                     "e_len_naive": base.e_len_naive, "drafts": q.baseline_drafts.tolist()},
        "e_len_change": result.metrics.e_len - base.e_len,
        "e_len_change_se": _finite_or_none(e_len_change_se(result)),  # paired, over chains (see the text report)
        "drafts_identical": [float(v) for v in same.mean(axis=0)],
        "drafts_changed": int((~same).sum()), "chains_changed": int((~same).any(axis=1).sum()),
    }


def _finite_or_none(value: float) -> float | None:
    return value if np.isfinite(value) else None


def write_json(result: AcceptResult, path: Path, command: str = "") -> None:
    with atomic_output(path, "--json") as tmp:
        tmp.write_text(json.dumps(result_json(result, command), indent=1, allow_nan=False) + "\n")


def write_plot(result: AcceptResult, path: Path) -> None:
    """A picture (PNG, or what the extension names) of α_j and p_j by depth, with E[len] and the naive bound."""
    m = result.metrics
    depth = np.arange(1, m.k + 1)
    fig = agg_figure((5, 3.5))  # the Agg canvas, without pyplot's global state
    ax = fig.add_subplot()
    alpha = [np.nan if a is None else a for a in m.alpha]  # undefined α_j leaves a gap
    ax.plot(depth, alpha, "o-", label="α_j (conditional)" + (", quantized" if result.quantize else ""))
    if result.quantize is not None:
        base = [np.nan if a is None else a for a in result.quantize.baseline.alpha]
        ax.plot(depth, base, "o:", color="grey", label="α_j unquantized")
    ax.plot(depth, m.p, "s--", label="p_j (unconditional)")
    ax.set_xticks(depth)
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("draft depth j")
    ax.set_ylabel("acceptance rate")
    unquantized = "" if result.quantize is None else f" (unquantized {result.quantize.baseline.e_len:.3f})"
    ax.set_title(f"E[len]={m.e_len:.3f}{unquantized} (naive {m.e_len_naive:.3f}), {m.chains} chains, "
                 f"target={result.target}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    with atomic_output(path, "--plot") as tmp:
        fig.savefig(tmp, format=figure_format(path, "--plot"), dpi=100)
