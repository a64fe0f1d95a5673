"""Qwen3.5 (dense) MTP head: config fields and checkpoint tensor layout, with no torch or transformers import.

This is the half of the Qwen3.5 family that `probe` may read (to hand an engine the head's weights and config);
the head itself, built from the official transformers classes, is `oracle/families/qwen3_5.py`.
"""

from dataclasses import asdict, dataclass

from oracle.errors import CheckpointError

FAMILY = "qwen3_5"
MODEL_TYPES = ("qwen3_5", "qwen3_5_text")
# The two layouts a Qwen3.5 text stack is released in: the VLM release (Qwen3_5ForConditionalGeneration,
# `model.language_model.*`) and a text-only conversion (Qwen3_5ForCausalLM, `model.*`). Tried in this order.
MAIN_MODEL_PREFIXES = ("model.language_model.", "model.")
LM_HEAD = "lm_head.weight"
# transformers' Qwen3_5TextConfig defaults for fields a config.json may omit; they equal the released models'.
_TEXT_DEFAULTS = {"head_dim": 256, "rms_norm_eps": 1e-6, "hidden_act": "silu", "attention_bias": False,
                  "partial_rotary_factor": 0.25, "max_position_embeddings": 32768}


@dataclass(frozen=True)
class HeadConfig:
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    partial_rotary_factor: float
    mrope_section: tuple[int, ...]
    mrope_interleaved: bool
    max_position_embeddings: int
    family: str = FAMILY

    @property
    def rotary_dim(self) -> int:
        """Leading dims of each head that RoPE rotates (NeoX halves); the rest pass through."""
        return int(self.head_dim * self.partial_rotary_factor)

    def to_dict(self) -> dict:
        return asdict(self)


def head_config_from_json(raw: dict, source: str) -> HeadConfig:
    """HeadConfig from a config.json dict, flat (text model) or nested under `text_config` (VLM release)."""
    text = raw.get("text_config", raw)
    model_type = text.get("model_type", raw.get("model_type"))
    if model_type not in MODEL_TYPES:
        raise CheckpointError(f"{source}: model_type {model_type!r} is not a dense Qwen3.5 model "
                              f"(expected one of {', '.join(MODEL_TYPES)}); this oracle builds only that head.")
    for key, expected in (("mtp_num_hidden_layers", 1), ("hidden_act", "silu"), ("attention_bias", False)):
        value = text.get(key, _TEXT_DEFAULTS.get(key, expected))
        if value != expected:
            raise CheckpointError(f"{source}: {key} = {value!r}; this oracle supports only {key} = {expected!r}.")
    rope = _rope_fields(text, source)
    cfg = HeadConfig(
        hidden_size=_required_int(text, "hidden_size", source),
        num_attention_heads=_required_int(text, "num_attention_heads", source),
        num_key_value_heads=_required_int(text, "num_key_value_heads", source),
        head_dim=int(text.get("head_dim", _TEXT_DEFAULTS["head_dim"])),
        intermediate_size=_required_int(text, "intermediate_size", source),
        vocab_size=_required_int(text, "vocab_size", source),
        rms_norm_eps=float(text.get("rms_norm_eps", _TEXT_DEFAULTS["rms_norm_eps"])),
        max_position_embeddings=int(text.get("max_position_embeddings",
                                             _TEXT_DEFAULTS["max_position_embeddings"])),
        **rope,
    )
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise CheckpointError(f"{source}: num_attention_heads {cfg.num_attention_heads} is not a multiple of "
                              f"num_key_value_heads {cfg.num_key_value_heads}.")
    if cfg.rotary_dim % 2 or not 0 < cfg.rotary_dim <= cfg.head_dim:
        raise CheckpointError(f"{source}: head_dim {cfg.head_dim} x partial_rotary_factor "
                              f"{cfg.partial_rotary_factor} gives rotary dim {cfg.rotary_dim}; it must be even "
                              f"and in 2..head_dim.")
    return cfg


def _rope_fields(text: dict, source: str) -> dict:
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise CheckpointError(f"{source}: rope_type {rope_type!r} is not supported (Qwen3.5 uses 'default').")
    theta = rope.get("rope_theta", text.get("rope_theta"))
    if theta is None:
        # transformers would silently fall back to theta = 1e4; Qwen3.5 uses 1e7. Refuse to guess.
        raise CheckpointError(f"{source}: no rope_theta (looked in text_config.rope_parameters.rope_theta and "
                              f"rope_theta). Add the model's value (Qwen3.5: 10000000); the transformers "
                              f"default of 10000 would be silently wrong.")
    section = rope.get("mrope_section", text.get("mrope_section", [11, 11, 10]))
    return {
        "rope_theta": float(theta),
        "partial_rotary_factor": float(rope.get("partial_rotary_factor",
                                                text.get("partial_rotary_factor",
                                                         _TEXT_DEFAULTS["partial_rotary_factor"]))),
        "mrope_section": tuple(int(s) for s in section),
        "mrope_interleaved": bool(rope.get("mrope_interleaved", text.get("mrope_interleaved", True))),
    }


def _required_int(text: dict, key: str, source: str) -> int:
    value = text.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise CheckpointError(f"{source}: {key} must be a positive integer, found {value!r}.")
    return value


def head_tensor_shapes(cfg: HeadConfig) -> dict[str, tuple[int, ...]]:
    """The 15 `mtp.*` tensors of the dense head and the shape the config implies for each ([out, in] for linears)."""
    d, hd, ff = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    layer = "mtp.layers.0."
    return {
        "mtp.pre_fc_norm_embedding.weight": (d,),
        "mtp.pre_fc_norm_hidden.weight": (d,),
        "mtp.fc.weight": (d, 2 * d),
        layer + "input_layernorm.weight": (d,),
        layer + "self_attn.q_proj.weight": (2 * q, d),  # rows per head: [q_h (hd) | gate_h (hd)]
        layer + "self_attn.k_proj.weight": (kv, d),
        layer + "self_attn.v_proj.weight": (kv, d),
        layer + "self_attn.q_norm.weight": (hd,),
        layer + "self_attn.k_norm.weight": (hd,),
        layer + "self_attn.o_proj.weight": (d, q),
        layer + "post_attention_layernorm.weight": (d,),
        layer + "mlp.gate_proj.weight": (ff, d),
        layer + "mlp.up_proj.weight": (ff, d),
        layer + "mlp.down_proj.weight": (d, ff),
        "mtp.norm.weight": (d,),
    }
