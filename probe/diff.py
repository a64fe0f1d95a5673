"""`diff_traces`: compare a candidate trace with the oracle's, stage by stage and token by token.

Both traces are read in token-row chunks (oracle.trace.rows_per_chunk of the widest compared stage), all stages of
one chunk before the next, so memory does not grow with T and `--fail-fast` stops with the earliest divergent
token fully localised. Each (stage, chunk) is compared as a block (probe/compare.py: columns, no Python object per
row) and full detail is kept only for the rows a report shows: each stage's first divergent row and its worst row.
The result is data (`DiffReport`); probe/report.py renders it.
"""

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path
from typing import Sequence
import zlib

import numpy as np

from oracle.progress import tracked
from oracle.stages import INDEX_SET, LEGACY_FAMILY
from oracle.trace import rows_per_chunk

from probe.adapters.trace_file import TraceSource, open_candidate, open_reference
from probe.compare import (ALIGNED_BY_IDS, DIVERGENT_STATUSES, INDEX_STAGE, Cell, StageDiff, StageRows,
                           compare_index_sets, in_expected_id_order, join_rows, mark_ties, most_severe,
                           not_compared_rows, oracle_finite, rows_from_sums, stream_detail)
from probe.errors import ProbeError, ReferenceTraceError
from probe.evidence import ATTENTION, PART_NAMES, POSITION_NOTE, QkSensitivity, Verdict, cell_at, decide, window_reason
from probe.localize import first_divergence, first_divergence_per_token
from probe.drafts import DRAFT_STAGE, DraftTies
from probe.rule import RULE
from probe.findings import candidate_findings
from probe.selfcheck import (Issue, check_reference, coverage_issues, expected_shape, input_issues,
                             integrity_issues, layout_problem, pos0_convention, unwritten_issues)
from probe.tolerance import Tol, tol_table

READ_CHUNKS = 4


@dataclass(frozen=True)
class DiffReport:
    reference: str
    candidate: str
    candidate_kind: str  # "mtp-trace/1" | "raw dir"
    num_tokens: int
    hidden_size: int
    captured: tuple[str, ...]  # stages the candidate holds, in STAGES order
    inputs_recorded: tuple[str, ...]  # candidate inputs that were checked against the reference
    tols: dict[str, Tol]
    rows: dict[str, StageRows]  # per captured stage, STAGES order: compared rows, or all rows of a bad layout
    issues: tuple[Issue, ...]  # failed self-checks; any makes the verdict invalid
    verdict: Verdict
    first: Cell | None  # the first divergence: earliest token, then first stage
    first_per_token: dict[int, str]
    compared_tokens: int  # < num_tokens only when --fail-fast stopped early
    qk: QkSensitivity  # which reference tokens' attn rows can witness the q/k path
    zero_is_unwritten: bool  # the candidate was not poison-filled: all-zero rows count as unwritten
    findings: tuple[str, ...] = ()  # measured observations about the candidate (e.g. rows shifted by one token)
    stage_names: tuple[str, ...] = ()  # the reference's stages, in its order (columns of every rendering)
    family: str = LEGACY_FAMILY
    stage_docs: dict = None  # stage name -> one-line doc (from the reference)
    routing_ties: tuple[int, ...] = ()  # tokens whose routing flipped at a reference near-tie
    evidence_notes: tuple[str, ...] = ()  # what the family's (verified) evidence rules say this trace can show
    chain: "ChainDiff | None" = None  # the draft loop's depths 2..K (probe/chain.py); None: not compared
    depth: int = 1  # the depth these rows are (a depth-j report's tokens are bridge positions)

    @property
    def first_at(self) -> "tuple[int, Cell] | None":
        """The first divergence as (depth, cell): depth 1's first, else the first depth 2, 3, ... that diverged."""
        if self.first is not None:
            return self.depth, self.first
        for part in self.chain.depths if self.chain is not None else ():
            if part.report.first is not None:
                return part.depth, part.report.first
        return None

    @property
    def not_captured(self) -> tuple[str, ...]:
        return tuple(n for n in self.stage_names if n not in self.captured)

    def cell(self, stage: str, token: int) -> Cell | None:
        """The comparison of (stage, token), or None when it was not made."""
        rows = self.rows.get(stage)
        if rows is None or not rows.start <= token < rows.start + len(rows):
            return None
        return cell_at(rows, token)

    @cached_property
    def cells(self) -> tuple[Cell, ...]:
        """Every comparison as a Cell, STAGES order then token order (built on first use: T x stages objects)."""
        return tuple(self.cell(name, int(t)) for name, rows in self.rows.items() for t in rows.tokens)


def diff_traces(ref_path: Path, cand_path: Path, tols: dict[str, Tol] | None = None,
                fail_fast: bool = False) -> DiffReport:
    """Compare the trace (file or raw directory) at `cand_path` with the oracle trace at `ref_path`.

    `tols` maps every stage to its Tol (default: `tol_table()`); `fail_fast` stops after the first token chunk that
    holds a divergence. Raises MtpError subclasses for unreadable or unusable files.
    """
    with open_reference(ref_path) as ref:
        check_reference(ref)
        with open_candidate(cand_path, ref) as cand:
            return diff_sources(ref, cand, tols if tols is not None else tol_table(), fail_fast)


def diff_sources(ref: TraceSource, cand: TraceSource, tols: dict[str, Tol], fail_fast: bool = False) -> DiffReport:
    """`diff_traces` on opened sources (a checked reference and a candidate): depth 1 (the bridge step), then each
    chain depth the reference records (probe/chain.py), into one report whose verdict covers every depth."""
    from probe.chain import with_chain  # (it builds on this module)

    return with_chain(diff_depth(ref, cand, tols, fail_fast), ref, cand, tols, fail_fast)


def diff_depth(ref: TraceSource, cand: TraceSource, tols: dict[str, Tol], fail_fast: bool = False,
               depth: int = 1) -> DiffReport:
    """One depth's comparison: every stage of `ref` against `cand`, rows = tokens (depth 1) or bridge positions."""
    unknown = [n for n in cand.stages if n not in ref.stages]
    if unknown:
        raise ProbeError(f"candidate {cand.path} holds stages the reference does not: {', '.join(unknown)}; the "
                         f"reference ({ref.attrs.get('family', LEGACY_FAMILY)}) has {', '.join(ref.stages)}. Name each "
                         f"stage as the reference does (mtp-oracle inspect {ref.path}).")
    issues = coverage_issues(cand) + integrity_issues(cand) + input_issues(ref, cand)
    qk = qk_sensitivity(ref, tols[ATTENTION])
    zero_is_unwritten = not getattr(cand, "poisoned", False)
    kinds = {s.name: s.kind for s in ref.stage_list}
    rows: dict[str, StageRows] = {}
    comparable = []
    for name in [n for n in ref.stages if n in cand.stages]:
        problem = layout_problem(cand, name, expected_shape(ref, name), kinds[name])
        if problem is None:
            comparable.append(name)
            continue
        status, message = problem
        issues.append(Issue(status, name, tuple(range(ref.num_tokens)), message))
        rows[name] = not_compared_rows(name, ref.num_tokens, expected_shape(ref, name)[1], status, tols[name])
    stop_now = fail_fast and bool(issues)
    routing = _Routing.of(ref, cand, tols)
    drafts = DraftTies.of(ref, cand, tols)
    compared, compared_tokens = ({}, 0) if stop_now else _compare_stages(ref, cand, comparable, tols, fail_fast, qk,
                                                                           zero_is_unwritten, routing, drafts)
    rows = {name: (rows | compared)[name] for name in ref.stages if name in rows or name in compared}
    issues += unwritten_issues(rows.values(), pos0_convention(ref))
    first = first_divergence(rows.values(), ref.stages)  # its row holds full detail (_StageProgress)
    findings = candidate_findings(ref, cand, first, tols, rows)
    captured = tuple(n for n in ref.stages if n in cand.stages)
    return DiffReport(str(ref.path), str(cand.path), cand.kind, ref.num_tokens, ref.hidden_size, captured,
                      cand.recorded_inputs, tols.for_stages(ref.stages) if hasattr(tols, "for_stages") else tols,
                      rows, tuple(issues), decide(rows.values(), [i.message for i in issues], captured, qk),
                      first, first_divergence_per_token(rows.values(), ref.stages), compared_tokens, qk,
                      zero_is_unwritten, findings, tuple(ref.stages), ref.attrs.get("family", LEGACY_FAMILY),
                      {s.name: s.doc for s in ref.stage_list}, routing.tie_tokens(), evidence_notes(ref), depth=depth)


def _compare_stages(ref: TraceSource, cand: TraceSource, names: Sequence[str], tols: dict[str, Tol],
                    fail_fast: bool, qk: QkSensitivity, zero_is_unwritten: bool,
                    routing: "_Routing", drafts: "DraftTies") -> tuple[dict[str, StageRows], int]:
    total = ref.num_tokens
    if not names:
        return {}, total
    widths = {n: ref.stage_shape(n)[1] for n in ref.stages}
    step = read_rows(widths, total, names)
    blocks = [(name, start, min(start + step, total)) for start in range(0, total, step) for name in names]
    stages = {name: _StageProgress(_streams(ref, name)) for name in names}
    stop, chunk_ok = total, True
    blocks_read = tracked(_read_and_sum(ref, cand, blocks, tols, widths), "diff", total * len(names), unit="row",
                          count=lambda item: item[0][2] - item[0][1])  # (stage, token) rows compared
    checksums = _ReferenceChecksums(ref, names)
    for (name, start, end), actual, expected, sums in blocks_read:
        checksums.add(name, expected)
        if sums is None and name == DRAFT_STAGE:  # a flip within the draft margin Δout explains is a near-tie
            block = compare_index_sets(name, start, actual, expected, tols[name], drafts.near_tie(start, end),
                                       None, zero_is_unwritten)
            routing.excuse(name, block)  # a routing flip upstream changes the draft too
        elif sums is None:  # an index-set stage (topk_ids): compared as sets
            block = compare_index_sets(name, start, actual, expected, tols[name], routing.near_tie(start, end),
                                       routing.flippable(start, end), zero_is_unwritten)
            routing.saw_flips(block)
        else:
            block = _block_rows(ref.path, name, start, expected.shape[1], sums, tols[name],
                                qk.blind(name, start, end), zero_is_unwritten)
            routing.excuse(name, block)
            drafts.saw(name, start, sums, block)
        chunk_ok &= stages[name].add(block, actual, expected)
        if name == names[-1]:  # every stage of this chunk compared
            if fail_fast and not chunk_ok:
                stop = end
                break
            chunk_ok = True
    if stop < total:  # a fail-fast stop: the reference's other rows are still read (not the candidate's, no sums),
        checksums.add_rest(stop, total, step, widths)  # so an edited reference is refused, never blamed on the
    checksums.verify()  # candidate (it had been DIVERGED, exit 1, with --fail-fast only)
    return {name: join_rows(progress.blocks) for name, progress in stages.items()}, stop


class _ReferenceChecksums:
    """The reference's stage rows checked against its `stage_checksums` (oracle/trace.py) as the diff reads them:
    a reference damaged or edited after export is refused (exit 2) instead of blaming the candidate. Blocks of one
    stage arrive in token order, so each CRC-32 runs along its stage; traces without the record are not checked."""

    def __init__(self, ref: TraceSource, names: Sequence[str]):
        recorded = ref.attrs.get("stage_checksums")
        self.ref, self.recorded = ref, recorded if isinstance(recorded, dict) else {}
        unlisted = [name for name in ref.stages if name not in self.recorded]
        if recorded is not None and unlisted:  # write_trace lists every stage it writes: one missing was removed
            raise ReferenceTraceError(f"reference {ref.path}: its stage_checksums list no checksum for stage "
                                      f"{unlisted[0]}, which the trace holds; the oracle writes one for every stage, "
                                      f"so the reference was edited after export. Regenerate it with mtp-oracle "
                                      f"export.")
        self.crc = {name: 0 for name in names if name in self.recorded}

    def add(self, name: str, rows: np.ndarray) -> None:
        if name in self.crc:
            self.crc[name] = zlib.crc32(np.ascontiguousarray(rows), self.crc[name])

    def add_rest(self, start: int, total: int, step: int, widths: dict[str, int]) -> None:
        """Read rows start..total of each checked stage from the reference alone, as `_read_and_sum` reads them."""
        index_sets = {s.name for s in self.ref.stage_list if s.kind == INDEX_SET}
        for name in self.crc:
            buffer = np.empty(min(step, total - start) * widths[name], dtype=np.float32)
            for first in range(start, total, step):
                last = min(first + step, total)
                if name in index_sets:
                    rows = np.array(self.ref.stage_rows(name, first, last), dtype=np.int64)
                else:
                    rows = self.ref.stage_rows(name, first, last, buffer[:(last - first) * widths[name]].reshape(
                        last - first, widths[name]))
                self.add(name, rows)

    def verify(self) -> None:
        for name, crc in self.crc.items():
            if f"crc32:{crc:08x}" != self.recorded[name]:
                raise ReferenceTraceError(f"reference {self.ref.path}: the rows of stage {name} do not match the "
                                          f"trace's stage_checksums ({self.recorded[name]}, read crc32:{crc:08x}): "
                                          f"the reference was edited or damaged after export, so no comparison "
                                          f"with it means anything. Regenerate it with mtp-oracle export.")


def _read_and_sum(ref: TraceSource, cand: TraceSource, blocks: list[tuple[str, int, int]], tols: dict[str, Tol],
                  widths: dict[str, int]):
    """Yield (block, candidate rows, oracle rows, row sums) for each (stage, start, stop) block, in order (sums
    None for an index-set stage, read as int64 and compared as sets).

    The sums of block k are computed on a second thread while block k + 1 is read (the compiled kernel and
    os.preadv both release the GIL). Rows are read into two reused buffer pairs, so a block's arrays are valid
    only until the next block is asked for; fresh arrays for every read would fault in new pages each time
    (measured: a fifth of the diff's time)."""
    index_sets = {s.name for s in ref.stage_list if s.kind == INDEX_SET}
    # topk_weights are put in the reference's topk_ids order only where the candidate's topk_ids are comparable
    # (their layout passed): a wrongly shaped topk_ids file is reported as such, never read to align another stage
    align = INDEX_STAGE in {name for name, _, _ in blocks}
    widest = max(widths[name] for name, _, _ in blocks)
    rows = max(stop - start for _, start, stop in blocks)
    pairs = [[np.empty(rows * widest, dtype=np.float32) for _ in range(2)] for _ in range(2)]
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="mtp-probe-rowdiff") as pool:
        pending = None
        for k, (name, start, stop) in enumerate(blocks):
            if name in index_sets:
                current = ((name, start, stop), np.array(cand.stage_rows(name, start, stop), dtype=np.int64),
                           np.array(ref.stage_rows(name, start, stop), dtype=np.int64), None)
                if pending is not None:
                    yield *pending[:3], pending[3].result()
                pending = None
                yield current
                continue
            shape = (stop - start, widths[name])
            into = [buffer[:shape[0] * shape[1]].reshape(shape) for buffer in pairs[k % 2]]
            actual, expected = cand.stage_rows(name, start, stop, into[0]), ref.stage_rows(name, start, stop, into[1])
            if name == ALIGNED_BY_IDS and align:
                actual = _aligned_to_reference_ids(ref, cand, start, stop, actual)
            current = ((name, start, stop), actual, expected, pool.submit(RULE.sums, actual, expected, tols[name]))
            if pending is not None:
                yield *pending[:3], pending[3].result()
            pending = current
        if pending is not None:
            yield *pending[:3], pending[3].result()


def _aligned_to_reference_ids(ref: TraceSource, cand: TraceSource, start: int, stop: int,
                              weights: np.ndarray) -> np.ndarray:
    """The candidate's topk_weights rows in the reference's topk_ids order (probe/compare.py in_expected_id_order:
    the one rule --explain uses too)."""
    return in_expected_id_order(weights, cand.stage_rows(INDEX_STAGE, start, stop),
                                ref.stage_rows(INDEX_STAGE, start, stop))


def read_rows(widths: "dict[str, int] | int", num_tokens: int, names: Sequence[str]) -> int:
    """Token rows per read: READ_CHUNKS HDF5 chunks of the widest stage (4 MiB), few enough reads to keep their
    fixed cost small and memory bounded whatever T. `widths`: stage -> row width (an int: the default stages of
    that hidden size)."""
    if isinstance(widths, int):
        from oracle.stages import STAGE_BY_NAME

        widths = {n: STAGE_BY_NAME[n].width(widths) for n in names}
    return READ_CHUNKS * min(rows_per_chunk(max(widths[n], 1), num_tokens) for n in names)


class _StageProgress:
    """One stage's blocks so far, and which of their rows keep full detail: the stage's first divergent row, and a
    valid row worse than any before it (so, in the end, the stage's worst valid row, which `-v` shows)."""

    def __init__(self, streams: int = 1) -> None:
        self.streams = streams  # > 1: a [T, hc·D] stage, whose detailed rows also get per-stream detail
        self.blocks: list[StageRows] = []
        self.worst: tuple[int, float] = (-1, -1.0)  # severity of the worst valid row so far (most_severe)
        self.diverged = False

    def add(self, block: StageRows, actual: np.ndarray, expected: np.ndarray) -> bool:
        """Append `block` (rows of `actual` against `expected`), keeping the detail it earns; True when every row
        in it is ok."""
        divergent = np.flatnonzero(block.has_status(DIVERGENT_STATUSES))
        if divergent.size and not self.diverged:
            self._detail(block, int(divergent[0]), actual, expected)
            self.diverged = True
        worst = most_severe(block, valid_only=True)
        if worst and worst[1] > self.worst:
            self._detail(block, worst[0], actual, expected)
            self.worst = worst[1]
        self.blocks.append(block)
        return bool(block.has_status({"ok"}).all())

    def _detail(self, block: StageRows, i: int, actual: np.ndarray, expected: np.ndarray) -> None:
        if actual.dtype.kind in "iu":  # an index-set row: the two sets, side by side
            d = block.diff(block.start + i)
            worst = tuple((j, float(e), float(a)) for j, (e, a) in enumerate(zip(expected[i], actual[i])))
            block.detail[block.start + i] = StageDiff(d.status, d.n_total, d.n_mismatch, 0, d.max_abs, -1, d.max_rel,
                                                      d.budget_used, d.rel_l2, d.cosine, None, None, d.tol, worst)
            return
        block.add_detail(block.start + i, actual[i], expected[i])
        if self.streams > 1 and actual.shape == expected.shape:
            block.detail[block.start + i] = replace(block.detail[block.start + i],
                                                    per_stream=stream_detail(actual[i], expected[i], self.streams))


def _streams(ref: TraceSource, name: str) -> int:
    """hc for a [T, hc·D] stage of the reference (DeepSeek-V4's hyper-connection streams), else 1."""
    stage = ref.stage_list[name]
    return ref.dims.hc_mult if stage.shape == "Txhc*D" and getattr(ref, "dims", None) is not None else 1


def _block_rows(ref_path: Path, name: str, start: int, width: int, sums: np.ndarray, tol: Tol,
                qk_blind: np.ndarray, zero_is_unwritten: bool) -> StageRows:
    """The rows of stage `name` from token `start`, from their sums; a non-finite oracle row is refused."""
    bad = np.flatnonzero(~oracle_finite(sums))
    if bad.size:  # NaN/Inf would propagate through both sides
        raise ReferenceTraceError(f"reference {ref_path}: stage {name} holds NaN/Inf in row {start + bad[0]}, so it "
                                  f"cannot serve as the truth. Regenerate it with mtp-oracle export.")
    return rows_from_sums(name, start, width, sums, tol, qk_blind, zero_is_unwritten)


def qk_sensitivity(ref: TraceSource, tol: Tol) -> QkSensitivity:
    """Which reference tokens' attn rows depend on the attention weights (where /evidence/attn_uniform FAILS the
    attn stage's tolerance against /stages/attn) and, per q/k-path part the reference measured, where each of the
    part's wrong variants would fail it (/evidence/qk_<part>, judged by the same tolerance; probe/evidence.py).
    None are, without the records."""
    total = ref.num_tokens
    # Every stage from attn on is q/k-dependent unless the (digest-verified) rules say which; attn always is.
    default = tuple(ref.stages[list(ref.stages).index(ATTENTION):])
    rules = _verified_rules(ref)
    dependent = tuple(dict.fromkeys((ATTENTION, *rules.get("qk_dependent", default))))
    if not ref.has_evidence("attn_uniform"):
        return QkSensitivity(np.zeros(total, dtype=bool), recorded=False, dependent=dependent,
                             window=_window(rules))
    sensitive = np.zeros(total, dtype=bool)
    parts = _part_records(ref, rules)
    caught = {part: np.zeros((total, len(names)), dtype=bool) for part, (names, _) in parts.items()}
    step = read_rows({n: ref.stage_shape(n)[1] for n in ref.stages}, total, ref.stages)  # as the comparison reads
    for start in range(0, total, step):
        stop = min(start + step, total)
        uniform, attn = ref.evidence_rows("attn_uniform", start, stop), ref.stage_rows(ATTENTION, start, stop)
        if uniform.shape != attn.shape or uniform.dtype != np.float32:
            raise ReferenceTraceError(f"reference {ref.path}: /evidence/attn_uniform is {uniform.dtype} "
                                      f"{uniform.shape}, expected float32 {attn.shape}. Regenerate it with "
                                      f"mtp-oracle export.")
        sums = RULE.sums(uniform, attn, tol)
        if not oracle_finite(sums).all() or not np.isfinite(sums["aa"]).all():
            raise ReferenceTraceError(f"reference {ref.path}: /evidence/attn_uniform or attn holds NaN/Inf near row "
                                      f"{start}. Regenerate it with mtp-oracle export.")
        rows = rows_from_sums(ATTENTION, start, attn.shape[1], sums, tol, zero_is_unwritten=False)
        sensitive[start:stop] = ~rows.has_status({"ok"})
        for part, (_, distances) in parts.items():  # a variant is caught where its row would FAIL the rule
            caught[part][start:stop] = ~RULE.passes_at(distances[start:stop], sums["e_max"][:, None], tol)
    order = list(PART_NAMES)  # RoPE, q_norm, k_norm, KV append, window, sink: the reports' order
    measured = {part: dict(zip(parts[part][0], caught[part].T))
                for part in sorted(parts, key=lambda p: (order.index(p) if p in order else len(order), p))}
    return QkSensitivity(sensitive, recorded=True, dependent=dependent, window=_window(rules),
                         parts=measured if "qk_parts" in rules else None)


def _part_records(ref: TraceSource, rules: dict) -> dict[str, tuple[list[str], np.ndarray]]:
    """{part: (variant names, [T, V] max_abs)} from the (verified) rules' qk_parts and /evidence/qk_<part>; {}
    for a reference that predates them. A record that contradicts its rules is refused (exit 2)."""
    declared = rules.get("qk_parts")
    if declared is None:
        return {}
    if not isinstance(declared, dict) or not all(isinstance(k, str) and isinstance(v, list) and v and
                                                 all(isinstance(n, str) for n in v) for k, v in declared.items()):
        raise ReferenceTraceError(f"reference {ref.path}: evidence_rules.qk_parts is not {{part: [variant names]}}. "
                                  f"Regenerate it with mtp-oracle export.")
    records = {}
    for part, names in declared.items():
        name = f"qk_{part}"
        if not ref.has_evidence(name):
            raise ReferenceTraceError(f"reference {ref.path}: evidence_rules.qk_parts names {part} but "
                                      f"/evidence/{name} is missing. Regenerate it with mtp-oracle export.")
        values = np.asarray(ref.evidence_rows(name, 0, ref.num_tokens))
        if values.dtype != np.float32 or values.shape != (ref.num_tokens, len(names)) or \
                not (np.isfinite(values) & (values >= 0)).all():
            raise ReferenceTraceError(f"reference {ref.path}: /evidence/{name} is {values.dtype} {values.shape}, "
                                      f"expected finite non-negative float32 ({ref.num_tokens}, {len(names)}) (one "
                                      f"column per variant: {', '.join(names)}). Regenerate it with mtp-oracle "
                                      f"export.")
        records[part] = (names, values)
    return records


def _window(rules: dict) -> int | None:
    """A sliding-window head's W from its (verified) evidence rules; None for full attention."""
    window = rules.get("window")
    return window if isinstance(window, int) and not isinstance(window, bool) and window > 0 else None


def evidence_notes(ref: TraceSource) -> tuple[str, ...]:
    """The family's own evidence statements (verified rules): absolute positions (e.g. position 0 observable
    under DeepSeek's embedding mask), how many tokens' routing depended on a group limit, and any other rule the
    family states in words."""
    rules = _verified_rules(ref)
    position = rules.get("absolute_positions", "not evidenced")
    notes = [POSITION_NOTE if position == "not evidenced" else str(position)]
    if "router_group_limited" in rules and ref.has_evidence("router_group_limited"):
        limited = int(np.count_nonzero(np.asarray(ref.evidence_rows("router_group_limited", 0, ref.num_tokens))))
        notes.append(f"{limited} of {ref.num_tokens} tokens had a routing decision that depended on the group "
                     f"limit (n_group/topk_group): a group-limit error can show only at those tokens")
    # A window the reference measured (qk_parts) is stated with the other parts (report.qk_lines), not assumed here.
    window = None if "window" in (rules.get("qk_parts") or {}) else _window(rules)
    if window is not None and ref.num_tokens > window:
        notes.append(f"sliding window W={window}: steps t >= {window} ({ref.num_tokens - window} of "
                     f"{ref.num_tokens}) attend to W keys and drop the earlier ones, so their attn rows evidence "
                     f"the window")
    elif window is not None:
        notes.append(window_reason(window, ref.num_tokens))
    known = {"qk_dependent", "routing_dependent", "absolute_positions", "router_group_limited", "window",
             "qk_parts"}
    notes += [str(v) for k, v in sorted(rules.items()) if k not in known and isinstance(v, str)]
    return tuple(notes)


def _verified_rules(ref: TraceSource) -> dict:
    """The reference's evidence_rules where its evidence_digest covers them; {} (the defaults) otherwise."""
    if getattr(ref, "evidence_verified", None) is not True:
        return {}
    rules = ref.attrs.get("evidence_rules", {})
    return rules if isinstance(rules, dict) else {}


class _Routing:
    """Routing near-ties: where the reference's own top-k selection margin (/evidence/topk_margin, in router-logit
    units) is below twice the router_logits tolerance, a candidate within tolerance there may select another expert
    by rounding alone. Such a topk_ids row is `tie`, and so are the divergent rows of the stages that depend on the
    selection (evidence_rules "routing_dependent") at that token: not a divergence, and not evidence. Where
    topk_ids is not captured, every near-tie token counts as possibly flipped."""

    def __init__(self, ties: np.ndarray | None, dependent: tuple[str, ...], topk_captured: bool,
                 flippable: np.ndarray | None = None):
        self.ties, self.dependent, self._flippable = ties, dependent, flippable
        self.flipped = np.zeros(0 if ties is None else len(ties), dtype=bool)
        if ties is not None and not topk_captured:
            self.flipped = ties.copy()

    @staticmethod
    def of(ref: TraceSource, cand: TraceSource, tols) -> "_Routing":
        dependent = tuple(_verified_rules(ref).get("routing_dependent", ("topk_weights", "routed", "mlp", "res2", "out")))
        dependent += () if DRAFT_STAGE in dependent else (DRAFT_STAGE,)  # lm_head(out) follows out
        if "router_logits" not in ref.stages or not ref.has_evidence("topk_margin"):
            return _Routing(None, dependent, True)
        tol, total = tols["router_logits"], ref.num_tokens
        margin = np.asarray(ref.evidence_rows("topk_margin", 0, total), dtype=np.float64).reshape(total, -1)[:, 0]
        logits = np.asarray(ref.stage_rows("router_logits", 0, total), dtype=np.float64)
        limit = 2 * np.maximum(tol.atol, tol.rtol * np.abs(logits).max(axis=1))
        flippable = None
        if ref.has_evidence("topk_flip"):  # per expert: only the experts at the boundary may flip by rounding
            flips = np.asarray(ref.evidence_rows("topk_flip", 0, total), dtype=np.float64)
            if flips.shape != logits.shape:
                raise ReferenceTraceError(f"reference {ref.path}: /evidence/topk_flip is {flips.shape}, expected "
                                          f"{logits.shape} (router_logits). Regenerate it with mtp-oracle export.")
            flippable = flips < limit[:, None]
        return _Routing(margin < limit, dependent, "topk_ids" in cand.stages, flippable)

    def near_tie(self, start: int, stop: int) -> np.ndarray | None:
        return None if self.ties is None else self.ties[start:stop]

    def flippable(self, start: int, stop: int) -> np.ndarray | None:
        return None if self._flippable is None else self._flippable[start:stop]

    def saw_flips(self, block: StageRows) -> None:
        if self.ties is not None:
            self.flipped[block.start:block.start + len(block)] |= block.has_status({"tie"})

    def excuse(self, name: str, block: StageRows) -> None:
        if self.ties is not None and name in self.dependent:
            mark_ties(block, self.flipped[block.start:block.start + len(block)])

    def tie_tokens(self) -> tuple[int, ...]:
        return tuple(np.flatnonzero(self.flipped).tolist()) if self.ties is not None else ()
