"""Issue 30's "how it will be judged", each term computed independently of oracle/speedup.py: parameter counts from
transformers' own modules built on the meta device (held-out dense, MoE and DeepSeek-V3 configs), byte counts
written out by hand from the published shapes, and the speedup formula evaluated by hand. The code under test runs
on real-scale checkpoints whose safetensors headers are real and whose data is a sparse hole (no bytes written:
the speed model reads only the headers)."""

import json
import math
import struct

import numpy as np
import pytest
import torch

from oracle.checkpoint import Checkpoint
from oracle.cli import cli
from oracle.speedup import (Clock, head_draft_terms, main_model, quantized_worth_line, runs_by_k, speed_table,
                            verify_terms)
from tests.helpers import FIXTURES as FIXTURE_DIR
from tests.helpers import load_script, run_cli

FIXTURES = load_script("make_fixtures")
DTYPE_BYTES = {"BF16": 2, "F32": 4, "F8_E4M3": 1}
FP8 = 1 + 4 / (128 * 128)  # the model's FP8 main weight: a byte plus a float32 scale per 128x128 block


def sparse_checkpoint(out, config: dict, tensors: dict[str, tuple[str, tuple[int, ...]]]):
    """A safetensors checkpoint with these (dtype, shape) tensors whose data is never written (a sparse file)."""
    out.mkdir(parents=True, exist_ok=True)
    header, offset = {}, 0
    for name, (dtype, shape) in sorted(tensors.items()):
        size = math.prod(shape) * DTYPE_BYTES[dtype]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    with open(out / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        f.truncate(8 + len(blob) + offset)
    (out / "config.json").write_text(json.dumps(config))
    return out


# ---- held-out main models: the verify step's parameters are transformers' own --------------------------------

HELD_OUT_DENSE = {  # no fixture has these dims: 5 layers, 3 of them Gated DeltaNet
    "model_type": "qwen3_5_text", "hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 2,
    "head_dim": 24, "intermediate_size": 160, "vocab_size": 300, "num_hidden_layers": 5,
    "layer_types": ["linear_attention", "full_attention", "linear_attention", "linear_attention", "full_attention"],
    "linear_conv_kernel_dim": 3, "linear_key_head_dim": 12, "linear_value_head_dim": 20, "linear_num_key_heads": 2,
    "linear_num_value_heads": 6}
HELD_OUT_MOE = HELD_OUT_DENSE | {"model_type": "qwen3_5_moe_text", "num_experts": 6, "num_experts_per_tok": 3,
                                 "moe_intermediate_size": 40, "shared_expert_intermediate_size": 56}
DEEPSEEK_V3 = {  # deepseek-ai/DeepSeek-V3 config.json (the fields that shape the model)
    "model_type": "deepseek_v3", "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1,
    "n_routed_experts": 256, "num_experts_per_tok": 8, "first_k_dense_replace": 3, "q_lora_rank": 1536,
    "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "vocab_size": 129280,
    "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4}


def official_counts(text: dict) -> tuple[int, int]:
    """(every stored main-model value but the routed experts, the routed experts) of transformers' own text
    model for `text`, built on the meta device: parameters plus the router's correction bias (a buffer there,
    a stored tensor in the release). No lm_head (the text model has none)."""
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds
    from transformers.models.qwen3_5 import modeling_qwen3_5 as dense
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as moe

    config_cls, model_cls = {"qwen3_5_text": (dense.Qwen3_5TextConfig, dense.Qwen3_5TextModel),
                             "qwen3_5_moe_text": (moe.Qwen3_5MoeTextConfig, moe.Qwen3_5MoeTextModel),
                             "deepseek_v3": (ds.DeepseekV3Config, ds.DeepseekV3Model)}[text["model_type"]]
    with torch.device("meta"):
        model = model_cls(config_cls(**{k: v for k, v in text.items() if k != "model_type"}))
    values = {n: p.numel() for n, p in model.named_parameters()}
    values |= {n: b.numel() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")}
    experts = sum(v for n, v in values.items() if ".mlp.experts." in n)
    return sum(values.values()) - experts, experts


@pytest.mark.parametrize("text", [HELD_OUT_DENSE, HELD_OUT_MOE, DEEPSEEK_V3], ids=["dense", "moe", "deepseek_v3"])
def test_held_out_main_models_count_what_transformers_builds(text):
    non_expert, experts = official_counts(text)
    m = main_model(text)
    d, v = text["hidden_size"], text["vocab_size"]
    assert m.dense_params - d + v * d == non_expert  # the model reads one embedding row, the module holds the table
    assert m.moe_layers * m.experts * m.expert_params == experts
    assert m.lm_head_params == v * d
    if text is DEEPSEEK_V3:  # published: 671B total, 37B activated (with the 14B MTP module apart)
        assert abs((non_expert + experts + v * d) / 671e9 - 1) < 0.01
        assert m.kv_values_per_token == 512 + 64 and m.full_attention_layers == 61 and m.moe_layers == 58
    else:
        assert m.kv_values_per_token == 2 * 2 * 24 and m.full_attention_layers == 2
        assert m.state_values == 3 * 6 * 12 * 20  # per Gated DeltaNet layer: value heads x key dim x value dim


def test_held_out_moe_verify_step_bytes_by_hand():
    """A verify of 3 tokens at 100 tokens of context, bf16: each term from the official counts and the
    independent-routing formula written out here."""
    non_expert, experts = official_counts(HELD_OUT_MOE)
    d, v, e, k, inter = 96, 300, 6, 3, 40
    terms = verify_terms(main_model(HELD_OUT_MOE), 3, 100, 2, 2).bytes
    distinct = e * (1 - (1 - k / e) ** 3)  # experts 3 independent uniform top-3-of-6 tokens touch
    assert experts == 5 * e * 3 * d * inter  # 5 MoE layers of 6 experts of gate, up, down
    assert terms["main weights (dense)"] == 2 * (non_expert - v * d + d)
    assert terms[f"main routed experts ({distinct:.1f} distinct per MoE layer)"] == pytest.approx(
        2 * 5 * distinct * 3 * d * inter)
    assert terms["main lm_head"] == 2 * v * d
    assert terms["main KV cache at 100 tokens"] == 2 * 2 * (2 * 2 * 24) * 100  # 2 full layers, K and V, bf16
    assert terms["linear-attention state (read + write)"] == 2 * 4 * 3 * 6 * 12 * 20  # float32, read and written


# ---- the seed's ratio: the lm_head is 3x the MTP layer at Qwen3.5-27B scale -----------------------------------


def qwen3_5_27b_head(tmp_path) -> Checkpoint:
    script = load_script("make_realscale_checkpoint")
    tensors = {n: ("BF16", s) for n, s in script.shapes().items()}
    return Checkpoint(sparse_checkpoint(tmp_path / "qwen27b", script.config(), tensors))


def test_the_seeds_ratio_at_qwen3_5_27b_scale_by_hand(tmp_path):
    terms = head_draft_terms(qwen3_5_27b_head(tmp_path), "lm_head.weight", context=0).bytes
    d, q, kv, ff, v = 5120, 24 * 256, 4 * 256, 17408, 248320
    layer = (d * 2 * d  # fc over concat(e, h)
             + 5 * d  # pre_fc_norm_embedding, pre_fc_norm_hidden, mtp.norm, input and post-attention layernorms
             + 2 * q * d + 2 * kv * d + d * q  # q_proj (query and gate), k_proj, v_proj, o_proj
             + 2 * 256  # q_norm, k_norm
             + 3 * ff * d)  # gate, up, down
    assert layer == 424_699_392
    assert terms["head layer (dense tensors)"] == 2 * layer
    assert terms["draft lm_head (V x D)"] == 2 * v * d == 2_542_796_800
    ratio = terms["draft lm_head (V x D)"] / terms["head layer (dense tensors)"]
    assert ratio == pytest.approx(2.9937, abs=1e-4)  # the seed's "3x the whole MTP layer"
    assert sum(terms.values()) / terms["head layer (dense tensors)"] == pytest.approx(1 + ratio, abs=1e-4)  # ~4x
    assert terms["embedding row"] == 2 * d


# ---- the DeepSeek-V3 layer and DeepSeek's published sanity row -------------------------------------------------

V3_DIMS = {k: DEEPSEEK_V3[k] for k in ("hidden_size", "num_attention_heads", "q_lora_rank", "kv_lora_rank",
                                       "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_routed_experts",
                                       "num_experts_per_tok", "n_group", "topk_group", "moe_intermediate_size",
                                       "n_shared_experts", "num_hidden_layers", "vocab_size")}


@pytest.fixture(scope="module")
def deepseek_v3_head(tmp_path_factory) -> Checkpoint:
    """The DeepSeek-V3 MTP layer as released (model.layers.61.*, FP8 e4m3 with 128x128 block scales where
    README_WEIGHTS says, eh_proj/router/norms/vocabulary tables bf16, the router bias f32), 19 GB of headers."""
    config = FIXTURES.mtp_layer_release_config("deepseek_v3", V3_DIMS, [128, 128]) | {
        "intermediate_size": 18432, "first_k_dense_replace": 3}
    tensors = {}
    for name, shape in FIXTURES.mtp_layer_shapes("deepseek_v3", V3_DIMS).items():
        if name.startswith("model.layers.61.") and any(p in name for p in FIXTURES.FP8_PARTS) and len(shape) == 2:
            tensors[name] = ("F8_E4M3", shape)
            tensors[name.removesuffix("weight") + "weight_scale_inv"] = ("F32", tuple(-(-s // 128) for s in shape))
        else:
            tensors[name] = ("F32" if name.endswith("e_score_correction_bias") else "BF16", shape)
    return Checkpoint(sparse_checkpoint(tmp_path_factory.mktemp("v3") / "ckpt", config, tensors))


def fp8(rows: int, cols: int) -> int:
    """An FP8 matrix as stored: a byte per value and a float32 scale per 128x128 block."""
    return rows * cols + 4 * math.ceil(rows / 128) * math.ceil(cols / 128)


V3_LAYER_BYTES = (5 * 7168 * 2  # enorm, hnorm, input/post-attention layernorms, shared_head.norm (bf16)
                  + 7168 * 14336 * 2  # eh_proj (bf16)
                  + fp8(1536, 7168) + 1536 * 2 + fp8(128 * 192, 1536)  # q_a_proj, q_a_layernorm, q_b_proj
                  + fp8(576, 7168) + 512 * 2 + fp8(128 * 256, 512)  # kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj
                  + fp8(7168, 128 * 128)  # o_proj
                  + 256 * 7168 * 2 + 256 * 4  # router (bf16) and its correction bias (f32)
                  + 2 * fp8(2048, 7168) + fp8(7168, 2048))  # the shared expert
V3_EXPERT_BYTES = 2 * fp8(2048, 7168) + fp8(7168, 2048)  # one routed expert, its block scales with it
V3_LM_HEAD_BYTES = 129280 * 7168 * 2  # shared_head.head (bf16), read once per draft


def test_deepseek_v3_draft_step_by_hand(deepseek_v3_head):
    terms = head_draft_terms(deepseek_v3_head, "model.layers.61.shared_head.head.weight", context=4096).bytes
    assert V3_LAYER_BYTES == 440_469_728
    assert terms == {"head layer (dense tensors)": V3_LAYER_BYTES,
                     "head routed experts (top_k=8)": 8 * V3_EXPERT_BYTES,
                     "draft lm_head (V x D)": V3_LM_HEAD_BYTES,
                     "embedding row": 7168 * 2,
                     "head KV cache at 4096 tokens": (512 + 64) * 2 * 4096}  # the MLA latent and rope key, bf16


def hand_v3_speedup(alpha_1: float, context: int, shared_experts: bool) -> float:
    """k=1 by hand: E[len] = 1 + alpha_1; a round is a verify of 2 tokens and one draft; plain is a verify of 1.
    Main weights FP8 (the lm_head bf16); the bandwidth cancels."""
    non_expert = 16_190_954_496 + 58 * 256  # transformers' own parameters (checked above) + the router biases
    dense = non_expert - 129280 * 7168 + 7168  # one embedding row read, not the table
    expert = 3 * 7168 * 2048
    kv = 61 * 576 * context * 2
    lm = 129280 * 7168 * 2

    def verify(distinct: float) -> float:
        return FP8 * (dense + 58 * distinct * expert) + lm + kv

    two = 8 if shared_experts else 256 * (1 - (1 - 8 / 256) ** 2)
    draft = V3_LAYER_BYTES + 8 * V3_EXPERT_BYTES + V3_LM_HEAD_BYTES + 7168 * 2 + 576 * 2 * context
    return (1 + alpha_1) * verify(8) / (verify(two) + draft)


@pytest.mark.parametrize("alpha_1", [0.85, 0.90])
def test_deepseeks_k1_sanity_row_by_hand(deepseek_v3_head, alpha_1):
    """DeepSeek reports 85-90 % acceptance of the second token and 1.8x TPS with one draft: the model gives at
    most E[len] = 1 + alpha_1 <= 1.9, near 1.8x where the two verified tokens share their experts (a serving
    batch reads them all anyway), and much less at batch 1 with independent routing (twice the experts)."""
    context = 4096
    m = main_model(FIXTURES.mtp_layer_release_config("deepseek_v3", V3_DIMS, [128, 128])
                   | {"intermediate_size": 18432, "first_k_dense_replace": 3})
    draft = head_draft_terms(deepseek_v3_head, "model.layers.61.shared_head.head.weight", context)
    right = (np.arange(1000) < alpha_1 * 1000)[:, None]
    speeds = {}
    for shared in (True, False):
        verify = {n: verify_terms(m, n, context, FP8, 2, reuse_experts=shared) for n in (1, 2)}
        speeds[shared] = speed_table(runs_by_k(right=right), Clock(4.8e12), draft, verify).rows[0].speedup
        assert speeds[shared] == pytest.approx(hand_v3_speedup(alpha_1, context, shared), rel=1e-9)
    assert speeds[False] < speeds[True] < 1 + alpha_1 <= 1.9
    assert 1.7 < speeds[True]  # DeepSeek's 1.8x
    assert speeds[False] < 1.3  # the second token's own experts cost almost a plain step


# ---- the quantized head's worth, both ways ---------------------------------------------------------------------


def test_a_cheaper_head_that_loses_acceptance_is_worth_less_and_the_line_says_so():
    """Hand numbers: plain step 10 bytes, verify of 2 tokens 12, the unquantized draft 4, the quantized 1. With
    alpha_1 0.9 -> 0.8 the quantized head wins (1.8 x 10/13 > 1.9 x 10/16); at 0.9 -> 0.2 it loses."""
    from oracle.speedup import Terms

    verify = {1: Terms({"v": 10.0}, 0), 2: Terms({"v": 12.0}, 0)}
    base_right = (np.arange(100) < 90)[:, None]
    base = speed_table(runs_by_k(right=base_right), Clock(1.0), Terms({"d": 4.0}, 0), verify)
    assert base.rows[0].speedup == pytest.approx(1.9 * 10 / 16)
    for alpha, verdict, expected in ((0.8, "worth more", 1.8 * 10 / 13), (0.2, "worth less", 1.2 * 10 / 13)):
        right = (np.arange(100) < alpha * 100)[:, None]
        quantized = speed_table(runs_by_k(right=right), Clock(1.0), Terms({"d": 1.0}, 0), verify)
        assert quantized.rows[0].speedup == pytest.approx(expected)
        line = quantized_worth_line(quantized, base)
        assert f"the quantized head is {verdict}" in line
        assert "draft step 0.000 MB vs 0.000 MB" in line  # bytes shown both ways (MB of these toy sizes)


def trained_accept(tmp_path, *args):
    trained = FIXTURE_DIR / "qwen3_5_trained"
    out = tmp_path / "acc.json"
    r = run_cli(cli, ["accept", trained, "--tokens-file", trained / "heldout_tokens.txt", "--main-model", "-q",
                      "--bandwidth", "1TB/s", "--json", out, *args])
    assert r.exit_code == 0, r.output
    return r.stdout, json.loads(out.read_text()), trained


def hand_speedups(speed: dict, accepted: list[int]) -> list[float]:
    """speedup(k) = E[len](k) t(plain) / (t(verify k+1) + k t(draft)) from the JSON's byte totals (the bandwidth
    cancels), E[len](k) = 1 + the mean of min(accepted run, k) over chains."""
    plain = speed["verify_step"]["1"]["total_bytes"]
    draft = speed["draft_step"]["total_bytes"]
    out = []
    for k in range(1, 5):
        e_len = 1 + sum(min(a, k) for a in accepted) / len(accepted)
        out.append(e_len * plain / (speed["verify_step"][str(k + 1)]["total_bytes"] + k * draft))
    return out


def accepted_runs(drafts, targets) -> list[int]:
    runs = []
    for d, t in zip(drafts, targets):
        run = 0
        while run < len(d) and d[run] == t[run]:
            run += 1
        runs.append(run)
    return runs


@pytest.mark.parametrize("spec, context, verdict", [("*=int4", None, "worth more"), ("*=int2", "20000", "worth less")])
def test_quantize_both_ways_by_hand_and_the_report_says_which(tmp_path, spec, context, verdict):
    """The trained fixture's head: int4 keeps its acceptance and reads 4x fewer bytes (worth more); int2 loses a
    fifth of E[len], and at 20000 tokens of context, where the verify's KV cache dominates the round, the saved
    bytes no longer pay for it (worth less). Both ways by hand from the JSON's terms and per-chain drafts."""
    stdout, data, trained = trained_accept(tmp_path, "--quantize", spec, *(["--context", context] if context else []))
    targets = [c["targets"] for c in data["per_chain"]]
    quantized = hand_speedups(data["speed"], accepted_runs([c["drafts"] for c in data["per_chain"]], targets))
    base = hand_speedups(data["speed"]["unquantized"], accepted_runs(data["quantize"]["baseline"]["drafts"], targets))
    assert [r["speedup"] for r in data["speed"]["rows"]] == pytest.approx(quantized, rel=1e-9)
    assert [r["speedup"] for r in data["speed"]["unquantized"]["rows"]] == pytest.approx(base, rel=1e-9)
    assert (max(quantized) > max(base)) == (verdict == "worth more")
    assert f"the quantized head is {verdict}" in stdout
    if spec == "*=int4":  # codes of 4 bits and a 16-bit scale per 32 inputs, the rest as stored
        stored = {n: e.nbytes for n, e in ((n, Checkpoint(trained).entry(n)) for n in Checkpoint(trained).names())}
        codes = sum(math.prod(t["shape"]) * (4 + 16 / 32) / 8 for t in data["quantize"]["tensors"])
        kept = sum(stored[n] for n in data["quantize"]["kept"])
        assert data["speed"]["draft_step"]["bytes"]["head layer (dense tensors)"] == pytest.approx(codes + kept)
        assert data["speed"]["unquantized"]["draft_step"]["bytes"]["head layer (dense tensors)"] == sum(
            b for n, b in stored.items() if n.startswith("mtp."))


def test_the_printed_line_names_what_the_model_ignores(tmp_path):
    stdout, data, _ = trained_accept(tmp_path)
    line = next(s for s in stdout.splitlines() if s.strip().startswith("left out:"))
    for ignored in ("kernel launch overhead", "tensor parallelism", "batching above 1"):
        assert ignored in line and ignored in data["speed"]["left_out"]
