"""The draft loop (issue 24): comparing a candidate's chain depths 2..K with the reference's, and one verdict for all.

Depth 1 is the bridge step (probe/diff.py). A reference exported with `--chain K` also holds depths 2..K
(oracle/trace.py, Chains): depth j has n_j = T - j + 1 rows, row r = bridge position r. Each depth the candidate
captures is compared as a trace of its own (`diff_depth`, streaming its rows as depth 1 does: memory stays flat),
with that depth's evidence: attn_uniform (q/k), topk_margin (routing), draft_margin (draft near-ties) and the
recycle alternatives h_if_<alt>. The first divergence is depth 1's first, else the first of depth 2, 3, ...

Verdicts never claim depths not seen: a reference that records chains and a candidate that captures none (or only
some depths) is at best inconclusive ("the loop was not checked"); a candidate that captures depths the reference
lacks, or more rows at depth j than the reference has bridge positions, is bad input (ProbeError, exit 2).

A depth copied, not computed: a candidate whose every row of every float stage at depth j is bit-identical to the
reference's while one of those stages is not at depth 1 (an engine's own arithmetic leaves its last bits at every
depth, or at none) wrote the reference's rows there; that depth is not counted as passed (inconclusive). A candidate
identical at every depth cannot be told from the oracle itself, and is judged as before.

The recycle choice (which tensor depth j-1 hands to depth j) is evidenced at a depth-j row only where the `h` the
alternative would have given (/chain/d{j}/evidence/h_if_<alt>) fails the h tolerance against the reference's h:
elsewhere a candidate recycling the alternative gives the same row, and the row is reported as not evidential for
the choice. A captured depth whose h rows evidence no row against some alternative cannot pass.
"""

from dataclasses import dataclass, replace

import numpy as np

from oracle.stages import INDEX_SET
from oracle.trace import ChainInfo

from probe.compare import INVALID_STATUSES, rows_from_sums
from probe.errors import ProbeError, ReferenceTraceError
from probe.evidence import Verdict
from probe.rule import RULE
from probe.selfcheck import layout_problem

RECYCLE_PREFIX = "h_if_"
HIDDEN_STAGE = "h"  # the first stage that sees the recycled hidden: where the recycle choice shows
LAYER_ALTERNATIVE = "out_if_layer0"  # N-layer heads: the out of layer 0 at a depth that runs another layer
LAYER_STAGE = "out"


@dataclass(frozen=True)
class RecycleEvidence:
    """Against one alternative <alt>: which depth-j rows could show the recycle choice, and which did."""

    alt: str
    sensitive: np.ndarray  # bool [n_j]: h_if_<alt> fails the h tolerance there (the choice shows)
    evidencing: np.ndarray  # bool [n_j]: sensitive, and the candidate's h row is within tolerance

    @property
    def not_evidential(self) -> np.ndarray:
        return np.flatnonzero(~self.sensitive)


@dataclass(frozen=True)
class DepthDiff:
    depth: int
    report: "DiffReport"  # the depth's comparison; its tokens are bridge positions
    recycle: tuple[RecycleEvidence, ...]
    recycle_note: str | None  # why the recycle choice is not evidenced at this depth (None: it is, or diverged)
    layer_note: str | None = None  # the candidate records another physical layer than the reference ran here
    layer_evidence: RecycleEvidence | None = None  # alt "layer 0": rows where running layer 0 would have failed
    layer_evidence_note: str | None = None  # why this depth does not evidence its layer (None: it does, or n/a)


@dataclass(frozen=True)
class ChainDiff:
    info: ChainInfo | None  # the reference's chain record (None: it records the bridge step only)
    depths: tuple[DepthDiff, ...]  # the depths compared, in order
    not_captured: tuple[int, ...]  # reference depths the candidate does not capture
    bridge_verdict: Verdict  # depth 1's own verdict
    not_compared: str | None = None  # why captured depths were not compared (--fail-fast after a failing depth)
    copied: tuple[int, ...] = ()  # depths bit-identical to the reference while depth 1 is not: not computed

    @property
    def compared_depths(self) -> tuple[int, ...]:
        return (1,) + tuple(d.depth for d in self.depths)


def with_chain(bridge: "DiffReport", ref, cand, tols, fail_fast: bool) -> "DiffReport":
    """`bridge` (depth 1's report) with the chain's depths compared and the verdict made over every depth."""
    info = getattr(ref, "chain", None)
    captured = tuple(getattr(cand, "depths", ()))
    if info is None:
        if captured:
            raise ProbeError(f"candidate {cand.path} captures chain depths {_list(captured)}, but the reference "
                             f"{ref.path} records the bridge step only: there is nothing to compare them with. "
                             f"Export the reference with mtp-oracle export ... --chain {max(captured)}.")
        note = ("the draft loop was not checked: the reference records the bridge step only (depth 1); export it "
                "with mtp-oracle export ... --chain K to compare depths 2..K")
        return replace(bridge, evidence_notes=bridge.evidence_notes + (note,))
    check_chain_reference(ref, info)
    extra = [j for j in captured if j > info.depths]
    if extra:
        raise ProbeError(f"candidate {cand.path} captures chain depth {extra[0]}, which the reference {ref.path} "
                         f"lacks (it records depths 2..{info.depths}); drop depths past {info.depths}, or export the "
                         f"reference with --chain {max(captured)}.")
    stopped = 1 if fail_fast and bridge.verdict.name in ("diverged", "invalid") else None
    depths = []
    for j in (j for j in info.chain_depths if j in captured and stopped is None):
        depths.append(_diff_one_depth(ref, cand, j, tols, fail_fast))
        if fail_fast and depths[-1].report.verdict.name in ("diverged", "invalid"):
            stopped = j  # --fail-fast: the first depth that failed ends the comparison
    left = [j for j in captured if j not in {d.depth for d in depths}]
    why = (f"--fail-fast: depth {stopped} {'diverged' if stopped == 1 and bridge.verdict.name == 'diverged' else 'failed'}"
           f", so depth(s) {_list(left)} were not compared") if stopped is not None and left else None
    chain = ChainDiff(info, tuple(depths), tuple(j for j in info.chain_depths if j not in captured), bridge.verdict,
                      why, copied_depths(ref, bridge, depths))
    return replace(bridge, chain=chain, verdict=combined_verdict(chain))


def copied_depths(ref, bridge: "DiffReport", depths: list[DepthDiff]) -> tuple[int, ...]:
    """The compared depths whose every float row is bit-identical to the reference's although some stage of theirs is
    not at depth 1 (the same arithmetic cannot be exact at depth j and inexact at depth 1). A stage exact at depth 1
    too (e.g. a norm computed in the oracle's order) is no sign of copying, nor is a candidate exact everywhere."""
    float_stages = {s.name for s in ref.stage_list if s.kind != INDEX_SET}
    inexact_at_1 = {name for name, exact in _exact_stages(bridge, float_stages).items() if not exact}
    copied = []
    for part in depths:
        exact = _exact_stages(part.report, float_stages)
        if exact and all(exact.values()) and inexact_at_1 & set(exact):
            copied.append(part.depth)
    return tuple(copied)


def _exact_stages(report: "DiffReport", float_stages: set[str]) -> dict[str, bool]:
    """Per compared float stage: every row valid and max |a - e| == 0."""
    return {name: bool((r.max_abs == 0).all()) and not r.has_status(INVALID_STATUSES).any()
            for name, r in report.rows.items() if name in float_stages and len(r)}


def check_chain_reference(ref, info: ChainInfo) -> None:
    """The reference's chain is complete and as recorded: groups d2..dK, bridge order, and its chain_digest."""
    regenerate = "Regenerate it with mtp-oracle export ... --chain K."
    if tuple(ref.depths) != info.chain_depths:
        raise ReferenceTraceError(f"reference {ref.path}: its chain record says depths 2..{info.depths}, but it holds "
                                  f"/chain groups {_list(ref.depths) or 'none'}. {regenerate}")
    recorded = ref.attrs.get("chain_digest")
    if not isinstance(recorded, str) or recorded != ref.recorded_chain_digest():
        what = "records no chain_digest" if recorded is None else "has /chain inputs that do not match its chain_digest"
        raise ReferenceTraceError(f"reference {ref.path} {what} (edited after export?), so its chain rows cannot be "
                                  f"trusted. {regenerate}")
    if not getattr(ref, "_chain_checked", False):
        for j in info.chain_depths:
            _check_reference_depth(ref, ref.depth(j), j)
        ref._chain_checked = True


def _check_reference_depth(ref, part, depth: int) -> None:
    regenerate = "Regenerate it with mtp-oracle export ... --chain K."
    if set(part.stages) != set(ref.stages):
        raise ReferenceTraceError(f"reference {ref.path}: /chain/d{depth} holds stages {', '.join(part.stages)}; every "
                                  f"depth holds depth 1's ({', '.join(ref.stages)}). {regenerate}")
    for stage in part.stage_list:
        problem = layout_problem(part, stage.name, (part.num_tokens, ref.stage_shape(stage.name)[1]), stage.kind)
        if problem:
            raise ReferenceTraceError(f"reference {problem[1]} {regenerate}")
    bridge = part.chain_input_rows("bridge") if "bridge" in part.chain_input_names() else None
    if bridge is None or not np.array_equal(bridge, np.arange(part.num_tokens)):
        raise ReferenceTraceError(f"reference {ref.path}: /chain/d{depth}/inputs/bridge is not 0..{part.num_tokens - 1} "
                                  f"(row r = bridge position r, n_j = T - j + 1). {regenerate}")


def _diff_one_depth(ref, cand, depth: int, tols, fail_fast: bool) -> DepthDiff:
    from probe.diff import diff_depth

    ref_part, cand_part = ref.depth(depth), cand.depth(depth)
    check_candidate_depth(ref_part, cand_part, depth)
    report = never_written_hint(diff_depth(ref_part, cand_part, tols, fail_fast, depth=depth), depth)
    recycle = recycle_evidence(ref_part, report, tols[HIDDEN_STAGE])
    layer = _ran_layer(ref_part)
    evidence = layer_evidence(ref_part, report, tols[LAYER_STAGE]) if layer else None
    return DepthDiff(depth, report, recycle, _recycle_note(ref_part, report, recycle, depth),
                     _layer_note(ref_part, cand_part, depth), evidence,
                     _layer_evidence_note(report, evidence, depth, layer))


def _layer_note(ref_part, cand_part, depth: int) -> str | None:
    """Why depth j cannot pass when the candidate records (/chain/d{j}/inputs/layer) another physical layer than the
    reference ran at some bridge: its rows may still match (layers with equal weights, a one-layer head mislabelled),
    but a PASS would certify a layer it says it did not run. Not bad input: the engine picks its layer (vLLM without
    spec_step_idx runs layer 0 at every depth), so a divergence, with its diagnosis, still takes precedence."""
    names = getattr(cand_part, "chain_input_names", tuple)()
    if "layer" not in names or "layer" not in getattr(ref_part, "chain_input_names", tuple)():
        return None
    got, want = np.asarray(cand_part.chain_input_rows("layer")), np.asarray(ref_part.chain_input_rows("layer"))
    if got.ndim != 1 or got.dtype.kind not in "iu" or len(got) > len(want):
        return (f"depth {depth}: the candidate's /chain/d{depth}/inputs/layer is {got.dtype} {got.shape}, not one "
                f"integer layer index per bridge row (int64 [{len(want)}]); write the physical layer the engine ran")
    # -1: the engine did not say which layer it ran (probe/run.py's driven loops, llama.cpp): nothing to hold it to
    bad = np.flatnonzero((got != want[:len(got)]) & (got != -1))
    if not len(bad):
        return None
    r = int(bad[0])
    return (f"depth {depth}: the candidate records layer {int(got[r])} at bridge {r} ({len(bad)} row(s)) where the "
            f"reference ran layer {int(want[r])}, so its rows there are not counted as that layer's; run layer "
            f"{int(want[r])} at depth {depth} (or record the layer the engine really ran)")


def never_written_hint(report: "DiffReport", depth: int) -> "DiffReport":
    """A depth captured and never written (every row of every captured stage unwritten: a draft step that says it
    drafts and writes nothing) is invalid as any unwritten row is; its first issue then says what to do, instead of
    the depth-1 advice about row offsets."""
    rows = [r for r in report.rows.values() if len(r)]
    if not rows or not all(r.has_status({"unwritten"}).all() for r in rows):
        return report
    first = next((i for i in report.issues if i.kind == "unwritten"), None)
    if first is None:
        return report
    hint = replace(first, message=f"stage {first.where}: depth {depth} is captured but none of its rows was written "
                                  f"(nor any other stage's): the draft step (mtp2_draft_step, draft_step, or a dump's "
                                  f"d{depth}/) never wrote this depth. Write `out` and every captured stage at row r "
                                  f"for bridge r, at every depth; an engine that runs no chain exports no draft step "
                                  f"(the loop is then reported as not checked).")
    return replace(report, issues=tuple(hint if i is first else i for i in report.issues))


def check_candidate_depth(ref_part, cand_part, depth: int) -> None:
    """ProbeError when the candidate's depth-j rows refer to bridge positions the reference lacks (more rows than
    n_j, or a bridge input that is not 0, 1, ...); fewer rows are a truncated stage, which the diff reports
    (invalid)."""
    n = ref_part.num_tokens
    for name in cand_part.stages:
        shape = tuple(cand_part.stage_shape(name))
        if len(shape) == 2 and shape[0] > n:
            raise ProbeError(f"candidate {cand_part.describe(name)} holds {shape[0]} rows at depth {depth}, but the "
                             f"reference has bridge positions 0..{n - 1} there (n_j = T - j + 1 = {n}): rows past "
                             f"{n - 1} refer to bridge positions the reference lacks. Write row r for bridge r only.")
    if "bridge" in getattr(cand_part, "chain_input_names", tuple)():  # an HDF5 candidate may record it
        bridge = np.asarray(cand_part.chain_input_rows("bridge"))
        if bridge.ndim != 1 or len(bridge) > n or not np.array_equal(bridge, np.arange(len(bridge))):
            raise ProbeError(f"candidate {cand_part.path}: /chain/d{depth}/inputs/bridge is {bridge[:8].tolist()}...; "
                             f"row r is bridge position r, for r = 0..{n - 1} (the reference's). Write the rows in "
                             f"bridge order.")


def recycle_evidence(ref_part, report, tol) -> tuple[RecycleEvidence, ...]:
    """Per recorded alternative: rows where h_if_<alt> fails the h tolerance (read a block of rows at a time), and
    those where the candidate's h row is also within tolerance (it evidences the recycle choice there)."""
    if tol is None or HIDDEN_STAGE not in ref_part.stages:
        return ()
    names = [n for n in ref_part.evidence_names() if n.startswith(RECYCLE_PREFIX)]
    names = [n for n in names if ref_part.has_evidence(n)]  # verified only
    return tuple(_alternative(ref_part, report, HIDDEN_STAGE, name, name[len(RECYCLE_PREFIX):], tol)
                 for name in names)


def layer_evidence(ref_part, report, tol) -> RecycleEvidence | None:
    """Rows where out_if_layer0 (layer 0's out at this depth) fails the out tolerance, and those where the
    candidate's out row is also within tolerance (it evidences the layer choice there); None: not recorded."""
    if tol is None or LAYER_STAGE not in ref_part.stages or not ref_part.has_evidence(LAYER_ALTERNATIVE):
        return None
    return _alternative(ref_part, report, LAYER_STAGE, LAYER_ALTERNATIVE, "layer 0", tol)


def _alternative(ref_part, report, stage: str, name: str, alt_name: str, tol) -> RecycleEvidence:
    """One recorded alternative of `stage` (/chain/d{j}/evidence/<name>), read a block of rows at a time."""
    total = ref_part.num_tokens
    found = report.rows.get(stage)
    ok = found.has_status({"ok"}) if found is not None else np.zeros(total, dtype=bool)
    width = ref_part.stage_shape(stage)[1]
    step = max(1, (4 << 20) // (4 * max(width, 1)))
    sensitive = np.zeros(total, dtype=bool)
    for start in range(0, total, step):
        stop = min(start + step, total)
        alt, rows_ref = ref_part.evidence_rows(name, start, stop), ref_part.stage_rows(stage, start, stop)
        if alt.shape != rows_ref.shape or alt.dtype != np.float32:
            raise ReferenceTraceError(f"reference {ref_part.path}: /chain/d{report.depth}/evidence/{name} is "
                                      f"{alt.dtype} {alt.shape}, expected float32 {rows_ref.shape} (stage {stage}). "
                                      f"Regenerate it with mtp-oracle export.")
        rows = rows_from_sums(stage, start, width, RULE.sums(alt, rows_ref, tol), tol, zero_is_unwritten=False)
        sensitive[start:stop] = ~rows.has_status({"ok"})
    return RecycleEvidence(alt_name, sensitive, sensitive & ok)


def _ran_layer(ref_part) -> int:
    """The physical layer the reference ran at this depth (0 where it records none: one-layer heads)."""
    if "layer" not in getattr(ref_part, "chain_input_names", tuple)():
        return 0
    layers = np.asarray(ref_part.chain_input_rows("layer"))
    return int(layers.max()) if layers.size else 0


def _layer_evidence_note(report, evidence: RecycleEvidence | None, depth: int, layer: int) -> str | None:
    """Why this depth does not evidence that it ran layer `layer` rather than layer 0 (vLLM without
    spec_step_idx); None when it does, when it diverged, or when it runs layer 0 itself."""
    if not layer or report.verdict.name in ("diverged", "invalid"):
        return None
    if LAYER_STAGE not in report.captured:
        return (f"depth {depth}: out not captured, so running layer {layer} rather than layer 0 is not evidenced "
                f"there; capture out at every depth")
    if evidence is None:
        return (f"depth {depth}: the reference records no layer evidence (/chain/d{depth}/evidence/"
                f"{LAYER_ALTERNATIVE}), so running layer {layer} rather than layer 0 is not evidenced there; "
                f"re-export it with this mtp-oracle")
    if evidence.evidencing.any():
        return None
    return (f"depth {depth}: no out row evidences the layer choice (layer 0 gives the same out as layer {layer} "
            f"within tolerance at every row: equal weights?), so a candidate running layer 0 here would pass too")


def _recycle_note(ref_part, report, recycle: tuple[RecycleEvidence, ...], depth: int) -> str | None:
    """Why this depth does not evidence the recycle choice; None when every alternative is evidenced somewhere."""
    if report.verdict.name in ("diverged", "invalid"):
        return None
    if HIDDEN_STAGE not in report.captured:
        return (f"depth {depth}: h not captured, so the recycle choice (which tensor depth {depth - 1} hands on) is "
                f"not evidenced there; capture h at every depth")
    if not recycle:
        return (f"depth {depth}: the reference records no verified recycle evidence (/chain/d{depth}/evidence/"
                f"h_if_*), so the recycle choice is not evidenced there; re-export it with this mtp-oracle")
    blind = [r.alt for r in recycle if not r.evidencing.any()]
    if not blind:
        return None
    return (f"depth {depth}: no h row evidences the recycle choice against {', '.join(blind)} (recycling it gives "
            f"the same h within tolerance at every row), so a candidate recycling it would pass too; compare "
            f"inputs where the alternatives differ")


def combined_verdict(chain: ChainDiff) -> Verdict:
    """invalid > diverged > inconclusive > pass over depth 1 and every compared depth; a reference depth the
    candidate does not capture (or a loop not compared) keeps it from passing."""
    parts = [(1, chain.bridge_verdict)] + [(d.depth, d.report.verdict) for d in chain.depths]
    for name in ("invalid", "diverged"):
        hit = [(j, v) for j, v in parts if v.name == name]
        if hit:
            return Verdict(name, tuple(_at(j, r) for j, v in hit for r in v.reasons))
    reasons = [_at(j, r) for j, v in parts if v.name == "inconclusive" for r in v.reasons]
    reasons += [d.recycle_note for d in chain.depths if d.recycle_note]
    reasons += [d.layer_note for d in chain.depths if d.layer_note]
    reasons += [d.layer_evidence_note for d in chain.depths if d.layer_evidence_note]
    if chain.copied:
        reasons.append(f"depth(s) {_list(chain.copied)} not counted as passed: every row of every stage there is "
                       f"bit-identical to the reference's while depth 1's are not, so those rows were copied, not "
                       f"computed (an engine's own arithmetic leaves its last bits at every depth or at none); write "
                       f"the rows the engine computes at each depth")
    if chain.not_compared:
        reasons.append(f"the draft loop was not checked: {chain.not_compared}")
    elif chain.not_captured and not chain.depths:
        reasons.append(f"the draft loop was not checked: the reference records depths 2..{chain.info.depths} and "
                       f"the candidate captures none (write /chain/d{{j}}/stages/<name>, or d{{j}}/<stage>.bin in a "
                       f"raw dump)")
    elif chain.not_captured:
        reasons.append(f"depth(s) {_list(chain.not_captured)} of the reference's 2..{chain.info.depths} not captured: "
                       f"the draft loop was checked to depth {max(chain.compared_depths)} only")
    return Verdict("inconclusive", tuple(reasons)) if reasons else Verdict("pass", ())


def _at(depth: int, reason: str) -> str:
    return reason if depth == 1 else f"depth {depth}: {reason}"


def _list(depths) -> str:
    return ", ".join(str(j) for j in depths)
