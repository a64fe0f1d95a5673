"""`diff_traces`: compare a candidate trace with the oracle's, stage by stage and token by token.

Both traces are read in token-row chunks (oracle.trace.rows_per_chunk of the widest compared stage), all stages of
one chunk before the next, so memory does not grow with T and `--fail-fast` stops with the earliest divergent
token fully localised. The result is data (`DiffReport`); probe/report.py renders it.
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from oracle.stages import STAGE_BY_NAME, STAGE_NAMES, stage_index
from oracle.trace import rows_per_chunk

from probe.adapters.trace_file import TraceSource, open_candidate, open_reference
from probe.compare import Cell, compare_chunk, compare_rows, not_compared
from probe.errors import ReferenceTraceError
from probe.evidence import Verdict, decide, is_evidential
from probe.localize import first_divergence, first_divergence_per_token
from probe.selfcheck import (Issue, check_reference, coverage_issues, expected_shape, input_issues, layout_problem,
                             unwritten_issues)
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
    cells: tuple[Cell, ...]  # STAGES order, then token order
    issues: tuple[Issue, ...]  # failed self-checks; any makes the verdict invalid
    verdict: Verdict
    first: Cell | None  # the first divergence: earliest token, then first stage
    first_per_token: dict[int, str]
    compared_tokens: int  # < num_tokens only when --fail-fast stopped early

    @property
    def not_captured(self) -> tuple[str, ...]:
        return tuple(n for n in STAGE_NAMES if n not in self.captured)


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
    issues = coverage_issues(cand) + input_issues(ref, cand)
    cells: list[Cell] = []
    comparable = []
    for name in cand.stages:
        problem = layout_problem(cand, name, expected_shape(ref, name))
        if problem is None:
            comparable.append(name)
            continue
        status, message = problem
        issues.append(Issue(status, name, tuple(range(ref.num_tokens)), message))
        width = expected_shape(ref, name)[1]
        cells += [Cell(name, t, not_compared(status, width, tols[name]), False) for t in range(ref.num_tokens)]
    stop_now = fail_fast and bool(issues)
    compared, compared_tokens = ([], 0) if stop_now else _compare_stages(ref, cand, comparable, tols, fail_fast)
    cells = sorted(cells + compared, key=lambda c: (stage_index(c.stage), c.token))
    issues += unwritten_issues(cells)
    return DiffReport(str(ref.path), str(cand.path), cand.kind, ref.num_tokens, ref.hidden_size, cand.stages,
                      cand.recorded_inputs, tols, tuple(cells), tuple(issues),
                      decide(cells, [i.message for i in issues], cand.stages), first_divergence(cells),
                      first_divergence_per_token(cells), compared_tokens)


def _compare_stages(ref: TraceSource, cand: TraceSource, names: Sequence[str], tols: dict[str, Tol],
                    fail_fast: bool) -> tuple[list[Cell], int]:
    total = ref.num_tokens
    if not names:
        return [], total
    step = read_rows(ref.hidden_size, total, names)
    cells: list[Cell] = []
    worst: dict[str, float] = {}  # per stage, the largest budget seen so far (its row gets full detail)
    for start in range(0, total, step):
        stop = min(start + step, total)
        chunk = [cell for name in names for cell in _compare_chunk(ref, cand, name, start, stop, tols[name], worst)]
        cells += chunk
        if fail_fast and not all(cell.diff for cell in chunk):
            return cells, stop
    return cells, total


def read_rows(hidden_size: int, num_tokens: int, names: Sequence[str]) -> int:
    """Token rows per read: READ_CHUNKS HDF5 chunks of the widest stage (4 MiB), few enough h5py calls to keep
    their overhead small and memory bounded whatever T."""
    return READ_CHUNKS * min(rows_per_chunk(STAGE_BY_NAME[n].width(hidden_size), num_tokens) for n in names)


def _compare_chunk(ref: TraceSource, cand: TraceSource, name: str, start: int, stop: int, tol: Tol,
                   worst: dict[str, float]) -> list[Cell]:
    expected = ref.stage_rows(name, start, stop)
    if not np.isfinite(expected.max()) or not np.isfinite(expected.min()):  # NaN/Inf propagate through both
        raise ReferenceTraceError(f"reference {ref.path}: stage {name} holds NaN/Inf in rows {start}..{stop - 1}, "
                                  f"so it cannot serve as the truth. Regenerate it with mtp-oracle export.")
    actual = cand.stage_rows(name, start, stop)
    diffs = compare_chunk(actual, expected, tol)
    i = max(range(len(diffs)), key=lambda r: diffs[r].budget_used)
    if diffs[i].budget_used > worst.get(name, -1.0):  # a new worst row for this stage: give it full detail (-v)
        worst[name] = diffs[i].budget_used
        diffs[i] = compare_rows(actual[i], expected[i], tol)
    return [Cell(name, start + i, diff, is_evidential(name, start + i, diff)) for i, diff in enumerate(diffs)]
