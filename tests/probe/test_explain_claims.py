"""--explain's claims, each measured (issue 29): the local-error analysis never lets the oracle's recomputation of an
uncaptured stage stand in for the candidate's; --explain compares a stage's rows as the diff does (topk_weights in
id order); routed experts count as seen only where a row that reads them was compared and passed; the observer
check judges out by its own tolerance and tells irreproducibility from an observer effect. Each with its twin."""

import numpy as np
import pytest

from oracle.trace import read_trace
from probe.adapters.trace_file import open_reference
from probe.compare import mark_ties
from probe.diff import diff_sources
from probe.explain import explain_run, explain_stages
from probe.run import ArraySource, adapter_from_spec, run_and_diff
from probe.tolerance import tol_table
from tests.helpers import TINY, TINY_REF, load_script, run_cli
from tests.probe.test_explain import SwappedSwiGlu  # noqa: F401  (the candidate the factories below build)

import numpy_step  # noqa: E402  (fixtures/candidates on sys.path: tests.probe.test_explain puts it there)


def reference(path=TINY_REF):
    with read_trace(path) as r:
        return r.inputs(), {n: r.stage_rows(n) for n in r.stages}


def explained(ref_path, ckpt, cand, inputs):
    with open_reference(ref_path) as ref:
        report = diff_sources(ref, ArraySource("candidate", inputs, cand), tol_table())
    return report, explain_stages(report, ref_path, cand, ckpt, tol_table())


def swapped_swiglu_stages():
    result = run_and_diff(TINY_REF, adapter_from_spec("python:tests.probe.test_explain:swapped_swiglu", TINY),
                          tol_table())
    assert result.report.first.stage == "mlp"
    return {n: a for n, a in result.stages.items()}


# ---- local error with uncaptured stages upstream ------------------------------------------------------------------

def test_a_bug_in_an_uncaptured_stage_is_not_blamed_on_the_next_captured_one_alone():
    """The MLP is wrong (silu(up) * gate) and mlp is not captured: res2 is the first divergent captured stage. Its
    local recomputation reads the oracle's mlp (the stand-in), so the bug is at res2 OR the uncaptured mlp."""
    inputs, _ = reference()
    stages = swapped_swiglu_stages()
    cand = {n: a for n, a in stages.items() if n != "mlp"}
    report, ex = explained(TINY_REF, TINY, cand, inputs)
    assert report.first.stage == "res2"
    assert ex.bug["stage"] == "res2" and ex.bug["or_uncaptured"] == ["mlp"]
    assert "the bug is at stage res2 or at an uncaptured stage before it (mlp" in ex.text()
    assert ex.to_json()["bug"]["or_uncaptured"] == ["mlp"]


def test_twin_with_the_stage_captured_the_bug_is_named_alone():
    inputs, _ = reference()
    report, ex = explained(TINY_REF, TINY, swapped_swiglu_stages(), inputs)
    assert ex.bug["stage"] == "mlp" and "or_uncaptured" not in ex.bug
    assert "the bug is at stage mlp (token" in ex.text()


def test_a_stage_equal_to_the_reference_is_not_blamed_for_an_uncaptured_stand_in():
    """The candidate's captured fc rows are corrupted (its engine used the right ones), ah is not captured: attn
    equals the reference, yet its recomputation from the stand-in ah (normed from the corrupted fc) differs. attn
    must not be called locally wrong: fc is the bug."""
    inputs, ref = reference()
    cand = {n: a.copy() for n, a in ref.items() if n != "ah"}
    noise = np.random.default_rng(0).standard_normal(cand["fc"][3:].shape).astype(np.float32)
    cand["fc"][3:] += noise * cand["fc"].std()  # not a scale: the norm after fc would undo one
    report, ex = explained(TINY_REF, TINY, cand, inputs)
    kinds = {(r["stage"], r["token"]): r for r in ex.local}
    assert ex.bug["stage"] == "fc" and "or_uncaptured" not in ex.bug
    attn = kinds["attn", 3]
    assert attn["local_max_rel"] > 1e-3 and attn["cumulative_max_rel"] < 1e-6  # the stand-in differs, attn does not
    assert attn["kind"] == "ok" and attn["or_uncaptured"] == ["ah"]


# ---- one row comparison: topk_weights in id order ---------------------------------------------------------------

@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    from oracle.cli import cli as oracle_cli

    root = tmp_path_factory.mktemp("claims-moe")
    ckpt = load_script("make_fixtures").write_moe_checkpoint(root / "moe", "qwen3_5_moe", "per_expert",
                                                               main_model=False)
    trace = root / "moe.h5"
    result = run_cli(oracle_cli, ["export", ckpt, "--out", trace, "--tokens", "5,17,3,99,200,7,42,5", "--hidden-seed",
                                  "0", "-q"])
    assert result.exit_code == 0, result.output
    return ckpt, trace


def test_weights_given_to_the_wrong_experts_are_a_local_error_at_topk_weights(moe):
    """Each row's top-k weights swapped between its experts (ids kept): the diff compares them in id order and
    fails topk_weights; --explain must agree (a sorted comparison had passed them, blaming nothing there)."""
    ckpt, trace = moe
    inputs, ref = reference(trace)
    cand = {n: a.copy() for n, a in ref.items()}
    assert (np.abs(np.diff(ref["topk_weights"], axis=1)) > 1e-3).all()  # distinct weights: the swap matters
    cand["topk_weights"] = ref["topk_weights"][:, ::-1].copy()
    report, ex = explained(trace, ckpt, cand, inputs)
    assert report.first.stage == "topk_weights"
    assert ex.bug["stage"] == "topk_weights"
    row = next(r for r in ex.local if r["stage"] == "topk_weights" and r["token"] == report.first.token)
    assert row["kind"] == "local" and row["cumulative_max_rel"] > 1e-2


def test_twin_an_engine_listing_its_top_k_in_another_order_agrees_everywhere(moe):
    """ids and weights listed in reverse order together: the same assignment. Diff and explain both pass them."""
    ckpt, trace = moe
    inputs, ref = reference(trace)
    cand = {n: a.copy() for n, a in ref.items()}
    cand["topk_weights"], cand["topk_ids"] = ref["topk_weights"][:, ::-1].copy(), ref["topk_ids"][:, ::-1].copy()
    cand["out"][2] *= np.float32(1.01)  # something to explain, downstream of the routing
    report, ex = explained(trace, ckpt, cand, inputs)
    assert report.first.stage == "out"
    weights = [r for r in ex.local if r["stage"] == "topk_weights"]
    assert weights and all(r["kind"] == "ok" and r["local_max_rel"] < 1e-6 for r in weights)
    assert ex.bug["stage"] == "out"


# ---- expert coverage from the comparison ---------------------------------------------------------------------------

def _experts_of(ids, tokens):
    return {int(e) for t in tokens for e in ids[t]}


def test_experts_count_as_seen_only_at_rows_compared_and_passed(moe):
    """Rows of routed that diverge, or that the diff excused as a routing near-tie, are no evidence of the experts
    they route to; only the experts of the passing rows are `evidenced`."""
    ckpt, trace = moe
    inputs, ref = reference(trace)
    ids = ref["topk_ids"]
    only_at = {t: _experts_of(ids, [t]) - _experts_of(ids, [u for u in range(len(ids)) if u != t])
               for t in range(len(ids))}
    excused = [t for t in range(len(ids)) if only_at[t]][:2]
    assert excused, "every expert of these tokens is routed twice: no expert to hide"
    cand = {n: a.copy() for n, a in ref.items()}
    for t in excused:
        cand["routed"][t] *= np.float32(1.5)
    with open_reference(trace) as r:
        report = diff_sources(r, ArraySource("candidate", inputs, cand), tol_table())
    tie = np.zeros(len(ids), dtype=bool)
    tie[excused[0]] = True
    mark_ties(report.rows["routed"], tie)  # as the diff marks a near-tie flip's rows: not compared, not evidence
    ex = explain_stages(report, trace, cand, ckpt, tol_table())
    experts = ex.coverage["experts"]
    passing = [t for t in range(len(ids)) if t not in excused]
    assert set(experts["evidenced"]) == _experts_of(ids, passing)
    hidden = set().union(*(only_at[t] for t in excused))
    assert hidden and hidden <= set(experts["not_evidenced"]) and not hidden & set(experts["evidenced"])
    assert any("no passing row evidences them" in line for line in ex.coverage["lines"])


def test_twin_every_routed_expert_of_a_passing_candidate_is_evidenced(moe):
    ckpt, trace = moe
    inputs, ref = reference(trace)
    cand = {n: a.copy() for n, a in ref.items()}
    report, ex = explained(trace, ckpt, cand, inputs)
    experts = ex.coverage["experts"]
    assert experts["evidenced"] == experts["routed"] and experts["not_evidenced"] == []
    assert experts["seen_at"] == "routed"


# ---- the observer check --------------------------------------------------------------------------------------------

class UlpJitter(numpy_step.NumpyHead):
    """A correct head whose out moves by about an ulp from run to run (e.g. a reduction order that varies)."""

    scale = 0.0  # extra relative noise beyond the ulp (0: none)

    def __init__(self, cfg, weights):
        super().__init__(cfg, weights)
        self.rng = np.random.default_rng()  # unseeded: every run differs

    def step(self, pos, embed_row, hidden, out, trace):
        super().step(pos, embed_row, hidden, out, trace)
        toward = np.where(self.rng.random(out.shape) < 0.5, -np.inf, np.inf).astype(np.float32)
        out[:] = np.nextafter(out, toward) * np.float32(1 + self.scale * self.rng.standard_normal())


class LargeJitter(UlpJitter):
    scale = 1e-2  # 100x out's rtol: the runs disagree beyond tolerance


def ulp_jitter(config, weights):
    return UlpJitter(config, weights)


def large_jitter(config, weights):
    return LargeJitter(config, weights)


def explained_run(spec):
    adapter = adapter_from_spec(spec, TINY)
    result = run_and_diff(TINY_REF, adapter, tol_table())
    return explain_run(result.report, TINY_REF, result.stages, TINY, tol_table(), adapter_from_spec(spec, TINY))


def test_an_out_that_moves_by_an_ulp_run_to_run_is_no_observer_effect():
    report, ex = explained_run("python:tests.probe.test_explain_claims:ulp_jitter")
    assert report.verdict.name == "pass", report.verdict
    assert ex.observer is None and ex.coverage["observer_checked"]
    assert "observer effect: none" in ex.text()


def test_twin_runs_that_disagree_beyond_tolerance_are_reported_irreproducible():
    report, ex = explained_run("python:tests.probe.test_explain_claims:large_jitter")
    assert report.verdict.name == "invalid" and report.verdict.exit_code == 2
    assert ex.observer.startswith("the candidate is not reproducible: two runs capturing only out differ")
    assert [i.kind for i in report.issues] == ["irreproducible"]
    assert "capturing changes the result" not in ex.observer


def test_twin_a_capture_dependent_out_is_still_an_observer_effect():
    report, ex = explained_run("python:tests.probe.test_explain:capture_dependent")
    assert report.verdict.name == "invalid"
    assert ex.observer.startswith("capturing changes the result") and "two runs capturing only out agree" in ex.observer
    assert [i.kind for i in report.issues] == ["observer"]


def test_cli_diff_explain_on_a_dump_without_the_buggy_stage_says_it_may_be_upstream(tmp_path):
    from probe.cli import cli as probe_cli
    from tests.probe.tracekit import write_raw

    inputs, _ = reference()
    dump = write_raw(tmp_path / "dump", {n: a for n, a in swapped_swiglu_stages().items() if n != "mlp"}, inputs)
    result = run_cli(probe_cli, ["diff", TINY_REF, dump, "--explain", "--checkpoint", TINY])
    assert result.exit_code == 1, result.output
    assert "the bug is at stage res2 or at an uncaptured stage before it (mlp" in result.output
