"""Rendering the draft loop's depths (issue 24) for probe/report.py: the text block and the JSON keys.

A depth-j report is a DiffReport of its own (probe/chain.py) whose tokens are bridge positions; its grid is drawn
by probe/report.py's own table. Depths that pass get one line each; a depth that diverged or is invalid also gets
its grid, its failed self-checks and its first divergent row, so one bad depth stands out among many.
"""

from probe.chain import ChainDiff, DepthDiff
from probe.diff import DiffReport
from probe.report import _ranges, _table, budget_text, cell_detail, coverage_text, depth_qk_lines

_SHOWN_RANGES = 6  # recycle rows that are not evidential: at most this many ranges are listed per alternative


def chain_text(report: DiffReport, verbose: bool = False) -> str:
    """The "draft loop" block of the text report ("" for a reference without chains)."""
    chain = report.chain
    if chain is None:
        return ""
    info = chain.info
    lines = [f"draft loop: the reference records depths 2..{info.depths} (tokens {info.tokens}, recycle "
             f"{info.recycle}, layers {', '.join(map(str, info.layers))}, kv {info.kv})",
             f"  {layer_text(info)}",
             f"  {'depth':<6}{'layer':>5}{'bridges':>8}  {'verdict':<13}{'first divergence':<28}captured",
             f"  {1:<6}{0:>5}{report.num_tokens:>8}  {chain.bridge_verdict.name:<13}{_first_text(report):<28}"
             f"{coverage_text(report.captured, report.stage_names)}"]
    parts = {d.depth: d for d in chain.depths}
    for depth in info.chain_depths:
        part = parts.get(depth)
        layer = info.layers[depth - 2]
        if part is None:
            why = "not captured (never counted as passed)" if depth in chain.not_captured else chain.not_compared
            lines.append(f"  {depth:<6}{layer:>5}{'-':>8}  {why}")
            continue
        r = part.report
        lines.append(f"  {depth:<6}{layer:>5}{r.num_tokens:>8}  {r.verdict.name:<13}{_first_text(r):<28}"
                     f"{coverage_text(r.captured, r.stage_names)}")
    lines += [f"  {line}" for part in chain.depths for line in _recycle_lines(part) + depth_qk_lines(part.report)]
    blocks = ["\n".join(lines)]
    blocks += [_depth_detail(part, verbose) for part in chain.depths if part.report.verdict.name in ("diverged",
                                                                                                    "invalid")]
    return "\n\n".join(blocks)


def layer_text(info) -> str:
    """Which physical MTP layer each depth ran in the reference, and by which convention (issue 25)."""
    ran = ", ".join(f"depth {j} layer {layer}" for j, layer in zip(info.chain_depths, info.layers))
    if info.num_layers <= 1:
        return "layer per depth: one MTP layer, layer 0 at every depth (depth 1 included)"
    line = f"layer per depth (the reference's physical MTP layer of {info.num_layers}): depth 1 layer 0, {ran}"
    if info.layer_convention:
        line += f"; convention: {info.layer_convention}"
    if any(layer != j - 1 for j, layer in zip(info.chain_depths, info.layers)):
        line += (f"; depths past {info.num_layers} reuse layers by the % {info.num_layers} convention (vLLM's "
                 f"spec_step_idx % N), not transformers' MtpModel, which has one layer per depth")
    return line


def _first_text(report: DiffReport) -> str:
    first = report.first
    if first is None:
        return "-"
    return f"{first.stage} at {'token' if report.depth == 1 else 'bridge'} {first.token} " \
           f"({budget_text(first.diff.budget_used)})"


def _recycle_lines(part: DepthDiff) -> list[str]:
    """Per alternative: the rows that evidence the recycle choice, and those where it cannot show."""
    lines = []
    for evidence in part.recycle:
        blind = evidence.not_evidential.tolist()
        shown = _ranges(tuple(blind[:200])) if blind else ""
        more = len(_ranges(tuple(blind)).split(", ")) > _SHOWN_RANGES if blind else False
        if more:
            shown = ", ".join(shown.split(", ")[:_SHOWN_RANGES]) + ", ..."
        lines.append(f"depth {part.depth}: recycle ({part.report.depth - 1} -> {part.depth}) vs {evidence.alt}: "
                     f"evidenced by {int(evidence.evidencing.sum())} of {len(evidence.sensitive)} h rows"
                     + (f"; not evidential at bridge(s) {shown} (recycling {evidence.alt} gives the same h there)"
                        if blind else ""))
    if part.recycle_note:
        lines.append(part.recycle_note)
    layer = part.layer_evidence
    if layer is not None:
        lines.append(f"depth {part.depth}: layer choice vs layer 0: evidenced by {int(layer.evidencing.sum())} of "
                     f"{len(layer.sensitive)} out rows (where running layer 0 would have failed)")
    if part.layer_evidence_note:
        lines.append(part.layer_evidence_note)
    return lines


def _depth_detail(part: DepthDiff, verbose: bool) -> str:
    r = part.report
    lines = [_table(r)]
    if r.issues:
        lines.append(f"depth {part.depth} self-checks FAILED (verdict invalid):")
        lines += [f"  - {i.message}" + (f" [bridges {_ranges(i.tokens)}]" if i.tokens else "") for i in r.issues]
    if r.first is not None:
        lines.append(f"first divergence at depth {part.depth}: stage {r.first.stage} at bridge {r.first.token}")
        lines.append(cell_detail(r.first, verbose, r.stage_names).replace(f" token {r.first.token}",
                                                                         f" depth {part.depth} bridge "
                                                                         f"{r.first.token}", 1))
    return "\n".join(lines)


def chain_json(report: DiffReport) -> dict:
    """The JSON report's chain keys: `chain` (the reference's record, null without one) and `depths` (one entry per
    depth, 1 first, with its verdict, first divergence and recycle evidence; depths not captured say so)."""
    chain: ChainDiff | None = report.chain
    if chain is None:
        return {"chain": None, "depths": [_depth_json(1, report, None)]}
    info = chain.info
    entries = [_depth_json(1, report, chain.bridge_verdict) | {"layer": 0}]
    parts = {d.depth: d for d in chain.depths}
    for depth in info.chain_depths:
        part = parts.get(depth)
        entries.append((_depth_json(depth, part.report, part.report.verdict, part) if part else
                        {"depth": depth, "captured": depth not in chain.not_captured, "verdict": None,
                         "reason": "not captured" if depth in chain.not_captured else chain.not_compared})
                       | {"layer": info.layers[depth - 2]})
    return {"chain": {"depths": info.depths, "tokens": info.tokens, "recycle": info.recycle,
                      "layers": list(info.layers), "num_layers": info.num_layers, "kv": info.kv,
                      "layer_convention": info.layer_convention},
            "depths": entries}


def _depth_json(depth: int, report: DiffReport, verdict, part: DepthDiff | None = None) -> dict:
    verdict = verdict or report.verdict
    first = report.first
    entry = {"depth": depth, "captured": True, "num_rows": report.num_tokens, "verdict": verdict.name,
             "reasons": list(verdict.reasons), "stages_captured": list(report.captured),
             "first_divergence": {"stage": first.stage, "token": first.token} if first else None,
             "issues": [{"kind": i.kind, "where": i.where, "tokens": list(i.tokens), "message": i.message}
                        for i in report.issues] if depth > 1 else []}
    if part is not None:
        entry["recycle_evidence"] = {e.alt: {"evidencing_rows": e.evidencing.nonzero()[0].tolist(),
                                             "not_evidential_rows": e.not_evidential.tolist()} for e in part.recycle}
        entry["recycle_note"] = part.recycle_note
        if part.layer_evidence is not None:
            entry["layer_evidence"] = {"evidencing_rows": part.layer_evidence.evidencing.nonzero()[0].tolist(),
                                       "not_evidential_rows": part.layer_evidence.not_evidential.tolist()}
        entry["layer_evidence_note"] = part.layer_evidence_note
        entry["qk_parts"] = depth_qk_lines(report)  # judged with this depth's own /chain/d{j}/evidence/qk_<part>
    return entry
