"""A synthetic checkpoint with Qwen3-Next-80B-A3B's MTP layer names, shapes and dtype, for benchmarks. Never
committed.

    python scripts/make_realscale_moe_checkpoint.py OUT_DIR

hidden 2048; 16 heads, 2 KV heads, head_dim 256 (q_proj out 8192 = query+gate interleaved); 512 routed experts,
top-10, moe_intermediate 512, shared expert 512 behind its sigmoid gate; vocab 151936; rope theta 5e6, partial
rotary 0.25; norm_topk_prob true. The `mtp.*` tensors with per-expert names as released (~3.3 GB of bf16 experts),
`model.embed_tokens.weight` and `lm_head.weight`, in 2 shards with an index. Written tensor by tensor with the bf16
bit-pattern generator of make_realscale_checkpoint.py (a few MB of memory).
"""

import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_realscale_checkpoint import write_shard  # noqa: E402

D, HEADS, KV, HD, VOCAB = 2048, 16, 2, 256, 151936
EXPERTS, TOP_K, MOE_I, SHARED_I = 512, 10, 512, 512


def shapes() -> dict[str, tuple[int, ...]]:
    q, kv = HEADS * HD, KV * HD
    layer, mlp = "mtp.layers.0.", "mtp.layers.0.mlp."
    out = {
        "model.embed_tokens.weight": (VOCAB, D), "lm_head.weight": (VOCAB, D),
        "mtp.fc.weight": (D, 2 * D), "mtp.pre_fc_norm_embedding.weight": (D,), "mtp.pre_fc_norm_hidden.weight": (D,),
        "mtp.norm.weight": (D,), layer + "input_layernorm.weight": (D,), layer + "post_attention_layernorm.weight": (D,),
        layer + "self_attn.q_proj.weight": (2 * q, D), layer + "self_attn.k_proj.weight": (kv, D),
        layer + "self_attn.v_proj.weight": (kv, D), layer + "self_attn.o_proj.weight": (D, q),
        layer + "self_attn.q_norm.weight": (HD,), layer + "self_attn.k_norm.weight": (HD,),
        mlp + "gate.weight": (EXPERTS, D), mlp + "shared_expert_gate.weight": (1, D),
        mlp + "shared_expert.gate_proj.weight": (SHARED_I, D), mlp + "shared_expert.up_proj.weight": (SHARED_I, D),
        mlp + "shared_expert.down_proj.weight": (D, SHARED_I),
    }
    for e in range(EXPERTS):
        out |= {f"{mlp}experts.{e}.gate_proj.weight": (MOE_I, D), f"{mlp}experts.{e}.up_proj.weight": (MOE_I, D),
                f"{mlp}experts.{e}.down_proj.weight": (D, MOE_I)}
    return out


def config() -> dict:
    return {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "hidden_size": D,
            "num_attention_heads": HEADS, "num_key_value_heads": KV, "head_dim": HD, "intermediate_size": 5120,
            "vocab_size": VOCAB, "num_hidden_layers": 48, "rms_norm_eps": 1e-6, "hidden_act": "silu",
            "attention_bias": False, "max_position_embeddings": 262144, "tie_word_embeddings": False,
            "num_experts": EXPERTS, "num_experts_per_tok": TOP_K, "moe_intermediate_size": MOE_I,
            "shared_expert_intermediate_size": SHARED_I, "norm_topk_prob": True, "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "rope_parameters": {"rope_type": "default", "rope_theta": 5000000, "partial_rotary_factor": 0.25},
            "_generated_by": "python scripts/make_realscale_moe_checkpoint.py"}


def main(out_dir: str) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    all_shapes = shapes()
    shards = {"model-00001-of-00002.safetensors": ["model.embed_tokens.weight", "lm_head.weight"],
              "model-00002-of-00002.safetensors": sorted(n for n in all_shapes if n.startswith("mtp."))}
    for file, names in shards.items():
        print(f"writing {out / file} ({len(names)} tensors)", file=sys.stderr)
        write_shard(out / file, names, all_shapes)
    weight_map = {n: f for f, names in shards.items() for n in names}
    total = sum(2 * int(np.prod(s)) for s in all_shapes.values())
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2, sort_keys=True))
    (out / "config.json").write_text(json.dumps(config(), indent=2))
    print(f"wrote {out}: {total / 1e9:.2f} GB", file=sys.stderr)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python scripts/make_realscale_moe_checkpoint.py OUT_DIR")
    main(sys.argv[1])
