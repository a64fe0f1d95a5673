"""`mtp-oracle gguf`: a checkpoint's MTP head as the GGUF llama.cpp's MTP context loads, written with `gguf`'s
GGUFWriter in the layout of llama.cpp's own converter (convert_hf_to_gguf.py, `_QwenMtpMixin` with --mtp-only).

What goes in (names: llama.cpp's; the MTP layer is block N = num_hidden_layers, so `block_count` is N + 1 and
`nextn_predict_layers` 1):
  token_embd, output_norm, output                   the main model's embedding, final norm and lm_head (what an
                                                    MTP-only GGUF keeps of the trunk)
  blk.N.nextn.{eh_proj, enorm, hnorm, shared_head_norm}   the stem: mtp.fc, the two pre-fc norms, mtp.norm
  blk.N.{attn_norm, attn_q, attn_k, attn_v, attn_output, attn_q_norm, attn_k_norm, post_attention_norm}
  blk.N.{ffn_gate, ffn_up, ffn_down}                dense MLP, or for a MoE layer ffn_gate_inp (router),
  blk.N.{ffn_gate_exps, ffn_up_exps, ffn_down_exps} stacked experts [E, I, D] / [E, D, I] (numpy order; GGUF's ne
  blk.N.{ffn_gate_shexp, ffn_up_shexp, ffn_down_shexp, ffn_gate_inp_shexp}   is reversed), shared expert + gate
q8_0: a matrix whose rows are no whole number of 32-value blocks is written F16, as the converter falls back.
Norms: llama.cpp's RMSNorm multiplies by w, so the (1+w) norms of these heads are stored as 1 + w in F32, as the
converter's `data_torch + 1` does (every `*norm.weight` of the head). Matrices in --outtype (f32, bf16, q8_0).
Metadata: the keys llama.cpp's qwen35/qwen35moe/qwen3next loaders read (`load_arch_hparams`), with
`tokenizer.ggml.model = none` and the vocabulary size (a head-only file carries no tokenizer; llama.cpp then adds
dummy tokens). oracle/gguf_source.py reads the file back: `mtp-oracle export head.gguf` in f32 equals the
safetensors export bit for bit (tests/oracle/test_gguf_writer.py).
"""

from collections.abc import Callable
from pathlib import Path

import numpy as np

from oracle.checkpoint import Checkpoint
from oracle.errors import CheckpointError, InputError
from oracle.gguf_source import LAYER, NORMS, STEM
from oracle.output import atomic_output, check_writable

# family -> llama.cpp architecture (the inverse of gguf_source.ARCH_MODEL_TYPE, by family)
ARCH = {"qwen3_5": "qwen35", "qwen3_5_moe": "qwen35moe", "qwen3_next": "qwen3next"}
OUTTYPES = ("f32", "bf16", "q8_0")
_HF_SUFFIX = {hf: short for short, hf in LAYER.items() if short != "ffn_norm"}  # ffn_norm: a reader alias
_EXPERT_PARTS = {"gate": "ffn_gate_exps", "up": "ffn_up_exps", "down": "ffn_down_exps"}


def write_head_gguf(checkpoint_dir: Path, out: Path, outtype: str = "f32",
                    log: Callable[[str], None] = lambda msg: None) -> Path:
    """Write the head of `checkpoint_dir` (a safetensors checkpoint in HF layout) to `out`, atomically."""
    if outtype not in OUTTYPES:
        raise InputError(f"--outtype {outtype!r}: use one of {', '.join(OUTTYPES)}.")
    check_writable(out)
    ckpt = Checkpoint(checkpoint_dir)
    arch = architecture(ckpt)
    tensors = head_gguf_tensors(ckpt)
    log(f"{ckpt.path}: {ckpt.family.name} head -> llama.cpp {arch}, {len(tensors)} tensors, {outtype}")
    return write_gguf(out, ckpt, tensors, outtype)


def architecture(ckpt: Checkpoint) -> str:
    arch = ARCH.get(ckpt.family.name)
    if arch is None:
        raise CheckpointError(f"{ckpt.path} is a {ckpt.family.name} head; llama.cpp's MTP GGUF layout is written for "
                              f"{', '.join(ARCH)} (the architectures whose MTP graph this oracle has checked).")
    layers = ckpt.family.layer_count(ckpt.config)
    if layers > 1:  # llama.cpp's Qwen3.5 MTP graph runs one nextn block (blk.N.nextn.*)
        raise CheckpointError(f"{ckpt.path} holds {layers} MTP layers (mtp_num_hidden_layers); llama.cpp's MTP GGUF "
                              f"layout has one nextn block, so this writer handles one-layer heads only (a GGUF "
                              f"with layer 0 alone would drop layers 1..{layers - 1}).")
    return arch


def write_gguf(out: Path, ckpt: Checkpoint, tensors: dict[str, np.ndarray], outtype: str = "f32",
               metadata: dict | None = None) -> Path:
    """`tensors` (head_gguf_tensors, possibly edited: the tests inject defects this way) with `ckpt`'s metadata,
    `metadata` overriding keys by name (e.g. {"qwen35.rope.freq_base": 1e4})."""
    import gguf  # the package llama.cpp's converter uses: its writer, its quantizers

    arch = architecture(ckpt)
    with atomic_output(out) as tmp:
        writer = gguf.GGUFWriter(str(tmp), arch)
        _write_metadata(writer, arch, ckpt, outtype, metadata or {})
        for name, values in tensors.items():
            data, options = _encoded(gguf, name, values, outtype)
            writer.add_tensor(name, data, **options)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    return Path(out)


def head_gguf_tensors(ckpt: Checkpoint) -> dict[str, np.ndarray]:
    """GGUF name -> float32 value (numpy order), (1+w) norms with their 1 added."""
    block = _main_layers(ckpt)
    head = ckpt.read_head(widen=True, digest=False).tensors
    layout = ckpt.layout()
    out = {}
    prefix = ckpt.main_model_prefix()
    out["token_embd.weight"] = ckpt.read(prefix + "embed_tokens.weight")
    out["output_norm.weight"] = _main_norm(ckpt, prefix)
    out["output.weight"] = ckpt.read("lm_head.weight") if "lm_head.weight" in ckpt.names() else out["token_embd.weight"]
    experts = layout.experts
    expert_names = set(experts.shapes()) if experts else set()
    for name, values in head.items():
        if name in expert_names:
            continue
        out[f"blk.{block}.{_short_name(name)}.weight"] = values
    if experts is not None:
        stacks = {part: [] for part in _EXPERT_PARTS}
        for e in range(int(ckpt.config.num_experts)):
            for part, stored in ckpt.expert_parts(experts, e):
                stacks[part].append(_float32(stored, ckpt, experts, part, e))
        for part, short in _EXPERT_PARTS.items():
            out[f"blk.{block}.{short}.weight"] = np.stack(stacks[part])
    for name in list(out):
        short = name.removeprefix(f"blk.{block}.").removesuffix(".weight")
        if short in NORMS or name == "output_norm.weight":
            out[name] = np.asarray(out[name], dtype=np.float32) + np.float32(1.0)
        if short == "ffn_gate_inp_shexp":  # llama.cpp reads the shared-expert gate as {n_embd}
            out[name] = out[name].reshape(-1)
    return out


def _text_config(ckpt: Checkpoint) -> dict:
    raw = ckpt.raw_config
    return raw.get("text_config", raw)


def _main_layers(ckpt: Checkpoint) -> int:
    """N = num_hidden_layers: llama.cpp places the MTP block after the main layers."""
    layers = _text_config(ckpt).get("num_hidden_layers")
    if not isinstance(layers, int) or isinstance(layers, bool) or layers < 1:
        raise CheckpointError(f"{ckpt.path}/config.json has no num_hidden_layers ({layers!r}); llama.cpp numbers the "
                              f"MTP block after the main layers, so the GGUF needs it.")
    return layers


def _short_name(name: str) -> str:
    """`mtp.*` checkpoint name -> llama.cpp's name within the MTP block."""
    stem = {hf + ".weight": short for short, hf in STEM.items()}
    if name in stem:
        return stem[name]
    suffix = name.removeprefix("mtp.layers.0.").removesuffix(".weight")
    if suffix in _HF_SUFFIX:
        return _HF_SUFFIX[suffix]
    raise CheckpointError(f"{name}: no llama.cpp name is known for this head tensor; the GGUF would drop it. "
                          f"Refusing to write an incomplete head.")


def _main_norm(ckpt: Checkpoint, prefix: str) -> np.ndarray:
    """The main model's final norm (llama.cpp requires output_norm; its MTP graph falls back to it only when
    nextn.shared_head_norm is missing). Without one, NaN: an engine that falls back to it must not look right."""
    name = prefix + "norm.weight"
    if name in ckpt.names():
        return ckpt.read(name)
    return np.full(int(ckpt.config.hidden_size), np.nan, dtype=np.float32) - np.float32(1.0)  # +1 added later


def _float32(stored: np.ndarray, ckpt: Checkpoint, experts, part: str, e: int) -> np.ndarray:
    from oracle.checkpoint import _widen

    name = experts.names["gate_up" if experts.kind == "fused" and part != "down" else part]
    dtype = ckpt.entry(name.format(e=e)).dtype
    if dtype not in ("F32", "BF16", "F16"):
        raise CheckpointError(f"{name.format(e=e)} is {dtype}; the GGUF writer reads float experts (dequantize FP8 "
                              f"experts first).")
    return _widen(np.asarray(stored), dtype)


def _encoded(gguf, name: str, values: np.ndarray, outtype: str) -> tuple[np.ndarray, dict]:
    """(data, add_tensor keywords): norms and 1-D tensors stay F32, as llama.cpp stores them."""
    values = np.ascontiguousarray(values, dtype=np.float32)
    if values.ndim == 1 or outtype == "f32":
        return values, {}
    qtype = {"bf16": gguf.GGMLQuantizationType.BF16, "q8_0": gguf.GGMLQuantizationType.Q8_0}[outtype]
    if qtype == gguf.GGMLQuantizationType.Q8_0 and values.shape[-1] % 32:
        # rows that are no whole number of Q8_0 blocks: F16, as llama.cpp's converter falls back
        return values.astype(np.float16), {}
    return gguf.quants.quantize(values, qtype), {"raw_dtype": qtype}


def _write_metadata(writer, arch: str, ckpt: Checkpoint, outtype: str, overrides: dict) -> None:
    """The keys llama.cpp's loader reads (src/llama-arch.cpp names; written by name, not through GGUFWriter's
    helpers, which older gguf releases lack for the newer keys)."""
    text = _text_config(ckpt)
    cfg = ckpt.config
    head_dim = int(text.get("head_dim") or cfg.hidden_size // cfg.num_attention_heads)
    rope = text.get("rope_parameters") or {}
    partial = float(rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25)))
    uint = {"block_count": _main_layers(ckpt) + 1, "nextn_predict_layers": 1,
            "context_length": int(text.get("max_position_embeddings", 4096)), "embedding_length": cfg.hidden_size,
            "attention.head_count": cfg.num_attention_heads, "attention.head_count_kv": cfg.num_key_value_heads,
            "attention.key_length": head_dim, "attention.value_length": head_dim,
            "rope.dimension_count": int(head_dim * partial), "vocab_size": cfg.vocab_size,
            "ssm.conv_kernel": text["linear_conv_kernel_dim"], "ssm.state_size": text["linear_key_head_dim"],
            "ssm.group_count": text["linear_num_key_heads"], "ssm.time_step_rank": text["linear_num_value_heads"],
            "ssm.inner_size": int(text["linear_value_head_dim"]) * int(text["linear_num_value_heads"]),
            "full_attention_interval": int(text.get("full_attention_interval", 4))}
    if getattr(cfg, "num_experts", 0):
        uint |= {"expert_count": cfg.num_experts, "expert_used_count": cfg.num_experts_per_tok,
                 "expert_feed_forward_length": text["moe_intermediate_size"],
                 "expert_shared_feed_forward_length": text["shared_expert_intermediate_size"],
                 "feed_forward_length": int(text.get("intermediate_size") or text["moe_intermediate_size"])}
    else:
        uint["feed_forward_length"] = cfg.intermediate_size
    floats = {f"{arch}.attention.layer_norm_rms_epsilon": float(cfg.rms_norm_eps),
              f"{arch}.rope.freq_base": float(rope.get("rope_theta", text.get("rope_theta")))}
    for key, value in uint.items():
        key = f"{arch}.{key}"
        writer.add_uint32(key, int(overrides.get(key, value)))
    for key, value in floats.items():
        writer.add_float32(key, float(overrides.get(key, value)))
    if arch in ("qwen35", "qwen35moe"):  # interleaved M-RoPE: the loaders require the sections
        writer.add_array(f"{arch}.rope.dimension_sections", [*rope.get("mrope_section", [11, 11, 10]), 0][:4])
    if (layer_types := text.get("layer_types")) is not None:  # the MTP block is attention, never recurrent
        writer.add_array(f"{arch}.attention.recurrent_layers", [t == "linear_attention" for t in layer_types] + [False])
    writer.add_string("general.name", f"{ckpt.family.name} MTP head (mtp-oracle gguf)")
    writer.add_uint32("general.file_type", {"f32": 0, "bf16": 32, "q8_0": 7}[outtype])  # llama_ftype
    writer.add_string("tokenizer.ggml.model", "none")  # no tokenizer: llama.cpp adds vocab_size dummy tokens
