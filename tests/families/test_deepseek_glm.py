"""DeepSeek-V3 and GLM-4.5 MTP heads (transformers' MtpLayer families) against an independent transcription.

The transcription below is written from the wiring atlas (shared/reference/mtp_wiring.md §3.3-3.4) and DeepSeek's
own formulas in plain torch ops (float64): it reads the safetensors with `safetensors` itself, dequantizes FP8 the
straightforward way, and never touches the oracle's classes or transformers. Every check has a twin: the same check
on a transcription with one known wiring mistake, which must fail.
"""

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from oracle.errors import CheckpointError, InputError
from oracle.export import HiddenSource, export_trace
from oracle.fp8 import E4M3_TABLE, dequantize
from oracle.trace import read_trace

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from make_fixtures import write_mtp_layer_checkpoint  # noqa: E402

TOKENS = np.array([5, 17, 3, 99, 4, 250, 5, 511, 0, 64], dtype=np.int64)
RTOL = 1e-4

CHECKPOINTS = {
    "ds_bf16": dict(family="deepseek_v3"),
    "ds_fp8": dict(family="deepseek_v3", fp8_block=[16, 32]),
    "ds_noq_sharded": dict(family="deepseek_v3", dims={"q_lora_rank": None}, sharded=True),
    # odd dims: partial 128x128 FP8 blocks, head widths that are not powers of two, no copies of embed/head
    "ds_odd_fp8": dict(family="deepseek_v3", fp8_block=[128, 128], copies=False,
                       dims={"hidden_size": 136, "num_attention_heads": 3, "q_lora_rank": 40, "kv_lora_rank": 24,
                             "qk_nope_head_dim": 12, "qk_rope_head_dim": 6, "v_head_dim": 10,
                             "moe_intermediate_size": 20, "n_routed_experts": 12, "n_group": 3, "topk_group": 2,
                             "num_experts_per_tok": 3, "num_hidden_layers": 3, "vocab_size": 520}),
    "glm": dict(family="glm4_moe"),
    "glm_plain": dict(family="glm4_moe", dims={"use_qk_norm": False, "attention_bias": False, "n_group": 2,
                                               "topk_group": 1, "partial_rotary_factor": 0.75, "head_dim": 16}),
}


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp_layer_ckpts")
    return {name: write_mtp_layer_checkpoint(root / name, **kw) for name, kw in CHECKPOINTS.items()}


# ---------------------------------------------------------------------------------------------------------------
# the independent transcription (float64, plain torch ops)


def load_tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    files = sorted(ckpt.glob("*.safetensors"))
    tensors = {}
    for f in files:
        tensors |= load_file(f)
    return tensors


def plain_dequant(w: torch.Tensor, scale_inv: torch.Tensor, block) -> torch.Tensor:
    """The straightforward FP8 dequant: expand the block grid to the weight's shape and multiply in float32."""
    full = scale_inv.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[: w.shape[0], : w.shape[1]]
    return w.to(torch.float32) * full


def weights64(ckpt: Path, cfg: dict, mutate: set) -> dict[str, torch.Tensor]:
    raw = load_tensors(ckpt)
    block = (cfg.get("quantization_config") or {}).get("weight_block_size", [128, 128])
    out = {}
    for name, t in raw.items():
        if name.endswith("weight_scale_inv"):
            continue
        scale = raw.get(name.removesuffix("weight") + "weight_scale_inv")
        if scale is not None:
            if "fp8_scale_transposed" in mutate and scale.shape[0] == scale.shape[1] and scale.shape[0] > 1:
                scale = scale.T
            t = plain_dequant(t, scale, block)
        out[name] = t.to(torch.float64)
    return out


def rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def yarn_inv_freq(dim, rope, max_pos):
    """DeepSeek-V3 inference/model.py precompute_freqs_cis, with YaRN whenever rope type is yarn (transformers)."""
    base = rope.get("rope_theta")
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    if rope.get("type", rope.get("rope_type")) != "yarn":
        return freqs, 1.0, 1.0
    factor, orig = rope["factor"], rope["original_max_position_embeddings"]
    fast, slow = rope.get("beta_fast", 32), rope.get("beta_slow", 1)

    def corr_dim(rot):
        return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

    low, high = max(math.floor(corr_dim(fast)), 0), min(math.ceil(corr_dim(slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low), 0, 1)
    smooth = 1 - ramp
    freqs = freqs / factor * (1 - smooth) + freqs * smooth

    def mscale(s, m):
        return 1.0 if s <= 1 else 0.1 * m * math.log(s) + 1.0

    m, mall = rope.get("mscale") or 0, rope.get("mscale_all_dim") or 0
    cos_sin_scale = mscale(factor, m) / mscale(factor, mall) if (m and mall) else mscale(factor, 1)
    softmax_mult = mscale(factor, mall) ** 2 if mall else 1.0
    return freqs, cos_sin_scale, softmax_mult


def rope_interleaved(x, pos, freqs, scale):
    """Pairs (x[2i], x[2i+1]) rotated by pos * freqs[i] (DeepSeek's complex view)."""
    ang = pos[:, None].double() * freqs[None]  # (T, d/2)
    c, s = torch.cos(ang) * scale, torch.sin(ang) * scale
    if x.dim() == 3:
        c, s = c[:, None], s[:, None]
    a, b = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2], out[..., 1::2] = a * c - b * s, a * s + b * c
    return out


def rope_halves(x, pos, freqs):
    """NeoX: the first half of the rotary dims pairs with the second half."""
    ang = pos[:, None].double() * freqs[None]
    c, s = torch.cos(ang)[:, None], torch.sin(ang)[:, None]
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * c - b * s, a * s + b * c], dim=-1)


def causal_softmax(scores):
    t = scores.shape[-1]
    blocked = torch.triu(torch.ones(t, t, dtype=torch.bool), 1)
    return torch.softmax(scores.masked_fill(blocked, float("-inf")), dim=-1)


def mla(cfg, w, p, x, pos, mutate):
    t, h = x.shape[0], cfg["num_attention_heads"]
    nope, rope_d, vd, kvl = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"], cfg["kv_lora_rank"]
    a = p + "self_attn."
    if cfg.get("q_lora_rank"):
        q = rms(x @ w[a + "q_a_proj.weight"].T, w[a + "q_a_layernorm.weight"], 1e-6) @ w[a + "q_b_proj.weight"].T
    else:
        q = x @ w[a + "q_proj.weight"].T
    q = q.view(t, h, nope + rope_d)
    kv = x @ w[a + "kv_a_proj_with_mqa.weight"].T
    latent = rms(kv[:, :kvl], w[a + "kv_a_layernorm.weight"], 1e-6)
    kvb = (latent @ w[a + "kv_b_proj.weight"].T).view(t, h, nope + vd)
    k_nope, v = kvb[..., :nope], kvb[..., nope:]
    rope = cfg.get("rope_scaling") or {}
    rope = {**rope, "rope_theta": cfg["rope_theta"]}
    freqs, cs, soft = yarn_inv_freq(rope_d, rope, cfg["max_position_embeddings"])
    if "no_yarn_mscale" in mutate:
        soft = 1.0
    rot = rope_halves if "rope_not_interleaved" in mutate else (lambda z, pp, f: rope_interleaved(z, pp, f, cs))
    q_pe = rot(q[..., nope:], pos, freqs)  # (T, H, r)
    k_pe = rot(kv[:, kvl:][:, None], pos, freqs)  # (T, 1, r): one rope key shared by the heads
    scale = (nope + rope_d) ** -0.5 * soft
    scores = (torch.einsum("ihd,jhd->hij", q[..., :nope], k_nope) + torch.einsum("ihd,jd->hij", q_pe, k_pe[:, 0]))
    probs = causal_softmax(scores * scale)
    out = torch.einsum("hij,jhd->ihd", probs, v).reshape(t, h * vd)
    return out @ w[a + "o_proj.weight"].T


def gqa(cfg, w, p, x, pos, mutate):
    t, h, kvh = x.shape[0], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim", cfg["hidden_size"] // h)
    a = p + "self_attn."

    def proj(n):
        y = x @ w[a + n + ".weight"].T
        return y + w[a + n + ".bias"] if cfg.get("attention_bias") and "no_qkv_bias" not in mutate else y

    q, k, v = proj("q_proj").view(t, h, hd), proj("k_proj").view(t, kvh, hd), proj("v_proj").view(t, kvh, hd)
    if cfg.get("use_qk_norm"):
        q, k = rms(q, w[a + "q_norm.weight"], cfg["rms_norm_eps"]), rms(k, w[a + "k_norm.weight"], cfg["rms_norm_eps"])
    rot = hd if "rope_all_dims" in mutate else int(hd * cfg.get("partial_rotary_factor", 0.5))
    freqs = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot))
    q = torch.cat([rope_halves(q[..., :rot], pos, freqs), q[..., rot:]], -1)
    k = torch.cat([rope_halves(k[..., :rot], pos, freqs), k[..., rot:]], -1)
    k, v = k.repeat_interleave(h // kvh, 1), v.repeat_interleave(h // kvh, 1)
    probs = causal_softmax(torch.einsum("ihd,jhd->hij", q, k) * hd**-0.5)
    return torch.einsum("hij,jhd->ihd", probs, v).reshape(t, h * hd) @ w[a + "o_proj.weight"].T


def swiglu(x, gate, up, down, mutate):
    if "gate_up_swap" in mutate:
        gate, up = up, gate
    return (torch.nn.functional.silu(x @ gate.T) * (x @ up.T)) @ down.T


def moe(cfg, w, p, x, mutate):
    """noaux_tc: sigmoid scores, bias for the choice only, group-limited top-k, unbiased weights, renorm, scale."""
    m = p + "mlp."
    e, k, g, kg = cfg["n_routed_experts"], cfg["num_experts_per_tok"], cfg["n_group"], cfg["topk_group"]
    logits = x @ w[m + "gate.weight"].T
    scores = torch.sigmoid(logits)
    choice = scores if "no_correction_bias" in mutate else scores + w[m + "gate.e_score_correction_bias"]
    if "no_group_limit" not in mutate:
        group = choice.view(-1, g, e // g).topk(2, dim=-1).values.sum(-1)
        keep = torch.zeros_like(group, dtype=torch.bool).scatter_(1, group.topk(kg, dim=-1).indices, True)
        choice = choice.masked_fill(~keep.repeat_interleave(e // g, 1), float("-inf"))
    ids = choice.topk(k, dim=-1).indices
    weights = (scores + w[m + "gate.e_score_correction_bias"] if "bias_in_weights" in mutate else scores).gather(1, ids)
    if cfg.get("norm_topk_prob", True) and "not_renormalised" not in mutate:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    if "no_routed_scaling" not in mutate:
        weights = weights * cfg["routed_scaling_factor"]
    routed = torch.zeros_like(x)
    for i in range(x.shape[0]):
        for j in range(k):
            ex = f"{m}experts.{int(ids[i, j])}."
            routed[i] += weights[i, j] * swiglu(x[i], w[ex + "gate_proj.weight"], w[ex + "up_proj.weight"],
                                                w[ex + "down_proj.weight"], mutate)
    s = m + "shared_experts."
    shared = swiglu(x, w[s + "gate_proj.weight"], w[s + "up_proj.weight"], w[s + "down_proj.weight"], set())
    return {"router_logits": logits, "topk_ids": ids, "topk_weights": weights, "shared": shared, "routed": routed,
            "mlp": routed + shared}


def transcription(ckpt: Path, tokens, hidden, positions, mask_pos0=False, mutate=frozenset()) -> dict:
    cfg = json.loads((ckpt / "config.json").read_text())
    w = weights64(ckpt, cfg, set(mutate))
    p = f"model.layers.{cfg['num_hidden_layers']}."
    eps = cfg["rms_norm_eps"]
    table = w.get(p + "embed_tokens.weight", w["model.embed_tokens.weight"])
    if "embed_main_copy" in mutate:
        table = w["model.embed_tokens.weight"]
    embed = table[torch.from_numpy(tokens)]
    pos = torch.from_numpy(positions)
    if mask_pos0 != ("pos0_mask_flipped" in mutate):
        embed = embed.masked_fill((pos == 0)[:, None], 0.0)
    s = {"e": rms(embed, w[p + "enorm.weight"], eps),
         "h": rms(torch.from_numpy(hidden).double(), w[p + "hnorm.weight"], eps)}
    s["fc_in"] = torch.cat([s["h"], s["e"]] if "concat_swap" in mutate else [s["e"], s["h"]], -1)
    s["fc"] = s["fc_in"] @ w[p + "eh_proj.weight"].T
    s["ah"] = rms(s["fc"], w[p + "input_layernorm.weight"], eps)
    attention = mla if cfg["model_type"] == "deepseek_v3" else gqa
    s["attn"] = attention(cfg, w, p, s["ah"], pos, set(mutate))
    s["res1"] = s["fc"] + s["attn"]
    s["mh"] = rms(s["res1"], w[p + "post_attention_layernorm.weight"], eps)
    s |= moe(cfg, w, p, s["mh"], set(mutate))
    s["res2"] = s["res1"] + s["mlp"]
    final = "model.norm.weight" if "main_norm_for_out" in mutate else p + "shared_head.norm.weight"
    s["out"] = rms(s["res2"], w[final], eps)
    # the draft: the MTP layer's own shared_head.head where the checkpoint has it, else the main lm_head
    s["draft"] = (s["out"] @ w.get(p + "shared_head.head.weight", w.get("lm_head.weight")).T).argmax(-1, keepdim=True)
    return {k: v.numpy() for k, v in s.items()}


# ---------------------------------------------------------------------------------------------------------------
# comparing


def worst_rel(actual: np.ndarray, expected: np.ndarray) -> float:
    """max over rows of max|a - e| / max|e| (the probe's row rule), in float64."""
    a, e = actual.astype(np.float64), expected.astype(np.float64)
    diff = np.abs(a - e).max(axis=1)
    scale = np.abs(e).max(axis=1)
    return float(np.max(np.where(diff == 0, 0.0, diff / np.maximum(scale, 1e-300))))


def by_id(ids: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    order = np.argsort(ids, axis=1)
    return np.take_along_axis(ids, order, 1), np.take_along_axis(values, order, 1)


def mismatches(trace: dict, ref: dict) -> dict[str, float]:
    """Stage -> worst max_rel where it exceeds RTOL (topk_ids: the number of rows whose sets differ)."""
    bad = {}
    ids_t, w_t = by_id(trace["topk_ids"], trace["topk_weights"])
    ids_r, w_r = by_id(ref["topk_ids"], ref["topk_weights"])
    if not np.array_equal(ids_t, ids_r):
        bad["topk_ids"] = float((ids_t != ids_r).any(axis=1).sum())
    for name, expected in ref.items():
        if name == "topk_ids":
            continue
        actual = w_t if name == "topk_weights" else trace[name]
        rel = worst_rel(actual, w_r if name == "topk_weights" else expected)
        if not rel <= RTOL:
            bad[name] = rel
    return bad


def export(ckpt: Path, out: Path, mask=False, mode="batched", start_pos=0) -> tuple[dict, dict, object]:
    overrides = {"mask_pos0_embedding": True} if mask else {}
    export_trace(ckpt, out, TOKENS, HiddenSource(seed=3), start_pos=start_pos, mode=mode, config_overrides=overrides)
    with read_trace(out) as t:
        stages = {name: t.stage_rows(name, 0, t.num_tokens) for name in t.stages}
        evidence = {name: t.evidence_rows(name, 0, t.num_tokens)
                    for name in ("attn_uniform", "topk_margin", "router_group_limited") if t.has_evidence(name)}
        return stages, evidence, (dict(t.attrs), np.asarray(t.inputs().hidden), np.asarray(t.inputs().positions))


# ---------------------------------------------------------------------------------------------------------------
# tests


@pytest.mark.parametrize("mask", [False, True], ids=["mask_off", "mask_on"])
@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_export_equals_independent_transcription(checkpoints, tmp_path, name, mask):
    stages, evidence, (attrs, hidden, positions) = export(checkpoints[name], tmp_path / "ref.h5", mask=mask)
    assert set(stages) == {"e", "h", "fc_in", "fc", "ah", "attn", "res1", "mh", "router_logits", "topk_ids",
                           "topk_weights", "shared", "routed", "mlp", "res2", "out", "draft"}
    ref = transcription(checkpoints[name], TOKENS, hidden, positions, mask_pos0=mask)
    assert mismatches(stages, ref) == {}
    assert attrs["config"]["mask_pos0_embedding"] is mask
    # twin: the same comparison with the mask flipped fails (first at e, row 0 only there)
    flipped = transcription(checkpoints[name], TOKENS, hidden, positions, mask_pos0=mask,
                            mutate={"pos0_mask_flipped"})
    bad = mismatches(stages, flipped)
    assert "e" in bad and "out" in bad
    assert worst_rel(stages["e"][1:], flipped["e"][1:]) < RTOL  # only position 0 differs at e


TWINS = {
    "ds_bf16": ["concat_swap", "rope_not_interleaved", "no_yarn_mscale", "no_group_limit", "no_correction_bias",
                "bias_in_weights", "not_renormalised", "no_routed_scaling", "gate_up_swap", "main_norm_for_out"],
    "ds_fp8": ["fp8_scale_transposed", "no_group_limit"],
    "ds_odd_fp8": ["no_group_limit", "rope_not_interleaved"],
    "glm": ["rope_all_dims", "no_qkv_bias", "concat_swap", "bias_in_weights"],
    "glm_plain": ["no_group_limit", "rope_all_dims"],
}


@pytest.mark.parametrize("name,mutation", [(n, m) for n, ms in TWINS.items() for m in ms])
def test_wiring_mistakes_are_caught(checkpoints, tmp_path, name, mutation):
    """Each twin: a transcription with one known mistake disagrees with the oracle's trace beyond 1e-4."""
    stages, _, (_, hidden, positions) = export(checkpoints[name], tmp_path / "ref.h5")
    assert mismatches(stages, transcription(checkpoints[name], TOKENS, hidden, positions, mutate={mutation}))


@pytest.mark.parametrize("name", ["ds_bf16", "ds_fp8", "ds_noq_sharded", "glm"])
@pytest.mark.parametrize("mask", [False, True])
def test_stepwise_equals_batched(checkpoints, tmp_path, name, mask):
    batched, ev_b, _ = export(checkpoints[name], tmp_path / "b.h5", mask=mask)
    stepwise, ev_s, _ = export(checkpoints[name], tmp_path / "s.h5", mask=mask, mode="stepwise")
    for stage, rows in batched.items():
        if stage == "topk_ids":
            assert np.array_equal(np.sort(rows, 1), np.sort(stepwise[stage], 1))
        elif stage != "topk_weights":
            assert worst_rel(stepwise[stage], rows) < 1e-5, stage
    assert np.array_equal(ev_b["router_group_limited"], ev_s["router_group_limited"])


def test_group_limit_evidence_counts_tokens(checkpoints, tmp_path):
    stages, evidence, (attrs, hidden, positions) = export(checkpoints["ds_bf16"], tmp_path / "ref.h5")
    limited = evidence["router_group_limited"][:, 0]
    assert set(np.unique(limited)) <= {0.0, 1.0}
    assert attrs["experts"]["group_limited_tokens"] == int(limited.sum()) > 0
    # the figure is what it says: at those tokens, and only those, dropping the group limit changes the choice
    free = transcription(checkpoints["ds_bf16"], TOKENS, hidden, positions, mutate={"no_group_limit"})
    differs = [set(a) != set(b) for a, b in zip(free["topk_ids"].tolist(), stages["topk_ids"].tolist())]
    assert np.array_equal(np.asarray(differs), limited == 1)
    assert (evidence["topk_margin"][:, 0] > 0).all()
    # GLM-4.5 with n_group 1: the limit never matters
    _, ev_glm, (attrs_glm, _, _) = export(checkpoints["glm"], tmp_path / "glm.h5")
    assert attrs_glm["experts"]["group_limited_tokens"] == 0 and not ev_glm["router_group_limited"].any()


def test_mask_pos0_evidence_rules_and_positions(checkpoints, tmp_path):
    off, _, (attrs_off, hidden, _) = export(checkpoints["ds_bf16"], tmp_path / "off.h5")
    on, _, (attrs_on, _, _) = export(checkpoints["ds_bf16"], tmp_path / "on.h5", mask=True)
    assert attrs_off["evidence_rules"]["absolute_positions"] == "not evidenced"
    assert attrs_on["evidence_rules"]["absolute_positions"].startswith("position 0 observable")
    assert not on["e"][0].any() and off["e"][0].any()
    # away from position 0 the mask changes nothing: a trace starting at position 5 is the same either way
    shifted_off, _, _ = export(checkpoints["ds_bf16"], tmp_path / "s_off.h5", start_pos=5)
    shifted_on, _, _ = export(checkpoints["ds_bf16"], tmp_path / "s_on.h5", mask=True, start_pos=5)
    assert all(np.array_equal(shifted_off[k], shifted_on[k]) for k in shifted_off)
    # a candidate running every step one position later is visible at e with the mask on (twin: invisible off)
    assert mismatches(shifted_on, on) and "e" in mismatches(shifted_on, on)
    assert "e" not in mismatches(shifted_off, off)


def test_mask_option_refused_for_qwen(tmp_path):
    root = Path(__file__).resolve().parents[2]
    with pytest.raises(InputError, match="mask_pos0_embedding"):
        export_trace(root / "fixtures" / "qwen3_5_tiny", tmp_path / "q.h5", TOKENS[:3], HiddenSource(seed=0),
                     config_overrides={"mask_pos0_embedding": True})


def test_fp8_dequant_equals_straightforward_dequant():
    rng = np.random.default_rng(0)
    for shape, block in (((300, 200), (128, 128)), ((37, 70), (16, 32)), ((128, 256), (128, 128))):
        bits = rng.integers(0, 256, size=shape, dtype=np.uint8)
        bits[(bits & 0x7F) == 0x7F] = 0x11  # no NaN patterns
        scales = rng.uniform(1e-4, 1.0, size=(-(-shape[0] // block[0]), -(-shape[1] // block[1]))).astype(np.float32)
        ours = dequantize(bits, scales, block)
        plain = plain_dequant(torch.from_numpy(bits).view(torch.float8_e4m3fn), torch.from_numpy(scales), block)
        assert np.array_equal(ours.view(np.uint32), plain.numpy().view(np.uint32)), (shape, block)
        # twin: a transposed scale grid (same shape only when square; else the shape check refuses it)
        if scales.shape[0] == scales.shape[1] and scales.shape[0] > 1:
            assert not np.array_equal(dequantize(bits, scales.T.copy(), block), ours)
        else:
            with pytest.raises(CheckpointError, match="weight_scale_inv"):
                dequantize(bits, scales.T.copy(), block)
    table = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float32).numpy()
    assert np.array_equal(E4M3_TABLE, table, equal_nan=True)


def test_checkpoint_reader_widens_fp8_with_scales(checkpoints):
    from oracle.checkpoint import Checkpoint

    ckpt = Checkpoint(checkpoints["ds_fp8"])
    weights = ckpt.read_head(widen=True)
    raw = load_tensors(checkpoints["ds_fp8"])
    name = "model.layers.2.self_attn.kv_b_proj.weight"
    expected = plain_dequant(raw[name], raw[name.removesuffix("weight") + "weight_scale_inv"], (16, 32)).numpy()
    assert ckpt.entry(name).dtype == "F8_E4M3"
    assert np.array_equal(weights.tensors[name], expected)


def _rewrite(ckpt: Path, dst: Path, edit) -> Path:
    import shutil

    shutil.copytree(ckpt, dst)
    tensors = load_tensors(dst)
    edit(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_strict_loading(checkpoints, tmp_path):
    ok = checkpoints["ds_fp8"]
    p = "model.layers.2."
    missing = _rewrite(ok, tmp_path / "missing", lambda t: t.pop(p + "mlp.gate.e_score_correction_bias"))
    with pytest.raises(CheckpointError, match="e_score_correction_bias"):
        export_trace(missing, tmp_path / "a.h5", TOKENS, HiddenSource(seed=0))
    extra = _rewrite(ok, tmp_path / "extra", lambda t: t.__setitem__(p + "self_attn.q_norm.weight", torch.ones(4)))
    with pytest.raises(CheckpointError, match="q_norm"):
        export_trace(extra, tmp_path / "b.h5", TOKENS, HiddenSource(seed=0))
    no_scale = _rewrite(ok, tmp_path / "noscale", lambda t: t.pop(p + "self_attn.o_proj.weight_scale_inv"))
    with pytest.raises(CheckpointError, match="o_proj"):
        export_trace(no_scale, tmp_path / "c.h5", TOKENS, HiddenSource(seed=0))
    # twin: the untouched checkpoint exports
    export_trace(ok, tmp_path / "d.h5", TOKENS, HiddenSource(seed=0))


def test_embedding_copy_that_differs_is_used_and_recorded(tmp_path):
    ckpt = write_mtp_layer_checkpoint(tmp_path / "differ", copies_differ=True)
    warnings = []
    export_trace(ckpt, tmp_path / "t.h5", TOKENS, HiddenSource(seed=0), warn=warnings.append)
    with read_trace(tmp_path / "t.h5") as t:
        attrs, stages = dict(t.attrs), {n: t.stage_rows(n, 0, t.num_tokens) for n in t.stages}
        hidden, positions = np.asarray(t.inputs().hidden), np.asarray(t.inputs().positions)
    assert attrs["embedding"]["tensor"] == "model.layers.2.embed_tokens.weight"
    assert attrs["embedding"]["rows_equal_main"] is False and any("differs" in w for w in warnings)
    assert mismatches(stages, transcription(ckpt, TOKENS, hidden, positions)) == {}
    assert "e" in mismatches(stages, transcription(ckpt, TOKENS, hidden, positions, mutate={"embed_main_copy"}))


def test_missing_mtp_layer_is_refused(checkpoints, tmp_path, monkeypatch):
    from oracle.families import mtp_layer

    monkeypatch.setattr(mtp_layer, "MtpLayer", None)
    with pytest.raises(CheckpointError, match="MtpLayer"):
        export_trace(checkpoints["glm"], tmp_path / "t.h5", TOKENS, HiddenSource(seed=0))


def test_accept_uses_shared_head(checkpoints, tmp_path):
    from oracle.accept import measure_acceptance

    seq = np.array([1, 5, 17, 3, 99, 4, 250, 7, 8, 9], dtype=np.int64)
    result = measure_acceptance(checkpoints["ds_bf16"], seq, HiddenSource(seed=0), k=2)
    assert result.source["lm_head"] == "model.layers.2.shared_head.head.weight"
    # without the copy, the main lm_head
    result = measure_acceptance(checkpoints["ds_odd_fp8"], seq, HiddenSource(seed=0), k=2)
    assert result.source["lm_head"] == "lm_head.weight"


def _config_edited(ckpt: Path, dest: Path, edit) -> Path:
    """A copy of `ckpt` (its safetensors linked, not copied) whose config.json went through `edit(dict)`."""
    dest.mkdir()
    for f in ckpt.iterdir():
        if f.name != "config.json":
            (dest / f.name).symlink_to(f.resolve())
    config = json.loads((ckpt / "config.json").read_text())
    edit(config)
    (dest / "config.json").write_text(json.dumps(config))
    return dest


def test_glm_without_num_key_value_heads_takes_the_config_class_default(tmp_path):
    """Glm4MoeConfig's num_key_value_heads defaults to 8, not to the head count: a config.json that leaves it out
    builds the official module with 8 key/value heads, and so must the oracle (it had refused valid weights)."""
    from make_fixtures import GLM_TINY
    from transformers import Glm4MoeConfig

    assert Glm4MoeConfig(num_attention_heads=16).num_key_value_heads == 8  # the default the layout copies
    ckpt = write_mtp_layer_checkpoint(tmp_path / "glm16", "glm4_moe",
                                      dims=dict(GLM_TINY, num_attention_heads=16, num_key_value_heads=8, head_dim=8))
    implicit = _config_edited(ckpt, tmp_path / "implicit", lambda c: c.pop("num_key_value_heads"))
    with_key, _, _ = export(ckpt, tmp_path / "a.h5")
    without, _, _ = export(implicit, tmp_path / "b.h5")
    assert with_key.keys() == without.keys()
    for name in with_key:
        np.testing.assert_array_equal(with_key[name], without[name], err_msg=name)
    # twin: 4 heads (2 key/value heads stored) without the key is 4 heads over the default 8: refused, saying so
    small = _config_edited(write_mtp_layer_checkpoint(tmp_path / "glm4", "glm4_moe"), tmp_path / "small",
                           lambda c: c.pop("num_key_value_heads"))
    with pytest.raises(CheckpointError, match=r"num_key_value_heads 8 \(glm4_moe's default"):
        export_trace(small, tmp_path / "c.h5", TOKENS, HiddenSource(seed=0))


def test_deepseek_key_value_heads_other_than_the_heads_are_refused(tmp_path):
    """MLA makes keys and values per attention head; transformers' DeepseekV3Attention would repeat them
    heads / num_key_value_heads times and fail on the shapes (exit 4 before): refused by name instead."""
    from make_fixtures import DEEPSEEK_TINY

    ckpt = write_mtp_layer_checkpoint(tmp_path / "ds", "deepseek_v3", dims=dict(DEEPSEEK_TINY, num_key_value_heads=2))
    with pytest.raises(CheckpointError, match="num_key_value_heads 2 differs from num_attention_heads 4"):
        export_trace(ckpt, tmp_path / "a.h5", TOKENS, HiddenSource(seed=0))
    fixed = _config_edited(ckpt, tmp_path / "fixed", lambda c: c.update(num_key_value_heads=4))
    export_trace(fixed, tmp_path / "b.h5", TOKENS, HiddenSource(seed=0))  # twin: equal counts export
    absent = _config_edited(ckpt, tmp_path / "absent", lambda c: c.pop("num_key_value_heads"))
    export_trace(absent, tmp_path / "c.h5", TOKENS, HiddenSource(seed=0))  # absent: the head count
