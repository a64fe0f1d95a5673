"""Deterministic tiny Qwen3.5 checkpoints in the real release layout, and the stored reference trace.

    python scripts/make_fixtures.py

writes fixtures/qwen3_5_tiny/ (one model.safetensors), fixtures/qwen3_5_tiny_sharded/ (3 shards + index, the
head split across two of them) and fixtures/qwen3_5_tiny_ref.h5 (a trace exported from the first). Tests import
`write_checkpoint` to make variants with other dims.

The layout is the release's: config.json as Qwen3_5ForConditionalGeneration with a nested text_config, bf16
safetensors holding a complete tiny main model (3 linear-attention + 1 full-attention layers, and a 1-block vision
tower) under the names transformers uses, `lm_head.weight`, and the 15 `mtp.*` head tensors, whose names are
transcribed below from the release (not taken from the oracle, so a wrong name in the oracle cannot agree with
itself). Dims are small but not degenerate: GQA (4 heads, 2 KV heads), head_dim 32 != hidden/heads = 16,
partial rotary (8 of 32 dims).
"""

import copy
import json
import os
import sys
import zlib
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parent.parent
GENERATED_BY = "python scripts/make_fixtures.py"
TINY = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "intermediate_size": 96, "vocab_size": 512, "num_hidden_layers": 4, "rope_theta": 1e7,
        "partial_rotary_factor": 0.25, "mrope_section": [2, 1, 1], "rms_norm_eps": 1e-6}
REF_TOKENS = [17, 42, 3, 255, 100, 7, 511, 64]  # step tokens t_1..t_8 of the stored trace
REF_HIDDEN_SEED = 0


def release_config(dims: dict) -> dict:
    """config.json of a Qwen3_5ForConditionalGeneration release, shrunk to `dims`."""
    text = {
        "model_type": "qwen3_5_text", "hidden_size": dims["hidden_size"],
        "num_attention_heads": dims["num_attention_heads"], "num_key_value_heads": dims["num_key_value_heads"],
        "head_dim": dims["head_dim"], "intermediate_size": dims["intermediate_size"],
        "vocab_size": dims["vocab_size"], "num_hidden_layers": dims["num_hidden_layers"],
        "layer_types": ["linear_attention" if (i + 1) % 4 else "full_attention"
                        for i in range(dims["num_hidden_layers"])],
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "hidden_act": "silu",
        "rms_norm_eps": dims["rms_norm_eps"], "max_position_embeddings": 4096, "attention_bias": False,
        "tie_word_embeddings": False, "mtp_num_hidden_layers": dims.get("mtp_num_hidden_layers", 1),
        "mtp_use_dedicated_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": dims["rope_theta"],
                            "partial_rotary_factor": dims["partial_rotary_factor"],
                            "mrope_section": dims["mrope_section"], "mrope_interleaved": True},
    }
    vision = {"model_type": "qwen3_5_vision", "depth": 1, "hidden_size": 32, "num_heads": 2,
              "intermediate_size": 64, "out_hidden_size": dims["hidden_size"], "patch_size": 4,
              "spatial_merge_size": 2, "temporal_patch_size": 2, "num_position_embeddings": 16}
    return {"_generated_by": GENERATED_BY, "architectures": ["Qwen3_5ForConditionalGeneration"],
            "model_type": "qwen3_5",
            "text_config": text, "vision_config": vision, "tie_word_embeddings": False}


def mtp_shapes(dims: dict) -> dict[str, tuple[int, ...]]:
    """The release's 15 head tensors ([out, in] for linears; q_proj holds query and gate per head). With
    `mtp_num_hidden_layers` N > 1 (vLLM's Qwen3_5MultiTokenPredictor: `mtp.layers.{i}` for i < N over one fc, one
    pair of pre-fc norms and one final norm), 11 more per layer."""
    d, hd, ff = dims["hidden_size"], dims["head_dim"], dims["intermediate_size"]
    q, kv = dims["num_attention_heads"] * hd, dims["num_key_value_heads"] * hd
    shapes = {"mtp.fc.weight": (d, 2 * d), "mtp.pre_fc_norm_embedding.weight": (d,),
              "mtp.pre_fc_norm_hidden.weight": (d,), "mtp.norm.weight": (d,)}
    for i in range(dims.get("mtp_num_hidden_layers", 1)):
        layer = f"mtp.layers.{i}."
        attn = layer + "self_attn."
        shapes |= {layer + "input_layernorm.weight": (d,), layer + "post_attention_layernorm.weight": (d,),
                   attn + "q_proj.weight": (2 * q, d), attn + "k_proj.weight": (kv, d), attn + "v_proj.weight": (kv, d),
                   attn + "o_proj.weight": (d, q), attn + "q_norm.weight": (hd,), attn + "k_norm.weight": (hd,),
                   layer + "mlp.gate_proj.weight": (ff, d), layer + "mlp.up_proj.weight": (ff, d),
                   layer + "mlp.down_proj.weight": (d, ff)}
    return shapes


def main_model_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the main model, exactly as transformers' Qwen3_5ForConditionalGeneration has them."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    cfg = Qwen3_5Config(text_config=config["text_config"], vision_config=config["vision_config"])
    with torch.device("meta"):
        model = Qwen3_5ForConditionalGeneration(cfg)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def tensor_values(name: str, shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Deterministic values per name; (1+w) norm weights are far from 0 so a missed or `w`-flavoured norm shows."""
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    if name.endswith("A_log"):
        return np.log(rng.uniform(1.0, 16.0, shape)).astype(np.float32)
    if name.endswith("dt_bias"):
        return rng.uniform(0.5, 1.5, shape).astype(np.float32)
    if "visual" in name or name.endswith(".bias"):
        return (0.02 * rng.standard_normal(shape)).astype(np.float32)
    if name.endswith("linear_attn.norm.weight"):  # Qwen3_5RMSNormGated: plain w, initialised to ones
        return (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
    if len(shape) == 1:  # every other 1-D weight here is a zero-centred (1+w) RMSNorm
        return (0.3 * rng.standard_normal(shape)).astype(np.float32)
    if name.endswith("embed_tokens.weight"):
        return rng.standard_normal(shape).astype(np.float32)
    fan_in = int(np.prod(shape[1:]))
    return (rng.standard_normal(shape) / np.sqrt(fan_in)).astype(np.float32)


def _shard_of(name: str) -> int:
    """Three shards like a release; the head is split across shards 2 and 3 so the index is really used."""
    if name.startswith("mtp.layers."):
        return 3
    if name.startswith("mtp.") or name.startswith("model.language_model.layers."):
        return 2
    return 1


def write_checkpoint(out_dir: Path, dims: dict | None = None, seed: int = 0, sharded: bool = False) -> Path:
    """A complete tiny checkpoint (config.json + bf16 safetensors) in the release layout."""
    dims = {**TINY, **(dims or {})}
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = release_config(dims)
    shapes = main_model_shapes(config) | mtp_shapes(dims)
    tensors = {n: torch.from_numpy(tensor_values(n, s, seed)).to(torch.bfloat16) for n, s in sorted(shapes.items())}
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    metadata = {"format": "pt"}  # one key: safetensors orders metadata keys at random, breaking byte-determinism
    if not sharded:
        save_file(tensors, out_dir / "model.safetensors", metadata=metadata)
        return out_dir
    files = {k: f"model-{k:05d}-of-00003.safetensors" for k in (1, 2, 3)}
    weight_map = {n: files[_shard_of(n)] for n in tensors}
    for k, file in files.items():
        save_file({n: t for n, t in tensors.items() if _shard_of(n) == k}, out_dir / file, metadata=metadata)
    index = {"metadata": {"total_size": sum(t.numel() * 2 for t in tensors.values())}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return out_dir


def reference_export_args(checkpoint: Path, out: Path) -> list[str]:
    return ["export", str(checkpoint), "--out", str(out), "--tokens", ",".join(map(str, REF_TOKENS)),
            "--hidden-seed", str(REF_HIDDEN_SEED)]


def main() -> None:
    from oracle.cli import main as oracle_main

    os.chdir(ROOT)  # the trace's provenance records these paths relative to the repository
    fixtures = ROOT / "fixtures"
    write_checkpoint(fixtures / "qwen3_5_tiny")
    write_checkpoint(fixtures / "qwen3_5_tiny_sharded", sharded=True)
    args = reference_export_args(Path("fixtures/qwen3_5_tiny"), Path("fixtures/qwen3_5_tiny_ref.h5"))
    oracle_main(args, standalone_mode=False)
    write_moe_checkpoint(fixtures / "qwen3_5_moe_tiny", "qwen3_5_moe", "per_expert")  # with its main model
    write_moe_checkpoint(fixtures / "qwen3_next_tiny_fused", "qwen3_next", "fused", main_model=False)
    write_family_fixtures(fixtures)
    print(f"wrote {fixtures}", file=sys.stderr)


# The MTP-layer families as released (head-only: the MTP layer and the main tensors it shares), one tiny folder
# each, so that every family runs from the README (export with --hidden-seed or --hidden). DeepSeek-V3 and V4 ship
# FP8 like their releases (32x32 blocks at this size); GLM-4.5 and the N-layer MtpModel heads bf16.
STEP3P7_FIXTURE = {"vocab_size": 512, "hidden_size": 32, "head_dim": 8, "intermediate_size": 48, "n_routed_experts": 4,
                   "moe_intermediate_size": 16, "share_expert_dim": 16}  # the README's token ids, a few hundred KB
FAMILY_FIXTURES = {
    "deepseek_v3_tiny": lambda out: write_mtp_layer_checkpoint(out, "deepseek_v3", fp8_block=[32, 32]),
    "glm4_moe_tiny": lambda out: write_mtp_layer_checkpoint(out, "glm4_moe"),
    "deepseek_v4_tiny": lambda out: write_deepseek_v4_checkpoint(out, fp8_block=[32, 32]),
    "step3p7_tiny": lambda out: write_mtp_model_checkpoint(out, "step3p7", STEP3P7_FIXTURE),  # 3 MTP layers
    "inkling_tiny": lambda out: write_mtp_model_checkpoint(out, "inkling"),
    "mimo_v2_flash_tiny": lambda out: write_mimo_v2_flash_checkpoint(out),
    # Qwen3.5 with 3 MTP layers (mtp_num_hidden_layers), the bundled head's D = 64: `mtp-probe selftest`'s N-layer
    # loop cases (layer0_reused); a one-layer main model (its MTP head never reads the main layers)
    "qwen3_5_tiny_3layer": lambda out: write_checkpoint(out, {"mtp_num_hidden_layers": 3, "num_hidden_layers": 1,
                                                             "intermediate_size": 64}),
}


def write_family_fixtures(fixtures: Path) -> None:
    for name, write in FAMILY_FIXTURES.items():
        write(fixtures / name)



# --- MoE families (Qwen3.5-MoE, Qwen3-Next): the head's MoE names transcribed from the release layouts in
# shared/reference/mtp_wiring.md §3.1-3.2 (not from the oracle), the main model from the official classes. ---
MOE_TINY = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 512,
            "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 48,
            "shared_expert_intermediate_size": 40, "num_hidden_layers": 4, "rms_norm_eps": 1e-6,
            "partial_rotary_factor": 0.25}


def moe_release_config(family: str, dims: dict) -> dict:
    """config.json as released: Qwen3.5-MoE nested under text_config with no norm_topk_prob key (transformers
    always renormalises), Qwen3-Next flat with norm_topk_prob true."""
    text = {"hidden_size": dims["hidden_size"], "num_attention_heads": dims["num_attention_heads"],
            "num_key_value_heads": dims["num_key_value_heads"], "head_dim": dims["head_dim"],
            "vocab_size": dims["vocab_size"], "num_hidden_layers": dims["num_hidden_layers"],
            "layer_types": ["linear_attention" if (i + 1) % 4 else "full_attention"
                            for i in range(dims["num_hidden_layers"])],
            "linear_conv_kernel_dim": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
            "linear_num_key_heads": 2, "linear_num_value_heads": 4, "hidden_act": "silu",
            "rms_norm_eps": dims["rms_norm_eps"], "max_position_embeddings": 4096, "attention_bias": False,
            "tie_word_embeddings": False, "num_experts": dims["num_experts"],
            "num_experts_per_tok": dims["num_experts_per_tok"], "moe_intermediate_size": dims["moe_intermediate_size"],
            "shared_expert_intermediate_size": dims["shared_expert_intermediate_size"]}
    if family == "qwen3_5_moe":
        text |= {"model_type": "qwen3_5_moe_text", "mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False,
                 "rope_parameters": {"rope_type": "default", "rope_theta": 1e7,
                                     "partial_rotary_factor": dims["partial_rotary_factor"],
                                     "mrope_section": [2, 1, 1], "mrope_interleaved": True}}
        vision = {"model_type": "qwen3_5_moe_vision", "depth": 1, "hidden_size": 32, "num_heads": 2,
                  "intermediate_size": 64, "out_hidden_size": dims["hidden_size"], "patch_size": 4,
                  "spatial_merge_size": 2, "temporal_patch_size": 2, "num_position_embeddings": 16}
        return {"_generated_by": GENERATED_BY, "architectures": ["Qwen3_5MoeForConditionalGeneration"],
                "model_type": "qwen3_5_moe", "text_config": text, "vision_config": vision,
                "tie_word_embeddings": False}
    return {"_generated_by": GENERATED_BY, "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
            **text, "intermediate_size": 96, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
            "rope_parameters": {"rope_type": "default", "rope_theta": 5e6,
                                "partial_rotary_factor": dims["partial_rotary_factor"]}}


def moe_main_model_shapes(family: str, config: dict) -> dict[str, tuple[int, ...]]:
    if family == "qwen3_5_moe":
        from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration as Model

        cfg = Qwen3_5MoeConfig(text_config=config["text_config"], vision_config=config["vision_config"])
    else:
        from transformers import Qwen3NextConfig, Qwen3NextForCausalLM as Model

        cfg = Qwen3NextConfig(**{k: v for k, v in config.items() if not k.startswith("_")})
    with torch.device("meta"):
        model = Model(cfg)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def moe_mtp_shapes(dims: dict, layout: str) -> dict[str, tuple[int, ...]]:
    """The MoE head: the dense head's stem and attention, the router, the shared expert and its gate, and the routed
    experts per expert (`experts.{e}.{gate,up,down}_proj.weight`) or fused (`experts.gate_up_proj`, gate rows first,
    and `experts.down_proj`)."""
    d, e, i, s = dims["hidden_size"], dims["num_experts"], dims["moe_intermediate_size"], \
        dims["shared_expert_intermediate_size"]
    shapes = {n: v for n, v in mtp_shapes({**TINY, **dims, "intermediate_size": 1}).items() if ".mlp." not in n}
    mlp = "mtp.layers.0.mlp."
    shapes |= {mlp + "gate.weight": (e, d), mlp + "shared_expert.gate_proj.weight": (s, d),
               mlp + "shared_expert.up_proj.weight": (s, d), mlp + "shared_expert.down_proj.weight": (d, s),
               mlp + "shared_expert_gate.weight": (1, d)}
    for x in range(e):
        shapes |= {f"{mlp}experts.{x}.gate_proj.weight": (i, d), f"{mlp}experts.{x}.up_proj.weight": (i, d),
                   f"{mlp}experts.{x}.down_proj.weight": (d, i)}
    return shapes


def write_moe_checkpoint(out_dir: Path, family: str, layout: str = "per_expert", dims: dict | None = None,
                         seed: int = 0, sharded: bool = False, main_model: bool = True) -> Path:
    """A tiny Qwen3.5-MoE or Qwen3-Next checkpoint (config.json + bf16 safetensors): the MTP head with its experts
    in `layout`, the shared embedding and lm_head, and (with `main_model`) the whole main model."""
    dims = {**MOE_TINY, **(dims or {})}
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = moe_release_config(family, dims)
    prefix = "model.language_model." if family == "qwen3_5_moe" else "model."
    shapes = moe_mtp_shapes(dims, layout)
    if main_model:
        shapes |= moe_main_model_shapes(family, config)
    else:
        shapes |= {prefix + "embed_tokens.weight": (dims["vocab_size"], dims["hidden_size"]),
                   "lm_head.weight": (dims["vocab_size"], dims["hidden_size"])}
    tensors = {n: torch.from_numpy(tensor_values(n, s, seed)).to(torch.bfloat16) for n, s in sorted(shapes.items())}
    if layout == "fused":  # the same expert values, stacked: both layouts hold identical weights
        tensors = _fused_experts(tensors, dims["num_experts"])
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    metadata = {"format": "pt"}
    if not sharded:
        save_file(tensors, out_dir / "model.safetensors", metadata=metadata)
        return out_dir
    names = sorted(tensors)
    files = {k: f"model-{k:05d}-of-00003.safetensors" for k in (1, 2, 3)}
    part = {n: 1 + (j * 3) // len(names) for j, n in enumerate(names)}  # experts spread over shards
    for k, file in files.items():
        save_file({n: t for n, t in tensors.items() if part[n] == k}, out_dir / file, metadata=metadata)
    index = {"metadata": {"total_size": sum(t.numel() * 2 for t in tensors.values())},
             "weight_map": {n: files[part[n]] for n in names}}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return out_dir


def _fused_experts(tensors: dict, num_experts: int) -> dict:
    """Per-expert head tensors -> `experts.gate_up_proj` [E, 2I, D] (gate rows first) and `experts.down_proj`."""
    mlp = "mtp.layers.0.mlp.experts."
    part = lambda e, p: tensors.pop(f"{mlp}{e}.{p}_proj.weight")  # noqa: E731
    gate_up, down = [], []
    for e in range(num_experts):
        gate_up.append(torch.cat([part(e, "gate"), part(e, "up")]))
        down.append(part(e, "down"))
    return tensors | {mlp + "gate_up_proj": torch.stack(gate_up), mlp + "down_proj": torch.stack(down)}


# --- DeepSeek-V3 and GLM-4.5 (transformers' MtpLayer families): the MTP layer `model.layers.{num_hidden_layers}.*`
# with names transcribed from the release layouts in shared/reference/mtp_wiring.md §3.3-3.4 (DeepSeek-R1 tensor
# dump, GLM-4.5 public tensor lists), not from the oracle. ---
DEEPSEEK_TINY = {"hidden_size": 64, "num_attention_heads": 4, "q_lora_rank": 48, "kv_lora_rank": 32,
                 "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": 16,
                 "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2, "moe_intermediate_size": 32,
                 "n_shared_experts": 1, "num_hidden_layers": 2, "vocab_size": 512}
GLM_TINY = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 24,
            "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1,
            "moe_intermediate_size": 32, "n_shared_experts": 1, "num_hidden_layers": 2, "vocab_size": 512,
            "use_qk_norm": True, "attention_bias": True, "partial_rotary_factor": 0.5}
# DeepSeek-V3 README_WEIGHTS: these are float8_e4m3fn with weight_scale_inv; eh_proj, the router, norms, embedding
# and heads stay bf16 (the router bias f32)
FP8_PARTS = ("self_attn.q_a_proj.", "self_attn.q_b_proj.", "self_attn.q_proj.", "self_attn.kv_a_proj_with_mqa.",
             "self_attn.kv_b_proj.", "self_attn.o_proj.", "mlp.experts.", "mlp.shared_experts.")


def mtp_layer_release_config(family: str, dims: dict, block: list[int] | None) -> dict:
    """config.json as released (flat), shrunk to `dims`; quantization_config when `block` (FP8)."""
    if family == "deepseek_v3":
        config = {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"],
                  "num_key_value_heads": dims["num_attention_heads"], "first_k_dense_replace": 1,
                  "moe_layer_freq": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True,
                  "routed_scaling_factor": 2.5, "rms_norm_eps": 1e-6, "max_position_embeddings": 16384,
                  "rope_theta": 10000, "attention_bias": False,
                  "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096,
                                   "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}}
    else:
        config = {"model_type": "glm4_moe", "architectures": ["Glm4MoeForCausalLM"], "first_k_dense_replace": 1,
                  "norm_topk_prob": True, "routed_scaling_factor": 2.5, "rms_norm_eps": 1e-5,
                  "max_position_embeddings": 8192, "rope_theta": 1000000.0}
    config |= {k: v for k, v in dims.items()} | {
        "_generated_by": GENERATED_BY, "intermediate_size": 96, "num_nextn_predict_layers": 1, "hidden_act": "silu",
        "tie_word_embeddings": False}
    if block:
        config["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                         "weight_block_size": block}
    return config


def mtp_layer_shapes(family: str, dims: dict) -> dict[str, tuple[int, ...]]:
    """The release's MTP layer tensors (model.layers.{N}.*), and the few main-model tensors the head shares."""
    d, v, n = dims["hidden_size"], dims["vocab_size"], dims["num_hidden_layers"]
    e, i = dims["n_routed_experts"], dims["moe_intermediate_size"]
    s = i * dims["n_shared_experts"]
    p = f"model.layers.{n}."
    shapes = {p + "embed_tokens.weight": (v, d), p + "enorm.weight": (d,), p + "hnorm.weight": (d,),
              p + "eh_proj.weight": (d, 2 * d), p + "shared_head.norm.weight": (d,),
              p + "shared_head.head.weight": (v, d), p + "input_layernorm.weight": (d,),
              p + "post_attention_layernorm.weight": (d,), p + "mlp.gate.weight": (e, d),
              p + "mlp.gate.e_score_correction_bias": (e,), p + "mlp.shared_experts.gate_proj.weight": (s, d),
              p + "mlp.shared_experts.up_proj.weight": (s, d), p + "mlp.shared_experts.down_proj.weight": (d, s)}
    for x in range(e):
        shapes |= {f"{p}mlp.experts.{x}.gate_proj.weight": (i, d), f"{p}mlp.experts.{x}.up_proj.weight": (i, d),
                   f"{p}mlp.experts.{x}.down_proj.weight": (d, i)}
    a = p + "self_attn."
    h = dims["num_attention_heads"]
    if family == "deepseek_v3":
        nope, rope, vd = dims["qk_nope_head_dim"], dims["qk_rope_head_dim"], dims["v_head_dim"]
        kvl = dims["kv_lora_rank"]
        shapes |= {a + "kv_a_proj_with_mqa.weight": (kvl + rope, d), a + "kv_a_layernorm.weight": (kvl,),
                   a + "kv_b_proj.weight": (h * (nope + vd), kvl), a + "o_proj.weight": (d, h * vd)}
        if dims.get("q_lora_rank"):
            q = dims["q_lora_rank"]
            shapes |= {a + "q_a_proj.weight": (q, d), a + "q_a_layernorm.weight": (q,),
                       a + "q_b_proj.weight": (h * (nope + rope), q)}
        else:
            shapes |= {a + "q_proj.weight": (h * (nope + rope), d)}
    else:
        hd, kv = dims["head_dim"], dims["num_key_value_heads"]
        shapes |= {a + "q_proj.weight": (h * hd, d), a + "k_proj.weight": (kv * hd, d),
                   a + "v_proj.weight": (kv * hd, d), a + "o_proj.weight": (d, h * hd)}
        if dims.get("attention_bias"):
            shapes |= {a + "q_proj.bias": (h * hd,), a + "k_proj.bias": (kv * hd,), a + "v_proj.bias": (kv * hd,)}
        if dims.get("use_qk_norm"):
            shapes |= {a + "q_norm.weight": (hd,), a + "k_norm.weight": (hd,)}
    # the main model's shared tensors, and one main layer (its names must not be mistaken for the head's)
    shapes |= {"model.embed_tokens.weight": (v, d), "lm_head.weight": (v, d), "model.norm.weight": (d,),
               "model.layers.0.input_layernorm.weight": (d,), "model.layers.0.mlp.gate_proj.weight": (96, d)}
    return shapes


def mtp_layer_values(name: str, shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Plain (w * x̂) norms around 1, biases and the router's correction bias small but not negligible, a router
    scaled so that its choice depends on the logits; embedding copies equal to the main ones."""
    key = name.replace("model.layers.", "L.") if not name.endswith("embed_tokens.weight") else "embed"
    key = "lm_head" if name.endswith(("shared_head.head.weight", "lm_head.weight")) else key
    rng = np.random.default_rng([seed, zlib.crc32(key.encode())])
    if name.endswith("e_score_correction_bias"):
        return (0.05 * rng.standard_normal(shape)).astype(np.float32)
    if name.endswith(".bias"):
        return (0.1 * rng.standard_normal(shape)).astype(np.float32)
    if len(shape) == 1:
        return (1.0 + 0.3 * rng.standard_normal(shape)).astype(np.float32)
    if key == "embed":
        return rng.standard_normal(shape).astype(np.float32)
    scale = 3.0 if name.endswith("mlp.gate.weight") else 1.0
    return (scale * rng.standard_normal(shape) / np.sqrt(shape[1])).astype(np.float32)


def fp8_quantize(w: torch.Tensor, block: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Block FP8 as DeepSeek releases it: q = e4m3(w / s) and weight_scale_inv = s, s = amax(block) / 448."""
    rows, cols = -(-w.shape[0] // block[0]), -(-w.shape[1] // block[1])
    scale = torch.empty(rows, cols)
    for r in range(rows):
        for c in range(cols):
            tile = w[r * block[0]:(r + 1) * block[0], c * block[1]:(c + 1) * block[1]]
            scale[r, c] = max(float(tile.abs().max()), 1e-12) / 448.0
    full = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[: w.shape[0], : w.shape[1]]
    return (w / full).to(torch.float8_e4m3fn), scale


# Step-3.5/3.7-Flash release names of an MtpModel layer's parameters (the inverse of transformers' step3p7
# conversion mapping; the oracle loads them through the official conversions, never through this table)
STEP3P7_RELEASE = (("mtp_block.", ""), ("post_norm.", "shared_head.norm."), ("mlp.gate.e_score_correction_bias",
                   "moe.router_bias"), ("mlp.gate.weight", "moe.gate.weight"), ("mlp.shared_experts.", "share_expert."),
                   ("mlp.experts.down_proj", "moe.down_proj.weight"))


# Inkling's release names of an MtpModel's parameters (the inverse of transformers' MtpModel and inkling_mm_model
# conversion mappings; the oracle loads them through the official conversions, never through this table)
INKLING_RELEASE = (("enorm.", "embed_norm."), ("hnorm.", "hidden_norm."), ("eh_proj.", "input_proj."),
                   ("mtp_block.", "transformer_block."), ("self_attn.q_proj.", "attn.wq_du."),
                   ("self_attn.k_proj.", "attn.wk_dv."), ("self_attn.v_proj.", "attn.wv_dv."),
                   ("self_attn.r_proj.", "attn.wr_du."), ("self_attn.o_proj.", "attn.wo_ud."),
                   ("sconv.conv1d.", "sconv."), ("self_attn.", "attn."), ("input_layernorm.", "attn_norm."),
                   ("post_attention_layernorm.", "mlp_norm."), ("mlp.down_proj.", "mlp.w2_md."))


def _release_names(family: str, cfg, index: int, rest: str, shape: tuple[int, ...]) -> dict:
    """{released name: shape} of MtpModel parameter `layers.{index}.{rest}`."""
    if family == "inkling":
        for a, b in INKLING_RELEASE:
            rest = rest.replace(a, b)
        prefix = cfg.layer_prefix(index)
        if rest.endswith(("mlp.gate_proj.weight", "mlp.up_proj.weight")):  # stored as one w13 [2I, D]
            return {prefix + rest.rsplit("mlp.", 1)[0] + "mlp.w13_dn.weight": (2 * shape[0], shape[1])}
        return {prefix + rest: shape}
    for a, b in STEP3P7_RELEASE:
        rest = rest.replace(a, b)
    prefix = f"model.layers.{cfg.num_hidden_layers + index}."
    if rest.endswith("mlp.experts.gate_up_proj"):  # stored as two stacks, gate then up
        e, i2, d = shape
        return {prefix + rest.replace("mlp.experts.gate_up_proj", f"moe.{part}_proj.weight"): (e, i2 // 2, d)
                for part in ("gate", "up")}
    return {prefix + rest: shape}


def mtp_model_release_shapes(family: str, config: dict, copies: bool = True) -> dict[str, tuple[int, ...]]:
    """Released tensor names and shapes of a tiny MtpModel head (every MTP layer, their shared_head.head copies
    when `copies` and the family releases them; Inkling's shared chain_norm) plus the main embedding and lm_head,
    from the official MtpModel built on the meta device."""
    from oracle.families.mtp_model import MtpModelHead
    from oracle.families.registry import family as family_spec

    spec = family_spec(family)
    cfg = spec.parse_config(config, "tiny config")
    head = MtpModelHead(cfg)
    shapes = {}
    for name, t in head.mtp.state_dict().items():
        if name == "shared_post_norm.weight":
            shapes[cfg.mtp_prefix + "chain_norm.weight"] = tuple(t.shape)
        elif name.startswith("layers."):
            _, index, rest = name.split(".", 2)
            shapes |= _release_names(family, cfg, int(index), rest, tuple(t.shape))
    v, d = cfg.vocab_size, cfg.hidden_size
    if copies and family != "inkling":
        shapes |= {cfg.layer_prefix(layer) + "shared_head.head.weight": (v, d) for layer in range(cfg.num_mtp_layers)}
    return shapes | {spec.main_model_prefixes[0] + spec.embedding: (v, d), spec.lm_head: (v, d)}


def write_mtp_model_checkpoint(out_dir: Path, family: str = "step3p7", overrides: dict | None = None,
                               seed: int = 0, shape_overrides: dict | None = None) -> Path:
    """A tiny multi-layer MtpModel head (issue 25) as released, bf16 (router bias, Inkling's MLP global_scale
    f32): every MTP layer, their shared_head.head copies (Step), the main embedding and lm_head. `shape_overrides`
    go into the text config the tensor shapes are built from, not into config.json (a release whose shapes the
    official class does not build from its config: Step-3.7's sliding MTP layers with their own head count)."""
    from oracle.families.registry import family as family_spec

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = family_spec(family).tiny_config(**(overrides or {}))
    shaped = copy.deepcopy(config)
    (shaped["text_config"] if "text_config" in shaped else shaped).update(shape_overrides or {})
    tensors = {}
    for name, shape in sorted(mtp_model_release_shapes(family, shaped).items()):
        flat = shape if len(shape) < 3 else (shape[0] * shape[1], shape[2])  # stacked experts: rows of [out, in]
        value = torch.from_numpy(mtp_layer_values(name, flat, seed)).reshape(shape)
        keep_f32 = name.endswith(("router_bias", "mlp.global_scale"))  # Inkling's global_scale: a scalar near 1
        tensors[name] = value if keep_f32 else value.to(torch.bfloat16)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
    return out_dir


def write_mtp_layer_checkpoint(out_dir: Path, family: str = "deepseek_v3", dims: dict | None = None, seed: int = 0,
                               fp8_block: list[int] | None = None, sharded: bool = False, copies: bool = True,
                               copies_differ: bool = False) -> Path:
    """A tiny DeepSeek-V3 (`family` "deepseek_v3"; q_lora_rank None for the q_proj form) or GLM-4.5 ("glm4_moe")
    checkpoint: the MTP layer as released, bf16 (router bias f32), or FP8 with `fp8_block` scales. `copies`: the
    layer's own embed_tokens and shared_head.head (equal to the main ones unless `copies_differ`)."""
    dims = {**(DEEPSEEK_TINY if family == "deepseek_v3" else GLM_TINY), **(dims or {})}
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = mtp_layer_release_config(family, dims, fp8_block)
    shapes = mtp_layer_shapes(family, dims)
    p = f"model.layers.{dims['num_hidden_layers']}."
    if not copies:
        dropped = (p + "embed_tokens.weight", p + "shared_head.head.weight")
        shapes = {n: s for n, s in shapes.items() if n not in dropped}
    tensors = {}
    for name, shape in sorted(shapes.items()):
        value = torch.from_numpy(mtp_layer_values(name, shape, seed))
        if copies_differ and name == p + "embed_tokens.weight":
            value = value + 0.25
        if name.endswith("e_score_correction_bias"):
            tensors[name] = value  # f32 as released
        elif fp8_block and name.startswith(p) and any(part in name for part in FP8_PARTS) and value.dim() == 2:
            tensors[name], tensors[name.removesuffix("weight") + "weight_scale_inv"] = fp8_quantize(value, fp8_block)
        else:
            tensors[name] = value.to(torch.bfloat16)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    metadata = {"format": "pt"}
    if not sharded:
        save_file(tensors, out_dir / "model.safetensors", metadata=metadata)
        return out_dir
    names = sorted(tensors)
    files = {k: f"model-{k:05d}-of-00003.safetensors" for k in (1, 2, 3)}
    part = {n: 1 + (j * 3) // len(names) for j, n in enumerate(names)}  # the MTP layer spread over shards
    for k, file in files.items():
        save_file({n: t for n, t in tensors.items() if part[n] == k}, out_dir / file, metadata=metadata)
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
             "weight_map": {n: files[part[n]] for n in names}}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return out_dir


# ---------------------------------------------------------------------------------------------------------------
# DeepSeek-V4: the MTP layer as released, `mtp.0.*` (names transcribed from shared/reference/mtp_wiring.md §3.7 and
# seed 002's MTPBlock, not from the oracle), beside the shared `embed.weight` / `head.weight` and a few main-model
# tensors under the release's native names (layers.N.*, the main hc_head_*, norm).

DEEPSEEK_V4_TINY = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "head_dim": 32,
                    "q_lora_rank": 48, "qk_rope_head_dim": 8, "o_groups": 2, "o_lora_rank": 24, "vocab_size": 512,
                    "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "hc_mult": 3,
                    "sliding_window": 4}
# the release's inference/config.json key for each transformers DeepseekV4Config key (release_keys=True)
V4_RELEASE_KEYS = {"hidden_size": "dim", "num_attention_heads": "n_heads", "num_hidden_layers": "n_layers",
                   "sliding_window": "window_size", "num_experts_per_tok": "n_activated_experts",
                   "moe_intermediate_size": "moe_inter_dim", "scoring_func": "score_func",
                   "routed_scaling_factor": "route_scale", "rms_norm_eps": "norm_eps",
                   "qk_rope_head_dim": "rope_head_dim"}
# FP8 e4m3 + block scale in the release: e_proj/h_proj (atlas §3.7), the attention projections and the experts;
# norms, hyper-connection mixes, sinks, router and embedding/head stay bf16/f32.
V4_FP8_PARTS = ("e_proj.", "h_proj.", "attn.wq_a.", "attn.wq_b.", "attn.wkv.", "attn.wo_a.", "attn.wo_b.",
                "ffn.experts.", "ffn.shared_experts.")


def deepseek_v4_config(dims: dict, release_keys: bool = False, fp8_block: list[int] | None = None,
                       scale_fmt: str = "ue8m0") -> dict:
    n = dims["num_hidden_layers"]
    config = {"model_type": "deepseek_v4", "architectures": ["DeepseekV4ForCausalLM"], "_generated_by": GENERATED_BY,
              "num_key_value_heads": 1, "n_shared_experts": 1, "scoring_func": "sqrtsoftplus",
              "routed_scaling_factor": 1.5, "norm_topk_prob": True, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
              "rms_norm_eps": 1e-6, "swiglu_limit": 1.5, "rope_theta": 10000.0, "compress_rope_theta": 160000.0,
              "compress_ratios": [4 if i % 2 else 128 for i in range(n)] + [0],  # main layers, then the MTP's 0
              "num_hash_layers": 1, "max_position_embeddings": 4096, "num_nextn_predict_layers": 1,
              "hidden_act": "silu", "tie_word_embeddings": False} | dims
    if release_keys:
        config = {V4_RELEASE_KEYS.get(k, k): v for k, v in config.items()}
    if fp8_block:
        config["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                         "weight_block_size": fp8_block, "scale_fmt": scale_fmt}
    return config


def deepseek_v4_shapes(dims: dict) -> dict[str, tuple[int, ...]]:
    d, v, hc, e, i = (dims[k] for k in ("hidden_size", "vocab_size", "hc_mult", "n_routed_experts",
                                        "moe_intermediate_size"))
    h, hd, q, g, o = (dims[k] for k in ("num_attention_heads", "head_dim", "q_lora_rank", "o_groups", "o_lora_rank"))
    mix = (2 + hc) * hc
    p = "mtp.0."
    shapes = {"e_proj.weight": (d, d), "h_proj.weight": (d, d), "enorm.weight": (d,), "hnorm.weight": (d,),
              "norm.weight": (d,), "hc_head_fn": (hc, hc * d), "hc_head_base": (hc,), "hc_head_scale": (1,),
              "attn_norm.weight": (d,), "ffn_norm.weight": (d,), "hc_attn_fn": (mix, hc * d), "hc_attn_base": (mix,),
              "hc_attn_scale": (3,), "hc_ffn_fn": (mix, hc * d), "hc_ffn_base": (mix,), "hc_ffn_scale": (3,),
              "attn.wq_a.weight": (q, d), "attn.q_norm.weight": (q,), "attn.wq_b.weight": (h * hd, q),
              "attn.wkv.weight": (hd, d), "attn.kv_norm.weight": (hd,), "attn.wo_a.weight": (g * o, h * hd // g),
              "attn.wo_b.weight": (d, g * o), "attn.attn_sink": (h,), "ffn.gate.weight": (e, d), "ffn.gate.bias": (e,),
              "ffn.shared_experts.w1.weight": (i, d), "ffn.shared_experts.w2.weight": (d, i),
              "ffn.shared_experts.w3.weight": (i, d)}
    for x in range(e):
        shapes |= {f"ffn.experts.{x}.w1.weight": (i, d), f"ffn.experts.{x}.w2.weight": (d, i),
                   f"ffn.experts.{x}.w3.weight": (i, d)}
    shapes = {p + k: s for k, s in shapes.items()}
    # shared with the main model, and a few main-model tensors that must not be taken for the head's
    return shapes | {"embed.weight": (v, d), "head.weight": (v, d), "norm.weight": (d,), "hc_head_fn": (hc, hc * d),
                     "layers.0.attn.wq_a.weight": (q, d), "layers.0.hc_attn_scale": (3,)}


def deepseek_v4_values(name: str, shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Plain w·x̂ norms around 1; hyper-connection mixes of order 1 (pre/post/comb vary per token); sinks around 0
    (so the sink's share of the softmax matters); a router scaled so its choice depends on the logits, and a
    selection bias large enough to change some choices."""
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    if name.endswith(("_base", "gate.bias")):
        return ((1.0 if name.endswith("gate.bias") else 0.5) * rng.standard_normal(shape)).astype(np.float32)
    if name.endswith("_scale"):
        return rng.uniform(0.5, 2.0, shape).astype(np.float32)
    if name.endswith("attn_sink"):
        return rng.standard_normal(shape).astype(np.float32)
    if len(shape) == 1:
        return (1.0 + 0.3 * rng.standard_normal(shape)).astype(np.float32)
    if name == "embed.weight":
        return rng.standard_normal(shape).astype(np.float32)
    scale = 3.0 if name.endswith("gate.weight") else 1.5 if "hc_" in name else 1.0
    return (scale * rng.standard_normal(shape) / np.sqrt(shape[1])).astype(np.float32)


def fp8_quantize_ue8m0(w: torch.Tensor, block: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Block FP8 with power-of-two (UE8M0) scales: s = 2^ceil(log2(amax / 448)), q = e4m3(w / s)."""
    q, scale = fp8_quantize(w, block)
    pow2 = torch.exp2(torch.ceil(torch.log2(scale)))
    full = pow2.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[: w.shape[0], : w.shape[1]]
    return (w / full).to(torch.float8_e4m3fn), pow2.to(torch.float8_e8m0fnu)


def write_deepseek_v4_checkpoint(out_dir: Path, dims: dict | None = None, seed: int = 0,
                                 fp8_block: list[int] | None = None, scale_fmt: str = "ue8m0",
                                 release_keys: bool = False) -> Path:
    """A tiny DeepSeek-V4 checkpoint: `mtp.0.*` as released, bf16 (hyper-connection mixes, sinks and the router
    bias f32), or FP8 e4m3 with `.scale` block scales (`scale_fmt` "ue8m0": F8_E8M0 powers of two, "float": F32);
    config.json with transformers' key names, or the release's (`release_keys`: dim, n_heads, window_size, ...)."""
    dims = {**DEEPSEEK_V4_TINY, **(dims or {})}
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, shape in sorted(deepseek_v4_shapes(dims).items()):
        value = torch.from_numpy(deepseek_v4_values(name, shape, seed))
        if "hc_" in name or name.endswith(("attn_sink", "gate.bias")):
            tensors[name] = value  # f32 as released
        elif fp8_block and name.startswith("mtp.0.") and any(x in name for x in V4_FP8_PARTS):
            quantize = fp8_quantize_ue8m0 if scale_fmt == "ue8m0" else fp8_quantize
            tensors[name], tensors[name.removesuffix("weight") + "scale"] = quantize(value, fp8_block)
        else:
            tensors[name] = value.to(torch.bfloat16)
    config = deepseek_v4_config(dims, release_keys, fp8_block, scale_fmt)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
    return out_dir


# --- MiMo-V2-Flash (issue 25): `model.mtp.layers.{l}.*` as released, names transcribed from vLLM's
# mimo_v2_mtp.py "Checkpoint weight layout" (Flash: separate q/k/v projections), not from the oracle ---

def mimo_v2_flash_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """The release's MTP tensors of every layer (SWA attention with its sink bias, dense MLP) plus the main
    embedding and lm_head the head shares."""
    d, v, inter = config["hidden_size"], config["vocab_size"], config["intermediate_size"]
    h, kv = config["swa_num_attention_heads"], config["swa_num_key_value_heads"]
    hd, vd = config["swa_head_dim"], config["swa_v_head_dim"]
    layer = {"enorm.weight": (d,), "hnorm.weight": (d,), "eh_proj.weight": (d, 2 * d),
             "input_layernorm.weight": (d,), "self_attn.q_proj.weight": (h * hd, d),
             "self_attn.k_proj.weight": (kv * hd, d), "self_attn.v_proj.weight": (kv * vd, d),
             "self_attn.o_proj.weight": (d, h * vd), "self_attn.attention_sink_bias": (h,),
             "pre_mlp_layernorm.weight": (d,), "mlp.gate_proj.weight": (inter, d), "mlp.up_proj.weight": (inter, d),
             "mlp.down_proj.weight": (d, inter), "final_layernorm.weight": (d,)}
    shapes = {f"model.mtp.layers.{i}.{n}": s for i in range(config["num_nextn_predict_layers"])
              for n, s in layer.items()}
    return shapes | {"model.embed_tokens.weight": (v, d), "lm_head.weight": (v, d)}


def write_mimo_v2_flash_checkpoint(out_dir: Path, overrides: dict | None = None, seed: int = 0,
                                   fp8_block: list[int] | None = None) -> Path:
    """A tiny MiMo-V2-Flash MTP head as released (config.json in the release's keys): every MTP layer, the main
    embedding and lm_head; bf16, or with `fp8_block` the MTP linears FP8 e4m3 beside `weight_scale_inv` block scales
    but o_proj (vLLM's mimo_v2.py leaves the MTP o_proj unquantized). Head-only."""
    from oracle.families.mimo_v2_flash_layout import tiny_config

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = tiny_config(**(overrides or {})) | {"_generated_by": GENERATED_BY}
    if fp8_block:
        config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                         "weight_block_size": fp8_block}
    tensors = {}
    for name, shape in sorted(mimo_v2_flash_shapes(config).items()):
        value = torch.from_numpy(mtp_layer_values(name, shape, seed))
        if fp8_block and name.startswith("model.mtp.") and len(shape) == 2 and "o_proj" not in name:
            tensors[name], tensors[name.removesuffix("weight") + "weight_scale_inv"] = fp8_quantize(value, fp8_block)
        else:
            tensors[name] = value.to(torch.bfloat16)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
    return out_dir


if __name__ == "__main__":
    main()
