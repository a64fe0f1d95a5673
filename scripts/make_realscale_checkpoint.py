"""A synthetic checkpoint with Qwen3.5-27B's head names, shapes and dtype, for benchmarks. Never committed.

    python scripts/make_realscale_checkpoint.py OUT_DIR

hidden 5120; 24 heads, 4 KV heads, head_dim 256 (q_proj out 12288 = query+gate interleaved, k/v 1024, o_proj
in 6144); intermediate 17408; vocab 248320; rms eps 1e-6; rope theta 1e7; partial rotary 0.25. The 15 `mtp.*`
tensors, `model.language_model.embed_tokens.weight` and `lm_head.weight` in bf16, in 3 shards (<= ~2.6 GB each)
with an index, like a release (the 64 main-model layers are not generated: --main-model is not available here).

The safetensors files are written by hand, tensor by tensor and 8 MiB at a time, so generating ~6 GB needs only
a few MB of memory. Values are deterministic bf16 bit patterns: a random sign and mantissa with a fixed exponent
per tensor, chosen so |w| ~ 1/sqrt(fan_in) and activations stay O(1).
"""

import json
import struct
import sys
import zlib
from pathlib import Path

import numpy as np

D, HEADS, KV, HD, FF, VOCAB = 5120, 24, 4, 256, 17408, 248320
CHUNK_ELEMS = 4 << 20


def shapes() -> dict[str, tuple[int, ...]]:
    q, kv = HEADS * HD, KV * HD
    layer = "mtp.layers.0."
    return {
        "model.language_model.embed_tokens.weight": (VOCAB, D), "lm_head.weight": (VOCAB, D),
        "mtp.fc.weight": (D, 2 * D), "mtp.pre_fc_norm_embedding.weight": (D,), "mtp.pre_fc_norm_hidden.weight": (D,),
        "mtp.norm.weight": (D,), layer + "input_layernorm.weight": (D,), layer + "post_attention_layernorm.weight": (D,),
        layer + "self_attn.q_proj.weight": (2 * q, D), layer + "self_attn.k_proj.weight": (kv, D),
        layer + "self_attn.v_proj.weight": (kv, D), layer + "self_attn.o_proj.weight": (D, q),
        layer + "self_attn.q_norm.weight": (HD,), layer + "self_attn.k_norm.weight": (HD,),
        layer + "mlp.gate_proj.weight": (FF, D), layer + "mlp.up_proj.weight": (FF, D),
        layer + "mlp.down_proj.weight": (D, FF),
    }


def config() -> dict:
    text = {"model_type": "qwen3_5_text", "hidden_size": D, "num_attention_heads": HEADS, "num_key_value_heads": KV,
            "head_dim": HD, "intermediate_size": FF, "vocab_size": VOCAB, "num_hidden_layers": 64,
            "full_attention_interval": 4, "rms_norm_eps": 1e-6, "hidden_act": "silu", "attention_bias": False,
            "max_position_embeddings": 262144, "tie_word_embeddings": False, "mtp_num_hidden_layers": 1,
            "mtp_use_dedicated_embeddings": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                                "mrope_section": [11, 11, 10], "mrope_interleaved": True}}
    return {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", "text_config": text,
            "tie_word_embeddings": False, "_generated_by": "python scripts/make_realscale_checkpoint.py"}


def exponent_for(name: str, shape: tuple[int, ...]) -> int:
    """bf16 exponent field: values in +-[2^(e-127), 2^(e-126))."""
    if len(shape) == 1:
        return 127 - 5  # (1+w) norm weights: |w| ~ 0.03-0.06
    if "embed_tokens" in name:
        return 127 - 1  # |x| ~ 0.5-1
    return 127 - int(np.ceil(np.log2(np.sqrt(shape[1])))) - 1  # |w| ~ 1/sqrt(fan_in)


def write_tensor_bytes(f, name: str, shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    exp_bits = np.uint16(exponent_for(name, shape) << 7)
    remaining = int(np.prod(shape))
    while remaining:
        n = min(remaining, CHUNK_ELEMS)
        bits = rng.integers(0, 1 << 16, size=n, dtype=np.uint16)
        f.write(((bits & np.uint16(0x807F)) | exp_bits).astype("<u2").tobytes())  # keep sign + mantissa
        remaining -= n


def write_shard(path: Path, names: list[str], all_shapes: dict) -> None:
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name in names:
        nbytes = 2 * int(np.prod(all_shapes[name]))
        header[name] = {"dtype": "BF16", "shape": list(all_shapes[name]), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # safetensors pads the header to 8 bytes
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for name in names:
            write_tensor_bytes(f, name, all_shapes[name])
    tmp.replace(path)


def main(out_dir: str) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    all_shapes = shapes()
    mtp = sorted(n for n in all_shapes if n.startswith("mtp."))
    shards = {"model-00001-of-00003.safetensors": ["model.language_model.embed_tokens.weight"],
              "model-00002-of-00003.safetensors": ["lm_head.weight"],
              "model-00003-of-00003.safetensors": mtp}
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
        sys.exit("usage: python scripts/make_realscale_checkpoint.py OUT_DIR")
    main(sys.argv[1])
