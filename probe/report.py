"""Rendering a `DiffReport`: the terminal report, the greppable summary line, and the JSON report.

This is the only module of the probe that formats text. Sides are labelled by role: `oracle` (the reference
trace) and `candidate`.
"""

import json
import math
from pathlib import Path

from oracle.output import atomic_output
from oracle.stages import STAGE_NAMES
from oracle.text import printable

from probe.adapters.trace_file import CHECKED_INPUTS

from probe.compare import DIVERGENT_STATUSES, STATUSES, Cell, RowStats, StageDiff, StageRows, most_severe
from probe.diff import DiffReport
from probe.evidence import (ATTENTION, NO_RECORD, NOT_MEASURED, PART_NAMES, POSITION_NOTE, QK_DEPENDENT, QK_NOTE,
                            cell_at, evidential_rows, part_evidence, qk_evidence_tokens)
from probe.rule import RULE
from probe.selfcheck import Issue

_COL = 7
_ALL_ROWS = 40  # up to this many tokens the table shows every token
_STATUS_TEXT = {"unwritten": "UNWR", "shape": "SHAPE", "dtype": "DTYPE", "nonfinite": "NaN!"}
_ISSUE_LABEL = {"coverage": "no stage captured", "integrity": "inconsistent trace", "shape": "wrong shape", "dtype": "wrong dtype",
                "inputs": "inputs differ", "unwritten": "unwritten rows", "observer": "capturing changes the result",
                "irreproducible": "not reproducible", "pos0_mask": "position-0 embedding mask differs"}
LEGEND = ("cells: tolerance budget used (1 = at the limit; a row passes below 1)\n"
          "       ! out of tolerance   ~ not evidential (attention there does not depend on q/k)   NaN! computed NaN/Inf   UNWR never written\n"
          "       SHAPE/DTYPE wrong layout   - not captured   . not compared (--fail-fast)")


def coverage_text(captured: tuple[str, ...], names: tuple[str, ...] = STAGE_NAMES) -> str:
    """`11 stages`, or `9/11 stages, not captured: mh, mlp` (`names`: the reference's stages)."""
    missing = [n for n in names if n not in captured]
    if not missing:
        return f"{len(names)} stages"
    return f"{len(captured)}/{len(names)} stages, not captured: {', '.join(missing)}"


def _names(report: DiffReport) -> tuple[str, ...]:
    return report.stage_names or STAGE_NAMES


def summary_line(report: DiffReport) -> str:
    """The last stdout line: VERDICT | what | coverage | ref=… candidate=…"""
    coverage, where = coverage_text(report.captured, _names(report)), f"ref={report.reference} candidate={report.candidate}"
    name = report.verdict.name
    if name == "pass":
        parts = ["PASSED", f"{len(report.captured)} stages x {report.num_tokens} tokens within tolerance"
                 + (f" at depths {_depth_span(report)}" if report.chain is not None else "")]
        parts += [coverage] if report.not_captured else []
        parts += _chain_gaps(report)
    elif name == "diverged":
        depth, first = report.first_at
        place = f"at token {first.token}" if depth == 1 else f"at depth {depth} bridge {first.token}"
        parts = ["DIVERGED", f"first divergent stage: {first.stage} {place}",
                 f"budget {budget_text(first.diff.budget_used)}", coverage]
    elif name == "invalid":
        parts = ["INVALID", _all_issues_short(report), coverage]
    else:
        parts = ["INCONCLUSIVE", "all compared rows within tolerance, but " + "; ".join(report.verdict.reasons),
                 coverage]
    if report.verdict.name == "diverged" and report.first is not None:
        parts[1:2] = [parts[1]] + [f for f in report.findings if f.startswith("rows shifted")][:1]
    if report.chain is not None and name != "pass":
        parts.append(f"depths compared: {_depth_span(report)} of 1-{report.chain.info.depths}")
    parts += [f"note: {f}" for f in report.findings if not f.startswith("rows shifted")]
    return printable(" | ".join(parts + [where]))  # one line, whatever a path or name in it holds


def _chain_gaps(report: DiffReport) -> list[str]:
    """`depth 3 not captured: mlp` for each compared chain depth that lacks a stage: a PASS's `N stages ... at
    depths 1-K` never reads as every stage at every depth when a depth captured fewer (depth 1's own gaps are in
    `coverage`)."""
    if report.chain is None:
        return []
    return [f"depth {d.depth} not captured: {', '.join(d.report.not_captured)}" for d in report.chain.depths
            if d.report.not_captured]


def _depth_span(report: DiffReport) -> str:
    """`1-4`, or `1, 2, 4`: the depths compared (1 = the bridge step)."""
    depths = report.chain.compared_depths if report.chain is not None else (1,)
    contiguous = list(depths) == list(range(1, len(depths) + 1))
    return f"1-{depths[-1]}" if contiguous and len(depths) > 1 else ", ".join(map(str, depths))


def render_text(report: DiffReport, verbose: bool = False) -> str:
    """The human report (everything but the summary line); `verbose` adds the worst elements side by side."""
    from probe.chain_report import chain_text  # (it renders with this module's pieces)

    depths = f", depths compared: {_depth_span(report)}" if report.chain is not None else ""
    blocks = [_header(report), _table(report), LEGEND, _issues(report), _divergence(report, verbose),
              _worst_per_stage(report) if verbose else "", _evidence(report), chain_text(report, verbose),
              f"verdict: {report.verdict.name} (exit {report.verdict.exit_code}){depths}"]
    return printable("\n\n".join(b for b in blocks if b), keep_lines=True)  # no terminal escapes from a file


def budget_text(budget: float) -> str:
    if not math.isfinite(budget):
        return "inf"
    return f"{budget:.0f}x" if budget >= 100 else f"{budget:.3g}x"


def _header(report: DiffReport) -> str:
    lines = [f"oracle     {report.reference}  (mtp-trace/1, T={report.num_tokens}, D={report.hidden_size})",
             f"candidate  {report.candidate}  ({report.candidate_kind}): {coverage_text(report.captured, _names(report))}",
             f"inputs     {_inputs_text(report)}", f"tolerance  {RULE.text}"]
    if getattr(report.tols, "noise", None) is not None:  # --profile FILE[:PATH]: a measured profile
        return "\n".join(lines + _noise_lines(report))
    tols = {tol for tol in report.tols.values()}
    for tol in sorted(tols, key=lambda t: t.why):
        stages = [n for n in _names(report) if report.tols[n] == tol]
        scope = "all stages" if len(stages) == len(_names(report)) else ", ".join(stages)
        lines.append(f"           {scope}: rtol {tol.rtol:g}, atol {tol.atol:g} ({tol.why})")
    return "\n".join(lines)


def _noise_lines(report: DiffReport) -> list[str]:
    """The measured noise floor the tolerances came from: the profile, and per stage its figures and the tolerance
    used (a --stage-tol override says so)."""
    noise = report.tols.noise
    inputs = {True: "the reference's own inputs", False: "OTHER inputs than the reference's",
              None: "inputs not checked"}[noise.same_inputs]
    u = f"; floor: one {noise.path} rounding (u {noise.unit_roundoff:.2g})" if noise.unit_roundoff else ""
    lines = [f"noise      {noise.file} path {noise.path}, tolerance = {noise.margin:g} x measured "
             f"({noise.family}, T={noise.num_tokens}, {inputs}){u}",
             f"           {'stage':<14}{'max_rel':>9}{'max_abs':>9}{'rtol':>10}{'atol':>10}   "
             f"(measured against float64; used)"]
    for name in _names(report):
        figures, tol = noise.stages.get(name, {}), report.tols[name]
        if figures.get("kind") == "index_set":
            lines.append(f"           {name:<14}compared as a set ({tol.why})")
            continue
        override = "" if tol.why.startswith(f"{noise.path} noise") else f"   {tol.why}"
        override = override or ("   floor: one rounding" if "(floor" in tol.why else "")
        lines.append(f"           {name:<14}{figures['measured_max_rel']:>9.2g}{figures['measured_max_abs']:>9.2g}"
                     f"{tol.rtol:>10.3g}{tol.atol:>10.3g}{override}")
    return lines


def _inputs_text(report: DiffReport) -> str:
    if report.candidate_kind == "adapter":
        return "handed to the implementation by mtp-probe run: the reference's own inputs and weights"
    if report.candidate_kind == "adapter, own weights":
        return "handed to the implementation by mtp-probe run: the reference's own inputs; the weights are its own"
    if not report.inputs_recorded:
        return "inputs not recorded: not verified"
    differ = [i.where.split("/")[1] for i in report.issues if i.kind == "inputs"]
    same = [n for n in report.inputs_recorded if n not in differ]
    missing = [n for n in CHECKED_INPUTS if n not in report.inputs_recorded]
    parts = ([f"DIFFER from the reference: {', '.join(differ)}"] if differ else []) + \
        ([f"identical to the reference: {', '.join(same)}"] if same else []) + \
        ([f"not recorded (not verified): {', '.join(missing)}"] if missing else [])
    return "; ".join(parts)


def _table(report: DiffReport) -> str:
    names = _names(report)
    col = {n: max(_COL, len(n) + 1) for n in names}
    row = "token" if report.depth == 1 else "bridge"  # a depth-j report's rows are bridge positions
    lines = [f"budget used per ({row}, stage)" + ("" if report.depth == 1 else f" at depth {report.depth}"),
             f"{row:<6}" + "".join(f"{n:>{col[n]}}" for n in names)]
    previous = -1
    for token in _tokens_shown(report):
        if token > previous + 1:
            lines.append(f"  ... {row}s {previous + 1}-{token - 1} not shown (see the max row)")
        lines.append(f"{row[0]}{token:<5}" + "".join(f"{_grid_text(report, n, token):>{col[n]}}" for n in names))
        previous = token
    if previous < report.num_tokens - 1:
        lines.append(f"  ... {row}s {previous + 1}-{report.num_tokens - 1} not shown (see the max row)")
    worst = [_worst_cell(report.rows[n]) if n in report.rows else None for n in names]
    lines.append("max   " + "".join(f"{_cell_text(c) if c else '-':>{col[n]}}" for n, c in zip(names, worst)))
    return "\n".join(lines)


def _tokens_shown(report: DiffReport) -> list[int]:
    total = report.num_tokens
    if total <= _ALL_ROWS:
        return list(range(total))
    must = {report.first.token} if report.first else set()
    must |= {i.tokens[0] for i in report.issues if i.tokens}
    return sorted(set(range(16)) | set(range(total - 8, total)) | must)


def _grid_text(report: DiffReport, stage: str, token: int) -> str:
    if stage not in report.captured:
        return "-"
    cell = report.cell(stage, token)
    return _cell_text(cell) if cell else "."


def _cell_text(cell: Cell) -> str:
    status = cell.diff.status
    if status in _STATUS_TEXT:
        return _STATUS_TEXT[status]
    mark = "!" if status in DIVERGENT_STATUSES else ("" if cell.evidential else "~")
    return _budget_short(cell.diff.budget_used) + mark


def _budget_short(budget: float) -> str:
    if budget == 0:
        return "0"
    if budget < 1e-3:
        return "<.001"
    if budget < 10:
        return f"{budget:.2f}"
    return f"{budget:.0f}" if budget < 1000 else f"{budget:.0e}"


def _worst_cell(rows: StageRows, valid_only: bool = False) -> Cell | None:
    worst = most_severe(rows, valid_only)
    return cell_at(rows, rows.start + worst[0]) if worst else None


def _issues(report: DiffReport) -> str:
    if not report.issues:
        inputs = ("inputs as recorded" if report.inputs_recorded or report.candidate_kind == "adapter"
                  else "inputs not recorded, so not checked")  # a raw dump without inputs.json
        return f"self-checks: passed (layout, {inputs}, {_written_text(report)})"
    lines = ["self-checks FAILED (verdict invalid):"]
    lines += [f"  - {i.message}" + (f" [tokens {_ranges(i.tokens)}]" if i.tokens else "") for i in report.issues]
    return "\n".join(lines)


def _written_text(report: DiffReport) -> str:
    """What the write check proved: with poison-filled buffers every row; otherwise rows with a nonzero value."""
    if not report.zero_is_unwritten:
        return "every compared row written: the buffers were poison-filled"
    both_zero = _rows_zero_on_both_sides(report)
    caveat = (f"; {both_zero} row(s) are all zeros on both sides, so whether they were written cannot be verified"
              if both_zero else "")
    return ("no compared row holds poison or is all zeros where the reference is not (this source was not "
            f"poison-filled: a zero row cannot be told from an unwritten one){caveat}")


def _rows_zero_on_both_sides(report: DiffReport) -> int:
    return sum(int(r.both_zero.sum()) for r in report.rows.values())


def _all_issues_short(report: DiffReport) -> str:
    """_issues_short of depth 1, then of each chain depth that failed a self-check (`depth j: ...`)."""
    texts = [_issues_short(report.issues)] if report.issues else []
    texts += [f"depth {d.depth}: {_issues_short(d.report.issues)}" for d in
              (report.chain.depths if report.chain is not None else ()) if d.report.issues]
    return "; ".join(texts)


def _issues_short(issues: tuple[Issue, ...]) -> str:
    """`unwritten rows: e at token(s) 1-7, h at token(s) 1-7, fc_in at token(s) 1-7 and 8 more; inputs differ: …`"""
    by_kind: dict[str, list[str]] = {}
    for issue in issues:
        place = f"{issue.where} at token(s) {_ranges(issue.tokens)}" if issue.tokens else issue.where
        by_kind.setdefault(_ISSUE_LABEL[issue.kind], []).append(place)
    return "; ".join(f"{label}: {', '.join(places[:3])}" + (f" and {len(places) - 3} more" if len(places) > 3 else "")
                     for label, places in by_kind.items())


def _ranges(tokens: tuple[int, ...]) -> str:
    spans: list[list[int]] = []
    for t in sorted(tokens):
        if spans and t == spans[-1][1] + 1:
            spans[-1][1] = t
        else:
            spans.append([t, t])
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans)


def _divergence(report: DiffReport, verbose: bool) -> str:
    lines = []
    if report.compared_tokens < report.num_tokens:
        lines.append(f"--fail-fast: stopped after {report.compared_tokens} of {report.num_tokens} tokens; "
                     f"later tokens were not compared")
    if report.first is None:
        return "\n".join(lines + ["no divergence: every compared row is within tolerance or failed a self-check"])
    first = report.first
    per_token = ", ".join(f"t{t} {s}" for t, s in list(report.first_per_token.items())[:12])
    lines += [f"first divergence: stage {first.stage} at token {first.token} (stage s at token t depends only on "
              f"tokens <= t, so this is the origin)", f"first divergent stage per token: {per_token}"
              + (" ..." if len(report.first_per_token) > 12 else ""), cell_detail(first, verbose, _names(report))]
    return "\n".join(lines)


def cell_detail(cell: Cell, verbose: bool = False, names: tuple[str, ...] = STAGE_NAMES) -> str:
    """A divergence message in the style of torch.testing: counts, greatest differences, what would pass."""
    d = cell.diff
    where = f"stage {list(names).index(cell.stage) + 1}/{len(names)} '{cell.stage}' token {cell.token}"
    if d.expected_stats is None and d.worst:  # an index-set row (topk_ids): the two sets
        ref_ids = sorted(int(e) for _, e, _ in d.worst)
        cand_ids = sorted(int(a) for _, _, a in d.worst)
        return (f"FAILED | {where} | index set | status {d.status}\n"
                f"  oracle     {{{', '.join(map(str, ref_ids))}}}\n  candidate  {{{', '.join(map(str, cand_ids))}}}"
                f"\n  {d.n_mismatch} of {len(ref_ids)} selected ids differ")
    lines = [f"FAILED | {where} "
             f"| width {d.n_total} float32 vs oracle float32 | status {d.status}",
             f"  rule, per row (not per element as in torch.testing.assert_close): pass iff max_rel < rtol "
             f"{d.tol.rtol:g} or max_abs < atol {d.tol.atol:g}",
             f"  max_abs = max|a-e| = {d.max_abs:.3g} at index {d.max_abs_index}",
             f"  max_rel = max|a-e| / max|e| = {d.max_rel:.3g} (the row's largest difference over its largest "
             f"oracle magnitude)",
             f"  elements that alone fail the row: {d.n_mismatch} / {d.n_total} "
             f"({100 * d.n_mismatch / max(d.n_total, 1):.1f}%)",
             f"  would pass with: atol > {d.max_abs:.3g} or rtol > {d.max_rel:.3g} | tolerance budget used: "
             f"{budget_text(d.budget_used)} (1x = at the limit)",
             *_spread_lines(d),
             f"  rel L2 {d.rel_l2:.3g}, cosine {d.cosine:.6g}",
             f"  oracle     {_stats_text(d.expected_stats)}",
             f"  candidate  {_stats_text(d.actual_stats)}{_stats_hint(d)}"]
    lines += _streams_text(d)
    if verbose:
        lines += _side_by_side(d)
    return "\n".join(lines)


def _spread_lines(d: StageDiff) -> list[str]:
    """|a-e| over the row's elements: mean and median beside the max, and a histogram by decade (Polygraphy-style:
    one large outlier and a row wrong everywhere read differently)."""
    s = d.spread
    if s is None:
        return []
    lines = [f"  |a-e| per element: mean {s.mean:.3g}, median {s.median:.3g}, max {d.max_abs:.3g}"]
    most = max(count for _, _, count in s.histogram) or 1
    lines.append("  |a-e| histogram (elements per decade):")
    for lo, hi, count in s.histogram:
        label = "0 (exact)" if hi == 0 else f"< {hi:.0e}" if lo == 0 else f"{lo:.0e} .. {hi:.0e}"
        lines.append(f"    {label:<17}{count:>7}  {'#' * round(24 * count / most)}")
    return lines


def _streams_text(d: StageDiff) -> list[str]:
    """A [T, hc·D] row stream by stream (hyper-connection heads), the worst stream marked."""
    if not d.per_stream:
        return []
    width = d.n_total // len(d.per_stream)
    worst = max(range(len(d.per_stream)), key=lambda s: d.per_stream[s][0])
    lines = [f"  per stream ({len(d.per_stream)} streams of {width}; element i is stream i // {width}):"]
    lines += [f"    stream {s}: max|diff| {diff:.3g}  oracle absmax {e:.4g}  candidate absmax {a:.4g}"
              + ("   <- worst" if s == worst and diff > 0 else "") for s, (diff, e, a) in enumerate(d.per_stream)]
    return lines


def _stats_text(s: RowStats) -> str:
    text = f"mean {s.mean:+.4g}  std {s.std:.4g}  absmax {s.absmax:.4g}"
    return text + (f"  non-finite {s.n_nonfinite}" if s.n_nonfinite else "")


def _stats_hint(d: StageDiff) -> str:
    if d.status == "nonfinite":
        return "     <- NaN/Inf computed by the candidate"
    e, a = d.expected_stats, d.actual_stats
    same = all(f"{x:.3g}" == f"{y:.3g}" for x, y in ((e.mean, a.mean), (e.std, a.std), (e.absmax, a.absmax)))
    return "     <- same statistics, different values: suspect layout or permutation" if same and not d else ""


def _side_by_side(d: StageDiff) -> list[str]:
    lines = [f"  worst elements:  {'index':>6} {'oracle':>15} {'candidate':>15} {'|diff|':>10}"]
    lines += [f"                   {i:>6} {e:>15.8g} {a:>15.8g} {abs(a - e):>10.3g}" for i, e, a in d.worst]
    return lines


def _worst_per_stage(report: DiffReport) -> str:
    lines = ["worst row of every compared stage (-v):"]
    for name in report.captured:
        cell = _worst_cell(report.rows[name], valid_only=True)
        if cell:
            d = cell.diff
            lines.append(f"{name} token {cell.token}: {d.status}, budget {budget_text(d.budget_used)}, "
                         f"max_abs {d.max_abs:.3g} at index {d.max_abs_index}, max_rel {d.max_rel:.3g}")
            lines += _streams_text(d) + _side_by_side(d)
    return "\n".join(lines)


def qk_text(report: DiffReport) -> str:
    """The q/k path's evidence in one statement, part by part (qk_lines)."""
    return "; ".join(qk_lines(report))


def qk_lines(report: DiffReport) -> list[str]:
    """Per part of the q/k path: the attention pattern (uniform-weights test), then each part the reference
    measured (RoPE, q_norm, k_norm, KV append, window, sink): evidenced by which compared attn rows, or NOT
    evidenced and why; for a reference without the part records, that they were not measured."""
    return [_weights_line(report), *_part_lines(report)]


def _weights_line(report: DiffReport) -> str:
    qk = qk_evidence_tokens(report.rows.values())
    sensitive = int(report.qk.sensitive.sum())
    if not report.qk.recorded:
        return f"q/k path, attention pattern: NOT evidenced: {NO_RECORD}"
    if qk:
        return (f"q/k path, attention pattern (softmax(q·k), not uniform weights): evidenced by {len(qk)} "
                f"{ATTENTION} row(s) at t={_ranges(tuple(qk))}, where uniform weights would fail (the reference has "
                f"{sensitive} of {report.num_tokens} such tokens)")
    if ATTENTION not in report.captured:
        return f"q/k path, attention pattern: NOT evidenced: {ATTENTION} not captured"
    return (f"q/k path, attention pattern: NOT evidenced: no valid {ATTENTION} row at a token whose output depends "
            f"on the attention weights ({sensitive} of {report.num_tokens} reference tokens do)")


def _part_lines(report: DiffReport) -> list[str]:
    if not report.qk.recorded:
        return []
    if report.qk.parts is None:
        return [NOT_MEASURED if report.depth == 1 else depth_not_measured(report.depth)]
    found = part_evidence(report.rows.values(), report.qk)
    lines = []
    for part, variants in found.items():
        name = PART_NAMES.get(part, part)
        missing = [v for v, tokens in variants.items() if not tokens]
        counts = ", ".join(f"{v} at {len(tokens)}" for v, tokens in variants.items())
        if ATTENTION not in report.captured:
            lines.append(f"q/k path, {name}: NOT evidenced: {ATTENTION} not captured")
        elif missing:
            lines.append(f"q/k path, {name}: NOT evidenced: no compared {ATTENTION} row would fail with "
                         f"{', '.join(missing)} (rows that would fail, per variant: {counts})")
        else:
            rows = sorted({t for tokens in variants.values() for t in tokens})
            lines.append(f"q/k path, {name}: evidenced: each wrong variant fails some compared {ATTENTION} row "
                         f"(rows, per variant: {counts}; t={_ranges(tuple(rows))})")
    return lines


def depth_not_measured(depth: int) -> str:
    """Why a chain depth states no q/k-path part: its own records are absent (never borrowed from depth 1)."""
    return (f"q/k path parts (RoPE, q_norm, k_norm, KV append, window, sink) not measured at depth {depth}: the "
            f"reference records no /chain/d{depth}/evidence/qk_<part> (argmax chains of an N-layer head, whose rows "
            f"over the layer's cache the trace does not hold, or a reference exported before per-depth records), so "
            f"none of them is claimed evidenced there")


def depth_qk_lines(report: DiffReport) -> list[str]:
    """A chain depth's own q/k-path part lines (its rows are bridge positions), judged with its own records."""
    return [f"depth {report.depth}: " + line.replace("; t=", "; bridge(s) ") for line in _part_lines(report)]


def _evidence(report: DiffReport) -> str:
    note = QK_NOTE.replace(", ".join(QK_DEPENDENT), ", ".join(report.qk.dependent))
    lines = ["evidence:", f"  - {note}", *(f"  - {line}" for line in qk_lines(report))]
    lines += [f"  - {n}" for n in (report.evidence_notes or (POSITION_NOTE,))]
    if report.routing_ties:
        lines.append(f"  - routing near-ties at token(s) {_ranges(report.routing_ties)}: the reference's own top-k "
                     f"margin is within the router-logit tolerance there, so a different selection is rounding; "
                     f"the rows it changes are not compared (tie)")
    lines.append(f"  - inputs: {_inputs_text(report)}")
    lines += [f"  - finding: {f}" for f in report.findings]
    if report.not_captured:
        lines.append(f"  - not captured (never counted as passed): {', '.join(report.not_captured)}")
    lines += [f"  - {reason}" for reason in report.verdict.reasons if report.verdict.name == "inconclusive"]
    return "\n".join(lines)


def report_json(report: DiffReport) -> dict:
    """The JSON report: verdict, first divergence, issues, tolerances and one row per (stage, token)."""
    return _report_head(report) | {"rows": list(_all_rows_json(report))}


def write_json(report: DiffReport, path: Path, extra: dict | None = None) -> None:
    """report_json, written row by row: memory stays flat however many (stage, token) rows there are. `extra`
    adds top-level keys (e.g. "explain" under --explain)."""
    with atomic_output(path, "--json") as tmp, tmp.open("w") as f:
        f.write("{\n")
        for key, value in (_report_head(report) | (extra or {})).items():
            f.write(f" {json.dumps(key)}: {json.dumps(value, allow_nan=False)},\n")
        f.write(' "rows": [')
        for i, row in enumerate(_all_rows_json(report)):
            f.write(("," if i else "") + "\n  " + json.dumps(row, allow_nan=False))
        f.write("\n ]\n}\n")


def _first_json(report: DiffReport) -> dict | None:
    """{depth, stage, token, budget_used}: depth 1's first divergence, else the first depth 2.. that diverged (token:
    the bridge position there)."""
    at = report.first_at
    if at is None:
        return None
    depth, first = at
    return {"depth": depth, "stage": first.stage, "token": first.token, "budget_used": _num(first.diff.budget_used)}


def _report_head(report: DiffReport) -> dict:
    from probe.chain_report import chain_json

    return {
        "schema": "mtp-probe-diff/1", "verdict": report.verdict.name, "exit_code": report.verdict.exit_code,
        "summary": summary_line(report), "reasons": list(report.verdict.reasons),
        "reference": report.reference, "candidate": report.candidate, "candidate_kind": report.candidate_kind,
        "num_tokens": report.num_tokens, "hidden_size": report.hidden_size,
        "stages": {"captured": list(report.captured), "not_captured": list(report.not_captured),
                   "coverage": coverage_text(report.captured, _names(report))},
        "compared_tokens": report.compared_tokens, "rule": RULE.text,
        "tolerances": {n: {"rtol": t.rtol, "atol": t.atol, "why": t.why} for n, t in report.tols.items()},
        "noise_profile": noise.to_json() if (noise := getattr(report.tols, "noise", None)) else None,
        "inputs": _inputs_text(report),
        "evidence_notes": [QK_NOTE, qk_text(report), *(report.evidence_notes or (POSITION_NOTE,))],
        "routing_ties": list(report.routing_ties),
        "qk_evidence": {"recorded": report.qk.recorded, "sensitive_tokens": int(report.qk.sensitive.sum()),
                        "evidencing_tokens": qk_evidence_tokens(report.rows.values()),
                        "parts_measured": report.qk.parts is not None,
                        "parts": {part: {"evidenced": all(variants.values()), "variants": variants}
                                  for part, variants in part_evidence(report.rows.values(), report.qk).items()}},
        "findings": list(report.findings),
        "written_check": _written_text(report),
        "first_divergence": _first_json(report),
        "first_divergence_per_token": [{"token": t, "stage": s} for t, s in report.first_per_token.items()],
        "issues": [{"kind": i.kind, "where": i.where, "tokens": list(i.tokens), "message": i.message}
                   for i in report.issues],
    } | chain_json(report)


def _all_rows_json(report: DiffReport):
    """Depth 1's rows, then each compared chain depth's (token = the bridge position there), all with their depth."""
    for part in (report, *(d.report for d in (report.chain.depths if report.chain is not None else ()))):
        for rows in part.rows.values():
            yield from ({"depth": part.depth} | row for row in _rows_json(rows))


def _rows_json(rows: StageRows):
    """One JSON row per token; statistics and worst elements only where the full detail was kept ("detailed")."""
    columns = {name: getattr(rows, name).tolist() for name in _JSON_COLUMNS}
    evidential = evidential_rows(rows).tolist()
    status = [STATUSES[code] for code in rows.status.tolist()]
    for i, token in enumerate(rows.tokens.tolist()):
        if token in rows.detail:
            yield _detailed_row_json(cell_at(rows, token))
            continue
        yield {"stage": rows.stage, "token": token, "status": status[i], "evidential": evidential[i],
               "n_total": rows.width, **{name: _num(values[i]) for name, values in columns.items()},
               "detailed": False, "expected_stats": None, "actual_stats": None, "worst": []}


_JSON_COLUMNS = ("n_mismatch", "n_poison", "max_abs", "max_abs_index", "max_rel", "budget_used", "rel_l2", "cosine")


def _detailed_row_json(cell: Cell) -> dict:
    d = cell.diff
    return {"stage": cell.stage, "token": cell.token, "status": d.status, "evidential": cell.evidential,
            "n_total": d.n_total, **{name: _num(getattr(d, name)) for name in _JSON_COLUMNS}, "detailed": True,
            "expected_stats": _stats_json(d.expected_stats), "actual_stats": _stats_json(d.actual_stats),
            "worst": [{"index": i, "oracle": _num(e), "candidate": _num(a)} for i, e, a in d.worst],
            **({"abs_diff": {"mean": _num(d.spread.mean), "median": _num(d.spread.median), "max": _num(d.max_abs),
                             "histogram": [{"lo": lo, "hi": hi, "count": n} for lo, hi, n in d.spread.histogram]}}
               if d.spread is not None else {}),
            **({"per_stream": [{"stream": k, "max_abs": _num(x), "oracle_absmax": _num(e), "candidate_absmax": _num(a)}
                               for k, (x, e, a) in enumerate(d.per_stream)]} if d.per_stream else {})}


def _stats_json(s: RowStats | None) -> dict | None:
    if s is None:
        return None
    return {"mean": _num(s.mean), "std": _num(s.std), "absmax": _num(s.absmax), "n_nonfinite": s.n_nonfinite}


def _num(x: float | int) -> float | int | str:
    # Strict JSON has no NaN/Infinity; non-finite values are written as the strings float() reads back.
    return x if math.isfinite(x) else str(x)
