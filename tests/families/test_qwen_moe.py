"""Qwen3.5-MoE and Qwen3-Next heads: an independent numpy transcription agrees with the oracle in both expert
layouts; the MoE stages are compared as the design says (topk_ids as sets, near-ties excused); only routed experts
are read; the top-k renormalisation convention is explicit; sharded checkpoints and `accept` work."""

import json
import shutil

import h5py
import numpy as np
import pytest

from oracle.checkpoint import Checkpoint
from oracle.cli import cli as oracle_cli
from oracle.families.registry import head_module
from oracle.trace import evidence_digest, read_trace, write_trace
from probe.cli import cli as probe_cli
from probe.diff import diff_traces
from tests.helpers import ROOT, load_script, run_cli
from tests.probe.tracekit import load_trace

FIXTURES = load_script("make_fixtures")
TOKENS = "5,17,3,99,200,7,42,5,300,11"
CANDIDATES = ROOT / "fixtures" / "candidates"
CASES = [(f, layout) for f in ("qwen3_5_moe", "qwen3_next") for layout in ("per_expert", "fused")]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """{(family, layout): (checkpoint, trace)} on identical weights in both layouts."""
    root = tmp_path_factory.mktemp("moe")
    out = {}
    for family, layout in CASES:
        ckpt = FIXTURES.write_moe_checkpoint(root / f"{family}_{layout}", family, layout, main_model=False)
        trace = root / f"{family}_{layout}.h5"
        result = run_cli(oracle_cli, ["export", ckpt, "--out", trace, "--tokens", TOKENS, "--hidden-seed", "0", "-q"])
        assert result.exit_code == 0, result.output
        out[family, layout] = (ckpt, trace)
    return out


def last_line(result) -> str:
    return result.output.rstrip("\n").splitlines()[-1]


@pytest.mark.parametrize("family, layout", CASES)
def test_an_independent_numpy_transcription_passes_at_every_stage(exported, family, layout, monkeypatch):
    ckpt, trace = exported[family, layout]
    monkeypatch.syspath_prepend(str(CANDIDATES))
    result = run_cli(probe_cli, ["run", trace, "--impl", "python:numpy_moe_step:make_head", "--checkpoint", ckpt])
    assert result.exit_code == 0 and last_line(result).startswith("PASSED | 16 stages x 10 tokens"), result.output


def test_twin_a_candidate_that_forgets_to_renormalise_diverges_at_topk_weights(exported, tmp_path, monkeypatch):
    ckpt, trace = exported["qwen3_next", "per_expert"]
    (tmp_path / "unnormed.py").write_text(
        "import dataclasses, numpy_moe_step\n"
        "def make(config, weights):\n"
        "    return numpy_moe_step.NumpyMoeHead(dataclasses.replace(config, norm_topk_prob=False), weights)\n")
    monkeypatch.syspath_prepend(str(CANDIDATES))
    monkeypatch.syspath_prepend(str(tmp_path))
    result = run_cli(probe_cli, ["run", trace, "--impl", "python:unnormed:make", "--checkpoint", ckpt])
    assert result.exit_code == 1 and "first divergent stage: topk_weights at token 0" in last_line(result)


def test_both_expert_layouts_give_bit_identical_traces(exported):
    for family in ("qwen3_5_moe", "qwen3_next"):
        _, a = load_trace(exported[family, "per_expert"][1])
        _, b = load_trace(exported[family, "fused"][1])
        for stage in a:
            np.testing.assert_array_equal(a[stage], b[stage], err_msg=f"{family} {stage}")


def test_only_the_routed_experts_are_read_and_recorded(exported):
    ckpt, trace = exported["qwen3_5_moe", "per_expert"]
    _, stages = load_trace(trace)
    used = sorted(set(stages["topk_ids"].ravel().tolist()))
    with read_trace(trace) as reader:
        assert reader.attrs["experts"]["used"] == used and reader.attrs["experts"]["layout"] == "per_expert"
    checkpoint = Checkpoint(ckpt)
    impl = head_module(checkpoint.family)
    inputs, _ = load_trace(trace)
    head, rotary = impl.build_head(checkpoint.config, impl.torch_weights(checkpoint.read_head(widen=False)))
    routed = head.layers[0].mlp.experts.gate_up_proj.experts  # the RoutedExperts behind the official module
    impl.run_batched(head, rotary, inputs)
    assert sorted(routed.touched) == used
    # two experts in float32 at a time (the one in use, the next being read), never all of them
    assert [tuple(slot.gate_up.shape) for slot in routed._slots] == [(96, 64)] * 2


def _with_stages(ref, path, change):
    inputs, stages = load_trace(ref)
    change(stages)
    with read_trace(ref) as reader:
        write_trace(path, inputs, stages, {"producer": "test"}, stage_list=reader.stage_list, dims=reader.dims)
    return path


def test_topk_ids_are_compared_as_sets(exported, tmp_path):
    _, trace = exported["qwen3_5_moe", "fused"]

    def reorder(stages):
        stages["topk_ids"] = stages["topk_ids"][:, ::-1].copy()
        stages["topk_weights"] = stages["topk_weights"][:, ::-1].copy()

    report = diff_traces(trace, _with_stages(trace, tmp_path / "reordered.h5", reorder))
    assert report.rows["topk_ids"].has_status({"ok"}).all()

    def swap_one(stages):
        ids = stages["topk_ids"]
        ids[3, 0] = next(e for e in range(8) if e not in ids[3])

    wrong = diff_traces(trace, _with_stages(trace, tmp_path / "wrong.h5", swap_one))
    assert (wrong.first.stage, wrong.first.token) == ("topk_ids", 3) and wrong.verdict.name == "diverged"


def _boundary(trace, token):
    """(the reference's weakest chosen expert, its best unchosen one) at `token`: the pair a rounding flip swaps."""
    _, stages = load_trace(trace)
    logits, ids = stages["router_logits"][token], stages["topk_ids"][token]
    weakest = int(ids[np.argmin(logits[ids])])
    best_out = int(max((e for e in range(len(logits)) if e not in ids), key=lambda e: logits[e]))
    return weakest, best_out


def _flip_at(token, leaving, entering):
    def change(stages):
        ids = stages["topk_ids"]
        ids[token, list(ids[token]).index(leaving)] = entering
        for later in ("topk_weights", "routed", "mlp", "res2", "out"):  # a flip changes everything after it
            stages[later][token] += 0.05
    return change


def _near_tie_reference(trace, out, token, experts):
    """The reference, edited (and re-signed) so that its own selection at `token` is a near-tie between `experts`."""
    shutil.copy(trace, out)
    with h5py.File(out, "a") as f:
        f["evidence/topk_margin"][token, 0] = 1e-7
        flips = f["evidence/topk_flip"][token]
        flips[list(experts)] = 1e-7
        f["evidence/topk_flip"][token] = flips
        rules = json.loads(f.attrs["evidence_rules"])
        f.attrs["evidence_digest"] = evidence_digest(rules, {n: f["evidence"][n][()] for n in f["evidence"]})
    return out


def test_a_routing_flip_at_a_reference_near_tie_is_a_tie_not_a_wiring_bug(exported, tmp_path):
    _, trace = exported["qwen3_next", "fused"]
    leaving, entering = _boundary(trace, 4)
    near = _near_tie_reference(trace, tmp_path / "near.h5", 4, (leaving, entering))
    cand = _with_stages(trace, tmp_path / "flip.h5", _flip_at(4, leaving, entering))
    report = diff_traces(near, cand)
    # not a divergence (rounding), but the rows after the flip were not compared: never a pass
    assert report.verdict.name == "inconclusive" and report.routing_ties == (4,), report.verdict
    assert any("routing near-ties at token(s) 4" in r for r in report.verdict.reasons)
    assert report.rows["topk_ids"].has_status({"tie"})[4] and report.rows["out"].has_status({"tie"})[4]
    # twin: the same flip where the reference's margin is wide is a divergence at topk_ids
    twin = diff_traces(trace, cand)
    assert twin.verdict.name == "diverged" and (twin.first.stage, twin.first.token) == ("topk_ids", 4)


def test_a_near_tie_excuses_only_the_experts_at_the_boundary(exported, tmp_path):
    """A near-tie token is no licence for any set: a candidate that brings in an expert far from the boundary
    (a wrong router that happens to differ there) diverges at topk_ids, even though the reference is a near-tie."""
    _, trace = exported["qwen3_next", "fused"]
    leaving, entering = _boundary(trace, 4)
    near = _near_tie_reference(trace, tmp_path / "near.h5", 4, (leaving, entering))
    _, stages = load_trace(trace)
    logits, ids = stages["router_logits"][4], stages["topk_ids"][4]
    far = int(min((e for e in range(len(logits)) if e not in ids), key=lambda e: logits[e]))  # the least likely
    assert far != entering
    report = diff_traces(near, _with_stages(trace, tmp_path / "far.h5", _flip_at(4, leaving, far)))
    assert report.verdict.name == "diverged" and (report.first.stage, report.first.token) == ("topk_ids", 4)
    assert report.routing_ties == ()


def test_the_top_k_renormalisation_convention_is_recorded_and_handed_to_the_candidate(exported, tmp_path,
                                                                                         monkeypatch):
    ckpt, _ = exported["qwen3_5_moe", "per_expert"]
    out = tmp_path / "unnormed.h5"
    result = run_cli(oracle_cli, ["export", ckpt, "--out", out, "--tokens", TOKENS, "--hidden-seed", "0",
                                  "--no-norm-topk-prob", "-q"])
    assert result.exit_code == 0, result.output
    inputs, stages = load_trace(out)
    assert not np.allclose(stages["topk_weights"].sum(axis=1), 1.0)
    with read_trace(out) as reader:
        assert reader.attrs["config"]["norm_topk_prob"] is False
    monkeypatch.syspath_prepend(str(CANDIDATES))
    run = run_cli(probe_cli, ["run", out, "--impl", "python:numpy_moe_step:make_head", "--checkpoint", ckpt])
    assert run.exit_code == 0, run.output
    dense = run_cli(oracle_cli, ["export", ROOT / "fixtures" / "qwen3_5_tiny", "--out", tmp_path / "d.h5", "--tokens",
                                 "5,6", "--hidden-seed", "0", "--no-norm-topk-prob"])
    assert dense.exit_code == 2 and "does not apply" in dense.output


def test_a_sharded_checkpoint_exports_the_same_trace(exported, tmp_path):
    ckpt = FIXTURES.write_moe_checkpoint(tmp_path / "sharded", "qwen3_5_moe", "per_expert", main_model=False,
                                         sharded=True)
    out = tmp_path / "sharded.h5"
    assert run_cli(oracle_cli, ["export", ckpt, "--out", out, "--tokens", TOKENS, "--hidden-seed", "0"]).exit_code == 0
    _, a = load_trace(out)
    _, b = load_trace(exported["qwen3_5_moe", "per_expert"][1])
    for stage in a:
        np.testing.assert_array_equal(a[stage], b[stage], err_msg=stage)


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_next"])
def test_accept_runs_on_the_moe_heads(exported, family, tmp_path):
    ckpt, _ = exported[family, "fused"]
    np.save(tmp_path / "h.npy", np.random.default_rng(0).standard_normal((24, 64)).astype(np.float32))
    result = run_cli(oracle_cli, ["accept", ckpt, "--k", "2", "--tokens", ",".join(map(str, range(1, 25))),
                                  "--hidden", tmp_path / "h.npy", "-q"])
    assert result.exit_code == 0 and last_line(result).startswith("ACCEPT | k=2 chains=21"), result.output


def test_experts_in_ordinary_memory_are_never_dropped_and_repeated_passes_agree(exported):
    """The mapped-page release (moe_experts._drop_pages) must only touch file mappings: on heap memory it would zero
    the weights, and a second pass (accept runs many) would silently differ."""
    ckpt, trace = exported["qwen3_next", "per_expert"]
    checkpoint = Checkpoint(ckpt)
    impl = head_module(checkpoint.family)
    inputs, stages = load_trace(trace)
    heap = {n: t.clone() for n, t in impl.torch_weights(checkpoint.read_head(widen=False)).items()}
    head, rotary = impl.build_head(checkpoint.config, heap)
    first, second = impl.run_batched(head, rotary, inputs), impl.run_batched(head, rotary, inputs)
    for stage in (s for s in stages if s != "draft"):  # the draft is the export's lm_head argmax, not the head's
        np.testing.assert_array_equal(first[stage], stages[stage], err_msg=stage)
        np.testing.assert_array_equal(second[stage], stages[stage], err_msg=stage)


def test_topk_weights_follow_the_candidates_own_expert_order(exported, tmp_path):
    """An engine may list its top-k in any order: its weights are compared in the reference's topk_ids order."""
    _, trace = exported["qwen3_next", "fused"]

    def reorder(stages):
        stages["topk_ids"] = stages["topk_ids"][:, ::-1].copy()
        stages["topk_weights"] = stages["topk_weights"][:, ::-1].copy()

    report = diff_traces(trace, _with_stages(trace, tmp_path / "reordered.h5", reorder))
    assert report.verdict.name == "pass", report.first

    def weights_only(stages):  # twin: the same weights in another order, ids not: a real divergence
        stages["topk_weights"] = stages["topk_weights"][:, ::-1].copy()

    twin = diff_traces(trace, _with_stages(trace, tmp_path / "twin.h5", weights_only))
    assert twin.verdict.name == "diverged" and twin.first.stage == "topk_weights"


def test_a_loosened_router_tolerance_never_turns_other_experts_into_a_pass(exported, tmp_path):
    """Red team: `--stage-tol router_logits=0.5,...` makes every token a near-tie, so a candidate routing to other
    experts with everything after them wrong was PASSED. Excused rows were not compared: inconclusive. Twins: the
    default tolerance calls the same candidate a divergence, and even the loose one does where the expert brought
    in is far from the boundary (/evidence/topk_flip)."""
    from probe.tolerance import Tol, tol_table

    _, trace = exported["qwen3_next", "fused"]
    _, stages = load_trace(trace)
    def wrong_everywhere(st):
        for t in range(len(st["topk_ids"])):
            logits, ids = stages["router_logits"][t], stages["topk_ids"][t]
            weakest = int(ids[np.argmin(logits[ids])])
            pick = max if near else min
            other = int(pick((e for e in range(len(logits)) if e not in ids), key=lambda e: logits[e]))
            _flip_at(t, weakest, other)(st)
    loose = tol_table()
    loose["router_logits"] = Tol(0.5, 1e-5, "red team")
    near = True
    cand = _with_stages(trace, tmp_path / "wrong.h5", wrong_everywhere)
    report = diff_traces(trace, cand, loose)
    assert report.verdict.name == "inconclusive" and report.routing_ties, report.verdict
    assert diff_traces(trace, cand).verdict.name == "diverged"
    near = False
    far = _with_stages(trace, tmp_path / "far.h5", wrong_everywhere)
    assert diff_traces(trace, far, loose).verdict.name == "diverged"


def test_export_warns_about_routing_near_ties_in_its_own_reference(tmp_path):
    """A router whose logits tie (here: a zero gate, every expert equal) makes every token a near-tie: the export
    says so before anyone diffs against it. Twin: the ordinary fixture exports without the warning."""
    import torch
    from safetensors.torch import load_file, save_file

    ckpt = FIXTURES.write_moe_checkpoint(tmp_path / "tie", "qwen3_5_moe", "per_expert", main_model=False)
    tensors = load_file(ckpt / "model.safetensors")
    gate = next(n for n in tensors if n.endswith("mlp.gate.weight"))
    tensors[gate] = torch.zeros_like(tensors[gate])
    save_file(tensors, ckpt / "model.safetensors")
    args = ["--tokens", TOKENS, "--hidden-seed", "0"]
    tied = run_cli(oracle_cli, ["export", ckpt, "--out", tmp_path / "tie.h5", *args])
    assert tied.exit_code == 0 and "near-tie at 10 of 10 token(s)" in tied.output, tied.output
    plain = FIXTURES.write_moe_checkpoint(tmp_path / "plain", "qwen3_5_moe", "per_expert", main_model=False)
    ok = run_cli(oracle_cli, ["export", plain, "--out", tmp_path / "plain.h5", *args])
    assert ok.exit_code == 0 and "near-tie" not in ok.output
