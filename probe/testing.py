"""For engines' own test suites: `assert_trace_close(reference, candidate)`, the probe as a pytest assertion.

    from probe.testing import assert_trace_close, reference_inputs

    def test_head(mtp_reference):                       # fixture from probe/pytest_plugin.py
        inputs = reference_inputs(mtp_reference)        # token ids, positions, hidden, embedding rows
        assert_trace_close(mtp_reference, my_engine.stages(inputs))

It runs the same self-checks, comparison and verdict as `mtp-probe diff`, and raises AssertionError (its
`.report` is the DiffReport) for every verdict but pass — diverged, invalid (unwritten rows, wrong shapes, inputs that differ)
and inconclusive (attn/out not captured, T=1) alike: a test never goes green on evidence the CLI would not pass.
The message is the CLI's summary line, then the first divergent row as the CLI prints it (probe/report.py).
"""

from collections.abc import Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from oracle.stages import KNOWN_STAGE_NAMES
from oracle.trace import TraceInputs, TraceReader, chain_rows, read_trace
from probe.adapters.trace_file import TraceSource, open_candidate, open_reference
from probe.diff import DiffReport, diff_sources
from probe.errors import AdapterError, ToleranceError
from probe.report import cell_detail, summary_line
from probe.run import ArraySource
from probe.selfcheck import check_reference
from probe.tolerance import PROFILES, Tol, tol_table, user_tol


@dataclass(frozen=True)
class ReferenceSpec:
    """What the `mtp_reference` fixture exports: the checkpoint, the step tokens, and where H comes from (exactly one
    of `hidden_seed` / `hidden_file`), as `mtp-oracle export CHECKPOINT --tokens … --hidden-seed N` would."""

    checkpoint: Path
    tokens: tuple[int, ...]
    hidden_seed: int | None = 0
    hidden_file: str | None = None
    start_pos: int = 0


def reference_inputs(reference: Path) -> TraceInputs:
    """The reference's step inputs (token_ids, positions, hidden [T, D], embed [T, D]): what a candidate consumes."""
    with read_trace(Path(reference)) as reader:
        return reader.inputs()


def assert_trace_close(reference, candidate, *, rtol: float | None = None, atol: float | None = None,
                       profile: str = "float32", stage_tol: Mapping[str, tuple[float, float]] | None = None,
                       fail_fast: bool = False) -> DiffReport:
    """Diff `candidate` against the oracle trace at `reference`; return the report if it passes, else raise.

    candidate: a path (an mtp-trace/1 file or a raw directory of <stage>.bin), a dict {stage: float32 [T, width]}
    (numpy arrays or anything np.asarray takes; captured stages only; chain depths as {"d2": {stage: [n_2, width]},
    ...}, rows = bridge positions, n_j = T - j + 1), or an open trace (a TraceSource from
    probe.adapters.trace_file, or oracle.trace.read_trace's reader). Tolerances as on the CLI: `profile`
    ("float32" | "bfloat16"), or `rtol` and `atol` together, and per-stage `stage_tol={"fc": (rtol, atol)}`.
    Raises AssertionError (with `.report`) on any verdict but pass; bad files or arguments raise MtpError.
    """
    __tracebackhide__ = True  # pytest shows the caller's line, not this one
    tols = _tolerances(rtol, atol, profile, stage_tol)
    with ExitStack() as stack:
        ref = stack.enter_context(open_reference(Path(reference)))
        check_reference(ref)
        cand = _candidate_source(candidate, ref, stack)
        report = diff_sources(ref, cand, tols, fail_fast)
    if report.verdict.name != "pass":
        error = AssertionError(failure_message(report))  # plain AssertionError: pytest prints it as such
        error.report = report  # the whole DiffReport (probe.report.render_text renders it)
        raise error
    return report


def failure_message(report: DiffReport) -> str:
    """The summary line, then the first divergent row's detail (at its depth), then for `invalid` each failed
    self-check with its hint (an inconclusive verdict's reasons are already in the summary line)."""
    lines = [summary_line(report)]
    if report.first_at is not None:
        depth, first = report.first_at
        lines.append(("" if depth == 1 else f"at depth {depth} (token = bridge position):\n")
                     + cell_detail(first, names=report.stage_names))
    if report.verdict.name == "invalid":
        lines += [f"  - {reason}" for reason in report.verdict.reasons]
    return "\n".join(lines)


def _tolerances(rtol, atol, profile: str, stage_tol) -> dict[str, Tol]:
    if (rtol is None) != (atol is None):
        raise ToleranceError("assert_trace_close: give both rtol and atol, or neither.")
    if rtol is not None and not all(isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)
                                    for v in (rtol, atol)):
        raise ToleranceError(f"assert_trace_close: rtol and atol are numbers, got {rtol!r:.20} and {atol!r:.20}.")
    if profile not in PROFILES:
        raise ToleranceError(f"assert_trace_close: profile {profile!r} is not one of {', '.join(sorted(PROFILES))}.")
    base = PROFILES[profile] if rtol is None else user_tol(rtol, atol, "assert_trace_close(rtol, atol)")
    table = tol_table(base)
    if stage_tol is not None and not isinstance(stage_tol, Mapping):
        raise ToleranceError(f"assert_trace_close: stage_tol must be a dict {{stage: (rtol, atol)}}, not "
                             f"{type(stage_tol).__name__} {stage_tol!r:.40}.")
    for name, pair in (stage_tol or {}).items():
        if isinstance(pair, (str, bytes)) or not hasattr(pair, "__len__") or len(pair) != 2 or not all(
                isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool) for v in pair):
            raise ToleranceError(f"assert_trace_close: stage_tol[{name!r}] is {pair!r:.40}; give the pair "
                                 f"(rtol, atol), e.g. stage_tol={{{name!r}: (1e-4, 1e-5)}}.")
        stage_rtol, stage_atol = pair
        if name not in KNOWN_STAGE_NAMES:
            raise ToleranceError(f"assert_trace_close: stage_tol names unknown stage {name!r}; valid stages are "
                                 f"{', '.join(KNOWN_STAGE_NAMES)}.")
        shown = ", ".join(f"{v:g}" if isinstance(v, (int, float, np.floating)) else repr(v)[:20]
                          for v in (stage_rtol, stage_atol))
        table[name] = user_tol(stage_rtol, stage_atol, f"stage_tol {name}=({shown})")
    return table


def _candidate_source(candidate, ref: TraceSource, stack: ExitStack) -> TraceSource:
    if isinstance(candidate, (str, Path)):
        return stack.enter_context(open_candidate(Path(candidate), ref))
    if isinstance(candidate, TraceReader):  # oracle.trace's reader: reopened as a probe source (read-only)
        return stack.enter_context(open_candidate(candidate.path, ref))
    if isinstance(candidate, Mapping):
        return _arrays_source(candidate, ref)
    if all(hasattr(candidate, attr) for attr in ("stages", "stage_rows", "stage_shape", "recorded_inputs")):
        return candidate  # an open TraceSource; its owner closes it
    raise TypeError(f"assert_trace_close: candidate must be a path, a dict of stage -> array or an open trace, "
                    f"not {type(candidate).__name__}.")


class _ArrayCandidate(ArraySource):
    """In-memory arrays from a test: nothing recorded about the inputs they were computed from."""

    def __init__(self, stages: dict[str, np.ndarray], ref: TraceSource, num_tokens: int | None = None,
                 depths: dict[int, dict[str, np.ndarray]] | None = None):
        # ArraySource reads only T and D from its inputs: hand it the reference's, without their rows.
        rows = ref.num_tokens if num_tokens is None else num_tokens
        empty = np.empty((0, ref.hidden_size), np.float32)
        shape_only = TraceInputs(np.empty(rows, np.int64), np.empty(rows, np.int64), empty, empty)
        super().__init__("arrays", shape_only, stages)
        self.kind = "arrays (in memory)"
        self.poisoned = False  # nothing says the test filled its arrays with poison: a zero row may be unwritten
        self._depths, self._ref = depths or {}, ref
        self.depths = tuple(sorted(self._depths))

    def depth(self, depth: int) -> "_ArrayCandidate":
        """The arrays given for chain depth `depth` ({"d{depth}": {...}}), rows = bridge positions."""
        return _ArrayCandidate(self._depths[depth], self._ref, chain_rows(self._ref.num_tokens, depth))


def _arrays_source(candidate: Mapping, ref: TraceSource) -> _ArrayCandidate:
    depths = {int(k[1:]): v for k, v in candidate.items() if _depth_key(k) and isinstance(v, Mapping)}
    unknown = sorted(str(k) for k in candidate if k not in ref.stages and not (_depth_key(k) and int(k[1:]) in depths))
    unknown += sorted(f"d{j}/{k}" for j, part in depths.items() for k in part if k not in ref.stages)
    if unknown:
        raise AdapterError(f"assert_trace_close: unknown stage names {unknown}; the reference's stages are "
                           f"{', '.join(ref.stages)}, and chain depths are given as {{'d2': {{stage: rows}}, ...}}.")
    # np.asarray keeps the dtype: a float64 or bf16-widened array is reported as a wrong dtype, never cast silently.
    stages = {name: _array(name, candidate[name]) for name in ref.stages if name in candidate}
    parts = {j: {name: _array(f"d{j}/{name}", part[name]) for name in ref.stages if name in part}
             for j, part in depths.items()}
    return _ArrayCandidate(stages, ref, depths=parts)


def _depth_key(key) -> bool:
    """"d2", "d3", ...: a chain depth's stages (depth 1 is the dict itself)."""
    return isinstance(key, str) and key[:1] == "d" and key[1:].isdigit() and int(key[1:]) >= 2


def _array(name: str, values) -> np.ndarray:
    """np.asarray(values), or AdapterError naming the stage where they are no rectangular array (ragged rows)."""
    try:
        array = np.asarray(values)
    except ValueError as err:  # numpy refuses ragged nested sequences
        raise AdapterError(f"assert_trace_close: stage {name} is not a rectangular array ({err}); give a float32 "
                           f"[T, width] array, one row per step.") from None
    if array.dtype == object:
        raise AdapterError(f"assert_trace_close: stage {name} holds Python objects (ragged rows?), not numbers; give "
                           f"a float32 [T, width] array, one row per step.")
    return array
