"""`diff_traces`: compare a candidate trace with the oracle's, stage by stage and token by token.

Both traces are read in token-row chunks (oracle.trace.rows_per_chunk of the widest compared stage), all stages of
one chunk before the next, so memory does not grow with T and `--fail-fast` stops with the earliest divergent
token fully localised. Each (stage, chunk) is compared as a block (probe/compare.py: columns, no Python object per
row) and full detail is kept only for the rows a report shows: each stage's first divergent row and its worst row.
The result is data (`DiffReport`); probe/report.py renders it.
"""

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Sequence

import numpy as np

from oracle.stages import STAGE_BY_NAME, STAGE_NAMES
from oracle.trace import rows_per_chunk

from probe.adapters.trace_file import TraceSource, open_candidate, open_reference
from probe.compare import (DIVERGENT_STATUSES, Cell, StageRows, join_rows, most_severe, not_compared_rows,
                           oracle_finite, rows_from_sums)
from probe.errors import ReferenceTraceError
from probe.evidence import ATTENTION, QkSensitivity, Verdict, cell_at, decide
from probe.localize import first_divergence, first_divergence_per_token
from probe.rowdiff import row_sums
from probe.findings import candidate_findings
from probe.selfcheck import (Issue, check_reference, coverage_issues, expected_shape, input_issues,
                             integrity_issues, layout_problem, unwritten_issues)
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

    @property
    def not_captured(self) -> tuple[str, ...]:
        return tuple(n for n in STAGE_NAMES if n not in self.captured)

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
        with open_candidate(cand_path, ref.num_tokens, ref.hidden_size) as cand:
            return diff_sources(ref, cand, tols or tol_table(), fail_fast)


def diff_sources(ref: TraceSource, cand: TraceSource, tols: dict[str, Tol], fail_fast: bool = False) -> DiffReport:
    """`diff_traces` on opened sources (a checked reference and a candidate)."""
    issues = coverage_issues(cand) + integrity_issues(cand) + input_issues(ref, cand)
    qk = qk_sensitivity(ref, tols[ATTENTION])
    zero_is_unwritten = not getattr(cand, "poisoned", False)
    rows: dict[str, StageRows] = {}
    comparable = []
    for name in cand.stages:
        problem = layout_problem(cand, name, expected_shape(ref, name))
        if problem is None:
            comparable.append(name)
            continue
        status, message = problem
        issues.append(Issue(status, name, tuple(range(ref.num_tokens)), message))
        rows[name] = not_compared_rows(name, ref.num_tokens, expected_shape(ref, name)[1], status, tols[name])
    stop_now = fail_fast and bool(issues)
    compared, compared_tokens = ({}, 0) if stop_now else _compare_stages(ref, cand, comparable, tols, fail_fast, qk,
                                                                           zero_is_unwritten)
    rows = {name: (rows | compared)[name] for name in STAGE_NAMES if name in rows or name in compared}
    issues += unwritten_issues(rows.values())
    first = first_divergence(rows.values())  # its row holds full detail (_StageProgress)
    findings = candidate_findings(ref, cand, first, tols)
    return DiffReport(str(ref.path), str(cand.path), cand.kind, ref.num_tokens, ref.hidden_size, cand.stages,
                      cand.recorded_inputs, tols, rows, tuple(issues),
                      decide(rows.values(), [i.message for i in issues], cand.stages, qk),
                      first, first_divergence_per_token(rows.values()), compared_tokens, qk, zero_is_unwritten,
                      findings)


def _compare_stages(ref: TraceSource, cand: TraceSource, names: Sequence[str], tols: dict[str, Tol],
                    fail_fast: bool, qk: QkSensitivity, zero_is_unwritten: bool) -> tuple[dict[str, StageRows], int]:
    total = ref.num_tokens
    if not names:
        return {}, total
    step = read_rows(ref.hidden_size, total, names)
    blocks = [(name, start, min(start + step, total)) for start in range(0, total, step) for name in names]
    stages = {name: _StageProgress() for name in names}
    stop, chunk_ok = total, True
    for (name, start, end), actual, expected, sums in _read_and_sum(ref, cand, blocks, tols):
        block = _block_rows(ref.path, name, start, expected.shape[1], sums, tols[name], qk.blind(name, start, end),
                            zero_is_unwritten)
        chunk_ok &= stages[name].add(block, actual, expected)
        if name == names[-1]:  # every stage of this chunk compared
            if fail_fast and not chunk_ok:
                stop = end
                break
            chunk_ok = True
    return {name: join_rows(progress.blocks) for name, progress in stages.items()}, stop


def _read_and_sum(ref: TraceSource, cand: TraceSource, blocks: list[tuple[str, int, int]], tols: dict[str, Tol]):
    """Yield (block, candidate rows, oracle rows, row sums) for each (stage, start, stop) block, in order.

    The sums of block k are computed on a second thread while block k + 1 is read (the compiled kernel and
    os.preadv both release the GIL). Rows are read into two reused buffer pairs, so a block's arrays are valid
    only until the next block is asked for; fresh arrays for every read would fault in new pages each time
    (measured: a fifth of the diff's time)."""
    widest = max(STAGE_BY_NAME[name].width(ref.hidden_size) for name, _, _ in blocks)
    rows = max(stop - start for _, start, stop in blocks)
    pairs = [[np.empty(rows * widest, dtype=np.float32) for _ in range(2)] for _ in range(2)]
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="mtp-probe-rowdiff") as pool:
        pending = None
        for k, (name, start, stop) in enumerate(blocks):
            shape = (stop - start, STAGE_BY_NAME[name].width(ref.hidden_size))
            into = [buffer[:shape[0] * shape[1]].reshape(shape) for buffer in pairs[k % 2]]
            actual, expected = cand.stage_rows(name, start, stop, into[0]), ref.stage_rows(name, start, stop, into[1])
            current = ((name, start, stop), actual, expected, pool.submit(row_sums, actual, expected, tols[name]))
            if pending is not None:
                yield *pending[:3], pending[3].result()
            pending = current
        if pending is not None:
            yield *pending[:3], pending[3].result()


def read_rows(hidden_size: int, num_tokens: int, names: Sequence[str]) -> int:
    """Token rows per read: READ_CHUNKS HDF5 chunks of the widest stage (4 MiB), few enough reads to keep their
    fixed cost small and memory bounded whatever T."""
    return READ_CHUNKS * min(rows_per_chunk(STAGE_BY_NAME[n].width(hidden_size), num_tokens) for n in names)


class _StageProgress:
    """One stage's blocks so far, and which of their rows keep full detail: the stage's first divergent row, and a
    valid row worse than any before it (so, in the end, the stage's worst valid row, which `-v` shows)."""

    def __init__(self) -> None:
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

    @staticmethod
    def _detail(block: StageRows, i: int, actual: np.ndarray, expected: np.ndarray) -> None:
        block.add_detail(block.start + i, actual[i], expected[i])


def _block_rows(ref_path: Path, name: str, start: int, width: int, sums: np.ndarray, tol: Tol,
                qk_blind: np.ndarray, zero_is_unwritten: bool) -> StageRows:
    """The rows of stage `name` from token `start`, from their sums; a non-finite oracle row is refused."""
    bad = np.flatnonzero(~oracle_finite(sums))
    if bad.size:  # NaN/Inf would propagate through both sides
        raise ReferenceTraceError(f"reference {ref_path}: stage {name} holds NaN/Inf in row {start + bad[0]}, so it "
                                  f"cannot serve as the truth. Regenerate it with mtp-oracle export.")
    return rows_from_sums(name, start, width, sums, tol, qk_blind, zero_is_unwritten)


def qk_sensitivity(ref: TraceSource, tol: Tol) -> QkSensitivity:
    """Which reference tokens' attn rows depend on the attention weights: where /evidence/attn_uniform FAILS the
    attn stage's tolerance against /stages/attn (probe/evidence.py). None are, without the record."""
    total = ref.num_tokens
    if not ref.has_evidence("attn_uniform"):
        return QkSensitivity(np.zeros(total, dtype=bool), recorded=False)
    sensitive = np.zeros(total, dtype=bool)
    step = read_rows(ref.hidden_size, total, STAGE_NAMES)  # the same read size as the comparison itself
    for start in range(0, total, step):
        stop = min(start + step, total)
        uniform, attn = ref.evidence_rows("attn_uniform", start, stop), ref.stage_rows(ATTENTION, start, stop)
        if uniform.shape != attn.shape or uniform.dtype != np.float32:
            raise ReferenceTraceError(f"reference {ref.path}: /evidence/attn_uniform is {uniform.dtype} "
                                      f"{uniform.shape}, expected float32 {attn.shape}. Regenerate it with "
                                      f"mtp-oracle export.")
        sums = row_sums(uniform, attn, tol)
        if not oracle_finite(sums).all() or not np.isfinite(sums["aa"]).all():
            raise ReferenceTraceError(f"reference {ref.path}: /evidence/attn_uniform or attn holds NaN/Inf near row "
                                      f"{start}. Regenerate it with mtp-oracle export.")
        rows = rows_from_sums(ATTENTION, start, attn.shape[1], sums, tol, zero_is_unwritten=False)
        sensitive[start:stop] = ~rows.has_status({"ok"})
    return QkSensitivity(sensitive, recorded=True)
