"""Qwen3.5 (dense) MTP head: config fields and checkpoint tensor layout, with no torch or transformers import.

This is the half of the Qwen3.5 family that `probe` may read (to hand an engine the head's weights and config);
the head itself, built from the official transformers classes, is `oracle/families/qwen3_5.py`.
"""

import math
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
    """HeadConfig from a config.json dict, flat (text model) or nested under `text_config` (VLM release).

    Every field is checked for its JSON type where it is read (a string rope_theta, a null head_dim, a head_dim of
    32.7 or true): CheckpointError naming the field, never a traceback and never a silent conversion."""
    text = raw.get("text_config", raw)
    if not isinstance(text, dict):
        raise CheckpointError(f"{source}: text_config is {_json_type(text)}; it must be an object holding the text "
                              f"model's config (or leave it out for a flat config).")
    model_type = text.get("model_type", raw.get("model_type"))
    if model_type not in MODEL_TYPES:
        raise CheckpointError(f"{source}: model_type {model_type!r} is not a dense Qwen3.5 model "
                              f"(expected one of {', '.join(MODEL_TYPES)}); this oracle builds only that head.")
    for key, expected in (("mtp_num_hidden_layers", 1), ("hidden_act", "silu"), ("attention_bias", False)):
        value = text.get(key, _TEXT_DEFAULTS.get(key, expected))
        if value != expected or type(value) is not type(expected):  # 1.0 or true is not the layer count 1
            raise CheckpointError(f"{source}: {key} = {value!r}; this oracle supports only {key} = {expected!r}.")
    rope = _rope_fields(text, source)
    cfg = HeadConfig(
        hidden_size=_required_int(text, "hidden_size", source),
        num_attention_heads=_required_int(text, "num_attention_heads", source),
        num_key_value_heads=_required_int(text, "num_key_value_heads", source),
        head_dim=_optional_int(text, "head_dim", source),
        intermediate_size=_required_int(text, "intermediate_size", source),
        vocab_size=_required_int(text, "vocab_size", source),
        rms_norm_eps=_number(text.get("rms_norm_eps", _TEXT_DEFAULTS["rms_norm_eps"]), "rms_norm_eps", source),
        max_position_embeddings=_optional_int(text, "max_position_embeddings", source),
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
    for key in ("rope_parameters", "rope_scaling"):
        if text.get(key) is not None and not isinstance(text[key], dict):
            raise CheckpointError(f"{source}: {key} is {_json_type(text[key])}; it must be an object such as "
                                  f'{{"rope_type": "default", "rope_theta": 10000000}}.')
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
    if not isinstance(section, list) or not all(_is_int(s) and s >= 0 for s in section):
        raise CheckpointError(f"{source}: mrope_section must be a list of non-negative integers, found {section!r}.")
    interleaved = rope.get("mrope_interleaved", text.get("mrope_interleaved", True))
    if not isinstance(interleaved, bool):
        raise CheckpointError(f"{source}: mrope_interleaved must be true or false, found {interleaved!r}.")
    factor = _number(rope.get("partial_rotary_factor", text.get("partial_rotary_factor",
                                                                _TEXT_DEFAULTS["partial_rotary_factor"])),
                     "partial_rotary_factor", source)
    if factor > 1:
        raise CheckpointError(f"{source}: partial_rotary_factor {factor} is above 1; it is the fraction of each "
                              f"head that RoPE rotates.")
    return {
        "rope_theta": _number(theta, "rope_theta", source),
        "partial_rotary_factor": factor,
        "mrope_section": tuple(section),
        "mrope_interleaved": interleaved,
    }


def _required_int(text: dict, key: str, source: str) -> int:
    value = text.get(key)
    if not _is_int(value) or value <= 0:
        raise CheckpointError(f"{source}: {key} must be a positive integer, found {value!r}.")
    return value


def _optional_int(text: dict, key: str, source: str) -> int:
    """A positive integer field that transformers defaults when absent; present, it must be one (32.7 is not
    truncated to 32, null is not the default)."""
    return _required_int(text, key, source) if key in text else _TEXT_DEFAULTS[key]


def _number(value, key: str, source: str) -> float:
    """A positive, finite JSON number (int or float; not a string, not true/false)."""
    if not (_is_int(value) or isinstance(value, float)) or not math.isfinite(value) or value <= 0:
        raise CheckpointError(f"{source}: {key} must be a positive finite number, found {value!r}.")
    return float(value)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _json_type(value) -> str:
    return {type(None): "null", list: "a list", str: "a string", bool: "a boolean", int: "a number",
            float: "a number"}.get(type(value), type(value).__name__)


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
