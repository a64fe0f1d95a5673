"""A synthetic checkpoint with Step-3.5/3.7-Flash's MTP head names, shapes and dtypes (bf16), for benchmarks.
Never committed.

    python scripts/make_realscale_step3p7_checkpoint.py OUT_DIR [--moe [--experts N]]

Text dims as released (transformers' Step3p7TextConfig defaults and the hub config): hidden 4096, 45 main layers
and 3 MTP layers (model.layers.45..47), 64 heads (96 on sliding layers), 8 kv heads (num_attention_groups), head_dim 128, head-wise
attention gate (g_proj), q/k norms, dense intermediate 11264, 288 routed experts top-8 of moe_intermediate 1280
with a shared expert of 1280, vocab 128815, sliding window 512, layer types full on every 4th layer and sliding
otherwise (the MTP layers 45..47 are sliding), rope theta 5e6 (full, partial 0.5) / 1e4 (sliding, partial 1.0).

The MTP layers as released are DENSE: the hub config's `moe_layers_enum` is 3..44, so transformers derives
`mtp_mlp_layer_types` = dense for 45..47 (Step3p7TextConfig.__post_init__), and the released MTP layers carry a
dense `mlp.{gate,up,down}_proj` (11264). That is the default here (~3.6 GB: 1.5 GB the three layers, plus the bf16
embedding and lm_head, 1.06 GB each). `--moe` writes the MoE-MTP variant instead (moe_layers_enum 3..47: stacked
`moe.{gate,up,down}_proj.weight` [E, 1280, 4096] / [E, 4096, 1280], router, router_bias, share_expert), which the
oracle reads with lazily widened experts; all 288 experts x 3 layers are ~27 GB of bf16, so `--experts N`
(default 64 with --moe: ~6.5 GB in all) keeps it within a shared machine's disk and page cache.

Attention heads of the sliding MTP layers: the hub config's `attention_other_setting` gives sliding layers 96
heads (64 on full ones), and the released code and vLLM (step3p5_mtp: each MTP layer built at its own index into
`layer_types`) build the sliding MTP layers 45..47 with 96, so this checkpoint stores 96-head q_proj/g_proj/o_proj
there. transformers 5.24's MtpModel alone would build 64 (`get_mtp_config` swaps `per_layer_config` for the unset
`mtp_per_layer_config`); the oracle reads the count from the stored q_proj (mtp_model.sliding_heads_as_stored).

The layer's own vocabulary copies (shared_head.head, embed_tokens) are left out, as the layout allows. Shards: the
embedding, the lm_head, then one per MTP layer, with an index. Written tensor by tensor, 4 MiB at a time, with
make_realscale_checkpoint.py's deterministic bf16 bit patterns (random sign and mantissa, one exponent per tensor
so |w| ~ 1/sqrt(fan_in); norms ~1).
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

D, HEADS, SLIDING_HEADS, KV, HEAD_DIM, VOCAB, FF = 4096, 64, 96, 8, 128, 128815, 11264
EXPERTS, TOP_K, MOE_I, SHARED_I = 288, 8, 1280, 1280
MAIN, MTP, WINDOW = 45, 3, 512
CHUNK = 4 << 20
SIZES = {"BF16": 2, "F32": 4}


def layer_tensors(layer: int, experts: int | None) -> dict[str, tuple[str, tuple[int, ...]]]:
    """One MTP layer's tensors, name -> (dtype, shape); `experts` None: dense (as released)."""
    p = f"model.layers.{layer}."
    a = p + "self_attn."
    heads = SLIDING_HEADS  # every MTP layer (45..47) is a sliding one
    out = {p + "enorm.weight": ("BF16", (D,)), p + "hnorm.weight": ("BF16", (D,)),
           p + "eh_proj.weight": ("BF16", (D, 2 * D)), p + "shared_head.norm.weight": ("BF16", (D,)),
           p + "input_layernorm.weight": ("BF16", (D,)), p + "post_attention_layernorm.weight": ("BF16", (D,)),
           a + "q_proj.weight": ("BF16", (heads * HEAD_DIM, D)), a + "k_proj.weight": ("BF16", (KV * HEAD_DIM, D)),
           a + "v_proj.weight": ("BF16", (KV * HEAD_DIM, D)), a + "o_proj.weight": ("BF16", (D, heads * HEAD_DIM)),
           a + "g_proj.weight": ("BF16", (heads, D)), a + "q_norm.weight": ("BF16", (HEAD_DIM,)),
           a + "k_norm.weight": ("BF16", (HEAD_DIM,))}
    if experts is None:
        m = p + "mlp."
        return out | {m + "gate_proj.weight": ("BF16", (FF, D)), m + "up_proj.weight": ("BF16", (FF, D)),
                      m + "down_proj.weight": ("BF16", (D, FF))}
    m, s = p + "moe.", p + "share_expert."
    return out | {m + "gate.weight": ("BF16", (experts, D)), m + "router_bias": ("F32", (experts,)),
                  m + "gate_proj.weight": ("BF16", (experts, MOE_I, D)),
                  m + "up_proj.weight": ("BF16", (experts, MOE_I, D)),
                  m + "down_proj.weight": ("BF16", (experts, D, MOE_I)),
                  s + "gate_proj.weight": ("BF16", (SHARED_I, D)), s + "up_proj.weight": ("BF16", (SHARED_I, D)),
                  s + "down_proj.weight": ("BF16", (D, SHARED_I))}


def config(experts: int | None) -> dict:
    padded = MAIN + MTP
    kinds = ["full_attention" if i % 4 == 0 else "sliding_attention" for i in range(padded)]
    moe = range(3, padded if experts is not None else MAIN)
    text = {"model_type": "step3p5", "hidden_size": D, "intermediate_size": FF, "num_hidden_layers": MAIN,
            "num_attention_heads": HEADS, "num_attention_groups": KV, "num_key_value_heads": KV, "head_dim": HEAD_DIM,
            "vocab_size": VOCAB, "moe_intermediate_size": MOE_I, "n_routed_experts": experts or EXPERTS,
            "num_experts_per_tok": TOP_K, "share_expert_dim": SHARED_I, "num_nextn_predict_layers": MTP,
            "sliding_window": WINDOW, "max_position_embeddings": 262144, "layer_types": kinds,
            "attention_other_setting": {"attention_type": "sliding_attention", "num_attention_heads": SLIDING_HEADS,
                                        "num_attention_groups": KV, "head_dim": HEAD_DIM},
            "moe_layers_enum": ",".join(map(str, moe)), "moe_router_scaling_factor": 3.0,
            "rope_theta": [5000000.0 if k == "full_attention" else 10000.0 for k in kinds],
            "partial_rotary_factors": [0.5 if k == "full_attention" else 1.0 for k in kinds],
            "rms_norm_eps": 1e-5, "hidden_act": "silu", "tie_word_embeddings": False}
    return {"model_type": "step3p7", "architectures": ["Step3p7ForConditionalGeneration"], "text_config": text,
            "vision_config": {"width": 32, "layers": 1, "heads": 2},
            "_generated_by": "python scripts/make_realscale_step3p7_checkpoint.py"
                             + (f" --moe --experts {experts}" if experts is not None else "")}


def write_tensor_bytes(f, name: str, dtype: str, shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    remaining = int(np.prod(shape))
    while remaining:
        n = min(remaining, CHUNK)
        if dtype == "F32":  # the router's correction bias
            f.write((0.05 * rng.standard_normal(n)).astype("<f4").tobytes())
        else:
            exp_bits = np.uint16(exponent_for(name, shape[-2:]) + (5 if len(shape) == 1 else 0)) << 7  # norms ~1
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
            write_tensor_bytes(f, name, *all_tensors[name])
    tmp.replace(path)  # never a half-written shard under its own name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--moe", action="store_true", help="MoE MTP layers (not the release: its MTP layers are dense)")
    parser.add_argument("--experts", type=int, default=None, help="routed experts with --moe (default 64; 288 real)")
    args = parser.parse_args()
    if args.experts is not None and not args.moe:
        parser.error("--experts needs --moe (the released MTP layers are dense)")
    experts = (args.experts or 64) if args.moe else None
    if experts is not None and not TOP_K <= experts <= EXPERTS:
        parser.error(f"--experts must be between top-k {TOP_K} and {EXPERTS}")
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    n = 2 + MTP
    shards = {f"model-00001-of-{n:05d}.safetensors": {"model.embed_tokens.weight": ("BF16", (VOCAB, D))},
              f"model-00002-of-{n:05d}.safetensors": {"lm_head.weight": ("BF16", (VOCAB, D))}}
    for i in range(MTP):
        shards[f"model-{3 + i:05d}-of-{n:05d}.safetensors"] = layer_tensors(MAIN + i, experts)
    all_tensors = {k: v for tensors in shards.values() for k, v in tensors.items()}
    for file, tensors in shards.items():
        print(f"writing {out / file} ({len(tensors)} tensors)", file=sys.stderr)
        write_shard(out / file, sorted(tensors), all_tensors)
    weight_map = {name: file for file, tensors in shards.items() for name in tensors}
    total = sum(SIZES[d] * int(np.prod(s)) for d, s in all_tensors.values())
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2, sort_keys=True))
    (out / "config.json").write_text(json.dumps(config(experts), indent=2))
    layers = sum(SIZES[d] * int(np.prod(s)) for name, (d, s) in all_tensors.items() if name.startswith("model.layers."))
    print(f"wrote {out}: {total / 1e9:.2f} GB ({layers / 1e9:.2f} GB the {MTP} MTP layers, "
          f"{'dense' if experts is None else f'{experts} experts each'})", file=sys.stderr)


if __name__ == "__main__":
    main()
