"""`mtp-probe diff|run --explain`: why the candidate diverges, not only where.

Four measurements, each on the reference's own inputs and checkpoint (the one the reference records, or
--checkpoint; its head digest must be the reference's, and so must the digest of the routed experts a MoE reference
records it used, `experts`):

1. Local vs inherited error. Every stage is recomputed with the oracle's operator from the candidate's OWN previous
   stages (attention from its own `ah` rows of every token up to t). `local_max_rel` (candidate vs that
   recomputation) beside `cumulative_max_rel` (candidate vs the reference): a row whose local error fails the
   stage's tolerance was computed wrongly ("local"); a divergent row computed correctly from divergent inputs is
   "inherited". The first stage with a local error is the bug; a divergence with no local error anywhere was
   pushed over the limit by sub-tolerance differences upstream. An uncaptured stage has no row of the candidate's:
   its oracle recomputation stands in, so a local error downstream of it is "at that stage or an uncaptured one
   before it", and a row equal to the reference is not blamed. Every row is compared by the diff's own row
   comparison (probe/compare.py compare_stage_rows: topk_weights in id order).
2. Diagnosis by fingerprint. Each wiring variant of the family's catalogue (oracle/families/*_layout.py
   `variants`) runs through the oracle's operators with one wiring change (oracle/variants.py); a variant is
   reported only when it reproduces the candidate at every captured stage and every compared token within
   tolerance, best (smallest max rel) first. The draft loop's variants (oracle/loop_variants.py: recycle_prenorm,
   recycle_main_hidden, position_frozen, chain_kv_kept, layer0_reused, draft_embed_tokens, enorm_hnorm_swap,
   layer_caches_swapped, shared_head_shared) run the oracle's own loop with one change, for every family, and are
   judged the same way at every captured depth (depth 1 and each chain depth the diff compared): whichever depth
   diverged first. On an argmax-chain reference they are fed its recorded chain tokens, as the candidate was.
3. Weight coverage. Each head tensor perturbed by 1% of its RMS (oracle/variants.py PERTURBATION), the head rerun
   from the stage that reads it: "evidenced" where one of the compared rows (captured stages, compared tokens)
   would then fail its tolerance. MoE: the routed experts these tokens never route to are listed.
4. Observer effect (driven candidates only: `run`): the candidate runs twice more capturing only `out`, judged by
   out's own tolerance (the diff's row comparison, not bit for bit): the two out-only runs disagreeing makes the
   verdict invalid as irreproducible; agreeing with each other but not with the fully captured run, as an observer
   effect ("capturing changes the result").

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
from oracle.trace import chain_info, read_trace
from probe.adapters.trace_file import open_candidate, open_reference
from probe.compare import ALIGNED_BY_IDS, INDEX_STAGE, compare_stage_rows
from probe.diff import DiffReport
from probe.evidence import Verdict
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
    first_depth: int = 1  # the depth of the first divergence (1: the bridge step)

    def to_json(self) -> dict:
        return {"diagnosis": [{k: _num(v) if isinstance(v, float) else v for k, v in d.items()
                               if k in ("variant", "max_rel", "stages_matched", "depths", "description")}
                              for d in self.diagnosis],
                "variants": [{k: _num(v) if isinstance(v, float) else v for k, v in d.items()} for d in self.variants],
                "local": [{k: _num(v) if isinstance(v, float) else v for k, v in row.items()} for row in self.local],
                "bug": self.bug and {k: _num(v) if isinstance(v, float) else v for k, v in self.bug.items()},
                "coverage": self.coverage, "observer": self.observer, "notes": self.notes}

    def diagnosis_line(self) -> str:
        if self.not_run:
            return f"DIAGNOSIS | {self.not_run}"
        if not self.diagnosis:
            line = "DIAGNOSIS | no known variant reproduces the candidate"
            if self.first_depth > 1:
                line += (f": depth {self.first_depth} of the draft loop diverges; the loop variants were checked at "
                         f"every captured depth, the bridge step's wiring variants at depth 1 only")
            return line
        best, rest = self.diagnosis[0], self.diagnosis[1:]
        matched = len(best["stages_matched"])
        where = f"all {matched} stages" if matched == self.num_stages else \
            f"all {matched} captured stage{'s' if matched != 1 else ''}"
        if best.get("depths"):
            where += f" at depth{'s' if len(best['depths']) > 1 else ''} {_depth_list(best['depths'])}"
        form = f" [{best['form']}]" if best.get("form") else ""  # which form of a bug with several
        line = (f"DIAGNOSIS | {best['variant']}{form} reproduces the candidate at {where} (max rel "
                f"{best['max_rel']:.1g}): {self.descriptions.get(best['variant'], '')}")
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
            lines.append(f"  local error: {_bug_place(self.bug)} (token {self.bug['token']}: local max rel "
                         f"{self.bug['local_max_rel']:.3g}, computed wrongly from its own inputs"
                         + (", or from what the uncaptured stages computed" if self.bug.get("or_uncaptured") else "")
                         + ")")
            local_stages = sorted({r["stage"] for r in self.local if r["kind"] == "local"} - {self.bug["stage"]},
                                  key=lambda s: self._order.index(s) if s in self._order else 99)
            if local_stages:
                upstream = {r["stage"]: r["or_uncaptured"] for r in self.local if r.get("or_uncaptured")}
                named = [f"{n} (or uncaptured {', '.join(upstream[n])})" if n in upstream else n for n in local_stages]
                lines.append(f"  also computed wrongly from their own inputs: {', '.join(named)}")
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
            lines.append("observer effect: none; out agrees within its tolerance with every stage captured and with "
                         "only out captured, and across two runs capturing only out")
        return "\n".join(lines)

    _order: tuple = ()


def _bug_place(bug: dict) -> str:
    """Where the first local error is: its stage, or that stage or an uncaptured one before it (whose oracle
    stand-in the recomputation read, so the error may lie there)."""
    before = bug.get("or_uncaptured")
    if not before:
        return f"the bug is at stage {bug['stage']}"
    return (f"the bug is at stage {bug['stage']} or at an uncaptured stage before it ({', '.join(before)}; capture "
            f"{'it' if len(before) == 1 else 'them'} to tell)")


def explain_diff(report: DiffReport, ref_path: Path, cand_path: Path, checkpoint: Path,
                 tols: dict[str, Tol]) -> Explanation:
    """--explain for `diff`: the candidate's stages (and chain depths) read from its trace file or raw directory."""
    with open_reference(ref_path) as ref, open_candidate(cand_path, ref) as cand:
        stages = _candidate_stages(ref, cand, report)
        depths = {part.depth: _candidate_stages(ref.depth(part.depth), cand.depth(part.depth), part.report)
                  for part in (report.chain.depths if report.chain is not None else ())}
    return explain_stages(report, ref_path, stages, checkpoint, tols, depths)


def explain_run(report: DiffReport, ref_path: Path, stages: dict[str, np.ndarray], checkpoint: Path,
                tols: dict[str, Tol], adapter, depths: dict | None = None) -> tuple[DiffReport, Explanation]:
    """--explain for `run`: the four measurements; an observer effect or an irreproducible out makes the verdict
    invalid. `depths`: the candidate's chain depths {j: {stage: rows}} (a driven draft loop)."""
    explanation = explain_stages(report, ref_path, stages, checkpoint, tols, depths)
    message, tokens, kind = observer_effect(adapter, ref_path, stages.get("out"), tols["out"])
    explanation.coverage["observer_checked"] = True
    if message:
        explanation.observer = message
        issue = Issue(kind, "out", tokens, message)
        report = dataclasses.replace(report, issues=report.issues + (issue,),
                                     verdict=Verdict("invalid", tuple(i.message for i in report.issues + (issue,))))
    return report, explanation


def observer_effect(adapter, ref_path: Path, full_out: np.ndarray | None,
                    tol: Tol) -> tuple[str | None, tuple[int, ...], str]:
    """Run `adapter` twice capturing only `out`, judged by out's own tolerance with the diff's row comparison (an
    engine whose out moves by an ulp from run to run is not at fault): two out-only runs that disagree are
    irreproducible (kind `irreproducible`); out-only runs that agree with each other but not with the fully
    captured run show an observer effect (`observer`). (None, (), "") when neither."""
    if full_out is None or not hasattr(adapter, "capture_only"):
        return None, (), ""
    with read_trace(ref_path) as reader:
        inputs = reader.inputs()
    chain = None
    if getattr(adapter, "supports_chains", False):  # its loop runs as in the captured run: bridge i+1 after chain i
        from probe.run import chain_inputs

        with open_reference(ref_path) as ref:
            chain = chain_inputs(ref)
    first, second = (_out_only(adapter, inputs, chain) for _ in range(2))
    differ, rel = _out_rows_differ(second, first, tol)
    if differ:
        return (f"the candidate is not reproducible: two runs capturing only out differ beyond out's tolerance at "
                f"{len(differ)} token(s) (max rel {rel:.3g}), so no single run's verdict holds; make the run "
                f"deterministic, or widen out's tolerance with a recorded reason (--stage-tol out=RTOL,ATOL)"), \
            differ, "irreproducible"
    differ, rel = _out_rows_differ(first, full_out, tol)
    if differ:
        return (f"capturing changes the result: out with every stage captured differs from out with only out "
                f"captured beyond out's tolerance at {len(differ)} token(s) (max rel {rel:.3g}), while two runs "
                f"capturing only out agree; a capture point must not change what is computed"), differ, "observer"
    return None, (), ""


def _out_only(adapter, inputs, chain=None) -> np.ndarray:
    """Depth 1's out of a run capturing only out; a driven loop runs its chains as in the captured run (an engine
    whose bridge steps see its chains, e.g. one that keeps their KV rows, gives another out without them)."""
    saved = adapter.capture_only
    adapter.capture_only = ()
    try:
        return (adapter.run(inputs) if chain is None else adapter.run(inputs, chain))["out"]
    finally:
        adapter.capture_only = saved


def _out_rows_differ(actual: np.ndarray, expected: np.ndarray, tol: Tol) -> tuple[tuple[int, ...], float]:
    """Tokens whose out rows fail out's tolerance (all of them when the shapes differ), and the worst max rel."""
    if np.shape(actual) != np.shape(expected):
        return tuple(range(len(expected))), math.inf
    rel, ok = _verdicts("out", actual, expected, tol, {})
    return tuple(int(t) for t in np.flatnonzero(~ok)), float(rel.max()) if rel.size else 0.0


def explain_stages(report: DiffReport, ref_path: Path, cand: dict[str, np.ndarray], checkpoint: Path,
                   tols: dict[str, Tol], depths: dict[int, dict[str, np.ndarray]] | None = None) -> Explanation:
    from oracle.loop_variants import DESCRIPTIONS as LOOP_DESCRIPTIONS
    from oracle.variants import Explainer  # torch and transformers: only under --explain

    with read_trace(ref_path) as reader:
        inputs, attrs = reader.inputs(), reader.attrs
        ref = {n: reader.stage_rows(n) for n in reader.stages}
        kinds = {s.name: s.kind for s in reader.stage_list}
        info = chain_info(reader)
        chain_tokens = _chain_tokens(reader, info)
    family = FAMILIES.get(attrs.get("family", LEGACY_FAMILY))
    conventions = {k: v for k, v in (attrs.get("config") or {}).items() if k in CONVENTIONS}
    explainer = Explainer(checkpoint, inputs, conventions, attrs.get("checkpoint_digest"), reference=ref)
    # The head digest leaves routed experts out: the experts the reference used are checked by their own digest.
    check_experts(checkpoint, recorded_experts(ref_path), ref_path)
    order = tuple(report.stage_names)
    explanation = Explanation([], [], [], None, {}, descriptions={v.name: v.description for v in family.variants}
                              if family else {}, num_stages=len(order))
    explanation._order = order
    explanation.descriptions |= LOOP_DESCRIPTIONS
    row_ok, max_rel = _row_rule(tols, kinds)
    tokens = report.compared_tokens
    first = report.first_at
    loop = []
    if first is not None:  # the loop variants, on every depth the diff compared (any family)
        explanation.first_depth = first[0]
        loop = _loop_variants(explainer.loop_variants(info, chain_tokens), _captured_depths(report, cand, depths),
                              order, row_ok, max_rel)
        if info is not None and info.tokens != "teacher_forced":
            explanation.notes.append("the draft loop's variants ran on the reference's recorded chain tokens (its "
                                     "own drafts, --chain-tokens argmax), as the candidate was fed them")
    if not explainer.supported:
        explanation.variants = loop
        explanation.diagnosis = sorted((v for v in loop if v["status"] == "reproduces"), key=lambda v: v["max_rel"])
        if not explanation.diagnosis:
            explanation.not_run = (f"not available: local error and diagnosis are not implemented for the "
                                   f"{explainer.family.name} family yet (oracle/variants.py: explain_ops, "
                                   f"EXPLAIN_VARIANTS)" + (f"; no loop variant ({', '.join(_checked(loop))}) "
                                                            f"reproduces the candidate" if _checked(loop) else ""))
        explanation.coverage = {"tensors": [], "lines": ["not measured for this family"]}
        return explanation
    cand = {n: a[:tokens] for n, a in cand.items() if n in explainer.ops.order or n == "draft"}
    divergent = sorted(report.first_per_token)
    if divergent:
        explanation.local, explanation.bug = _local(explainer, cand, ref, divergent, tols, kinds, order)
        names = tuple(v.name for v in family.variants) if family else ()
        compared = {n: a for n, a in cand.items()}
        truncated = _truncate(explainer, tokens)
        explanation.variants = truncated.variants(names, compared, row_ok, max_rel) + loop
    elif first is not None:  # a chain depth diverged: the bridge step's wiring variants do not apply there
        explanation.variants = loop
        explanation.notes.append(f"depth {first[0]} of the draft loop diverges first: the loop variants were checked "
                                 f"at every captured depth; local error and the bridge step's wiring variants are "
                                 f"measured at depth 1, which passed")
    else:
        explanation.not_run = "nothing to diagnose: no row diverges"
    explanation.diagnosis = sorted((v for v in explanation.variants if v["status"] == "reproduces"),
                                   key=lambda v: v["max_rel"])
    unchecked = [v for v in explanation.variants if v["status"] in ("not checkable", "not implemented")]
    if unchecked:
        explanation.notes.append("variants not checked on this trace: " + "; ".join(
            f"{v['variant']} ({v['reason']})" for v in unchecked))
    explanation.coverage = _coverage(explainer, report, tokens, row_ok, ref, cand)
    return explanation


def _chain_tokens(reader, info) -> dict[int, np.ndarray]:
    """{depth j: the token ids the reference fed at depth j} (/chain/d{j}/inputs/token_ids) of an argmax-chain
    reference, which the loop variants are fed as the candidate was; {} otherwise (teacher-forced tokens are the
    step tokens) or where a depth records none (the variants then say so)."""
    from oracle.trace import ChainDepthReader

    if info is None or info.tokens == "teacher_forced":
        return {}
    out = {}
    for j in info.chain_depths:
        part = ChainDepthReader(reader, j)
        if "token_ids" in part.input_names():
            out[j] = np.asarray(part.input_rows("token_ids")).reshape(-1).astype(np.int64)
    return out


def _captured_depths(report: DiffReport, cand: dict[str, np.ndarray],
                     depths: dict[int, dict[str, np.ndarray]] | None) -> dict[int, dict[str, np.ndarray]]:
    """The candidate's compared rows per depth: depth 1's first `compared_tokens`, each chain depth's likewise."""
    out = {1: {n: a[:report.compared_tokens] for n, a in cand.items()}}
    for part in report.chain.depths if report.chain is not None else ():
        rows = (depths or {}).get(part.depth)
        if rows:
            out[part.depth] = {n: a[:part.report.compared_tokens] for n, a in rows.items()
                               if n in part.report.captured}
    return out


def _loop_variants(runner, captured: dict[int, dict[str, np.ndarray]], order: tuple[str, ...], row_ok,
                   max_rel) -> list[dict]:
    """Each loop variant (oracle/loop_variants.py) against every captured stage of every captured depth: it
    reproduces the candidate only where every compared row of every depth is within tolerance of it."""
    from oracle.loop_variants import NAMES

    results = []
    for name in NAMES:
        if name == "draft_embed_tokens" and not any("draft" in rows for rows in captured.values()):
            results.append({"variant": name, "status": "not checkable", "reason": "the candidate captures no draft "
                            "stage (it shows only there)"})
            continue
        rows = runner.rows(name)
        if isinstance(rows, str):
            results.append({"variant": name, "status": "not applicable", "reason": rows})
            continue
        if isinstance(rows, list):  # one bug in several forms (layer0_reused): the first that reproduces, said
            found = [_loop_match(name, form_rows, captured, order, row_ok, max_rel) | {"form": form}
                     for form, form_rows in rows]
            results.append(next((r for r in found if r["status"] == "reproduces"), found[0]))
            continue
        results.append(_loop_match(name, rows, captured, order, row_ok, max_rel))
    return results


def _loop_match(name: str, rows: dict, captured: dict, order: tuple[str, ...], row_ok, max_rel) -> dict:
    matched, worst, depths = [], 0.0, []
    for depth in sorted(captured):
        want = rows.get(depth)
        stages = [s for s in order if s in captured[depth] and want is not None and s in want]
        for stage in stages:
            got = captured[depth][stage]
            n = min(len(got), len(want[stage]))
            expected = {k: v[:n] for k, v in want.items()}
            actual = {k: v[:n] for k, v in captured[depth].items()}
            ids = _ids(stage, actual, expected, slice(None))
            ok = row_ok(stage, actual[stage], expected[stage], ids)
            if not ok.all():
                return {"variant": name, "status": "differs", "first_mismatch": stage, "depth": depth,
                        "token": int(np.flatnonzero(~ok)[0]), "max_rel": max_rel(stage, actual[stage],
                                                                                expected[stage], ids),
                        "stages_matched": matched}
            worst = max(worst, max_rel(stage, actual[stage], expected[stage], ids))
            if stage not in matched:
                matched.append(stage)
        if stages:
            depths.append(depth)
    if not matched:
        return {"variant": name, "status": "not checkable", "reason": "no captured stage to compare"}
    return {"variant": name, "status": "reproduces", "max_rel": worst, "stages_matched": matched, "depths": depths}


def _checked(results: list[dict]) -> list[str]:
    return [r["variant"] for r in results if r["status"] in ("reproduces", "differs")]


def _depth_list(depths: list[int]) -> str:
    if len(depths) > 2 and depths == list(range(depths[0], depths[-1] + 1)):
        return f"{depths[0]}-{depths[-1]}"
    return ", ".join(map(str, depths))


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
    """Per (captured stage, divergent token): local (computed wrongly from its own inputs), inherited or ok. Where
    an uncaptured stage's oracle stand-in fed the recomputation, a local error is at that stage OR an uncaptured one
    before it (`or_uncaptured`), and a row equal to the reference is not blamed: the stand-in, not it, differs."""
    local, upstream = explainer.local(cand)
    rows, bug = [], None
    for stage in [n for n in order if n in cand and n in local]:
        tol, uncaptured = tols[stage], list(upstream.get(stage, ()))
        (lrel, lok) = _verdicts(stage, cand[stage][divergent], local[stage][divergent], tol, kinds,
                                _ids(stage, cand, local, divergent))
        (crel, cok) = _verdicts(stage, cand[stage][divergent], ref[stage][divergent], tol, kinds,
                                _ids(stage, cand, ref, divergent))
        for i, token in enumerate(divergent):
            local_bad, cum_bad = not lok[i], not cok[i]
            kind = "local" if local_bad and (cum_bad or not uncaptured) else "inherited" if cum_bad else "ok"
            row = {"stage": stage, "token": token, "local_max_rel": float(lrel[i]),
                   "cumulative_max_rel": float(crel[i]), "kind": kind}
            if uncaptured:
                row["or_uncaptured"] = uncaptured
            rows.append(row)
            if kind == "local" and bug is None:
                bug = {k: row[k] for k in ("stage", "token", "local_max_rel", "or_uncaptured") if k in row}
    rows.sort(key=lambda r: (r["token"], order.index(r["stage"])))
    return rows, bug


def _coverage(explainer, report: DiffReport, tokens: int, row_ok, ref, cand) -> dict:
    captured = tuple(report.captured)
    tensors = explainer.coverage(captured, tokens, row_ok)
    short = {t["tensor"]: _short(t["tensor"]) for t in tensors}
    # Tensor VALUES (a 1% error), in words apart from the evidence section's q/k-path PARTS (wiring variants), so
    # "q/k path, RoPE: evidenced" there and "k_proj: a 1% error moves no row" here never read as a contradiction.
    lines, evidenced = [], [short[t["tensor"]] for t in tensors if t["evidenced"]]
    if evidenced:
        lines.append(f"{', '.join(evidenced)}: values evidenced (a 1% error fails a compared row)")
    blind = [t for t in tensors if not t["evidenced"]]
    qk_rows = int(report.qk.sensitive[:tokens].sum()) if report.qk.recorded else 0
    qk_path = getattr(explainer.ops, "qk_path", QK_PATH)
    qk = [short[t["tensor"]] for t in blind if short[t["tensor"]] in qk_path]
    if qk:
        why = ("no attn row where the attention pattern matters" if qk_rows == 0 or "attn" not in captured
               else f"it stays within tolerance at the {qk_rows} attn row(s) where the attention pattern matters")
        lines.append(f"{', '.join(qk)}: values NOT evidenced: a 1% error moves no compared row ({why}; the q/k "
                     f"path's parts are stated under evidence)")
    other = [short[t["tensor"]] for t in blind if short[t["tensor"]] not in qk_path]
    if other:
        lines.append(f"{', '.join(other)}: values NOT evidenced: a 1% error moves no compared row beyond tolerance")
    experts = _experts(explainer, report, ref, cand, tokens)
    if experts:
        never, unseen = experts["never_routed"], experts["not_evidenced"]
        if never:
            lines.append(f"experts {_ids_text(never)}: never routed by these tokens ({len(never)} of "
                         f"{experts['num_experts']}; an error in them cannot show)")
        if unseen:
            lines.append(f"experts {_ids_text(unseen)}: routed only at rows not compared, or excused as routing "
                         f"near-ties, or divergent (no passing row evidences them)")
        if experts["evidenced"]:
            lines.append(f"experts {_ids_text(experts['evidenced'])}: routed at compared rows that passed (seen "
                         f"through {experts['seen_at']})")
    return {"perturbation": "1% of the tensor's RMS (of 1+w for a (1+w) norm) in every element",
            "tensors": tensors, "experts": experts, "lines": lines}


def _experts(explainer, report: DiffReport, ref: dict, cand: dict, tokens: int) -> dict | None:
    """For a MoE head: the routed experts of these tokens, split by what the comparison saw. An expert is evidenced
    only where a row that reads it (the first captured stage from `routed` on) was compared and passed, and so was
    topk_ids where captured; a row excused as a near-tie, not compared (--fail-fast) or divergent is no evidence.
    Its ids there are the candidate's own (equal to the reference's as a set, where topk_ids passed)."""
    every = explainer.experts(ref.get(INDEX_STAGE))
    if not every:
        return None
    order = tuple(report.stage_names)
    readers = order[order.index("routed"):] if "routed" in order else ()
    seen_at = next((n for n in readers if n in report.rows), None)
    passed = np.zeros(tokens, dtype=bool)
    if seen_at is not None:
        passed = _passed(report.rows[seen_at], tokens)
        if INDEX_STAGE in report.rows:
            passed &= _passed(report.rows[INDEX_STAGE], tokens)
    ids = cand.get(INDEX_STAGE, ref[INDEX_STAGE])[:tokens]
    evidenced = sorted({int(e) for e in np.unique(ids[passed])}) if passed.any() else []
    return {**every, "evidenced": evidenced, "seen_at": seen_at,
            "not_evidenced": [e for e in every["routed"] if e not in set(evidenced)]}


def _passed(rows, tokens: int) -> np.ndarray:
    """Per token < `tokens`: whether `rows` (a report's StageRows from token 0) holds a compared row that passed."""
    out = np.zeros(tokens, dtype=bool)
    ok = rows.has_status({"ok"})[:tokens]
    out[rows.start:rows.start + len(ok)] = ok[:max(tokens - rows.start, 0)]
    return out


def _ids_text(ids: list[int], shown: int = 24) -> str:
    return ", ".join(map(str, ids[:shown])) + (f" and {len(ids) - shown} more" if len(ids) > shown else "")


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
    """The diff's own row comparison (probe/compare.py compare_stage_rows), for the oracle side; `ids` = (actual's
    topk_ids, expected's topk_ids) puts topk_weights in the expected side's id order, as the diff does."""

    def row_ok(stage: str, actual: np.ndarray, expected: np.ndarray, ids=None) -> np.ndarray:
        return _verdicts(stage, actual, expected, tols[stage], kinds, ids)[1]

    def max_rel(stage: str, actual: np.ndarray, expected: np.ndarray, ids=None) -> float:
        rel = _verdicts(stage, actual, expected, tols[stage], kinds, ids)[0]
        return float(rel.max()) if rel.size else 0.0

    return row_ok, max_rel


def _verdicts(stage: str, actual, expected, tol: Tol, kinds: dict[str, str], ids=None) -> tuple[np.ndarray, np.ndarray]:
    """(max_rel, passes) per row, by the diff's row comparison (index sets: a differing set counts as 100%)."""
    rows = compare_stage_rows(stage, actual, expected, tol, kinds.get(stage) == INDEX_SET, ids)
    return np.where(np.isnan(rows.max_rel), np.inf, rows.max_rel), rows.has_status({"ok"})


def _ids(stage: str, actual: dict, expected: dict, rows) -> tuple | None:
    """(actual's, expected's) topk_ids at `rows` for a topk_weights comparison; None for any other stage."""
    if stage != ALIGNED_BY_IDS:
        return None
    return tuple(side[INDEX_STAGE][rows] if INDEX_STAGE in side else None for side in (actual, expected))


def _num(x: float):
    return x if math.isfinite(x) else str(x)
