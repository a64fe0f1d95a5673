"""The DeepSeek-V4 MTP head against an independent transcription.

The transcription below is written from the wiring atlas (shared/reference/mtp_wiring.md §3.7), seed 002's
`MTPBlock` and the V4 formulas (hyper-connections with Sinkhorn, sliding-window attention with per-head sinks and
interleaved RoPE on the trailing rope dims, grouped output projection, sqrtsoftplus top-k with the selection bias,
clamped SwiGLU) in plain float64 torch ops. It reads the safetensors with `safetensors` itself under the release's
names and dequantizes FP8 the straightforward way; it never touches the oracle's head or a transformers class. Its
pieces are checked against the official `DeepseekV4*` classes separately (test_the_transcription_agrees_with...),
and every agreement has a twin: the same check on a transcription with one known wiring mistake, which must fail.
"""

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from oracle.cli import cli as oracle_cli
from oracle.export import HiddenSource, export_trace
from oracle.trace import read_trace
from probe.diff import diff_traces
from probe.report import render_text, report_json
from tests.helpers import run_cli

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from make_fixtures import write_deepseek_v4_checkpoint  # noqa: E402

TOKENS = np.array([5, 17, 3, 99, 4, 250, 5, 511, 0, 64], dtype=np.int64)  # T = 10 > W = 4
RTOL = 1e-4
P = "mtp.0."

CHECKPOINTS = {
    "bf16": dict(),
    "fp8_ue8m0_release_keys": dict(fp8_block=[32, 32], scale_fmt="ue8m0", release_keys=True),
    "fp8_float_odd": dict(fp8_block=[16, 48], scale_fmt="float",
                          dims={"hidden_size": 48, "hc_mult": 4, "num_attention_heads": 6, "head_dim": 16,
                                "qk_rope_head_dim": 4, "o_groups": 3, "o_lora_rank": 20, "q_lora_rank": 24,
                                "n_routed_experts": 6, "num_experts_per_tok": 3, "sliding_window": 3}),
}


# ---------------------------------------------------------------------------------------------------------------
# the independent transcription (float64)


def load_head(ckpt: Path) -> tuple[dict, dict]:
    """(config as a plain dict with transformers' names, {release name: float64 tensor}) with FP8 dequantized."""
    raw = json.loads((ckpt / "config.json").read_text())
    alias = {"dim": "hidden_size", "n_heads": "num_attention_heads", "n_layers": "num_hidden_layers",
             "window_size": "sliding_window", "n_activated_experts": "num_experts_per_tok",
             "moe_inter_dim": "moe_intermediate_size", "score_func": "scoring_func", "route_scale":
             "routed_scaling_factor", "norm_eps": "rms_norm_eps", "rope_head_dim": "qk_rope_head_dim"}
    cfg = {alias.get(k, k): v for k, v in raw.items()}
    block = (cfg.get("quantization_config") or {}).get("weight_block_size")
    stored = load_file(ckpt / "model.safetensors")
    w = {}
    for name, t in stored.items():
        if name.endswith(".scale"):
            continue
        if t.dtype == torch.float8_e4m3fn:
            s = stored[name.removesuffix("weight") + "scale"].to(torch.float64)  # e8m0 or f32 scales
            s = s.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[: t.shape[0], : t.shape[1]]
            w[name] = t.to(torch.float64) * s
        else:
            w[name] = t.to(torch.float64)
    return cfg, w


def rms(x, weight, eps):
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return x if weight is None else x * weight


def rope(x, pos, rd, theta, sign=1.0):
    """Interleaved pairs (2i, 2i+1) of the trailing rd dims of each head rotated by pos * theta^(-2i/rd)."""
    inv = 1.0 / theta ** (torch.arange(0, rd, 2, dtype=torch.float64) / rd)
    # float32 angles, as every engine (and transformers) computes them
    ang = (pos.to(torch.float32)[:, None] * inv.to(torch.float32)).to(torch.float64) * sign  # (T, rd/2)
    shape = (-1,) + (1,) * (x.dim() - 2) + (rd // 2,)
    cos, sin = ang.cos().view(shape), ang.sin().view(shape)
    nope, r = x[..., :-rd], x[..., -rd:]
    a, b = r[..., 0::2], r[..., 1::2]
    rot = torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)
    return torch.cat([nope, rot], dim=-1)


def hyper_connection(x, fn, base, scale, cfg, wrong=()):
    """x (T, hc, D) -> post (T, hc), comb (T, hc, hc), collapsed (T, D)."""
    t, hc, _ = x.shape
    m = rms(x.reshape(t, -1), None, cfg["rms_norm_eps"]) @ fn.T
    pre = torch.sigmoid(m[:, :hc] * scale[0] + base[:hc]) + cfg["hc_eps"]
    post = 2 * torch.sigmoid(m[:, hc:2 * hc] * scale[1] + base[hc:2 * hc])
    comb = torch.softmax(m[:, 2 * hc:].view(t, hc, hc) * scale[2] + base[2 * hc:].view(hc, hc), -1) + cfg["hc_eps"]
    comb = comb / (comb.sum(-2, keepdim=True) + cfg["hc_eps"])
    for _ in range(cfg["hc_sinkhorn_iters"] - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + cfg["hc_eps"])
        comb = comb / (comb.sum(-2, keepdim=True) + cfg["hc_eps"])
    return post, comb, (pre[..., None] * x).sum(1)


def mix(post, f, comb, x, wrong=()):
    """Streams out[k] = post[k] * f + sum_j comb[j, k] x[j]."""
    residual = comb @ x if "comb_not_transposed" in wrong else comb.transpose(-1, -2) @ x
    return post[..., None] * f[:, None, :] + residual


def attention(ah, pos, w, cfg, wrong=()):
    t = ah.shape[0]
    h, hd, rd, g = cfg["num_attention_heads"], cfg["head_dim"], cfg["qk_rope_head_dim"], cfg["o_groups"]
    eps, window, theta = cfg["rms_norm_eps"], cfg["sliding_window"], cfg["rope_theta"]
    a = P + "attn."
    qr = rms(ah @ w[a + "wq_a.weight"].T, w[a + "q_norm.weight"], eps)
    q = rms((qr @ w[a + "wq_b.weight"].T).view(t, h, hd), None, eps)  # per head, unweighted
    kv = rms(ah @ w[a + "wkv.weight"].T, w[a + "kv_norm.weight"], eps)  # (T, hd): one head, key = value
    q, kv = rope(q, pos, rd, theta), rope(kv, pos, rd, theta)
    scores = torch.einsum("ihd,jd->hij", q, kv) * hd ** -0.5
    i, j = torch.arange(t)[:, None], torch.arange(t)[None, :]
    visible = (j <= i) & ((j > i - window) if "full_attention" not in wrong else True)
    scores = scores.masked_fill(~visible, -math.inf)
    sink = w[a + "attn_sink"].view(h, 1, 1).expand(h, t, 1)
    logits = scores if "no_sink" in wrong else torch.cat([scores, sink], -1)
    p = torch.softmax(logits, -1)[..., :t]
    o = torch.einsum("hij,jd->ihd", p, kv)
    o = rope(o, pos, rd, theta, sign=-1.0)  # de-rotate the value's rope slice at the query position
    o = o.reshape(t, g, -1)  # heads grouped contiguously
    wo_a = w[a + "wo_a.weight"].view(g, -1, o.shape[-1])  # (g, o_lora, in per group)
    return torch.einsum("tgi,goi->tgo", o, wo_a).reshape(t, -1) @ w[a + "wo_b.weight"].T


def swiglu(x, w1, w3, w2, limit, wrong=()):
    gate, up = x @ w1.T, x @ w3.T
    if "no_swiglu_clamp" not in wrong:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return (torch.nn.functional.silu(gate) * up) @ w2.T


def moe(mh, w, cfg, wrong=()):
    f, k, limit = P + "ffn.", cfg["num_experts_per_tok"], cfg["swiglu_limit"]
    logits = mh @ w[f + "gate.weight"].T
    scores = torch.nn.functional.softplus(logits).sqrt()
    choice = scores if "no_selection_bias" in wrong else scores + w[f + "gate.bias"]
    ids = torch.topk(choice, k, -1).indices
    weights = scores.gather(1, ids)
    weights = weights / weights.sum(-1, keepdim=True) * cfg["routed_scaling_factor"]
    routed = torch.zeros_like(mh)
    for t in range(mh.shape[0]):
        for slot in range(k):
            e = f"{f}experts.{int(ids[t, slot])}."
            routed[t] += weights[t, slot] * swiglu(mh[t], w[e + "w1.weight"], w[e + "w3.weight"], w[e + "w2.weight"],
                                                  limit, wrong)
    s = f + "shared_experts."
    shared = swiglu(mh, w[s + "w1.weight"], w[s + "w3.weight"], w[s + "w2.weight"], limit, wrong)
    return {"router_logits": logits, "topk_ids": ids, "topk_weights": weights, "shared": shared, "routed": routed,
            "mlp": routed + shared}


def transcribe(cfg: dict, w: dict, embed: np.ndarray, hidden: np.ndarray, positions: np.ndarray,
               wrong: tuple[str, ...] = ()) -> dict[str, np.ndarray]:
    """Every stage of T teacher-forced steps, [T, width] float64 (streams flattened stream-major)."""
    eps, hc, d = cfg["rms_norm_eps"], cfg["hc_mult"], cfg["hidden_size"]
    emb = torch.from_numpy(embed).double()
    streams = torch.from_numpy(hidden).double().view(-1, hc, d)
    pos = torch.from_numpy(positions)
    s = {"e": rms(emb, w[P + "enorm.weight"], eps)}
    s["h"] = (rms(streams.reshape(len(pos), -1), None, eps).view(-1, hc, d) * w[P + "hnorm.weight"]
              if "hnorm_over_streams" in wrong else rms(streams, w[P + "hnorm.weight"], eps))
    s["e_proj"] = s["e"] @ w[P + "e_proj.weight"].T
    s["h_proj"] = s["h"] @ w[P + "h_proj.weight"].T
    if "e_first_stream_only" in wrong:
        s["x_in"] = s["h_proj"].clone()
        s["x_in"][:, 0] += s["e_proj"]
    else:
        s["x_in"] = s["h_proj"] + s["e_proj"][:, None, :]
    post, comb, collapsed = hyper_connection(s["x_in"], w[P + "hc_attn_fn"], w[P + "hc_attn_base"],
                                             w[P + "hc_attn_scale"], cfg)
    s["ah"] = rms(collapsed, w[P + "attn_norm.weight"], eps)
    s["attn"] = attention(s["ah"], pos, w, cfg, wrong)
    s["after_attn"] = mix(post, s["attn"], comb, s["x_in"], wrong)
    post, comb, collapsed = hyper_connection(s["after_attn"], w[P + "hc_ffn_fn"], w[P + "hc_ffn_base"],
                                             w[P + "hc_ffn_scale"], cfg)
    s["mh"] = rms(collapsed, w[P + "ffn_norm.weight"], eps)
    s |= moe(s["mh"], w, cfg, wrong)
    s["block_out"] = mix(post, s["mlp"], comb, s["after_attn"], wrong)
    flat = rms(s["block_out"].reshape(len(pos), -1), None, eps)
    pre = torch.sigmoid(flat @ w[P + "hc_head_fn"].T * w[P + "hc_head_scale"] + w[P + "hc_head_base"]) + cfg["hc_eps"]
    s["head_collapsed"] = (pre[..., None] * s["block_out"]).sum(1)
    s["out"] = rms(s["head_collapsed"], w[P + "norm.weight"], eps)
    s["draft"] = (s["out"] @ w["head.weight"].T).argmax(dim=-1, keepdim=True)  # the shared lm_head's argmax
    return {k: v.reshape(len(pos), -1).numpy() for k, v in s.items()}


def max_rel(a: np.ndarray, e: np.ndarray) -> float:
    """The probe's rule, over the whole stage: max over rows of max|a-e| / max|e|."""
    a, e = a.astype(np.float64), e.astype(np.float64)
    return float((np.abs(a - e).max(1) / np.maximum(np.abs(e).max(1), 1e-30)).max())


# ---------------------------------------------------------------------------------------------------------------
# fixtures


@pytest.fixture(scope="module", params=sorted(CHECKPOINTS))
def exported(request, tmp_path_factory):
    """(checkpoint, trace path, transcription of the same inputs) per checkpoint kind."""
    root = tmp_path_factory.mktemp(request.param)
    ckpt = write_deepseek_v4_checkpoint(root / "ckpt", **CHECKPOINTS[request.param])
    out = export_trace(ckpt, root / "ref.h5", TOKENS, HiddenSource(seed=3))
    cfg, w = load_head(ckpt)
    with read_trace(out) as trace:
        inputs = trace.inputs()
        stages = {n: trace.stage_rows(n) for n in trace.stages}
    assert np.array_equal(inputs.embed, w["embed.weight"].float().numpy()[TOKENS])  # the shared table's rows
    mine = transcribe(cfg, w, inputs.embed, inputs.hidden, inputs.positions)
    return ckpt, out, cfg, w, inputs, stages, mine


def test_every_stage_agrees_with_the_independent_transcription(exported):
    *_, stages, mine = exported
    assert list(stages) == list(mine)
    for name, rows in stages.items():
        if name == "topk_ids":
            np.testing.assert_array_equal(np.sort(rows, 1), np.sort(mine[name], 1))
        elif name == "topk_weights":  # in topk_ids' order: compare as (id, weight) pairs
            order_a, order_b = np.argsort(stages["topk_ids"], 1), np.argsort(mine["topk_ids"], 1)
            assert max_rel(np.take_along_axis(rows, order_a, 1), np.take_along_axis(mine[name], order_b, 1)) < RTOL
        else:
            assert max_rel(rows, mine[name]) < RTOL, (name, max_rel(rows, mine[name]))


@pytest.mark.parametrize("wrong, first", [
    ("hnorm_over_streams", "h"), ("e_first_stream_only", "x_in"), ("no_sink", "attn"),
    ("comb_not_transposed", "after_attn"), ("no_selection_bias", "topk_ids"), ("no_swiglu_clamp", "shared"),
    ("full_attention", "attn"),
])
def test_twins_a_wiring_mistake_in_the_transcription_fails_first_at_its_stage(exported, wrong, first):
    _, _, cfg, w, inputs, stages, _ = exported
    bad = transcribe(cfg, w, inputs.embed, inputs.hidden, inputs.positions, (wrong,))
    failing = [n for n in stages if n != "topk_weights" and (
        not np.array_equal(np.sort(stages[n], 1), np.sort(bad[n], 1)) if n == "topk_ids"
        else max_rel(stages[n], bad[n]) >= RTOL)]
    assert failing and failing[0] == first, (wrong, failing)


def test_the_window_only_shows_at_steps_t_ge_w(exported):
    """Full causal attention differs from the W-key window exactly at t >= W (T = 10 > W)."""
    _, _, cfg, w, inputs, stages, _ = exported
    full = transcribe(cfg, w, inputs.embed, inputs.hidden, inputs.positions, ("full_attention",))
    window = cfg["sliding_window"]
    rel = np.abs(full["attn"] - stages["attn"]).max(1) / np.abs(stages["attn"]).max(1)
    assert (rel[:window] < RTOL).all() and (rel[window:] > 1e-3).all(), rel


# ---------------------------------------------------------------------------------------------------------------
# the transcription itself against the official transformers classes


def test_the_transcription_agrees_with_the_official_v4_classes(exported):
    """Its hyper-connection, attention (sinks, window, interleaved RoPE, grouped output) and head collapse against
    DeepseekV4HyperConnection / DeepseekV4Attention / DeepseekV4HyperHead loaded with the same weights (float64)."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import (DeepseekV4Attention,
                                                                      DeepseekV4HyperConnection,
                                                                      DeepseekV4HyperHead,
                                                                      DeepseekV4RotaryEmbedding)

    from oracle.families.deepseek_v4 import head_text_config, sliding_mask
    from oracle.families.deepseek_v4_layout import head_config_from_json

    ckpt, _, cfg, w, inputs, stages, mine = exported
    text = head_text_config(head_config_from_json(json.loads((ckpt / "config.json").read_text()), "cfg"))
    text._attn_implementation = "eager"
    t, hc, d = len(TOKENS), cfg["hc_mult"], cfg["hidden_size"]
    x = torch.from_numpy(stages["x_in"]).double().view(1, t, hc, d)
    hcm = DeepseekV4HyperConnection(text).double()
    hcm.load_state_dict({"fn": w[P + "hc_attn_fn"], "base": w[P + "hc_attn_base"], "scale": w[P + "hc_attn_scale"]})
    post, comb, collapsed = hcm(x)
    p2, c2, col2 = hyper_connection(x[0], w[P + "hc_attn_fn"], w[P + "hc_attn_base"], w[P + "hc_attn_scale"], cfg)
    # the official mixes run in float32 whatever the input dtype (`.float()`): agreement to float32 rounding
    assert max_rel(post[0].detach().numpy(), p2.numpy()) < 1e-5 and max_rel(comb[0].detach().numpy().reshape(t, -1),
                                                                               c2.numpy().reshape(t, -1)) < 1e-5
    assert max_rel(collapsed[0].detach().numpy(), col2.numpy()) < 1e-5

    attn = DeepseekV4Attention(text, 0).double()
    a = P + "attn."
    attn.load_state_dict({"q_a_proj.weight": w[a + "wq_a.weight"], "q_a_norm.weight": w[a + "q_norm.weight"],
                          "q_b_proj.weight": w[a + "wq_b.weight"], "kv_proj.weight": w[a + "wkv.weight"],
                          "kv_norm.weight": w[a + "kv_norm.weight"], "o_a_proj.weight": w[a + "wo_a.weight"],
                          "o_b_proj.weight": w[a + "wo_b.weight"], "sinks": w[a + "attn_sink"]})
    ah = torch.from_numpy(stages["ah"]).double()
    pos = torch.from_numpy(inputs.positions)
    cos, sin = DeepseekV4RotaryEmbedding(text)(ah[None], pos[None], layer_type="main")
    official = attn(ah[None], position_embeddings={"main": (cos.double(), sin.double())}, position_ids=pos[None],
                    attention_mask=sliding_mask(t, cfg["sliding_window"]).double())[0][0]
    ours = attention(ah, pos, w, cfg)
    assert max_rel(official.detach().numpy(), ours.numpy()) < 1e-5
    assert max_rel(official.detach().numpy(), attention(ah, pos, w, cfg, ("no_sink",)).numpy()) > 1e-3  # twin

    head = DeepseekV4HyperHead(text).double()
    head.load_state_dict({"hc_fn": w[P + "hc_head_fn"], "hc_base": w[P + "hc_head_base"],
                          "hc_scale": w[P + "hc_head_scale"]})
    block_out = torch.from_numpy(stages["block_out"]).double().view(1, t, hc, d)
    flat = rms(block_out[0].reshape(t, -1), None, cfg["rms_norm_eps"])
    pre = torch.sigmoid(flat @ w[P + "hc_head_fn"].T * w[P + "hc_head_scale"] + w[P + "hc_head_base"]) + cfg["hc_eps"]
    assert max_rel(head(block_out)[0].detach().numpy(), (pre[..., None] * block_out[0]).sum(1).numpy()) < 1e-5


# ---------------------------------------------------------------------------------------------------------------
# inputs, config, probe


def test_release_key_names_read_as_transformers_names(tmp_path):
    a = write_deepseek_v4_checkpoint(tmp_path / "hf")
    b = write_deepseek_v4_checkpoint(tmp_path / "release", release_keys=True)
    ta = export_trace(a, tmp_path / "a.h5", TOKENS[:6], HiddenSource(seed=0))
    tb = export_trace(b, tmp_path / "b.h5", TOKENS[:6], HiddenSource(seed=0))
    with read_trace(ta) as x, read_trace(tb) as y:
        assert x.attrs["config"] == y.attrs["config"]
        assert all(np.array_equal(x.stage_rows(n), y.stage_rows(n)) for n in x.stages)


def test_hidden_is_the_streams_hc_times_d(tmp_path):
    ckpt = write_deepseek_v4_checkpoint(tmp_path / "ckpt")
    cfg, _ = load_head(ckpt)
    d, hc = cfg["hidden_size"], cfg["hc_mult"]
    np.save(tmp_path / "narrow.npy", np.zeros((4, d), np.float32))
    result = run_cli(oracle_cli, ["export", ckpt, "--out", tmp_path / "x.h5", "--tokens", "1,2,3,4",
                                  "--hidden", tmp_path / "narrow.npy"])
    assert result.exit_code == 2 and f"hc_mult={hc}" in result.output and f"[T, {hc * d}]" in result.output
    assert not (tmp_path / "x.h5").exists()
    np.save(tmp_path / "streams.npy", np.random.default_rng(0).standard_normal((4, hc * d)).astype(np.float32))
    result = run_cli(oracle_cli, ["export", ckpt, "--out", tmp_path / "x.h5", "--tokens", "1,2,3,4",
                                  "--hidden", tmp_path / "streams.npy", "-q"])
    assert result.exit_code == 0, result.output
    with read_trace(tmp_path / "x.h5") as trace:
        assert trace.hidden_size == d and trace.inputs().hidden.shape == (4, hc * d)


def test_compressed_mtp_attention_and_fp4_experts_are_refused(tmp_path):
    ckpt = write_deepseek_v4_checkpoint(tmp_path / "ckpt")
    config = json.loads((ckpt / "config.json").read_text())
    for change, words in (({"compress_ratios": [4, 128, 4]}, "compressed-attention MTP"),
                          ({"expert_dtype": "fp4"}, "FP4 experts")):
        (ckpt / "config.json").write_text(json.dumps(config | change))
        result = run_cli(oracle_cli, ["export", ckpt, "--out", tmp_path / "x.h5", "--tokens", "1,2",
                                      "--hidden-seed", "0"])
        assert result.exit_code == 2 and words in result.output, result.output


def test_probe_window_inconclusive_when_t_le_w_and_pass_when_longer(tmp_path):
    ckpt = write_deepseek_v4_checkpoint(tmp_path / "ckpt")
    short = export_trace(ckpt, tmp_path / "short.h5", TOKENS[:4], HiddenSource(seed=0))  # T = W = 4
    long = export_trace(ckpt, tmp_path / "long.h5", TOKENS, HiddenSource(seed=0))
    report = diff_traces(short, short)
    assert report.verdict.name == "inconclusive"
    # measured (/evidence/qk_window): W - 1 drops a key at t = 3, W + 1 and no window drop none before t = 4
    assert any("q/k path parts not evidenced: sliding window (one_more, none)" in r for r in report.verdict.reasons)
    assert diff_traces(long, long).verdict.name == "pass"  # twin: T > W


def test_probe_reports_per_stream_detail_for_a_stream_stage(tmp_path):
    """A candidate whose e term reaches stream 0 only: first divergence at x_in, the report names stream 0 as the
    only divergent stream (text and JSON)."""
    from oracle.trace import write_trace

    ckpt = write_deepseek_v4_checkpoint(tmp_path / "ckpt")
    ref = export_trace(ckpt, tmp_path / "ref.h5", TOKENS, HiddenSource(seed=0))
    with read_trace(ref) as trace:
        inputs, stage_list, dims = trace.inputs(), trace.stage_list, trace.dims
        stages = {n: trace.stage_rows(n) for n in trace.stages}
    d = dims.hidden_size
    cand = dict(stages)
    x_in = stages["x_in"].copy()
    x_in[:, d:] -= np.tile(stages["e_proj"], dims.hc_mult - 1)  # streams 1.. without e_proj(e)
    cand["x_in"] = x_in
    write_trace(tmp_path / "cand.h5", inputs, cand, {"producer": "test"}, stage_list=stage_list, dims=dims)
    report = diff_traces(ref, tmp_path / "cand.h5")
    assert report.first.stage == "x_in"
    per_stream = report.first.diff.per_stream
    assert len(per_stream) == dims.hc_mult and per_stream[0][0] == 0 and all(s[0] > 0 for s in per_stream[1:])
    text = render_text(report)
    assert "per stream (3 streams of 64" in text and "stream 0: max|diff| 0" in text
    rows = [r for r in report_json(report)["rows"] if r["stage"] == "x_in" and r["detailed"]]
    assert rows and rows[0]["per_stream"][1]["max_abs"] > 0


def test_softmax_scoring_is_refused_by_name_not_a_crash(tmp_path):
    """Red team: scoring_func "softmax" passed the config check and then failed inside transformers'
    DeepseekV4TopKRouter (ACT2FN has no softmax): exit 4. Refused now (exit 2). Twin: sigmoid exports."""
    from oracle.errors import CheckpointError
    from oracle.export import HiddenSource, export_trace

    softmax = write_deepseek_v4_checkpoint(tmp_path / "softmax", dims={"scoring_func": "softmax"})
    with pytest.raises(CheckpointError, match="scoring_func 'softmax' is not supported"):
        export_trace(softmax, tmp_path / "a.h5", np.array([5, 17, 3]), HiddenSource(seed=0))
    sigmoid = write_deepseek_v4_checkpoint(tmp_path / "sigmoid", dims={"scoring_func": "sigmoid"})
    export_trace(sigmoid, tmp_path / "b.h5", np.array([5, 17, 3]), HiddenSource(seed=0))
