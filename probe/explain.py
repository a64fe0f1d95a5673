"""`mtp-probe diff|run --explain`: why the candidate diverges, not only where.

Four measurements, each on the reference's own inputs and checkpoint (the one the reference records, or
--checkpoint; its head digest must be the reference's, and so must the digest of the routed experts a MoE reference
records it used, `experts`):

1. Local vs inherited error. Every stage is recomputed with the oracle's operator from the candidate's OWN previous
   stages (attention from its own `ah` rows of every token up to t). `local_max_rel` (candidate vs that
   recomputation) beside `cumulative_max_rel` (candidate vs the reference): a row whose local error fails the
   stage's tolerance was computed wrongly ("local"); a divergent row computed correctly from divergent inputs is
   "inherited". The first stage with a local error is the bug; a divergence with no local error anywhere was
   pushed over the limit by sub-tolerance differences upstream.
2. Diagnosis by fingerprint. Each wiring variant of the family's catalogue (oracle/families/*_layout.py
   `variants`) runs through the oracle's operators with one wiring change (oracle/variants.py); a variant is
   reported only when it reproduces the candidate at every captured stage and every compared token within
   tolerance, best (smallest max rel) first.
3. Weight coverage. Each head tensor perturbed by 1% of its RMS (oracle/variants.py PERTURBATION), the head rerun
   from the stage that reads it: "evidenced" where one of the compared rows (captured stages, compared tokens)
   would then fail its tolerance. MoE: the routed experts these tokens never route to are listed.
4. Observer effect (driven candidates only: `run`): the candidate runs again capturing only `out`; an `out` that
   differs bit for bit from the fully captured run makes the verdict invalid ("capturing changes the result").

The oracle's operators need torch and transformers, so this module imports oracle.variants only inside
`explain_*`; the probe's other paths never load them (tests/test_dependencies.py). It runs in-process.
"""

import dataclasses
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from oracle.families.registry import FAMILIES
from oracle.families.spec import CONVENTIONS
from oracle.stages import INDEX_SET, LEGACY_FAMILY
from oracle.trace import read_trace
from probe.adapters.trace_file import open_candidate, open_reference
from probe.diff import DiffReport
from probe.evidence import Verdict
from probe.rule import RULE
from probe.run import check_experts, recorded_experts
from probe.selfcheck import Issue
from probe.tolerance import Tol

QK_PATH = ("q_norm", "k_norm", "k_proj")  # tensors that reach attn only through the attention weights


@dataclass
class Explanation:
    diagnosis: list[dict]  # variants that reproduce the candidate, best first
    variants: list[dict]  # every variant's result (reproduces | differs | not checkable | …)
    local: list[dict]  # per (stage, token) of the divergent tokens
    bug: dict | None  # the first stage with a local error: {"stage", "token", "local_max_rel"}
    coverage: dict
    observer: str | None = None  # "capturing changes the result: …" or None
    notes: list[str] = field(default_factory=list)
    not_run: str | None = None  # why no diagnosis was attempted (no divergent row, family not supported)
    descriptions: dict = field(default_factory=dict)
    num_stages: int = 0

    def to_json(self) -> dict:
        return {"diagnosis": [{k: _num(v) if isinstance(v, float) else v for k, v in d.items()
                               if k in ("variant", "max_rel", "stages_matched", "description")}
                              for d in self.diagnosis],
                "variants": [{k: _num(v) if isinstance(v, float) else v for k, v in d.items()} for d in self.variants],
                "local": [{k: _num(v) if isinstance(v, float) else v for k, v in row.items()} for row in self.local],
                "bug": self.bug and {k: _num(v) if isinstance(v, float) else v for k, v in self.bug.items()},
                "coverage": self.coverage, "observer": self.observer, "notes": self.notes}

    def diagnosis_line(self) -> str:
        if self.not_run:
            return f"DIAGNOSIS | {self.not_run}"
        if not self.diagnosis:
            return "DIAGNOSIS | no known variant reproduces the candidate"
        best, rest = self.diagnosis[0], self.diagnosis[1:]
        matched = len(best["stages_matched"])
        where = f"all {matched} stages" if matched == self.num_stages else \
            f"all {matched} captured stage{'s' if matched != 1 else ''}"
        line = (f"DIAGNOSIS | {best['variant']} reproduces the candidate at {where} (max rel {best['max_rel']:.1g}): "
                f"{self.descriptions.get(best['variant'], '')}")
        if rest:
            line += (" | also reproduced by " + ", ".join(f"{d['variant']} (max rel {d['max_rel']:.1g})" for d in rest)
                     + ": these variants are indistinguishable on these inputs")
        return line

    def text(self) -> str:
        """The explain block printed before the DIAGNOSIS line."""
        lines = ["explain (each stage recomputed by the oracle from the candidate's own previous stages):"]
        if self.bug:
            wrong = {r["stage"] for r in self.local if r["kind"] == "local"}
            inherited = sorted({r["stage"] for r in self.local if r["kind"] == "inherited"} - wrong,
                               key=lambda s: self._order.index(s) if s in self._order else 99)
            lines.append(f"  local error: the bug is at stage {self.bug['stage']} (token {self.bug['token']}: local max "
                         f"rel {self.bug['local_max_rel']:.3g}, computed wrongly from its own inputs)")
            local_stages = sorted({r["stage"] for r in self.local if r["kind"] == "local"} - {self.bug["stage"]},
                                  key=lambda s: self._order.index(s) if s in self._order else 99)
            if local_stages:
                lines.append(f"  also computed wrongly from their own inputs: {', '.join(local_stages)}")
            if inherited:
                lines.append(f"  inherited (computed correctly from divergent inputs): {', '.join(inherited)}")
        elif self.local:
            first = next((r for r in self.local if r["kind"] == "inherited"), None)
            if first:
                lines.append(f"  local error: none; {first['stage']} at token {first['token']} diverges (max rel "
                             f"{first['cumulative_max_rel']:.3g}) but every stage is computed correctly from its own "
                             f"inputs: sub-tolerance differences upstream add up")
        lines += [f"  {n}" for n in self.notes]
        lines += ["weight coverage (an error of 1% of a tensor's RMS: would a compared row have failed?):"]
        lines += [f"  - {line}" for line in self.coverage.get("lines", [])]
        if self.observer:
            lines.append(f"observer effect: {self.observer}")
        elif self.coverage.get("observer_checked"):
            lines.append("observer effect: out is bit-identical with every stage captured and with only out captured")
        return "\n".join(lines)

    _order: tuple = ()


def explain_diff(report: DiffReport, ref_path: Path, cand_path: Path, checkpoint: Path,
                 tols: dict[str, Tol]) -> Explanation:
    """--explain for `diff`: the candidate's stages read from its trace file or raw directory."""
    with open_reference(ref_path) as ref, open_candidate(cand_path, ref) as cand:
        stages = _candidate_stages(ref, cand, report)
    return explain_stages(report, ref_path, stages, checkpoint, tols)


def explain_run(report: DiffReport, ref_path: Path, stages: dict[str, np.ndarray], checkpoint: Path,
                tols: dict[str, Tol], adapter) -> tuple[DiffReport, Explanation]:
    """--explain for `run`: the four measurements; an observer effect turns the verdict invalid."""
    explanation = explain_stages(report, ref_path, stages, checkpoint, tols)
    message, tokens = observer_effect(adapter, ref_path, stages.get("out"))
    explanation.coverage["observer_checked"] = True
    if message:
        explanation.observer = message
        issue = Issue("observer", "out", tokens, message)
        report = dataclasses.replace(report, issues=report.issues + (issue,),
                                     verdict=Verdict("invalid", tuple(i.message for i in report.issues + (issue,))))
    return report, explanation


def observer_effect(adapter, ref_path: Path, full_out: np.ndarray | None) -> tuple[str | None, tuple[int, ...]]:
    """Run `adapter` again capturing only `out`; compare with the fully captured run's `out` bit for bit."""
    if full_out is None or not hasattr(adapter, "capture_only"):
        return None, ()
    with read_trace(ref_path) as reader:
        inputs = reader.inputs()
    saved = adapter.capture_only
    adapter.capture_only = ()
    try:
        alone = adapter.run(inputs)["out"]
    finally:
        adapter.capture_only = saved
    a, b = np.ascontiguousarray(full_out, np.float32).view(np.uint32), np.ascontiguousarray(alone, np.float32).view(np.uint32)
    differ = tuple(int(t) for t in np.flatnonzero((a != b).any(axis=1))) if a.shape == b.shape else tuple(range(len(a)))
    if not differ:
        return None, ()
    rel = _verdicts(alone, full_out, Tol(0, 0, "exact"), False)[0].max() if a.shape == b.shape else math.inf
    return (f"capturing changes the result: out with every stage captured differs from out with only out captured "
            f"at {len(differ)} token(s) (max rel {rel:.3g}); a capture point must not change what is computed"), differ


def explain_stages(report: DiffReport, ref_path: Path, cand: dict[str, np.ndarray], checkpoint: Path,
                   tols: dict[str, Tol]) -> Explanation:
    from oracle.variants import Explainer  # torch and transformers: only under --explain

    with read_trace(ref_path) as reader:
        inputs, attrs = reader.inputs(), reader.attrs
        ref = {n: reader.stage_rows(n) for n in reader.stages}
        kinds = {s.name: s.kind for s in reader.stage_list}
    family = FAMILIES.get(attrs.get("family", LEGACY_FAMILY))
    conventions = {k: v for k, v in (attrs.get("config") or {}).items() if k in CONVENTIONS}
    explainer = Explainer(checkpoint, inputs, conventions, attrs.get("checkpoint_digest"), reference=ref)
    # The head digest leaves routed experts out: the experts the reference used are checked by their own digest.
    check_experts(checkpoint, recorded_experts(ref_path), ref_path)
    order = tuple(report.stage_names)
    explanation = Explanation([], [], [], None, {}, descriptions={v.name: v.description for v in family.variants}
                              if family else {}, num_stages=len(order))
    explanation._order = order
    if not explainer.supported:
        explanation.not_run = (f"not available: local error and diagnosis are not implemented for the "
                               f"{explainer.family.name} family yet (oracle/variants.py: explain_ops, EXPLAIN_VARIANTS)")
        explanation.coverage = {"tensors": [], "lines": ["not measured for this family"]}
        return explanation
    row_ok, max_rel = _row_rule(tols, kinds)
    tokens = report.compared_tokens
    cand = {n: a[:tokens] for n, a in cand.items() if n in explainer.ops.order}
    divergent = sorted(report.first_per_token)
    if divergent:
        explanation.local, explanation.bug = _local(explainer, cand, ref, divergent, tols, kinds, order)
        names = tuple(v.name for v in family.variants) if family else ()
        compared = {n: a for n, a in cand.items()}
        truncated = _truncate(explainer, tokens)
        explanation.variants = truncated.variants(names, compared, row_ok, max_rel)
        explanation.diagnosis = sorted((v for v in explanation.variants if v["status"] == "reproduces"),
                                       key=lambda v: v["max_rel"])
        unchecked = [v for v in explanation.variants if v["status"] in ("not checkable", "not implemented")]
        if unchecked:
            explanation.notes.append("variants not checked on this trace: " + "; ".join(
                f"{v['variant']} ({v['reason']})" for v in unchecked))
    else:
        explanation.not_run = "nothing to diagnose: no row diverges"
    explanation.coverage = _coverage(explainer, report, tokens, row_ok, ref)
    return explanation


def _truncate(explainer, tokens: int):
    """The explainer itself when every token was compared; else one over the first `tokens` (--fail-fast)."""
    if tokens == explainer.inputs.num_tokens:
        return explainer
    from oracle.trace import TraceInputs

    inputs = TraceInputs(*(getattr(explainer.inputs, n)[:tokens] for n in ("token_ids", "positions", "hidden", "embed")))
    clone = type(explainer).__new__(type(explainer))
    clone.__dict__.update(explainer.__dict__)
    clone.inputs, clone._base = inputs, None
    clone.reference = {k: v[:tokens] for k, v in explainer.reference.items()} if explainer.reference else None
    clone.ops = explainer.ops.prefix(tokens)  # exact for the first `tokens` steps (step t reads tokens <= t)
    return clone


def _local(explainer, cand, ref, divergent, tols, kinds, order) -> tuple[list[dict], dict | None]:
    local = explainer.local(cand)
    rows, bug = [], None
    for stage in [n for n in order if n in cand]:
        tol, index_set = tols[stage], kinds.get(stage) == INDEX_SET
        a, lo, e = (_order_free(stage, x[divergent]) for x in (cand[stage], local[stage], ref[stage]))
        (lrel, lok), (crel, cok) = _verdicts(a, lo, tol, index_set), _verdicts(a, e, tol, index_set)
        for i, token in enumerate(divergent):
            local_bad, cum_bad = not lok[i], not cok[i]
            kind = "local" if local_bad else "inherited" if cum_bad else "ok"
            rows.append({"stage": stage, "token": token, "local_max_rel": float(lrel[i]),
                         "cumulative_max_rel": float(crel[i]), "kind": kind})
            if kind == "local" and bug is None:
                bug = {"stage": stage, "token": token, "local_max_rel": float(lrel[i])}
    rows.sort(key=lambda r: (r["token"], order.index(r["stage"])))
    return rows, bug


def _coverage(explainer, report: DiffReport, tokens: int, row_ok, ref) -> dict:
    captured = tuple(report.captured)
    tensors = explainer.coverage(captured, tokens, row_ok)
    short = {t["tensor"]: _short(t["tensor"]) for t in tensors}
    lines, evidenced = [], [short[t["tensor"]] for t in tensors if t["evidenced"]]
    if evidenced:
        lines.append(f"{', '.join(evidenced)}: evidenced")
    blind = [t for t in tensors if not t["evidenced"]]
    qk_rows = int(report.qk.sensitive[:tokens].sum()) if report.qk.recorded else 0
    qk_path = getattr(explainer.ops, "qk_path", QK_PATH)
    qk = [short[t["tensor"]] for t in blind if short[t["tensor"]] in qk_path]
    if qk:
        why = ("no sensitive attention row" if qk_rows == 0 or "attn" not in captured
               else f"the {qk_rows} attention row(s) that depend on the weights do not move beyond tolerance")
        lines.append(f"{', '.join(qk)}: not evidenced ({why})")
    other = [short[t["tensor"]] for t in blind if short[t["tensor"]] not in qk_path]
    if other:
        lines.append(f"{', '.join(other)}: not evidenced (no compared row moves beyond tolerance)")
    experts = explainer.experts(ref.get("topk_ids"))
    if experts:
        never = experts["never_routed"]
        shown = ", ".join(map(str, never[:24])) + (f" and {len(never) - 24} more" if len(never) > 24 else "")
        if never:
            lines.append(f"experts {shown}: never routed by these tokens ({len(never)} of {experts['num_experts']}; "
                         f"an error in them cannot show)")
        lines.append(f"experts {', '.join(map(str, experts['routed'][:24]))}"
                     f"{' …' if len(experts['routed']) > 24 else ''}: routed by these tokens (seen through routed)")
    return {"perturbation": "1% of the tensor's RMS (of 1+w for a (1+w) norm) in every element",
            "tensors": tensors, "experts": experts, "lines": lines}


def _short(tensor: str) -> str:
    name = tensor.removeprefix("mtp.").removeprefix("layers.0.")
    name = re.sub(r"^model\.layers\.\d+\.", "", name).removesuffix(".weight")  # DeepSeek/GLM: the MTP layer
    return name.removeprefix("self_attn.").removeprefix("mlp.") if name.startswith(("self_attn.", "mlp.")) else name


def _candidate_stages(ref, cand, report: DiffReport) -> dict[str, np.ndarray]:
    """The candidate's stages whose layout the diff accepted (the others are not compared either)."""
    bad = {i.where for i in report.issues if i.kind in ("shape", "dtype")}
    out = {}
    for name in report.captured:
        if name in bad:
            continue
        rows = np.asarray(cand.stage_rows(name, 0, ref.num_tokens))
        out[name] = rows.astype(np.int64 if rows.dtype.kind in "iu" else np.float32, copy=True)
    return out


def _row_rule(tols: dict[str, Tol], kinds: dict[str, str]):
    """The probe's row rule (probe/rule.py RULE; index sets as sets), for the oracle side."""

    def row_ok(stage: str, actual: np.ndarray, expected: np.ndarray) -> np.ndarray:
        return _verdicts(_order_free(stage, actual), _order_free(stage, expected), tols[stage],
                         kinds.get(stage) == INDEX_SET)[1]

    def max_rel(stage: str, actual: np.ndarray, expected: np.ndarray) -> float:
        rel = _verdicts(_order_free(stage, actual), _order_free(stage, expected), tols[stage],
                        kinds.get(stage) == INDEX_SET)[0]
        return float(rel.max()) if rel.size else 0.0

    return row_ok, max_rel


def _order_free(stage: str, rows: np.ndarray) -> np.ndarray:
    """topk_weights are in each side's own topk_ids order: compared as the sorted weights (the ids are compared
    as sets at topk_ids, the assignment at routed)."""
    return -np.sort(-np.asarray(rows, dtype=np.float64), axis=1) if stage == "topk_weights" else rows


def _verdicts(actual, expected, tol: Tol, index_set: bool) -> tuple[np.ndarray, np.ndarray]:
    """(max_rel, passes) per row: RULE for float rows (any float dtype: its specification widens to float64); for
    index sets, the same set passes and a differing set counts as 100%."""
    a, e = np.asarray(actual), np.asarray(expected)
    if index_set:
        same = (np.sort(a.astype(np.int64), axis=1) == np.sort(e.astype(np.int64), axis=1)).all(axis=1)
        return np.where(same, 0.0, 1.0), same
    judged = RULE.judge(RULE.specification(a.reshape(len(a), -1), e.reshape(len(e), -1), tol), tol)
    return np.where(np.isnan(judged.max_rel), np.inf, judged.max_rel), judged.passes


def _num(x: float):
    return x if math.isfinite(x) else str(x)
