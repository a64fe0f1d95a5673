"""`--explain` for the MtpLayer families (DeepSeek-V3, GLM-4.5).

The candidates are held out from the code under test: each is the independent float64 transcription of
tests/families/test_deepseek_glm.py (plain torch ops, written from the wiring atlas, never the oracle's classes)
with one known wiring mistake, so a diagnosis is a match between two independent descriptions of the same mistake.
Each check has a twin: the correct transcription has nothing to diagnose; a bug outside the catalogue gets "no
known variant"; the position-0 mask is diagnosed in the direction the reference says (missing vs extra)."""

import json

import numpy as np
import pytest
import torch

from oracle.export import HiddenSource, export_trace
from oracle.trace import read_trace, write_trace
from probe.adapters.trace_file import open_reference
from probe.cli import cli as probe_cli
from probe.diff import diff_sources
from probe.explain import explain_stages
from probe.run import ArraySource
from probe.tolerance import tol_table
from tests.families.test_deepseek_glm import TOKENS, load_tensors, rms, transcription, write_mtp_layer_checkpoint
from tests.helpers import run_cli

CHECKPOINTS = {
    "ds": dict(family="deepseek_v3"),
    "ds_fp8": dict(family="deepseek_v3", fp8_block=[16, 32]),
    "ds_differ": dict(family="deepseek_v3", copies_differ=True),
    "glm": dict(family="glm4_moe"),
}
ALL_STAGES = 17  # the 16 head stages and the draft (the argmax of the variant's own out)


@pytest.fixture(scope="module")
def refs(tmp_path_factory):
    """name -> {mask: (checkpoint, reference trace, inputs)}, exported lazily."""
    root = tmp_path_factory.mktemp("explain-deepseek")
    cache: dict = {}

    def get(name: str, mask: bool = False):
        if (name, mask) not in cache:
            ckpt = root / name
            if not ckpt.is_dir():
                write_mtp_layer_checkpoint(ckpt, **CHECKPOINTS[name])
            trace = root / f"{name}-{mask}.h5"
            export_trace(ckpt, trace, TOKENS, HiddenSource(seed=3),
                         config_overrides={"mask_pos0_embedding": True} if mask else {})
            with read_trace(trace) as r:
                cache[name, mask] = ckpt, trace, r.inputs(), r.stage_rows("topk_ids")
        return cache[name, mask]

    return get


def candidate(ckpt, inputs, mask: bool, mutate=(), ref_ids: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """The transcription's stages as a candidate. Where a token's expert set equals the reference's, its experts
    are listed in the reference's order: the diff compares topk_weights position by position (in each side's
    topk_ids order), and the official router's unsorted top-k order is not what a transcription produces."""
    stages = transcription(ckpt, TOKENS, np.asarray(inputs.hidden), np.asarray(inputs.positions), mask_pos0=mask,
                           mutate=set(mutate))
    cand = {n: v.astype(np.int64 if n in ("topk_ids", "draft") else np.float32) for n, v in stages.items()}
    for t, row in enumerate(ref_ids if ref_ids is not None else ()):
        ids = cand["topk_ids"][t]
        if set(ids.tolist()) == set(row.tolist()):
            order = [int(np.flatnonzero(ids == e)[0]) for e in row]
            cand["topk_ids"][t], cand["topk_weights"][t] = ids[order], cand["topk_weights"][t][order]
    return cand


def explained(ref, cand):
    ckpt, trace, inputs, _ = ref
    with open_reference(trace) as reference:
        report = diff_sources(reference, ArraySource("transcription", inputs, cand), tol_table())
    return report, explain_stages(report, trace, cand, ckpt, tol_table())


CASES = [  # (checkpoint, reference masks position 0, transcription mistake, the variant that must be named)
    ("ds", False, "concat_swap", "concat_swap"),
    ("ds", False, "pos0_mask_flipped", "pos0_mask_extra"),
    ("ds", True, "pos0_mask_flipped", "pos0_mask_missing"),
    ("ds", False, "rope_not_interleaved", "rope_not_interleaved"),
    ("ds", False, "no_yarn_mscale", "no_yarn_mscale"),
    ("ds", False, "no_group_limit", "no_group_limit"),
    ("ds", False, "no_correction_bias", "no_correction_bias"),
    ("ds", False, "not_renormalised", "not_renormalised"),
    ("ds", False, "no_routed_scaling", "no_routed_scaling"),
    ("ds", False, "gate_up_swap", "gate_up_swap"),
    ("ds", True, "main_norm_for_out", "main_norm_for_out"),
    ("ds_fp8", False, "fp8_scale_transposed", "fp8_scale_transposed"),
    ("ds_differ", False, "embed_main_copy", "embed_main_copy"),
    ("glm", False, "rope_all_dims", "rope_all_dims"),
    ("glm", False, "no_qkv_bias", "no_qkv_bias"),
    ("glm", True, "pos0_mask_flipped", "pos0_mask_missing"),
]


@pytest.mark.parametrize("name, mask, mistake, variant", CASES, ids=[f"{c[0]}-{c[3]}" for c in CASES])
def test_each_mistake_is_diagnosed_by_its_variant_name(refs, name, mask, mistake, variant):
    ref = refs(name, mask)
    report, ex = explained(ref, candidate(ref[0], ref[2], ref_ids=ref[3], mask=mask, mutate={mistake}))
    assert report.verdict.name == "diverged", report.verdict
    assert [d["variant"] for d in ex.diagnosis] == [variant], (ex.diagnosis_line(), ex.variants)
    best = ex.diagnosis[0]
    assert len(best["stages_matched"]) == ALL_STAGES and best["max_rel"] < 1e-4
    assert ex.diagnosis_line().startswith(f"DIAGNOSIS | {variant} reproduces the candidate at all {ALL_STAGES} stages")
    # never a claim that holds only at the first divergent stage: every other variant that ran was rejected
    assert all(v["status"] != "reproduces" for v in ex.variants if v["variant"] != variant)
    assert ex.bug is not None and ex.bug["stage"] == report.first.stage


def test_twin_the_correct_transcription_has_nothing_to_diagnose(refs):
    for mask in (False, True):
        ref = refs("ds", mask)
        report, ex = explained(ref, candidate(ref[0], ref[2], ref_ids=ref[3], mask=mask))
        assert report.verdict.name == "pass", report.verdict
        assert ex.diagnosis_line() == "DIAGNOSIS | nothing to diagnose: no row diverges"


def test_the_position_0_mask_is_local_at_e_token_0_and_inherited_after(refs):
    ref = refs("ds", True)
    report, ex = explained(ref, candidate(ref[0], ref[2], ref_ids=ref[3], mask=True, mutate={"pos0_mask_flipped"}))
    assert ex.bug == {"stage": "e", "token": 0, "local_max_rel": ex.bug["local_max_rel"]}
    local = {(r["stage"], r["token"]): r["kind"] for r in ex.local}
    assert all(kind == "inherited" for (stage, token), kind in local.items() if stage != "e" and kind != "ok")
    assert local["fc_in", 0] == "inherited" and local["out", 0] == "inherited"
    assert "inherited (computed correctly from divergent inputs): " in ex.text()
    # the reverse direction is the other variant's: pos0_mask_extra is not checkable against a masking reference
    extra = next(v for v in ex.variants if v["variant"] == "pos0_mask_extra")
    assert extra["status"] == "not checkable" and "masks position 0" in extra["reason"]


def test_away_from_position_0_the_mask_variants_are_not_checkable(refs, tmp_path):
    ckpt = refs("ds", False)[0]
    trace = tmp_path / "shifted.h5"
    export_trace(ckpt, trace, TOKENS, HiddenSource(seed=3), start_pos=5)
    with read_trace(trace) as r:
        inputs, ids = r.inputs(), r.stage_rows("topk_ids")
    report, ex = explained((ckpt, trace, inputs, ids), candidate(ckpt, inputs, False, {"concat_swap"}, ids))
    assert [d["variant"] for d in ex.diagnosis] == ["concat_swap"]
    status = {v["variant"]: v for v in ex.variants}
    assert status["pos0_mask_extra"]["status"] == "not checkable"
    assert "no step at absolute position 0" in status["pos0_mask_extra"]["reason"]


def _mlp_bug(ckpt, inputs, ref_ids) -> dict[str, np.ndarray]:
    """mlp = routed - shared (a sign error no catalogue variant describes), res2 and out recomputed from it."""
    cand = candidate(ckpt, inputs, False, ref_ids=ref_ids)
    w = load_tensors(ckpt)
    cand["mlp"] = cand["routed"] - cand["shared"]
    cand["res2"] = cand["res1"] + cand["mlp"]
    norm = w["model.layers.2.shared_head.norm.weight"].double()
    cand["out"] = rms(torch.from_numpy(cand["res2"]).double(), norm, 1e-6).numpy().astype(np.float32)
    del cand["draft"]  # not recomputed from this out: not captured
    return cand


def test_a_bug_no_variant_explains_gets_no_known_variant_and_the_local_error_names_its_stage(refs):
    ref = refs("ds")
    report, ex = explained(ref, _mlp_bug(ref[0], ref[2], ref[3]))
    assert report.first.stage == "mlp"
    assert ex.diagnosis == [] and ex.diagnosis_line() == "DIAGNOSIS | no known variant reproduces the candidate"
    assert ex.bug["stage"] == "mlp"
    kinds = {}
    for r in ex.local:
        kinds.setdefault(r["stage"], set()).add(r["kind"])
    assert kinds["mlp"] == {"local"} and kinds["res2"] == {"inherited"} and kinds["out"] == {"inherited"}
    assert all(kinds[s] == {"ok"} for s in ("e", "h", "fc", "attn", "routed", "shared"))


def test_a_catalogue_variant_that_no_patch_can_express_is_said_to_be_unchecked(refs):
    """bias_in_weights is in the catalogue but not a module/weight patch: the candidate gets "no known variant",
    and the report says which variants were not checked and why (twin: the checkable ones ran and were rejected)."""
    ref = refs("ds")
    _, ex = explained(ref, candidate(ref[0], ref[2], ref_ids=ref[3], mask=False, mutate={"bias_in_weights"}))
    assert ex.diagnosis == []
    status = {v["variant"]: v["status"] for v in ex.variants}
    assert status["bias_in_weights"] == "not checkable" and status["concat_swap"] == "differs"
    assert any(n.startswith("variants not checked on this trace: ") and "bias_in_weights (not expressible" in n
               for n in ex.notes)


def test_coverage_names_the_mla_tensors_and_the_routed_experts(refs):
    ref = refs("ds")
    _, ex = explained(ref, candidate(ref[0], ref[2], ref_ids=ref[3], mask=False, mutate={"concat_swap"}))
    tensors = {t["tensor"].removeprefix("model.layers.2."): t for t in ex.coverage["tensors"]}
    assert {"eh_proj.weight", "self_attn.q_a_proj.weight", "self_attn.kv_b_proj.weight", "mlp.gate.weight",
            "mlp.shared_experts.down_proj.weight", "shared_head.norm.weight"} <= set(tensors)
    assert tensors["eh_proj.weight"]["evidenced"] and tensors["self_attn.o_proj.weight"]["evidenced"]
    assert ex.coverage["experts"]["num_experts"] == 16 and ex.coverage["experts"]["routed"]
    assert any(line.startswith("experts ") and "never routed" in line for line in ex.coverage["lines"]) or \
        len(ex.coverage["experts"]["routed"]) == 16


def test_cli_diff_prints_the_diagnosis_before_the_summary(refs, tmp_path):
    """Against a masking reference (a candidate trace with an all-zero e row would be read as unwritten)."""
    ckpt, trace, inputs, ids = refs("ds", True)
    cand = candidate(ckpt, inputs, True, {"pos0_mask_flipped"}, ids)
    with read_trace(trace) as r:
        stage_list, dims = r.stage_list, r.dims
    out = tmp_path / "cand.h5"
    write_trace(out, inputs, cand, {"producer": "transcription"}, stage_list=stage_list, dims=dims)
    js = tmp_path / "r.json"
    result = run_cli(probe_cli, ["diff", trace, out, "--explain", "--checkpoint", ckpt, "-q", "--json", js])
    lines = result.output.rstrip("\n").splitlines()
    assert result.exit_code == 1, result.output
    assert lines[-2].startswith("DIAGNOSIS | pos0_mask_missing reproduces the candidate at all 17 stages (max rel ")
    assert lines[-2].endswith("not zeroed, although the reference masks it (mask_pos0_embedding on)")
    assert lines[-1].startswith("DIVERGED | first divergent stage: e at token 0")
    assert json.loads(js.read_text())["explain"]["diagnosis"][0]["variant"] == "pos0_mask_missing"
