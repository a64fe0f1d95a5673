"""`--explain`: mutants diagnosed by the right variant name, a bug no variant explains gets "no known variant", the
local error singles out the wrong stage (later ones inherited), sub-tolerance accumulation is not blamed on a stage,
weight coverage is measured, and capturing that changes the result is invalid. Each with its twin."""

import dataclasses
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from oracle.trace import read_trace
from probe.adapters.cabi import CAbiAdapter, build_library
from probe.cli import cli as probe_cli
from probe.diff import diff_sources
from probe.explain import explain_run, explain_stages
from probe.run import ArraySource, adapter_from_spec, run_and_diff
from probe.adapters.trace_file import open_reference
from probe.selftest import first_step_reference
from probe.tolerance import tol_table
from tests.helpers import ROOT, TINY, TINY_REF, load_script, run_cli

sys.path.insert(0, str(ROOT / "fixtures" / "candidates"))
import numpy_step  # noqa: E402

SOURCE = ROOT / "fixtures" / "candidates" / "mtp_step.c"
MUTANTS = {  # C mutant (fixtures/candidates/mtp_step.c) -> the variant that must be named
    "CONCAT_SWAP": "concat_swap", "W_NORM": "plain_norm", "QGATE_HALVES": "qgate_halves", "NO_GATE": "no_gate",
    "NO_QK_NORM": "no_qk_norm", "ROPE_ALL_DIMS": "rope_all_dims", "ROPE_GPTJ": "rope_interleaved",
    "POS_FROZEN": "pos_frozen", "NO_KV_APPEND": "no_kv_append",
}


@pytest.fixture(scope="module")
def libs(tmp_path_factory):
    out = tmp_path_factory.mktemp("explain-libs")
    return {m: build_library(SOURCE, out, (f"MTP_MUTANT_{m}",) if m != "REF" else ()) for m in [*MUTANTS, "REF"]}


def explained_run(adapter, ref: Path = TINY_REF):
    result = run_and_diff(ref, adapter, tol_table())
    return explain_run(result.report, ref, result.stages, TINY, tol_table(), adapter)


@pytest.mark.parametrize("mutant", sorted(MUTANTS))
def test_each_c_mutant_is_diagnosed_with_its_variant_name(libs, mutant):
    report, ex = explained_run(CAbiAdapter(libs[mutant], TINY))
    assert report.verdict.name == "diverged"
    names = [d["variant"] for d in ex.diagnosis]
    assert MUTANTS[mutant] in names, (ex.diagnosis_line(), ex.variants)
    # Only variants that reproduce every stage are listed; at position 0 frozen positions ARE no RoPE at all.
    assert set(names) <= {MUTANTS[mutant]} | ({"no_rope"} if mutant == "POS_FROZEN" else set())
    best = ex.diagnosis[0]
    assert len(best["stages_matched"]) == 11 and best["max_rel"] < 1e-5
    assert ex.diagnosis_line().startswith(f"DIAGNOSIS | {names[0]} reproduces the candidate at all 11 stages")


def test_twin_the_correct_c_candidate_has_nothing_to_diagnose(libs):
    report, ex = explained_run(CAbiAdapter(libs["REF"], TINY))
    assert report.verdict.name == "pass" and ex.diagnosis == [] and ex.observer is None
    assert ex.diagnosis_line() == "DIAGNOSIS | nothing to diagnose: no row diverges"


def test_a_variant_matching_only_the_first_divergent_stage_is_not_claimed(libs):
    """NO_QK_NORM and the RoPE mutants all diverge first at attn@1; each other variant fails somewhere."""
    _, ex = explained_run(CAbiAdapter(libs["NO_QK_NORM"], TINY))
    others = {v["variant"]: v for v in ex.variants if v["variant"] != "no_qk_norm"}
    assert all(v["status"] != "reproduces" for v in others.values())


# ---- local vs inherited --------------------------------------------------------------------------------------

class SwappedSwiGlu(numpy_step.NumpyHead):
    """silu(up) * gate instead of silu(gate) * up: a bug in the MLP that no catalogue variant describes."""

    def mlp(self, x):
        w = self.w
        up = w["mlp.up_proj.weight"] @ x
        return {"mlp": w["mlp.down_proj.weight"] @ (up / (1 + np.exp(-up)) * (w["mlp.gate_proj.weight"] @ x))}


def swapped_swiglu(config, weights):
    return SwappedSwiGlu(config, weights)


class CaptureDependent(numpy_step.NumpyHead):
    """Computes `out` differently when nothing is captured (e.g. a fused fast path with a bug)."""

    def step(self, pos, embed_row, hidden, out, trace):
        super().step(pos, embed_row, hidden, out, trace)
        if not trace:
            out *= np.float32(1.0001)


def capture_dependent(config, weights):
    return CaptureDependent(config, weights)


def test_a_bug_no_variant_explains_gets_no_known_variant_and_the_local_error_names_its_stage():
    report, ex = explained_run(adapter_from_spec("python:tests.probe.test_explain:swapped_swiglu", TINY))
    assert report.first.stage == "mlp"
    assert ex.diagnosis == [] and ex.diagnosis_line() == "DIAGNOSIS | no known variant reproduces the candidate"
    assert ex.bug["stage"] == "mlp"
    kinds = {(r["stage"], r["token"]): r["kind"] for r in ex.local}
    assert all(kinds[s, 0] == "inherited" for s in ("res2", "out"))
    assert all(kinds[s, 0] == "ok" for s in ("e", "h", "fc_in", "fc", "ah", "attn", "res1", "mh"))
    assert "the bug is at stage mlp" in ex.text() and "inherited (computed correctly from divergent inputs): res2, out" \
        in ex.text()


def test_zero_o_proj_is_local_at_attn_with_every_later_stage_inherited():
    report, ex = explained_run(adapter_from_spec("python:tests.probe.lie_candidates:zero_o_proj", TINY))
    assert ex.bug == {"stage": "attn", "token": 0, "local_max_rel": pytest.approx(1.0)}
    assert ex.diagnosis == []
    later = [r for r in ex.local if r["stage"] in ("res1", "mh", "mlp", "res2", "out")]
    assert later and all(r["kind"] == "inherited" for r in later)
    assert all(r["local_max_rel"] < 1e-5 < r["cumulative_max_rel"] for r in later)


def test_python_no_qk_norm_candidate_is_diagnosed():
    _, ex = explained_run(adapter_from_spec("python:tests.probe.lie_candidates:no_qk_norm", TINY))
    assert [d["variant"] for d in ex.diagnosis] == ["no_qk_norm"] and ex.bug["stage"] == "attn"


def test_sub_tolerance_errors_upstream_are_not_blamed_on_the_stage_they_push_over():
    """e and h each within tolerance, fc computed correctly from them, yet fc out of tolerance: no local error."""
    from oracle.variants import Explainer

    with read_trace(TINY_REF) as r:
        inputs, ref = r.inputs(), {n: r.stage_rows(n) for n in r.stages}
    ex = Explainer(TINY, inputs)
    w = ex.head.fc.weight.detach().float().numpy()  # [D, 2D]
    d = inputs.hidden_size
    stages = {"e": ref["e"].copy(), "h": ref["h"].copy()}
    j = int(np.abs(ref["fc"][0]).argmin())  # push the row's smallest element: max|fc| stays, the error counts fully
    for name, cols in (("e", slice(0, d)), ("h", slice(d, 2 * d))):
        stages[name][0] += np.float32(0.9e-4) * np.abs(ref[name][0]).max() * np.sign(w[j, cols]).astype(np.float32)
    import torch

    s = {k: torch.from_numpy(v) for k, v in stages.items()}
    for name in ex.ops.order[2:]:
        s[name] = ex.ops.compute(name, s)
    cand = {n: s[n].numpy() for n in ex.ops.order}
    with open_reference(TINY_REF) as reference:
        report = diff_sources(reference, ArraySource("sub-tolerance", inputs, cand), tol_table())
    assert report.cell("e", 0).diff and report.cell("h", 0).diff  # both within tolerance
    assert report.first.stage == "fc" and report.first.token == 0  # today's report names fc
    explanation = explain_stages(report, TINY_REF, cand, TINY, tol_table())
    assert explanation.bug is None
    fc = next(r for r in explanation.local if (r["stage"], r["token"]) == ("fc", 0))
    assert fc["kind"] == "inherited" and fc["local_max_rel"] < 1e-6 < 1e-4 < fc["cumulative_max_rel"]
    assert "sub-tolerance differences upstream add up" in explanation.text()


# ---- coverage --------------------------------------------------------------------------------------------------

def test_coverage_at_t1_q_and_k_norms_are_not_evidenced_and_at_t8_they_are(libs, tmp_path):
    one = first_step_reference(TINY_REF, tmp_path / "t1.h5")
    _, ex1 = explained_run(CAbiAdapter(libs["REF"], TINY), one)
    _, ex8 = explained_run(CAbiAdapter(libs["REF"], TINY))
    blind = {t["tensor"].split(".")[-2] for t in ex1.coverage["tensors"] if not t["evidenced"]}
    assert {"q_norm", "k_norm", "k_proj"} <= blind and "v_proj" not in blind and "o_proj" not in blind
    assert any("k_norm" in line and "values NOT evidenced" in line and "no attn row where the attention pattern "
               "matters" in line for line in ex1.coverage["lines"])
    assert all(t["evidenced"] for t in ex8.coverage["tensors"])


def test_coverage_depends_on_what_was_captured(libs):
    """Twin: with only out compared, errors in tensors are still seen at out; with the bf16 profile, 1% is not."""
    result = run_and_diff(TINY_REF, CAbiAdapter(libs["REF"], TINY), tol_table())
    from probe.tolerance import PROFILES

    loose = tol_table(PROFILES["bfloat16"])
    ex = explain_stages(result.report, TINY_REF, result.stages, TINY, loose)
    assert not all(t["evidenced"] for t in ex.coverage["tensors"])


# ---- observer effect ---------------------------------------------------------------------------------------------

def test_capturing_that_changes_the_result_is_invalid():
    report, ex = explained_run(adapter_from_spec("python:tests.probe.test_explain:capture_dependent", TINY))
    assert report.verdict.name == "invalid" and report.verdict.exit_code == 2
    assert ex.observer.startswith("capturing changes the result")
    assert any(i.kind == "observer" for i in report.issues)


def test_twin_capture_independent_candidates_keep_their_verdict(libs):
    report, ex = explained_run(adapter_from_spec("python:numpy_step:make_head", TINY))
    assert report.verdict.name == "pass" and ex.observer is None and ex.coverage["observer_checked"]
    adapter = CAbiAdapter(libs["REF"], TINY)
    adapter.capture_only = ()
    with read_trace(TINY_REF) as r:
        only = adapter.run(r.inputs())
    assert set(only) == {"out"}  # the C worker narrowed the capture mask


# ---- the CLI -----------------------------------------------------------------------------------------------------

def test_cli_run_and_diff_print_the_diagnosis_before_the_summary_and_write_json(libs, tmp_path):
    out, js = tmp_path / "cand.h5", tmp_path / "r.json"
    result = run_cli(probe_cli, ["run", TINY_REF, "--impl", f"c:{libs['CONCAT_SWAP']}", "--explain", "-q",
                                 "--out", out, "--json", js])
    lines = result.output.rstrip("\n").splitlines()
    assert result.exit_code == 1, result.output
    assert lines[-2].startswith("DIAGNOSIS | concat_swap reproduces the candidate at all 11 stages (max rel ")
    assert lines[-2].endswith("): fc_in is [h, e], expected [e, h]") and lines[-1].startswith("DIVERGED |")
    explain = json.loads(js.read_text())["explain"]
    assert explain["diagnosis"][0]["variant"] == "concat_swap"
    assert set(explain["diagnosis"][0]) >= {"variant", "max_rel", "stages_matched"}
    assert set(explain["local"][0]) >= {"stage", "token", "local_max_rel", "cumulative_max_rel"}
    assert "coverage" in explain
    diffed = run_cli(probe_cli, ["diff", TINY_REF, out, "--explain", "--checkpoint", TINY, "-q"])
    assert diffed.output.rstrip("\n").splitlines()[-2] == lines[-2]


def test_twin_without_explain_no_diagnosis_line(libs):
    result = run_cli(probe_cli, ["run", TINY_REF, "--impl", f"c:{libs['CONCAT_SWAP']}", "-q"])
    assert "DIAGNOSIS" not in result.output


# ---- MoE ---------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    from oracle.cli import cli as oracle_cli

    root = tmp_path_factory.mktemp("explain-moe")
    ckpt = load_script("make_fixtures").write_moe_checkpoint(root / "moe", "qwen3_5_moe", "per_expert",
                                                               main_model=False)
    trace = root / "moe.h5"
    result = run_cli(oracle_cli, ["export", ckpt, "--out", trace, "--tokens", "5,17,3,99,200,7,42,5", "--hidden-seed",
                                  "0", "-q"])
    assert result.exit_code == 0, result.output
    return ckpt, trace


MOE_CANDIDATES = """\
import dataclasses, numpy as np, numpy_moe_step
from numpy_step import swiglu
MLP = numpy_moe_step.MLP
def unnormed(config, weights):
    return numpy_moe_step.NumpyMoeHead(dataclasses.replace(config, norm_topk_prob=False), weights)
class Ungated(numpy_moe_step.NumpyMoeHead):
    def mlp(self, x):
        s = super().mlp(x)
        s["shared"] = swiglu(self.w, MLP + "shared_expert.", x)
        s["mlp"] = s["routed"] + s["shared"]
        return s
def ungated(config, weights):
    return Ungated(config, weights)
"""


@pytest.mark.parametrize("factory, variant", [("unnormed", "topk_not_renormalised"), ("ungated", "shared_ungated"),
                                              ("make_head", None)])
def test_moe_variants_are_diagnosed(moe, tmp_path, monkeypatch, factory, variant):
    ckpt, trace = moe
    (tmp_path / "moe_lies.py").write_text(MOE_CANDIDATES)
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = f"python:{'numpy_moe_step' if factory == 'make_head' else 'moe_lies'}:{factory}"
    result = run_and_diff(trace, adapter_from_spec(spec, ckpt, {"norm_topk_prob": True}), tol_table())
    report, ex = explain_run(result.report, trace, result.stages, ckpt, tol_table(),
                             adapter_from_spec(spec, ckpt, {"norm_topk_prob": True}))
    if variant is None:
        assert ex.diagnosis == [] and report.verdict.name == "pass"
        assert ex.coverage["experts"]["routed"]
        return
    assert [d["variant"] for d in ex.diagnosis] == [variant], ex.variants
    assert len(ex.diagnosis[0]["stages_matched"]) == 16  # every stage, MoE stages included


def test_moe_operators_reproduce_the_reference(moe):
    from oracle.variants import Explainer

    ckpt, trace = moe
    with read_trace(trace) as r:
        inputs, ref = r.inputs(), {n: r.stage_rows(n) for n in r.stages}
    base = Explainer(ckpt, inputs).base
    assert set(ref) - set(base) == {"draft"}  # the operators run the head up to out; the draft is lm_head's
    for name, rows in ((n, r) for n, r in ref.items() if n != "draft"):
        got = base[name].numpy()
        if name == "topk_ids":
            assert (np.sort(got, 1) == np.sort(rows, 1)).all()
        else:
            assert np.abs(got - rows).max() <= 1e-6 * max(1.0, np.abs(rows).max()), name


def test_diff_explain_refuses_a_report_over_the_checkpoint_it_reads(tmp_path):
    """`diff --explain` reads the reference's checkpoint: a --json/--html/--plot path inside it (given with
    --checkpoint, or the one the reference records) is an input and is refused before anything is written (it had
    been overwritten, exit 0)."""
    import shutil

    from oracle.cli import cli as oracle_cli

    ckpt = Path(shutil.copytree(TINY, tmp_path / "ckpt"))
    before = {f.name: f.read_bytes() for f in ckpt.iterdir()}
    given = run_cli(probe_cli, ["diff", TINY_REF, TINY_REF, "--explain", "--checkpoint", ckpt, "-q",
                                "--json", ckpt / "config.json"])
    assert given.exit_code == 2 and "is the checkpoint file config.json" in given.output, given.output
    ref = tmp_path / "ref.h5"  # records ckpt as its checkpoint
    exported = run_cli(oracle_cli, ["export", ckpt, "--out", ref, "--tokens", "5,17,3", "--hidden-seed", "0"])
    assert exported.exit_code == 0, exported.output
    recorded = run_cli(probe_cli, ["diff", ref, ref, "--explain", "-q", "--html", ckpt / "model.safetensors"])
    assert recorded.exit_code == 2 and "is the checkpoint file model.safetensors" in recorded.output, recorded.output
    assert {f.name: f.read_bytes() for f in ckpt.iterdir()} == before
    # twin: the same commands with the report elsewhere run and write it
    fine = run_cli(probe_cli, ["diff", ref, ref, "--explain", "-q", "--html", tmp_path / "r.html"])
    assert fine.exit_code == 0 and (tmp_path / "r.html").is_file(), fine.output
