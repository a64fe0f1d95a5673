"""Step-3.5/3.7-Flash (`step3p7`) multi-layer heads against an independent transcription at every depth (issue 25,
"How it will be judged"): held-out checkpoints from the family's own tiny-config generator with dims and layer
counts no fixture uses; every stage (and the recorded inputs: bridge, token, position, layer) at every depth of
`mtp-oracle export --chain N` equals tests/families/step3p7_transcription.py (float64, release names, no
transformers), and so do the drafts. Twins: the transcription with one wiring change differs from the oracle at
the (depth, stage) where that change first shows, so the comparison can fail."""

import json

import h5py
import numpy as np
import pytest

from oracle.cli import cli as oracle_cli
from oracle.trace import read_trace
from tests.families import step3p7_transcription as transcription
from tests.families.step3p7_transcription import Wiring
from tests.helpers import load_script, run_cli

FIXTURES = load_script("make_fixtures")
TOKENS = "5,17,3,99,190,7,42,5,61,9,11,150"
# float32 (the oracle) against float64 (the transcription) through 4 layers: measured <= 2e-6 of a stage's max
RTOL = 2e-5

# Held out (the fixture: 2 main + 3 MTP layers, hidden 32, 4 heads over 2, head_dim 8, 4 experts top-2, window 4):
HELD_OUT = {
    # 3 main + 2 MTP layers (sliding then full), 5 heads over 1 KV head, head_dim 12, rotary 6 of 12 (full) and 9
    # of 12 (sliding: int(12 x 0.75) = 9, odd, so 10 dims turn), 7 experts top-3, a window of 2 the 12 steps exceed
    "two_layers": {"num_hidden_layers": 3, "hidden_size": 44, "head_dim": 12, "num_attention_heads": 5,
                   "num_key_value_heads": 1, "intermediate_size": 52, "moe_intermediate_size": 14,
                   "n_routed_experts": 7, "num_experts_per_tok": 3, "share_expert_dim": 18, "vocab_size": 197,
                   "num_nextn_predict_layers": 2, "sliding_window": 2,
                   "layer_types": ["full_attention", "sliding_attention", "full_attention", "sliding_attention",
                                   "full_attention"],
                   "rope_theta": [10000.0, 3000.0, 10000.0, 3000.0, 10000.0],
                   "partial_rotary_factors": [0.5, 0.75, 0.5, 0.75, 0.5], "moe_layers_enum": "1,2,3,4"},
    # 2 main + 4 MTP layers, 6 heads over 2, head_dim 10 (rotary int(10 x 0.5) = 5: 6 dims turn), 5 experts, a
    # window of 3, the scores scaled by query_pre_attn_scalar 16 (not head_dim) and the routed sum by 1.7
    "four_layers": {"hidden_size": 40, "head_dim": 10, "num_attention_heads": 6, "num_key_value_heads": 2,
                    "intermediate_size": 56, "moe_intermediate_size": 12, "n_routed_experts": 5,
                    "num_experts_per_tok": 2, "share_expert_dim": 20, "vocab_size": 230,
                    "num_nextn_predict_layers": 4, "sliding_window": 3, "query_pre_attn_scalar": 16,
                    "moe_router_scaling_factor": 1.7},
}


def _export(ckpt, out, depths):
    result = run_cli(oracle_cli, ["export", ckpt, "--out", out, "--tokens", TOKENS, "--hidden-seed", "1",
                                  "--chain", str(depths), "-q"])
    assert result.exit_code == 0, result.output
    return out


@pytest.fixture(scope="module", params=sorted(HELD_OUT))
def chained(request, tmp_path_factory):
    """(transcription's head, the oracle's chained trace, N): the trace records every depth 1..N."""
    root = tmp_path_factory.mktemp(request.param)
    dims = HELD_OUT[request.param]
    ckpt = FIXTURES.write_mtp_model_checkpoint(root / "ckpt", "step3p7", dims)
    depths = dims["num_nextn_predict_layers"]
    return transcription.load(ckpt), _export(ckpt, root / "chain.h5", depths), depths


def _trace(trace):
    """(inputs, {depth: {"stages": ..., "inputs": ...}}, stage order) of the oracle's chained trace."""
    with h5py.File(trace) as f:
        inputs = {k: f[f"inputs/{k}"][:] for k in ("token_ids", "hidden", "positions")}
        depths = json.loads(f.attrs["chain"])["depths"]
        parts = {}
        for j in range(1, depths + 1):
            g = f if j == 1 else f[f"chain/d{j}"]
            parts[j] = {"stages": {s: g[f"stages/{s}"][:] for s in g["stages"]},
                        "inputs": {k: g[f"inputs/{k}"][:] for k in ("bridge", "token_ids", "positions", "layer")}
                        if j > 1 else {}}
    with read_trace(trace) as t:
        order = list(t.stages)  # the family's stage order, as the probe diffs it
    return inputs, parts, order


def _rows_agree(name, got, want, got_ids=None, want_ids=None) -> bool:
    """One stage at one depth: ids as sets (torch.topk's order is unspecified), the draft exactly, topk_weights
    in id order, float rows within RTOL of the stage's largest magnitude."""
    if got.shape != want.shape:
        return False
    if name == "topk_ids":
        return bool((np.sort(got, 1) == np.sort(want, 1)).all())
    if name == "draft":
        return bool((got[:, 0] == want[:, 0]).all())
    if name == "topk_weights":
        got, want = (np.take_along_axis(w, np.argsort(i, 1), 1) for w, i in ((got, got_ids), (want, want_ids)))
    return bool(np.abs(got - want).max() <= RTOL * np.abs(want).max())


def first_difference(ref: dict, parts: dict, order: list[str]):
    """(depth, stage) where the transcription `ref` first differs from the oracle's trace, or None."""
    for depth in sorted(parts):
        oracle, mine = parts[depth]["stages"], ref[depth].stages
        assert set(oracle) == set(order), (depth, sorted(oracle))
        for name in order:
            ids = ("topk_ids",) * 2 if name == "topk_weights" else (None, None)
            extra = (oracle[ids[0]], mine[ids[1]]) if ids[0] else ()
            if not _rows_agree(name, oracle[name], np.asarray(mine[name], dtype=oracle[name].dtype), *extra):
                return depth, name
    return None


def _loop(head, trace, **wiring):
    inputs, parts, order = _trace(trace)
    ref = transcription.draft_loop(head, inputs["token_ids"], inputs["hidden"], inputs["positions"], len(parts),
                                   Wiring(**wiring))
    return ref, parts, order


def test_every_stage_and_draft_at_every_depth_equals_the_transcription(chained):
    head, trace, depths = chained
    ref, parts, order = _loop(head, trace)
    assert sorted(parts) == sorted(ref) == list(range(1, depths + 1))
    assert {"router_logits", "topk_ids", "topk_weights", "routed", "shared", "draft"} <= set(order)
    assert first_difference(ref, parts, order) is None
    for depth in range(2, depths + 1):  # the depth's recorded inputs: which bridge, token, position and layer
        recorded, mine = parts[depth]["inputs"], ref[depth]
        np.testing.assert_array_equal(recorded["bridge"], mine.bridge)
        np.testing.assert_array_equal(recorded["token_ids"], mine.token_ids)
        np.testing.assert_array_equal(recorded["positions"], mine.positions)
        np.testing.assert_array_equal(recorded["layer"], depth - 1)


@pytest.mark.parametrize("wiring, expected", [
    ({"hidden_first": True}, (1, "fc_in")),  # concat [h, e]
    ({"layer_of": lambda depth: 0}, (2, "e")),  # layer 0 at every depth (vllm#52688): enorm is per layer
    ({"post_norm_of": lambda layer: 0}, (2, "out")),  # layer 0's shared_head.norm ends every layer
    ({"recycle": "res2"}, (2, "h")),  # the pre-norm residual recycled
    ({"draft_table": "model.embed_tokens.weight"}, (1, "draft")),  # every float stage right, every draft wrong
], ids=["concat_he", "layer0_every_depth", "one_shared_head_norm", "recycle_prenorm", "draft_embed_tokens"])
def test_twins_one_wiring_change_differs_from_the_oracle_where_it_first_shows(chained, wiring, expected):
    head, trace, _ = chained
    assert first_difference(*_loop(head, trace, **wiring)) == expected


def test_twin_a_frozen_chain_position_cannot_show_on_these_chains(chained):
    """Measured, not assumed: every depth at its bridge's position (vLLM-style frozen chain position) moves every
    row of a depth by the same offset; each layer caches only its own depth's rows here, and rope and the window are
    relative, so nothing changes. A frozen position is invisible on a multi-layer step3p7 head's teacher-forced
    chains (the loop variant `position_frozen` cannot be diagnosed here); a non-uniform error still shows: every row
    of depth 2 and after at the first bridge's position diverges at depth 2's attention."""
    head, trace, _ = chained
    assert first_difference(*_loop(head, trace, position_of=lambda depth, p: p)) is None
    one_position = lambda depth, p: p if depth == 1 else np.full_like(p, p[0] + depth - 1)  # noqa: E731
    assert first_difference(*_loop(head, trace, position_of=one_position)) == (2, "attn")


def test_dense_mtp_layers_equal_the_transcription_at_every_depth(tmp_path):
    """MTP layers left out of moe_layers_enum are dense (as Step-3.7-Flash's release): no router stages, every depth
    equal to the transcription (this exited 4 before the family read sparse_mtp)."""
    dims = dict(HELD_OUT["four_layers"], moe_layers_enum="1", num_nextn_predict_layers=3)
    ckpt = FIXTURES.write_mtp_model_checkpoint(tmp_path / "ckpt", "step3p7", dims)
    head = transcription.load(ckpt)
    trace = _export(ckpt, tmp_path / "chain.h5", 3)
    ref, parts, order = _loop(head, trace)
    assert "router_logits" not in order and first_difference(ref, parts, order) is None


# Step-3.7-Flash's hub config gives sliding layers their own head count (96 against 64); the released MTP layers
# 45..47 are sliding and built with it (vLLM's step3p5_mtp), while transformers 5.24's MtpModel builds num_attention_heads
SLIDING_HEADS = dict(HELD_OUT["two_layers"], attention_other_setting={
    "attention_type": "sliding_attention", "num_attention_heads": 10, "num_attention_groups": 1, "head_dim": 12})
RELEASE_SHAPES = {"mtp_per_layer_config": {0: {"num_attention_heads": 10}}}  # MTP layer 0 is the sliding one


def _q_rows(ckpt, layer: int) -> int:
    from safetensors import safe_open

    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        return f.get_slice(f"model.layers.{3 + layer}.self_attn.q_proj.weight").get_shape()[0]


@pytest.mark.parametrize("shapes", ["release", "transformers"])
def test_sliding_mtp_layers_with_their_own_head_count_equal_the_transcription(tmp_path, shapes):
    """A sliding MTP layer stored with attention_other_setting's 10 heads (the release) and one stored with
    num_attention_heads' 5 (what transformers' MtpModel builds from the same config.json) both export, and every
    stage and draft at both depths equals the transcription, which reads the heads from the stored q_proj."""
    ckpt = FIXTURES.write_mtp_model_checkpoint(tmp_path / "ckpt", "step3p7", SLIDING_HEADS,
                                               shape_overrides=RELEASE_SHAPES if shapes == "release" else None)
    assert (_q_rows(ckpt, 0), _q_rows(ckpt, 1)) == ((10 if shapes == "release" else 5) * 12, 5 * 12)
    trace = _export(ckpt, tmp_path / "chain.h5", 2)
    ref, parts, order = _loop(transcription.load(ckpt), trace)
    assert first_difference(ref, parts, order) is None


def test_twin_without_reading_the_stored_head_count_the_release_is_refused(tmp_path, monkeypatch):
    """Twin: built from config.json alone, as transformers' MtpModel builds it, the release's sliding layer does
    not load: the strict load refuses it, exit 2, naming the tensor."""
    from oracle.families import mtp_model

    ckpt = FIXTURES.write_mtp_model_checkpoint(tmp_path / "ckpt", "step3p7", SLIDING_HEADS,
                                               shape_overrides=RELEASE_SHAPES)
    monkeypatch.setattr(mtp_model, "sliding_heads_as_stored", lambda cfg, weights: cfg)
    result = run_cli(oracle_cli, ["export", ckpt, "--out", tmp_path / "t.h5", "--tokens", TOKENS, "--hidden-seed", "1", "-q"])
    assert result.exit_code == 2 and "q_proj" in result.output, result.output
    assert not (tmp_path / "t.h5").exists()


def test_a_sliding_q_proj_matching_neither_head_count_is_refused_naming_its_shape(tmp_path):
    """A q_proj of 7 heads, neither the config's 5 nor the sliding layers' 10: exit 2, the tensor named."""
    ckpt = FIXTURES.write_mtp_model_checkpoint(tmp_path / "ckpt", "step3p7", SLIDING_HEADS,
                                               shape_overrides={"mtp_per_layer_config": {0: {"num_attention_heads": 7}}})
    result = run_cli(oracle_cli, ["export", ckpt, "--out", tmp_path / "t.h5", "--tokens", TOKENS, "--hidden-seed", "1", "-q"])
    assert result.exit_code == 2 and "q_proj" in result.output, result.output
