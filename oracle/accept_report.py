"""Rendering an acceptance measurement: the text table, the summary line, the JSON file and the PNG plot."""

import json
import re
from pathlib import Path

import numpy as np

from oracle.accept import AcceptMetrics, AcceptResult, QuantizeComparison
from oracle.accept_conventions import (FEW_TRIALS, Figure, Settings, by_key, conventions, counterpart,
                                       position_buckets)
from oracle.engine_logs import EngineFigure
from oracle.output import agg_figure, atomic_output, figure_format
from oracle.speedup import quantized_worth_line, speed_json, speed_lines, speed_summary
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


def render_report(result: AcceptResult, engine: list[EngineFigure] | None = None, speed=None) -> str:
    """The side-by-side table of p_j and α_j with their counts, then E[len] and the naive upper bound."""
    m = result.metrics
    lines = [f"acceptance: k={m.k} drafts per chain, {m.chains} chains (one after each bridge step "
             f"0..{m.chains - 1} of N={len(result.sequence)} tokens)",
             TARGET_NOTES[result.target], *_layer_note(result), ""]
    layered = any(result.depth_layers)  # an N-layer head: the table names each depth's layer
    layer_head = f"{'layer':>5}  " if layered else ""
    lines.append(f"{'depth':>5}  {layer_head}{'p_j (unconditional)':<24}{'alpha_j (given drafts 1..j-1 right)'}")
    for j, layer in enumerate(result.depth_layers):
        p = f"{_rate(m.p[j])}  ({m.hits[j]}/{m.chains})"
        alpha = f"{_rate(m.alpha[j])}  ({m.runs[j]}/{m.alpha_den[j]})"
        lines.append(f"{j + 1:>5}  {f'{layer:>5}  ' if layered else ''}{p:<24}{alpha}")
    lines += ["",
              f"E[len] = {m.e_len:.3f} tokens per round (chain-break: 1 + sum_j prod_(m<=j) alpha_m)",
              f"naive  = {m.e_len_naive:.3f} (1 + sum_j p_j: an upper bound; it ignores that draft j is only "
              f"checked when drafts 1..j-1 were accepted)"]
    if result.quantize is not None:
        lines += ["", *quantization_lines(result)]
    lines += ["", *convention_lines(result)]
    if speed is not None:
        lines += ["", *speed_report_lines(speed)]
    if engine is not None:
        lines += ["", *engine_lines(compare_engine(result, engine))]
    return "\n".join(lines)


def _layer_note(result: AcceptResult) -> list[str]:
    """Which physical MTP layer each depth ran: an N-layer head's alpha_j is its layer j-1's, measured once."""
    if not any(result.depth_layers):
        return []
    return [f"layer: depth j ran MTP layer j-1 (transformers' MtpModel, each layer its own cache), so alpha_j is "
            f"layer j-1's acceptance given drafts 1..j-1 right: "
            + ", ".join(f"depth {j} -> layer {layer}" for j, layer in enumerate(result.depth_layers, start=1))]


# ---- the engines' conventions -------------------------------------------------------------------------------------


def settings_of(result: AcceptResult) -> Settings:
    return result.settings if result.settings is not None else Settings(k=result.metrics.k)


def result_conventions(result: AcceptResult) -> list[Figure]:
    """Every engine's figure from this measurement (accept_conventions.conventions)."""
    stats = result.stats
    return conventions(result.drafts == result.targets, settings_of(result),
                       None if stats is None else stats.confidence, None if stats is None else stats.beta)


def _interval(f: Figure) -> str:
    if f.interval is None or f.value is None:
        return "-"
    return f"[{f.interval[0]:.3f}, {f.interval[1]:.3f}]"


def _value(f: Figure) -> str:
    return "-" if f.value is None else f"{f.value:.3f}"


def settings_text(settings: Settings) -> str:
    """k, the gate and the verification, as the text report states them."""
    if settings.p_min is None:
        gate = "p_min not simulated"
    else:
        over = f"its top {settings.p_min_top_k} logits" if settings.p_min_top_k else "the whole vocabulary"
        gate = f"p_min={settings.p_min} over {over}"
    verification = ("greedy" if settings.temperature is None else
                    f"sampled at T={settings.temperature} ({settings.draft_sampling} drafts)")
    return f"k=n_max={settings.k}, {gate}, n_min={settings.n_min}, verification={verification}"


def convention_lines(result: AcceptResult) -> list[str]:
    """Each engine's figure with its 95 % interval and definition; the settings; the table along the sequence."""
    settings, figures = settings_of(result), result_conventions(result)
    positions = result.chain_positions
    lines = [f"as engines count it (settings: {settings_text(settings)}, chains after bridge steps "
             f"{int(positions[0])}..{int(positions[-1])}):",
             f"  {'engine':<10}{'figure':<46}{'value':>7}  {'95% interval':<17}{'n':>6}  interval"]
    for f in figures:
        few = f"  TOO FEW (n<{FEW_TRIALS}): decides nothing" if f.too_few and f.interval is not None else ""
        lines.append(f"  {f.engine:<10}{f.name:<46}{_value(f):>7}  {_interval(f):<17}{f.trials:>6}  "
                     f"{f.method}{few}")
    lines += ["  definitions:"]
    seen = set()
    for f in figures:
        stem = f.key.rstrip("0123456789")
        if stem in seen:
            continue
        seen.add(stem)
        lines.append(f"    {f.key if not stem.endswith('_') else stem + 'j'}: {f.definition}")
    lines += ["  (chains start after every bridge step, an engine's rounds where the last one ended: each figure is "
              "the average over round starts; Wilson intervals treat chains as independent, though neighbours share "
              "tokens: read them as a little narrow)"]
    lines += ["", *bucket_lines(result)]
    return lines


def result_buckets(result: AcceptResult):
    stats = result.stats
    return position_buckets(result.drafts == result.targets, result.chain_positions, settings_of(result),
                            None if stats is None else stats.confidence, None if stats is None else stats.beta)


def bucket_lines(result: AcceptResult) -> list[str]:
    """alpha_1, E[len] (and the gated and sampled figures where set) per range of context positions."""
    settings = settings_of(result)
    keys = ["alpha_1", "e_len", "llama_cpp_acceptance_rate"] + (["sampled_e_len"] if settings.temperature else [])
    names = ["alpha_1", "E[len]", "llama.cpp rate"] + (["E[len] sampled"] if settings.temperature else [])
    header = "".join(f"{n:<26}" for n in names)
    lines = [f"along the sequence (context position = bridge step; {settings.buckets} bucket(s) of contiguous chains):",
             f"  {'positions':<14}{'chains':>7}  {header}"]
    for bucket in result_buckets(result):
        cells = "".join(f"{_value(bucket.figures[k]) + ' ' + _interval(bucket.figures[k]):<26}" for k in keys)
        chains = bucket.figures["e_len"].trials
        few = "  too few chains to decide" if chains < FEW_TRIALS else ""
        lines.append(f"  {f'{bucket.first}..{bucket.last - 1}':<14}{chains:>7}  {cells}{few}")
    return lines


# ---- the engine's own number ----------------------------------------------------------------------------------


def compare_engine(result: AcceptResult, engine: list[EngineFigure]) -> list[dict]:
    """Each engine figure beside ours under the same convention (the sampled one when verification samples)."""
    ours = by_key(result_conventions(result))
    sampled = settings_of(result).temperature is not None
    rows = []
    for e in engine:
        mine = ours.get(counterpart(e.key, sampled))
        if e.engine == "llama.cpp" and settings_of(result).p_min is None:
            verdict = "undecided (llama.cpp's rate depends on its gate: pass --p-min as the engine ran it)"
        elif mine is None or mine.value is None or mine.interval is None or not np.isfinite(mine.interval).all():
            verdict = "undecided (no interval of ours)"
        elif mine.too_few:
            verdict = f"undecided (too few: n={mine.trials})"
        elif mine.interval[0] <= e.value <= mine.interval[1]:
            verdict = "inside"
        else:
            verdict = "OUTSIDE"
        rows.append({"engine": e.engine, "key": e.key, "engine_value": e.value, "source": e.source,
                     "ours_key": None if mine is None else mine.key, "ours": None if mine is None else mine.value,
                     "interval95": None if mine is None or mine.interval is None else list(mine.interval),
                     "verdict": verdict})
    return rows


def engine_lines(rows: list[dict]) -> list[str]:
    lines = ["the engine's own numbers beside ours (same convention, our 95% interval):"]
    for r in rows:
        interval = "-" if r["interval95"] is None else f"[{r['interval95'][0]:.3f}, {r['interval95'][1]:.3f}]"
        ours = "-" if r["ours"] is None else f"{r['ours']:.3f}"
        lines.append(f"  {r['engine']:<10}{r['key']:<36} engine {r['engine_value']:.3f}  ours {ours} {interval}  "
                     f"{r['verdict']}")
        lines.append(f"  {'':<10}from {r['source']}")
    return lines


def engine_verdict(rows: list[dict]) -> str:
    """pass, diverged (an engine number outside our interval), or inconclusive (nothing decided)."""
    if any(r["verdict"] == "OUTSIDE" for r in rows):
        return "diverged"
    return "pass" if rows and all(r["verdict"] == "inside" for r in rows) else "inconclusive"


def engine_summary(rows: list[dict]) -> str:
    outside = [r for r in rows if r["verdict"] == "OUTSIDE"]
    if outside:
        r = outside[0]
        more = f" (and {len(outside) - 1} more)" if len(outside) > 1 else ""
        return (f"engine {r['engine']} {r['key']}={r['engine_value']:.3f} OUTSIDE ours {r['ours']:.3f} "
                f"[{r['interval95'][0]:.3f}, {r['interval95'][1]:.3f}]{more}: if the head diffs clean stage by stage, "
                f"look at the engine's draft loop or its verification")
    inside = sum(r["verdict"] == "inside" for r in rows)
    return f"engine: {inside}/{len(rows)} figures inside our 95% intervals"


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


def speed_report_lines(speed) -> list[str]:
    """The speed table (oracle/speedup.py); with --quantize the unquantized head's beside it."""
    measured, base = speed
    if base is None:
        return speed_lines(measured)
    return (["quantized head:", *speed_lines(measured), "unquantized head:", *speed_lines(base),
             quantized_worth_line(measured, base)])


def summary_line(result: AcceptResult, engine: list[EngineFigure] | None = None, speed=None) -> str:
    """The greppable last line: `ACCEPT | k=4 chains=169 | E[len]=2.107 (naive upper bound 2.310) | ...`, with
    the E[len] interval, the gated/sampled figures where set, and whether an engine's number falls outside."""
    m = result.metrics
    alpha = ",".join("-" if a is None else f"{a:.2f}" for a in m.alpha)
    figures = by_key(result_conventions(result))
    line = (f"ACCEPT | k={m.k} chains={m.chains} | E[len]={m.e_len:.3f} (naive upper bound {m.e_len_naive:.3f}) "
            f"| alpha={alpha} | target={result.target} | 95% E[len] {_interval(figures['e_len'])}")
    settings = settings_of(result)
    if settings.p_min is not None:
        line += f" | llama.cpp rate={_value(figures['llama_cpp_acceptance_rate'])} at p_min={settings.p_min}"
    if settings.temperature is not None:
        line += f" | sampled E[len]={_value(figures['sampled_e_len'])} at T={settings.temperature}"
    if result.quantize is not None:
        q = result.quantize
        changed = int((result.drafts != q.baseline_drafts).sum())
        line += (f" | quantized: {' '.join(map(str, q.head.specs))} | unquantized E[len]={q.baseline.e_len:.3f} "
                 f"| drafts changed {changed}/{result.drafts.size}")
    if speed is not None:
        line += " | " + speed_summary(speed[0])
        if speed[1] is not None:
            line += f" (unquantized {speed_summary(speed[1])})"
    if engine is not None:
        line += " | " + engine_summary(compare_engine(result, engine))
    return line


def result_json(result: AcceptResult, command: str = "", engine: list[EngineFigure] | None = None,
                speed=None) -> dict:
    """Everything measured: rates with their counts, and per chain its drafts and targets."""
    m = result.metrics
    accepted = _accepted(result.drafts, result.targets)  # (C,)
    stats = result.stats
    per_chain = [{"position": int(i), "drafts": d.tolist(), "targets": t.tolist(), "accepted": int(a)}
                 for i, d, t, a in zip(result.chain_positions, result.drafts, result.targets, accepted)]
    if stats is not None:
        for row, conf, full in zip(per_chain, stats.confidence, stats.confidence_full):
            row["confidence"], row["confidence_full_vocab"] = conf.tolist(), full.tolist()
        if stats.beta is not None:
            for row, beta in zip(per_chain, stats.beta):
                row["acceptance_probability"] = beta.tolist()
    extra = {"settings": settings_of(result).as_json(),
             "conventions": [f.as_json() for f in result_conventions(result)],
             "buckets": [{"positions": [b.first, b.last], "figures": {k: f.as_json() for k, f in b.figures.items()}}
                         for b in result_buckets(result)]}
    if engine is not None:
        rows = compare_engine(result, engine)
        extra["engine"] = {"comparisons": rows, "verdict": engine_verdict(rows)}
    if speed is not None:
        extra["speed"] = speed_json(speed[0]) | ({} if speed[1] is None else {"unquantized": speed_json(speed[1])})
    return extra | {
        "schema": SCHEMA, "k": m.k, "chains": m.chains, "target": result.target,
        "target_note": TARGET_NOTES[result.target],
        "p": list(m.p), "p_hits": list(m.hits),
        "alpha": list(m.alpha), "alpha_num": list(m.runs), "alpha_den": list(m.alpha_den),
        "layers": list(result.depth_layers),  # the physical MTP layer of depths 1..k
        "e_len": m.e_len, "e_len_naive": m.e_len_naive,
        "sequence": result.sequence.tolist(),
        "per_chain": per_chain,
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


def write_json(result: AcceptResult, path: Path, command: str = "", engine: list[EngineFigure] | None = None,
               speed=None) -> None:
    data = _json_safe(result_json(result, command, engine, speed))
    with atomic_output(path, "--json") as tmp:
        tmp.write_text(json.dumps(data, indent=1, allow_nan=False) + "\n")


def _json_safe(value):
    """NaN and infinities (an interval no resample could form) as null: JSON has no NaN."""
    if isinstance(value, float):
        return value if np.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


def _plot_conventions(ax, result: AcceptResult) -> None:
    """The engines' per-depth rates with their 95 % intervals; their lengths and rates in the title."""
    figures = by_key(result_conventions(result))
    k = result.metrics.k
    depth = np.arange(1, k + 1)
    for prefix, label, marker in (("alpha_", "ours: alpha_j (conditional)", "o-"),
                                  ("vllm_rate_", "vLLM per-position rate (unconditional)", "s--"),
                                  ("sampled_alpha_", "ours: alpha_j sampled", "^:")):
        rows = [figures.get(f"{prefix}{j}") for j in depth]
        if rows[0] is None:
            continue
        value = np.array([np.nan if f.value is None else f.value for f in rows])
        low = np.array([np.nan if f.interval is None else f.interval[0] for f in rows])
        high = np.array([np.nan if f.interval is None else f.interval[1] for f in rows])
        ax.errorbar(depth, value, yerr=[np.nan_to_num(value - low), np.nan_to_num(high - value)], fmt=marker,
                    capsize=3, label=label)
    ax.set_xticks(depth)
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("draft depth j")
    ax.set_ylabel("rate (95% interval)")
    llama = figures["llama_cpp_acceptance_rate"]
    ax.set_title(f"vLLM AL = SGLang accept len = E[len] {_value(figures['e_len'])} {_interval(figures['e_len'])}\n"
                 f"llama.cpp accepted/generated {_value(llama)} {_interval(llama)}", fontsize=8)
    ax.legend(fontsize=7)


def _plot_speed(ax, speed) -> None:
    """Speedup against k with its 95 % interval (and the unquantized head's with --quantize)."""
    for part, label, marker in ((speed[0], "speedup" if speed[1] is None else "quantized head", "o-"),
                                (speed[1], "unquantized head", "s:")):
        if part is None:
            continue
        k = np.array([r.k for r in part.rows])
        value = np.array([r.speedup for r in part.rows])
        low, high = np.array([r.interval for r in part.rows]).T
        ax.errorbar(k, value, yerr=[value - low, high - value], fmt=marker, capsize=3, label=label)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks([r.k for r in speed[0].rows])
    ax.set_xlabel("k (drafts per round)")
    ax.set_ylabel("speedup over plain decoding")
    ax.set_title(speed_summary(speed[0]), fontsize=8)
    ax.legend(fontsize=7)


def write_plot(result: AcceptResult, path: Path, speed=None) -> None:
    """A picture (PNG, or what the extension names) of α_j and p_j by depth, with E[len] and the naive bound."""
    m = result.metrics
    depth = np.arange(1, m.k + 1)
    panels = 2 if speed is None else 3
    fig = agg_figure((5 * panels, 3.5))  # the Agg canvas, without pyplot's global state
    ax = fig.add_subplot(1, panels, 1)
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
    _plot_conventions(fig.add_subplot(1, panels, 2), result)
    if speed is not None:
        _plot_speed(fig.add_subplot(1, panels, 3), speed)
    fig.tight_layout()
    with atomic_output(path, "--plot") as tmp:
        fig.savefig(tmp, format=figure_format(path, "--plot"), dpi=100)
