"""The probe's self-checks: a candidate that fails one is `invalid` (exit 2), whatever its numbers say.

They hold for every source: the reference is complete (every stage of its family's list, each [T, width] as its
shape symbol and dims say); the candidate captures something; each captured stage has the reference's shape and
dtype (float32, int64 for index sets); recorded inputs equal the reference's (token ids and positions exactly,
hidden bit for bit); every compared row was written (`unwritten` rows, found by probe/compare.py).
"""

from dataclasses import dataclass
from typing import Iterable

import numpy as np

from oracle.stages import INDEX_SET, STAGE_NAMES
from oracle.trace import export_hint, inputs_digest, rows_per_chunk

from probe.adapters.trace_file import CHECKED_INPUTS, TraceSource
from probe.compare import StageRows
from probe.errors import ReferenceTraceError
from probe.poison import POISON_BITS


@dataclass(frozen=True)
class Issue:
    kind: str  # coverage | shape | dtype | inputs | unwritten | pos0_mask | observer | irreproducible
    where: str  # a stage name, "inputs/<name>" or "candidate"
    tokens: tuple[int, ...]  # every affected token
    message: str


def check_reference(ref: TraceSource) -> None:
    """Raise ReferenceTraceError unless `ref` holds every stage of its family, each [T, width] of its kind's
    dtype, and its inputs."""
    regenerate = f"Write a complete one with: {export_hint(ref.path)}"
    required = _family_stages(ref)
    missing = [n for n in required if n not in ref.stages]
    if missing:
        raise ReferenceTraceError(f"reference {ref.path} lacks stages {', '.join(missing)}; a reference must hold "
                                  f"all {len(required)} of its family's. {regenerate}")
    if set(ref.recorded_inputs) != set(CHECKED_INPUTS):
        raise ReferenceTraceError(f"reference {ref.path} has no complete /inputs group. {regenerate}")
    for stage in ref.stage_list:
        want = (ref.num_tokens, stage.width(ref.dims))
        problem = layout_problem(ref, stage.name, want, stage.kind)
        if problem:
            raise ReferenceTraceError(f"reference {problem[1]} {regenerate}")
    stale = _stale_digest(ref)
    if stale:
        raise ReferenceTraceError(f"reference trace inconsistent: {stale}. Its inputs were changed after export, so "
                                  f"its stages are not the oracle's output for them. {regenerate}")
    if getattr(ref, "evidence_verified", None) is False:
        raise ReferenceTraceError(f"reference trace inconsistent: {ref.path}: its /evidence datasets or "
                                  f"evidence_rules do not match its evidence_digest (edited after export?), so what "
                                  f"it says a row can witness cannot be trusted. {regenerate}")


def _family_stages(ref: TraceSource) -> tuple[str, ...]:
    """The stages a reference must hold: those it declares (an oracle trace declares its family's whole list,
    `attn` and `out` included); a trace that declares no family has the default list."""
    if "family" not in getattr(ref, "attrs", {}):
        return STAGE_NAMES
    return tuple(dict.fromkeys(ref.stages + ("attn", "out")))


def _stale_digest(source: TraceSource) -> str | None:
    """What is wrong when the source's recorded inputs_digest does not match its /inputs; None when it matches or
    cannot be checked (no digest, or not every input recorded)."""
    recorded = getattr(source, "attrs", {}).get("inputs_digest")
    if recorded is None:
        return None
    if hasattr(source, "recorded_inputs_digest"):  # a trace file: hashed as it is read, never held whole
        actual = source.recorded_inputs_digest()
    else:
        inputs = source.all_inputs() if hasattr(source, "all_inputs") else None
        actual = None if inputs is None else inputs_digest(inputs)
    if actual is None:
        return None
    if actual == recorded:
        return None
    return (f"{source.path}: its /inputs hash to {actual[:19]}…, but its inputs_digest attribute says "
            f"{str(recorded)[:19]}…")


def integrity_issues(cand: TraceSource) -> list[Issue]:
    """A candidate trace that carries an inputs_digest must match it (an edited or spliced file is no evidence)."""
    stale = _stale_digest(cand)
    if stale is None:
        return []
    return [Issue("integrity", "candidate", (), f"candidate trace inconsistent: {stale}; write it again.")]


def layout_problem(source: TraceSource, name: str, want: tuple[int, int], kind: str = "rows") -> tuple[str, str] | None:
    """(`shape` | `dtype`, message) when stage `name` is not of shape `want` and of its kind's dtype (float32;
    int64 for index sets), else None."""
    got = tuple(source.stage_shape(name))
    expected = "int64" if kind == INDEX_SET else "float32"
    if got != want:
        return "shape", (f"stage {name}: {source.describe(name)} has shape {got}, expected {expected} {want} "
                         f"= [T, width] of the reference; write row t of step t, width {want[1]}.")
    dtype = np.dtype(source.stage_dtype(name))
    if kind == INDEX_SET and dtype.kind not in "iu":  # int32 ids from an engine are fine: compared as int64
        return "dtype", (f"stage {name}: {source.describe(name)} is {dtype}, expected integer ids (int64 in a raw "
                         f"dump), compared as a set per row.")
    if kind != INDEX_SET and not (dtype.kind == "f" and dtype.itemsize == 4):
        return "dtype", (f"stage {name}: {source.describe(name)} is {dtype}, expected float32; write the "
                         f"engine's float32 values (convert bf16/fp16 to float32 exactly, never round f64).")
    return None


def coverage_issues(cand: TraceSource) -> list[Issue]:
    """A candidate that captures no stage at all proves nothing."""
    if cand.stages:
        return []
    return [Issue("coverage", "candidate", (), f"{cand.path} captures no stage; capture at least "
                                               f"{', '.join(STAGE_NAMES)} (or a subset with attn and out).")]


def input_issues(ref: TraceSource, cand: TraceSource) -> list[Issue]:
    """Every recorded candidate input that differs from the reference, with every affected token."""
    issues = []
    for name in cand.recorded_inputs:
        want, got = tuple(ref.input_shape(name)), tuple(cand.input_shape(name))
        if got != want:
            issues.append(Issue("inputs", f"inputs/{name}", tuple(range(ref.num_tokens)),
                                f"recorded {name} has shape {got}, the reference's is {want}."))
            continue
        issue = _input_issue(ref, cand, name)
        if issue:
            issues.append(issue)
    return issues


def _input_issue(ref: TraceSource, cand: TraceSource, name: str) -> Issue | None:
    width = getattr(ref, "hidden_width", ref.hidden_size) if name == "hidden" else 1  # hc·D rows for DeepSeek-V4
    step = rows_per_chunk(width, ref.num_tokens)
    bad: list[int] = []
    for start in range(0, ref.num_tokens, step):
        stop = min(start + step, ref.num_tokens)
        expected, actual = ref.input_rows(name, start, stop), cand.input_rows(name, start, stop)
        kind_ok = actual.dtype == np.float32 if name == "hidden" else actual.dtype.kind in "iu"
        if actual.shape != expected.shape or not kind_ok:
            return Issue("inputs", f"inputs/{name}", tuple(range(ref.num_tokens)),
                         f"recorded {name} rows {start}..{stop - 1} are {actual.dtype} {actual.shape}, expected "
                         f"{expected.dtype} {expected.shape}.")
        if name == "hidden":  # bit-identical: the candidate must have been given the reference's hidden
            differs = (actual.view(np.uint32) != expected.view(np.uint32)).any(axis=1)
        else:
            differs = actual != expected
        bad.extend(int(t) + start for t in np.flatnonzero(differs))
    if not bad:
        return None
    example = "" if name == "hidden" else (f" (token {bad[0]}: reference {ref.input_rows(name, bad[0], bad[0] + 1)[0]}"
                                           f", candidate {cand.input_rows(name, bad[0], bad[0] + 1)[0]})")
    return Issue("inputs", f"inputs/{name}", tuple(bad),
                 f"{name} differs from the reference at {len(bad)} token(s){example}; run the candidate on the "
                 f"reference's inputs (/inputs of {ref.path}).")


def unwritten_issues(rows: Iterable[StageRows], pos0: "Pos0Convention | None" = None) -> list[Issue]:
    """One issue per stage and cause (poison left, all-zero row) naming every unwritten token. All-zero `e` rows
    at exactly the steps at absolute position 0, where the reference was exported without the mask, are the
    position-0 embedding mask (`pos0`, from pos0_convention), not unwritten rows: the issue names the convention."""
    issues = []
    for r in rows:  # in the reference's stage order
        unwritten = r.has_status({"unwritten"})
        for poisoned in (True, False):
            tokens = tuple(r.tokens[unwritten & ((r.n_poison > 0) == poisoned)].tolist())
            if not tokens:
                continue
            if not poisoned and pos0 is not None and pos0.explains(r.stage, tokens, candidate_zero=True):
                issues.append(Issue("pos0_mask", r.stage, tokens, pos0.message(tokens)))
                continue
            cause = (f"still hold the poison pattern 0x{POISON_BITS:08X}" if poisoned
                     else "are all zeros where the reference is not (a zero-initialised buffer?)")
            issues.append(Issue("unwritten", r.stage, tokens,
                                f"stage {r.stage}: {len(tokens)} row(s) {cause}: never written. Check the row offset "
                                f"the engine writes step t to (row t of [T, width])."))
    return issues


MASKED_STAGE = "e"  # the stage the position-0 embedding mask zeroes (enorm of a zero embedding is zero)


@dataclass(frozen=True)
class Pos0Convention:
    """A reference whose family has the position-0 embedding mask convention: which steps sit at absolute position
    0 and whether the reference masks them."""

    tokens: tuple[int, ...]
    masked: bool

    def explains(self, stage: str, tokens: tuple[int, ...], candidate_zero: bool) -> bool:
        """Whether rows of `stage` differing at exactly `tokens` are the mask convention the other way round: the
        candidate's rows zero where the reference is unmasked, or non-zero where the reference masks."""
        return (stage == MASKED_STAGE and bool(self.tokens) and set(tokens) == set(self.tokens)
                and candidate_zero != self.masked)

    def message(self, tokens: tuple[int, ...]) -> str:
        shown = ", ".join(map(str, tokens[:8])) + (" …" if len(tokens) > 8 else "")
        if self.masked:
            return (f"stage e differs exactly at token(s) {shown}, the step(s) at absolute position 0, where the "
                    f"reference's row is zero: the reference was exported with --mask-pos0-embedding and the "
                    f"candidate does not mask the position-0 embedding. Export the reference without "
                    f"--mask-pos0-embedding, or zero the embedding at position 0 in the engine (vLLM's convention).")
        return (f"stage e: row(s) at token(s) {shown}, the step(s) at absolute position 0, are all zeros where the "
                f"reference's are not: the candidate masks the position-0 embedding (vLLM's convention) and the "
                f"reference was exported without it. Export the reference with mtp-oracle export "
                f"--mask-pos0-embedding, or drop the mask in the engine.")


def pos0_convention(ref: TraceSource) -> Pos0Convention | None:
    """The reference's position-0 mask convention (None where its family has none, or it has no `e` stage)."""
    config = ref.attrs.get("config") if isinstance(getattr(ref, "attrs", None), dict) else None
    if not isinstance(config, dict) or "mask_pos0_embedding" not in config or MASKED_STAGE not in ref.stages:
        return None
    positions = np.asarray(ref.input_rows("positions", 0, ref.num_tokens)).reshape(-1)
    return Pos0Convention(tuple(np.flatnonzero(positions == 0).tolist()), bool(config["mask_pos0_embedding"]))


def expected_shape(ref: TraceSource, name: str) -> tuple[int, int]:
    """[T, width] of stage `name`: the reference's own (checked against its shape symbol by check_reference)."""
    return tuple(ref.stage_shape(name))
