"""MiMo-V2-Flash's multi-layer MTP head (issue 25): every depth of the oracle's chains equals an independent
transcription of the engine-side layer (vLLM's mimo_v2_mtp.py `MiMoV2MTPLayer.forward` over its `MiMoV2Attention`:
sinks, V scale, partial NeoX rope; the window as transformers and SGLang read it) computed in float64 from the
checkpoint's own tensors by their release names, and `MtpModel.forward` drafting through its own `MtpCache`; the
layer per depth is recorded; a layer count that disagrees with the tensors exits 2 naming both.

The family contract (stepwise = batched, strict loading, stage-first-seen at depth 1) runs it through
tests/families/test_family_contract.py; the stage-first-seen check at every depth and the layer-0-reused twin are
the MtpModel families' own tests (tests/families/test_mtp_model_families.py), run here on this head."""

import json

import h5py
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from oracle.checkpoint import Checkpoint
from oracle.cli import cli as oracle_cli
from oracle.families.registry import head_module
from tests.families import test_mtp_model_families as mtp_model_tests
from tests.helpers import load_script, run_cli

FIXTURES = load_script("make_fixtures")
TOKENS = "5,17,3,99,200,7,42,5,61,9"
# held-out dims: no fixture uses them (4 layers, 6 heads over 2 KV heads, q/k and v head dims apart, a window of 3
# keys the 10 steps exceed, 4 of 12 dims rotated: int(12 x 0.334), as the release's 64 of 192)
HELD_OUT = {"hidden_size": 48, "intermediate_size": 80, "num_hidden_layers": 6, "swa_num_attention_heads": 6,
            "swa_num_key_value_heads": 2, "swa_head_dim": 12, "swa_v_head_dim": 10, "sliding_window_size": 2,
            "partial_rotary_factor": 0.334, "swa_rope_theta": 5000.0, "vocab_size": 230, "num_nextn_predict_layers": 4,
            "attention_value_scale": 0.61, "layernorm_epsilon": 1e-6}


@pytest.fixture(scope="module")
def chained(tmp_path_factory):
    """(family, checkpoint, trace with every depth 2..N recorded), as the MtpModel families' tests take it."""
    root = tmp_path_factory.mktemp("mimo")
    ckpt = FIXTURES.write_mimo_v2_flash_checkpoint(root / "ckpt", HELD_OUT)
    out = root / "chain.h5"
    result = run_cli(oracle_cli, ["export", ckpt, "--out", out, "--tokens", TOKENS, "--hidden-seed", "0",
                                  "--chain", str(HELD_OUT["num_nextn_predict_layers"]), "-q"])
    assert result.exit_code == 0, result.output
    return "mimo_v2_flash", ckpt, out


# --- the independent transcription (float64, release names, no transformers) ----------------------------------

def _rms(x, w, eps):
    return w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))


def _neox(x, positions, theta, rotated):
    """NeoX rope on the first `rotated` dims of each head: x (n, heads, d)."""
    inv = 1.0 / theta ** (torch.arange(0, rotated, 2, dtype=torch.float64) / rotated)
    angles = positions[:, None].double() * inv  # (n, rotated/2)
    cos, sin = angles.cos()[:, None], angles.sin()[:, None]
    a, b, rest = x[..., : rotated // 2], x[..., rotated // 2: rotated], x[..., rotated:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin, rest], dim=-1)


def _attention(t, p, cfg, x, positions, window):
    """MiMoV2Attention.forward with sinks: softmax over the visible keys and one sink logit per head, dropped."""
    heads, kv, hd, vd = (cfg[k] for k in ("swa_num_attention_heads", "swa_num_key_value_heads", "swa_head_dim",
                                          "swa_v_head_dim"))
    n, rotated = len(x), int(hd * cfg["partial_rotary_factor"])
    q = _neox((x @ t[p + "self_attn.q_proj.weight"].T).view(n, heads, hd), positions, cfg["swa_rope_theta"], rotated)
    k = _neox((x @ t[p + "self_attn.k_proj.weight"].T).view(n, kv, hd), positions, cfg["swa_rope_theta"], rotated)
    v = (x @ t[p + "self_attn.v_proj.weight"].T).view(n, kv, vd) * cfg["attention_value_scale"]
    group = heads // kv
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # query head h reads kv head h // g
    scores = torch.einsum("qhd,khd->hqk", q, k) * hd ** -0.5
    visible = (positions[None, :] <= positions[:, None]) & (positions[:, None] - positions[None, :] < window)
    scores = scores.masked_fill(~visible[None], float("-inf"))
    sink = t[p + "self_attn.attention_sink_bias"][:, None, None].expand(heads, n, 1)
    weights = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :n]
    out = torch.einsum("hqk,khd->qhd", weights, v).reshape(n, heads * vd)
    return out @ t[p + "self_attn.o_proj.weight"].T


def reference_layer(t, layer, cfg, embed, hidden, positions, window, order="eh"):
    """MiMoV2MTPLayer.forward of `layer` -> (res2, out); `order` "he" is the wrong concat (a twin)."""
    p, eps = f"model.mtp.layers.{layer}.", cfg["layernorm_epsilon"]
    e, h = _rms(embed, t[p + "enorm.weight"], eps), _rms(hidden, t[p + "hnorm.weight"], eps)
    fc = torch.cat([e, h] if order == "eh" else [h, e], dim=-1) @ t[p + "eh_proj.weight"].T
    res1 = fc + _attention(t, p, cfg, _rms(fc, t[p + "input_layernorm.weight"], eps), positions, window)
    m = _rms(res1, t[p + "pre_mlp_layernorm.weight"], eps)
    mlp = (torch.nn.functional.silu(m @ t[p + "mlp.gate_proj.weight"].T) * (m @ t[p + "mlp.up_proj.weight"].T))
    res2 = res1 + mlp @ t[p + "mlp.down_proj.weight"].T
    return res2, _rms(res2, t[p + "final_layernorm.weight"], eps)


def _dequantized(tensors, quant):
    """float64 tensors; an FP8 weight times its weight_scale_inv, each scale over its (rows, cols) block."""
    out = {k: v.double() for k, v in tensors.items() if not k.endswith("weight_scale_inv")}
    for name, scale in tensors.items():
        if name.endswith("weight_scale_inv"):
            w, (r, c) = name.removesuffix("_scale_inv"), quant["weight_block_size"]
            full = scale.double().repeat_interleave(r, 0).repeat_interleave(c, 1)
            out[w] = out[w] * full[: out[w].shape[0], : out[w].shape[1]]
    return out


def reference_depths(ckpt, token_ids, hidden, positions, window=None, layer_of=lambda depth: depth - 1, **kw):
    """Teacher-forced depths 1..N: depth j, row s feeds token_ids[s + j - 1], depth j-1's out of row s (H for j = 1)
    at positions[s] + j - 1, through layer layer_of(j), one causal windowed pass."""
    cfg = json.loads((ckpt / "config.json").read_text())
    t = _dequantized(load_file(ckpt / "model.safetensors"), cfg.get("quantization_config"))
    window = cfg["sliding_window_size"] + 1 if window is None else window
    recycled, outs = torch.from_numpy(hidden).double(), {}
    for depth in range(1, cfg["num_nextn_predict_layers"] + 1):
        n = len(token_ids) - depth + 1
        embed = t["model.embed_tokens.weight"][torch.from_numpy(token_ids[depth - 1: depth - 1 + n])]
        _, out = reference_layer(t, layer_of(depth), cfg, embed, recycled[:n],
                                 torch.from_numpy(positions[:n] + depth - 1), window, **kw)
        outs[depth] = out.numpy()
        recycled = out
    return outs, t["lm_head.weight"].numpy()


def _trace_depths(trace):
    with h5py.File(trace) as f:
        inputs = {k: f[f"inputs/{k}"][:] for k in ("token_ids", "hidden", "positions")}
        depths = json.loads(f.attrs["chain"])["depths"]
        rows = {j: {s: f[f"stages/{s}" if j == 1 else f"chain/d{j}/stages/{s}"][:] for s in ("out", "draft")}
                for j in range(1, depths + 1)}
        layers = {j: f[f"chain/d{j}/inputs/layer"][:] for j in range(2, depths + 1)}
    return inputs, rows, layers


def _close(a, b) -> bool:
    return np.abs(a - b).max() <= 1e-5 * np.abs(b).max()


def test_every_depth_equals_the_independent_transcription_and_its_drafts(chained):
    _, ckpt, trace = chained
    inputs, rows, layers = _trace_depths(trace)
    ref, lm_head = reference_depths(ckpt, inputs["token_ids"], inputs["hidden"], inputs["positions"])
    assert sorted(ref) == sorted(rows) == [1, 2, 3, 4]
    for depth, out in ref.items():
        np.testing.assert_allclose(rows[depth]["out"], out, rtol=0, atol=1e-5 * np.abs(out).max(), err_msg=str(depth))
        np.testing.assert_array_equal(rows[depth]["draft"][:, 0], (out @ lm_head.T).argmax(axis=1))
        if depth > 1:
            np.testing.assert_array_equal(layers[depth], depth - 1)  # the physical layer recorded per depth


def test_twins_the_transcription_tells_each_wiring_change_apart(chained):
    """The comparison above would fail on: layer 0 reused at depth 2 (vLLM's proposer without spec_step_idx), the
    concat order [h, e], and vLLM FlashAttention's window (sliding_window_size keys, itself included: `(W - 1, 0)`,
    one key fewer than transformers and SGLang attend; these 10 steps exceed it)."""
    _, ckpt, trace = chained
    inputs, rows, _ = _trace_depths(trace)
    args = (ckpt, inputs["token_ids"], inputs["hidden"], inputs["positions"])
    reused, _ = reference_depths(*args, layer_of=lambda depth: 0)
    assert _close(reused[1], rows[1]["out"]) and not _close(reused[2], rows[2]["out"])
    swapped, _ = reference_depths(*args, order="he")
    assert not _close(swapped[1], rows[1]["out"])
    narrower, _ = reference_depths(*args, window=HELD_OUT["sliding_window_size"])
    assert not _close(narrower[1], rows[1]["out"])


def _official_mtp_model(ckpt):
    """The oracle's loaded head, and its MtpModel made runnable on its own: what MtpModel ties from the main model
    (built on the meta device) replaced by the checkpoint's tables and the real rope."""
    checkpoint = Checkpoint(ckpt)
    impl = head_module(checkpoint.family)
    head, rotary = impl.build_head(checkpoint.config, impl.torch_weights(checkpoint.read_head(widen=False)))
    mtp, tensors = head.mtp, load_file(ckpt / "model.safetensors")
    mtp.embed_tokens = torch.nn.Embedding.from_pretrained(tensors["model.embed_tokens.weight"].float())
    mtp.shared_head = torch.nn.Linear(checkpoint.config.hidden_size, checkpoint.config.vocab_size, bias=False)
    mtp.shared_head.weight.data = tensors["lm_head.weight"].float()
    mtp.rotary_emb = rotary
    return checkpoint, head, rotary


def test_every_depth_equals_mtp_model_forward_drafting_with_its_own_cache(chained):
    """transformers' MtpModel.forward (the oracle's own loaded MtpModel, its MtpCache, its masks from the MTP
    config's layer types) drafts the same rows at every layer as the oracle's chains, and its first draft."""
    from transformers.cache_utils import MtpCache

    _, ckpt, trace = chained
    _, head, _ = _official_mtp_model(ckpt)
    mtp, outs = head.mtp, {}
    hooks = [layer.register_forward_hook(lambda m, a, o, i=i: outs.__setitem__(i, o[0]))
             for i, layer in enumerate(mtp.layers)]
    inputs, rows, _ = _trace_depths(trace)
    ids, hidden, positions = (torch.from_numpy(inputs[k])[None] for k in ("token_ids", "hidden", "positions"))
    with torch.no_grad():
        drafts, _, _ = mtp(input_ids=ids, last_hidden_states=hidden, attention_mask=None, position_ids=positions,
                           mtp_cache=MtpCache(config=head.text_config))
    for hook in hooks:
        hook.remove()
    for layer in range(len(mtp.layers)):
        n = ids.shape[1] - layer
        ref = rows[layer + 1]["out"]
        np.testing.assert_allclose(outs[layer][:n].numpy(), ref, rtol=0, atol=1e-5 * np.abs(ref).max())
    assert int(drafts[0, 0]) == int(rows[1]["draft"][-1, 0])


def test_accept_drafts_equal_mtp_model_forward_on_every_prefix(chained):
    """accept's argmax chains (alpha_j per depth): chain c's drafts are what MtpModel.forward drafts from the prefix
    0..c through a fresh MtpCache; twin: layer 0 at every depth drafts otherwise somewhere past depth 1."""
    import copy

    from transformers.cache_utils import MtpCache

    from oracle.accept import draft_chains

    _, ckpt, _ = chained
    checkpoint, head, rotary = _official_mtp_model(ckpt)
    cfg, k = checkpoint.config, checkpoint.config.num_mtp_layers
    rng = np.random.default_rng(3)
    sequence = rng.integers(0, cfg.vocab_size, 12 + k)
    hidden = rng.standard_normal((len(sequence), cfg.hidden_size)).astype(np.float32)
    drafts, _ = draft_chains(checkpoint, head, rotary, sequence, hidden, k)
    with torch.no_grad():
        for c in range(len(drafts)):
            official, _, _ = head.mtp(input_ids=torch.from_numpy(sequence[1:c + 2])[None],
                                      last_hidden_states=torch.from_numpy(hidden[:c + 1])[None], attention_mask=None,
                                      position_ids=torch.arange(c + 1)[None], mtp_cache=MtpCache(config=head.text_config))
            np.testing.assert_array_equal(drafts[c], official[0].numpy(), err_msg=f"chain {c}")
    layers = head.mtp.layers
    reused = torch.nn.ModuleList([layers[0]] + [copy.deepcopy(layers[0]) for _ in range(1, len(layers))])
    for index, layer in enumerate(reused):  # layer 0's weights at every depth, each copy in its own cache slot
        layer.mtp_block.self_attn.layer_idx = index
    head.mtp.layers = reused
    try:
        wrong, _ = draft_chains(checkpoint, head, rotary, sequence, hidden, k)
    finally:
        head.mtp.layers = layers
    np.testing.assert_array_equal(wrong[:, 0], drafts[:, 0])
    assert (wrong[:, 1:] != drafts[:, 1:]).any()


def test_a_candidate_reusing_layer0_at_depth2_differs_from_the_reference_there(chained):
    mtp_model_tests.test_a_candidate_reusing_layer0_at_depth2_differs_from_the_reference_there(chained)


def test_a_perturbation_of_each_stage_is_first_seen_at_that_stage_at_every_depth(chained, tmp_path):
    mtp_model_tests.test_a_perturbation_of_each_stage_is_first_seen_at_that_stage_at_every_depth(chained, tmp_path)


def _with_config(ckpt, out, **changes):
    out.mkdir()
    config = json.loads((ckpt / "config.json").read_text())
    config.update(changes)
    (out / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    (out / "model.safetensors").symlink_to(ckpt / "model.safetensors")
    return out


def _export(ckpt, out):
    return run_cli(oracle_cli, ["export", ckpt, "--out", out, "--tokens", "5,6", "--hidden-seed", "0"])


def test_a_layer_count_disagreeing_with_the_tensors_exits_2_naming_both(tmp_path):
    ckpt = FIXTURES.write_mimo_v2_flash_checkpoint(tmp_path / "ckpt")
    n = Checkpoint(ckpt).config.num_mtp_layers
    key = "num_nextn_predict_layers"
    for case, count, named in (("fewer", n - 1, f"extra [{n - 1}]"), ("more", n + 1, f"missing [{n}]")):
        result = _export(_with_config(ckpt, tmp_path / case, **{key: count}), tmp_path / f"{case}.h5")
        assert result.exit_code == 2, result.output
        assert f"declares {count} MTP layer" in result.output and named in result.output, result.output
        assert not (tmp_path / f"{case}.h5").exists()
    result = _export(_with_config(ckpt, tmp_path / "absent", **{key: None}), tmp_path / "a.h5")  # the silent drop
    assert result.exit_code == 2 and key in result.output and "drops" in result.output, result.output
    result = _export(ckpt, tmp_path / "ok.h5")
    assert result.exit_code == 0, result.output  # twin: the count the tensors hold is accepted


@pytest.mark.parametrize("change, named", [
    ({"attention_projection_layout": "fused_qkv"}, "fused qkv_proj"),
    ({"add_swa_attention_sink_bias": False}, "always has sinks"),
    ({"swa_num_key_value_heads": 3}, "even positive integer"),
    ({"swa_rope_theta": None}, "swa_rope_theta"),
    ({"attention_value_scale": None}, "attention_value_scale"),  # absent: _with_config drops None keys
    ({"attention_value_scale": "0.7"}, "attention_value_scale"),
])
def test_configs_the_official_class_cannot_represent_exit_2_naming_the_key(change, named, tmp_path):
    ckpt = FIXTURES.write_mimo_v2_flash_checkpoint(tmp_path / "ckpt")
    result = _export(_with_config(ckpt, tmp_path / "bad", **change), tmp_path / "bad.h5")
    assert result.exit_code == 2 and named in result.output, result.output


def test_chain_deeper_than_the_layers_exits_2_unless_modulo(tmp_path):
    ckpt = FIXTURES.write_mimo_v2_flash_checkpoint(tmp_path / "ckpt")
    n = Checkpoint(ckpt).config.num_mtp_layers
    args = ["export", ckpt, "--tokens", TOKENS, "--hidden-seed", "0", "--chain", str(n + 1), "-q"]
    result = run_cli(oracle_cli, args + ["--out", tmp_path / "deep.h5"])
    assert result.exit_code == 2 and f"at most {n}" in result.output and "modulo" in result.output, result.output
    result = run_cli(oracle_cli, args + ["--out", tmp_path / "mod.h5", "--chain-layers", "modulo"])
    assert result.exit_code == 0, result.output
    with h5py.File(tmp_path / "mod.h5") as f:
        np.testing.assert_array_equal(f[f"chain/d{n + 1}/inputs/layer"][:], 0)


def test_an_fp8_release_is_dequantized_with_its_block_scales_at_every_depth(tmp_path):
    """FP8 e4m3 linears beside weight_scale_inv (as MiMo-V2-Flash ships; 16x16 blocks over 48/80-wide weights, so
    partial blocks too): every depth equals the transcription on the dequantized weights; twin: a scale removed
    exits 2 naming the weight."""
    ckpt = FIXTURES.write_mimo_v2_flash_checkpoint(tmp_path / "fp8", HELD_OUT, fp8_block=[16, 32])
    out = tmp_path / "fp8.h5"
    result = run_cli(oracle_cli, ["export", ckpt, "--out", out, "--tokens", TOKENS, "--hidden-seed", "0",
                                  "--chain", "4", "-q"])
    assert result.exit_code == 0, result.output
    tensors = load_file(ckpt / "model.safetensors")
    assert tensors["model.mtp.layers.1.mlp.up_proj.weight"].dtype == torch.float8_e4m3fn
    inputs, rows, _ = _trace_depths(out)
    ref, _ = reference_depths(ckpt, inputs["token_ids"], inputs["hidden"], inputs["positions"])
    for depth, expected in ref.items():
        np.testing.assert_allclose(rows[depth]["out"], expected, rtol=0, atol=1e-5 * np.abs(expected).max())
    victim = "model.mtp.layers.2.mlp.down_proj.weight"
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((ckpt / "config.json").read_text())
    save_file({k: v for k, v in tensors.items() if k != victim.removesuffix("weight") + "weight_scale_inv"},
              broken / "model.safetensors")
    result = run_cli(oracle_cli, ["export", broken, "--out", tmp_path / "b.h5", "--tokens", "5,6", "--hidden-seed",
                                  "0"])
    assert result.exit_code == 2 and victim in result.output, result.output
