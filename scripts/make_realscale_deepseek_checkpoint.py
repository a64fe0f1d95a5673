"""A synthetic checkpoint with DeepSeek-V3's MTP layer names, shapes and dtypes (FP8 as released), for benchmarks.
Never committed.

    python scripts/make_realscale_deepseek_checkpoint.py OUT_DIR [--experts N]

hidden 7168; MLA with 128 heads, q_lora 1536, kv_lora 512, rope 64 / nope 128 / v 128, YaRN (factor 40, mscale 1);
256 routed experts top-8 in 8 groups keeping 4, moe_intermediate 2048, 1 shared expert, routed_scaling 2.5; vocab
129280. The MTP layer is `model.layers.61.*` as released: the attention projections and every expert in FP8 e4m3
with float32 `weight_scale_inv` 128x128 block scales; eh_proj, norms and the router in bf16, the router's
`e_score_correction_bias` in float32 (~11.7 GB with 256 experts). Beside it `model.embed_tokens.weight` and
`lm_head.weight` in bf16 (3.7 GB; the layer's own copies are left out, as the layout allows), in 6 shards with an
index. `--experts N` (a multiple of n_group 8) shrinks the routed experts where the disk is short.

Written tensor by tensor, 4 MiB at a time, with deterministic bit patterns (a few MB of memory): bf16 as
make_realscale_checkpoint.py does (random sign and mantissa, one exponent per tensor so |w| ~ 1/sqrt(fan_in));
FP8 bytes with a random sign and mantissa and exponent field 7 (|q| in [1, 1.875]), and per-block scales
1/sqrt(fan_in) x U(0.75, 1.25), so the block grid matters (a transposed grid would change the result).
"""

import argparse
import json
import struct
import sys
import zlib
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_realscale_checkpoint import exponent_for  # noqa: E402

D, HEADS, VOCAB, Q_LORA, KV_LORA, ROPE, NOPE, V = 7168, 128, 129280, 1536, 512, 64, 128, 128
EXPERTS, TOP_K, GROUPS, TOPK_GROUP, MOE_I, SHARED = 256, 8, 8, 4, 2048, 1
LAYER = 61
BLOCK = 128
CHUNK = 4 << 20
SIZES = {"BF16": 2, "F8_E4M3": 1, "F32": 4}
FP8_PARTS = ("self_attn.q_a_proj.", "self_attn.q_b_proj.", "self_attn.kv_a_proj_with_mqa.", "self_attn.kv_b_proj.",
             "self_attn.o_proj.", "mlp.experts.", "mlp.shared_experts.")


def tensors(experts: int) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (dtype, shape), FP8 scales included."""
    p = f"model.layers.{LAYER}."
    a, m = p + "self_attn.", p + "mlp."
    qk = NOPE + ROPE
    out = {"model.embed_tokens.weight": ("BF16", (VOCAB, D)), "lm_head.weight": ("BF16", (VOCAB, D)),
           p + "enorm.weight": ("BF16", (D,)), p + "hnorm.weight": ("BF16", (D,)),
           p + "eh_proj.weight": ("BF16", (D, 2 * D)), p + "shared_head.norm.weight": ("BF16", (D,)),
           p + "input_layernorm.weight": ("BF16", (D,)), p + "post_attention_layernorm.weight": ("BF16", (D,)),
           a + "q_a_proj.weight": ("F8_E4M3", (Q_LORA, D)), a + "q_a_layernorm.weight": ("BF16", (Q_LORA,)),
           a + "q_b_proj.weight": ("F8_E4M3", (HEADS * qk, Q_LORA)),
           a + "kv_a_proj_with_mqa.weight": ("F8_E4M3", (KV_LORA + ROPE, D)),
           a + "kv_a_layernorm.weight": ("BF16", (KV_LORA,)),
           a + "kv_b_proj.weight": ("F8_E4M3", (HEADS * (NOPE + V), KV_LORA)),
           a + "o_proj.weight": ("F8_E4M3", (D, HEADS * V)),
           m + "gate.weight": ("BF16", (experts, D)), m + "gate.e_score_correction_bias": ("F32", (experts,)),
           m + "shared_experts.gate_proj.weight": ("F8_E4M3", (MOE_I * SHARED, D)),
           m + "shared_experts.up_proj.weight": ("F8_E4M3", (MOE_I * SHARED, D)),
           m + "shared_experts.down_proj.weight": ("F8_E4M3", (D, MOE_I * SHARED))}
    for e in range(experts):
        out |= {f"{m}experts.{e}.gate_proj.weight": ("F8_E4M3", (MOE_I, D)),
                f"{m}experts.{e}.up_proj.weight": ("F8_E4M3", (MOE_I, D)),
                f"{m}experts.{e}.down_proj.weight": ("F8_E4M3", (D, MOE_I))}
    for name, (dtype, shape) in list(out.items()):
        if dtype == "F8_E4M3":
            out[name.removesuffix("weight") + "weight_scale_inv"] = ("F32", (-(-shape[0] // BLOCK),
                                                                          -(-shape[1] // BLOCK)))
    return out


def config(experts: int) -> dict:
    return {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": D,
            "intermediate_size": 18432, "moe_intermediate_size": MOE_I, "num_hidden_layers": LAYER,
            "num_nextn_predict_layers": 1, "num_attention_heads": HEADS, "num_key_value_heads": HEADS,
            "n_shared_experts": SHARED, "n_routed_experts": experts, "num_experts_per_tok": TOP_K, "n_group": GROUPS,
            "topk_group": TOPK_GROUP, "routed_scaling_factor": 2.5, "norm_topk_prob": True, "topk_method": "noaux_tc",
            "scoring_func": "sigmoid", "first_k_dense_replace": 3, "moe_layer_freq": 1, "q_lora_rank": Q_LORA,
            "kv_lora_rank": KV_LORA, "qk_nope_head_dim": NOPE, "qk_rope_head_dim": ROPE, "v_head_dim": V,
            "hidden_act": "silu", "max_position_embeddings": 163840, "rms_norm_eps": 1e-6, "vocab_size": VOCAB,
            "rope_theta": 10000, "attention_bias": False, "tie_word_embeddings": False,
            "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                             "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
            "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                    "weight_block_size": [BLOCK, BLOCK]},
            "_generated_by": "python scripts/make_realscale_deepseek_checkpoint.py"}


def write_tensor_bytes(f, name: str, dtype: str, shape: tuple[int, ...], fan_in: int) -> None:
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    remaining = int(np.prod(shape))
    while remaining:
        n = min(remaining, CHUNK)
        if dtype == "F8_E4M3":  # sign and mantissa random, exponent field 7: |q| in [1, 1.875], never NaN
            f.write(((rng.integers(0, 256, size=n, dtype=np.uint8) & np.uint8(0x87)) | np.uint8(0x38)).tobytes())
        elif dtype == "F32":
            if name.endswith("weight_scale_inv"):
                values = rng.uniform(0.75, 1.25, size=n) / np.sqrt(fan_in) / 1.4
            else:  # the router's correction bias
                values = 0.05 * rng.standard_normal(n)
            f.write(values.astype("<f4").tobytes())
        else:
            exp_bits = np.uint16(exponent_for(name, shape) + (5 if len(shape) == 1 else 0)) << 7  # plain norms ~1
            bits = rng.integers(0, 1 << 16, size=n, dtype=np.uint16)
            f.write(((bits & np.uint16(0x807F)) | exp_bits).astype("<u2").tobytes())
        remaining -= n


def write_shard(path: Path, names: list[str], all_tensors: dict) -> None:
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name in names:
        dtype, shape = all_tensors[name]
        nbytes = SIZES[dtype] * int(np.prod(shape))
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for name in names:
            dtype, shape = all_tensors[name]
            weight = all_tensors.get(name.removesuffix("weight_scale_inv") + "weight")
            fan_in = weight[1][1] if name.endswith("weight_scale_inv") else (shape[-1] if len(shape) > 1 else 1)
            write_tensor_bytes(f, name, dtype, shape, fan_in)
    tmp.replace(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--experts", type=int, default=EXPERTS)
    args = parser.parse_args()
    if args.experts % GROUPS or args.experts // GROUPS < 2:
        sys.exit(f"--experts must be a multiple of n_group {GROUPS} with at least 2 per group")
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    all_tensors = tensors(args.experts)
    layer = sorted(n for n in all_tensors if n.startswith(f"model.layers.{LAYER}."))
    expert_of = {n: int(n.split(".experts.")[1].split(".")[0]) for n in layer if ".experts." in n}
    per = -(-args.experts // 4)
    shards = {"model-00001-of-00006.safetensors": ["model.embed_tokens.weight"],
              "model-00002-of-00006.safetensors": ["lm_head.weight"]}
    for k in range(4):  # the layer's dense tensors with the first quarter of the experts, then a quarter each
        names = [n for n in layer if (n not in expert_of and k == 0) or (n in expert_of and expert_of[n] // per == k)]
        shards[f"model-0000{3 + k}-of-00006.safetensors"] = names
    for file, names in shards.items():
        print(f"writing {out / file} ({len(names)} tensors)", file=sys.stderr)
        write_shard(out / file, names, all_tensors)
    weight_map = {n: f for f, names in shards.items() for n in names}
    total = sum(SIZES[d] * int(np.prod(s)) for d, s in all_tensors.values())
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2, sort_keys=True))
    (out / "config.json").write_text(json.dumps(config(args.experts), indent=2))
    layer_bytes = sum(SIZES[all_tensors[n][0]] * int(np.prod(all_tensors[n][1])) for n in layer)
    print(f"wrote {out}: {total / 1e9:.2f} GB ({layer_bytes / 1e9:.2f} GB the MTP layer)", file=sys.stderr)


if __name__ == "__main__":
    main()
