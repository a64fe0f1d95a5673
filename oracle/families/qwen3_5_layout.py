"""Qwen3.5 (dense) MTP head, torch-free half: config parsing, tensor names and shapes, stages, evidence rules,
known wiring variants and a tiny config. The head itself, from the official transformers classes, is
`oracle/families/qwen3_5.py`.

The Qwen stem (two (1+w) norms, concat [e, h], fc, a gated full-attention layer, the final norm) and the sparse
MoE block are shared by Qwen3.5-MoE and Qwen3-Next, whose layout files are declarations over them (`moe_spec`).

FP8 (Qwen's `-FP8` releases, `quantization_config = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size":
[128, 128], "activation_scheme": "dynamic"}`, at the top level or inside `text_config`): a linear stored as F8_E4M3
has its block scale `X.weight_scale_inv` [ceil(out/bo), ceil(in/bi)] (F32, BF16 or F16) beside `X.weight`; norms,
embeddings, lm_head and usually the router and shared-expert gate stay bf16. The layout accepts a scale exactly where
the checkpoint has one (oracle/fp8.py; the same block FP8 as DeepSeek's, oracle/families/mtp_layer_layout.py); the
head dequantizes (oracle/families/qwen3_5_stem.py).
"""

import math
import re
from dataclasses import asdict, dataclass

from oracle.errors import CheckpointError
from oracle.families.spec import MAIN_LM_HEAD, ExpertLayout, FamilySpec, Fusion, TensorLayout, Variant
from oracle.fp8 import scale_shape
from oracle.stages import SPINE, Dims, with_draft, with_moe

FAMILY = "qwen3_5"
MODEL_TYPES = ("qwen3_5", "qwen3_5_text")
# The two layouts a Qwen3.5 text stack is released in: the VLM release (Qwen3_5ForConditionalGeneration,
# `model.language_model.*`) and a text-only conversion (Qwen3_5ForCausalLM, `model.*`). Tried in this order.
MAIN_MODEL_PREFIXES = ("model.language_model.", "model.")
LM_HEAD = MAIN_LM_HEAD
SCALE = "weight_scale_inv"  # X.weight_scale_inv beside an FP8 X.weight
LAYERS = "mtp.layers."  # the MTP decoder layers: mtp.layers.{i}.*
_LAYER = re.compile(r"mtp\.layers\.(\d+)\.")
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
    # MoE heads only (0 for the dense head; left out of to_dict then, so dense traces keep their config):
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True  # renormalise the top-k weights to sum 1 (an engine convention: recorded)
    mrope: bool = True  # Qwen3.5 builds mrope rotary (3 equal sections for text); Qwen3-Next plain rotary
    weight_block_size: tuple[int, int] | None = None  # FP8 block scales (quantization_config); None: not quantised
    # mtp_num_hidden_layers: N MTP decoder layers `mtp.layers.{0..N-1}` over ONE stem (pre-fc norms, fc) and ONE
    # final `mtp.norm`, as vLLM's Qwen3_5/Qwen3NextMultiTokenPredictor builds them; depth j runs layer j-1 (left out
    # of to_dict when 1, so one-layer traces keep their config)
    num_mtp_layers: int = 1

    @property
    def rotary_dim(self) -> int:
        """Leading dims of each head that RoPE rotates (NeoX halves); the rest pass through."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def layer_prefix(self, layer: int) -> str:
        return f"{LAYERS}{layer}."

    def in_layer(self, name: str, layer: int) -> bool:
        """Whether tensor `name` is read when MTP layer `layer` runs: its own layer's, or the shared stem and final
        norm every layer's step reads (oracle/speedup.py prices one depth by these)."""
        return not name.startswith(LAYERS) or name.startswith(self.layer_prefix(layer))

    def to_dict(self) -> dict:
        d = asdict(self)
        block = d.pop("weight_block_size")
        if block is not None:  # left out unquantised, so bf16 traces keep their config
            d["weight_block_size"] = list(block)
        if d["num_mtp_layers"] == 1:
            d.pop("num_mtp_layers")
        if not d.pop("mrope"):
            d.pop("mrope_section"), d.pop("mrope_interleaved")
        if self.is_moe:
            d.pop("intermediate_size")  # the MoE layer has no dense MLP
        else:
            for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                        "shared_expert_intermediate_size", "norm_topk_prob"):
                d.pop(key)
        return d


def text_config_of(raw: dict, source: str) -> dict:
    """The text model's config: `text_config` (VLM release) or the flat config itself."""
    text = raw.get("text_config", raw)
    if not isinstance(text, dict):
        raise CheckpointError(f"{source}: text_config is {_json_type(text)}; it must be an object holding the text "
                              f"model's config (or leave it out for a flat config).")
    return text


def head_config_from_json(raw: dict, source: str) -> HeadConfig:
    """The dense Qwen3.5 head's config from a config.json dict, flat (text model) or nested under `text_config`."""
    return parse_qwen_config(raw, source, FAMILY, MODEL_TYPES, moe=False)


def parse_qwen_config(raw: dict, source: str, family: str, model_types: tuple[str, ...], moe: bool,
                      mrope: bool = True, norm_topk_default: bool = True) -> HeadConfig:
    """HeadConfig of a Qwen-stem head (Qwen3.5 dense or MoE, Qwen3-Next), flat or nested under `text_config`.

    Every field is checked for its JSON type where it is read (a string rope_theta, a null head_dim, a head_dim of
    32.7 or true): CheckpointError naming the field, never a traceback and never a silent conversion."""
    text = text_config_of(raw, source)
    model_type = text.get("model_type", raw.get("model_type"))
    if model_type not in model_types:
        raise CheckpointError(f"{source}: model_type {model_type!r} is not a {family} model "
                              f"(expected one of {', '.join(model_types)}).")
    layers = _layer_count(text, source, moe)
    for key, expected in (("hidden_act", "silu"), ("attention_bias", False)):
        value = text.get(key, _TEXT_DEFAULTS.get(key, expected))
        if value != expected or type(value) is not type(expected):
            raise CheckpointError(f"{source}: {key} = {value!r}; this oracle supports only {key} = {expected!r}.")
    rope = _rope_fields(text, source)
    moe_fields = _moe_fields(text, source, norm_topk_default) if moe else {}
    block = fp8_block_size(raw, text, source)
    cfg = HeadConfig(
        hidden_size=_required_int(text, "hidden_size", source),
        num_attention_heads=_required_int(text, "num_attention_heads", source),
        num_key_value_heads=_required_int(text, "num_key_value_heads", source),
        head_dim=_optional_int(text, "head_dim", source),
        intermediate_size=0 if moe else _required_int(text, "intermediate_size", source),
        vocab_size=_required_int(text, "vocab_size", source),
        rms_norm_eps=_number(text.get("rms_norm_eps", _TEXT_DEFAULTS["rms_norm_eps"]), "rms_norm_eps", source),
        max_position_embeddings=_optional_int(text, "max_position_embeddings", source),
        family=family, mrope=mrope, weight_block_size=block, num_mtp_layers=layers, **rope, **moe_fields,
    )
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise CheckpointError(f"{source}: num_attention_heads {cfg.num_attention_heads} is not a multiple of "
                              f"num_key_value_heads {cfg.num_key_value_heads}.")
    if cfg.rotary_dim % 2 or not 0 < cfg.rotary_dim <= cfg.head_dim:
        raise CheckpointError(f"{source}: head_dim {cfg.head_dim} x partial_rotary_factor "
                              f"{cfg.partial_rotary_factor} gives rotary dim {cfg.rotary_dim}; it must be even "
                              f"and in 2..head_dim.")
    return cfg


def _layer_count(text: dict, source: str, moe: bool) -> int:
    """N from `mtp_num_hidden_layers` (vLLM's Qwen3_5/Qwen3Next MTP read it; default 1), a positive integer (1.0 or
    true is not a layer count). A `num_nextn_predict_layers` beside it must agree. A MoE head has one layer: its
    routed experts are laid out (read, hashed, widened where tokens route) for layer 0 only."""
    layers = text.get("mtp_num_hidden_layers", 1)
    if not _is_int(layers) or layers < 1:
        raise CheckpointError(f"{source}: mtp_num_hidden_layers = {layers!r}; it must be a positive integer (the "
                              f"head's MTP decoder layers mtp.layers.0..N-1).")
    other = text.get("num_nextn_predict_layers", layers)
    if other != layers or not _is_int(other):
        raise CheckpointError(f"{source}: num_nextn_predict_layers = {other!r} disagrees with mtp_num_hidden_layers = "
                              f"{layers!r}; a Qwen head's MTP layer count is mtp_num_hidden_layers (fix or drop one).")
    if moe and layers > 1:
        raise CheckpointError(f"{source}: mtp_num_hidden_layers = {layers}: this oracle builds multi-layer Qwen heads "
                              f"with dense MLPs only; a MoE head's routed experts are read for one MTP layer. "
                              f"Export the one-layer head (mtp_num_hidden_layers 1, mtp.layers.0.* only), or file an "
                              f"issue with the release's layout.")
    return layers


def fp8_block_size(raw: dict, text: dict, source: str) -> tuple[int, int] | None:
    """The FP8 block size from `quantization_config` (top level, or inside `text_config` of a nested release; both
    must then agree), None when the checkpoint is not quantised. Any other quantisation is refused, never read as if
    it were plain weights."""
    found = {"quantization_config": raw.get("quantization_config")}
    if text is not raw:
        found["text_config.quantization_config"] = text.get("quantization_config")
    blocks = {key: _fp8_block(quant, key, source) for key, quant in found.items() if quant is not None}
    if len(set(blocks.values())) > 1:
        raise CheckpointError(f"{source}: {' and '.join(blocks)} disagree ({' vs '.join(map(str, blocks.values()))}); "
                              f"keep one quantization_config.")
    return next(iter(blocks.values()), None)


def _fp8_block(quant, key: str, source: str) -> tuple[int, int]:
    """(rows, cols) of one quantization_config: block FP8 e4m3 with dynamic activation scales, as Qwen releases."""
    supported = ('this oracle reads bf16/f16/f32 weights and block FP8 as Qwen\'s -FP8 releases store it '
                 '(quant_method "fp8", fmt "e4m3", weight_block_size [rows, cols], activation_scheme "dynamic")')
    if not isinstance(quant, dict):
        raise CheckpointError(f"{source}: {key} is {_json_type(quant)}; it must be an object ({supported}).")
    for field_name, expected in (("quant_method", "fp8"), ("fmt", "e4m3"), ("activation_scheme", "dynamic")):
        value = quant.get(field_name, None if field_name == "quant_method" else expected)
        if value != expected:
            raise CheckpointError(f"{source}: {key}.{field_name} = {value!r} is not supported; {supported}.")
    block = quant.get("weight_block_size")
    if not isinstance(block, list) or len(block) != 2 or not all(_is_int(b) and b > 0 for b in block):
        raise CheckpointError(f"{source}: {key}.weight_block_size must be [rows, cols] (positive integers; Qwen "
                              f"releases use [128, 128]), found {block!r}. Per-tensor FP8 is not supported.")
    return tuple(block)


def _moe_fields(text: dict, source: str, norm_topk_default: bool) -> dict:
    fields = {key: _required_int(text, key, source) for key in
              ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size")}
    if fields["num_experts_per_tok"] > fields["num_experts"]:
        raise CheckpointError(f"{source}: num_experts_per_tok {fields['num_experts_per_tok']} exceeds num_experts "
                              f"{fields['num_experts']}.")
    norm = text.get("norm_topk_prob", norm_topk_default)
    if not isinstance(norm, bool):
        raise CheckpointError(f"{source}: norm_topk_prob must be true or false, found {norm!r}.")
    if text.get("decoder_sparse_step", 1) != 1:
        raise CheckpointError(f"{source}: decoder_sparse_step {text['decoder_sparse_step']!r}: the MTP layer must be "
                              f"MoE (decoder_sparse_step 1); this oracle does not build a dense-MLP head for it.")
    return fields | {"norm_topk_prob": norm}


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


def stem_and_attention_shapes(cfg: HeadConfig) -> dict[str, tuple[int, ...]]:
    """The Qwen stem, gated attention, layer norms and final norm: every `mtp.*` tensor but the MLP's (each MTP
    layer's attention and norms; one stem and one final norm for all of them)."""
    d = cfg.hidden_size
    shared = {"mtp.pre_fc_norm_embedding.weight": (d,), "mtp.pre_fc_norm_hidden.weight": (d,),
              "mtp.fc.weight": (d, 2 * d), "mtp.norm.weight": (d,)}
    return shared | {k: v for i in range(cfg.num_mtp_layers) for k, v in _attention_shapes(cfg, i).items()}


def _attention_shapes(cfg: HeadConfig, i: int) -> dict[str, tuple[int, ...]]:
    d, hd = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    layer = cfg.layer_prefix(i)
    return {
        layer + "input_layernorm.weight": (d,),
        layer + "self_attn.q_proj.weight": (2 * q, d),  # rows per head: [q_h (hd) | gate_h (hd)]
        layer + "self_attn.k_proj.weight": (kv, d),
        layer + "self_attn.v_proj.weight": (kv, d),
        layer + "self_attn.q_norm.weight": (hd,),
        layer + "self_attn.k_norm.weight": (hd,),
        layer + "self_attn.o_proj.weight": (d, q),
        layer + "post_attention_layernorm.weight": (d,),
    }


def head_tensor_shapes(cfg: HeadConfig) -> dict[str, tuple[int, ...]]:
    """The `mtp.*` tensors of the dense head (15 for one layer; 4 + 11 per layer) and the shape the config implies
    for each ([out, in] for linears)."""
    d, ff = cfg.hidden_size, cfg.intermediate_size
    mlps = {f"{cfg.layer_prefix(i)}mlp.{p}_proj.weight": (d, ff) if p == "down" else (ff, d)
            for i in range(cfg.num_mtp_layers) for p in ("gate", "up", "down")}
    return stem_and_attention_shapes(cfg) | mlps


def check_layer_count(cfg: HeadConfig, names: set[str]) -> None:
    """The MTP layers the checkpoint holds (`mtp.layers.{i}.*`) are exactly the config's 0..N-1: a layer past N
    (most often a head whose config leaves its count out, so it defaults to 1 and a layer would be dropped in
    silence) or one missing is refused, naming both."""
    held = sorted({int(m.group(1)) for n in names if (m := _LAYER.match(n))})
    if held == list(range(cfg.num_mtp_layers)):
        return
    shown = ", ".join(map(str, held)) if held else "none"
    declared = range(cfg.num_mtp_layers)
    missing, extra = [i for i in declared if i not in held], [i for i in held if i not in declared]
    wrong = "; ".join(f"{what} {', '.join(f'{LAYERS}{i}.*' for i in ids)}" for what, ids in
                      (("missing", missing), ("extra", extra)) if ids)
    absent = " (1 where the key is absent)" if cfg.num_mtp_layers == 1 else ""
    raise CheckpointError(f"config.json: mtp_num_hidden_layers = {cfg.num_mtp_layers}{absent} declares MTP layers "
                          f"{LAYERS}0..{cfg.num_mtp_layers - 1}, but the checkpoint holds MTP layer(s) {shown} "
                          f"({wrong}). Set mtp_num_hidden_layers in config.json's text config to the layers the "
                          f"release has, or restore the missing shards.")


# Known wiring mistakes of the Qwen stem and gated attention that still run (shared/reference/mtp_wiring.md §8).
QWEN_VARIANTS = (
    Variant("concat_swap", "fc_in is [h, e], expected [e, h]"),
    Variant("plain_norm", "every RMSNorm of the head scales by w instead of (1 + w), q_norm and k_norm included"),
    Variant("qgate_halves", "q_proj rows split as [all q | all gate] instead of per head [q_h | gate_h]"),
    Variant("no_gate", "attention output not multiplied by sigmoid(gate)"),
    Variant("no_qk_norm", "q_norm and k_norm skipped"),
    Variant("rope_all_dims", "RoPE rotates the whole head instead of its partial rotary dims"),
    Variant("rope_interleaved", "RoPE on GPT-J (interleaved) pairs instead of NeoX halves"),
    Variant("no_rope", "no RoPE at all"),
    Variant("pos_frozen", "every step at the first position"),
    Variant("no_kv_append", "each step attends only to itself (the KV cache never grows)"),
    Variant("pre_norm_hidden", "the main model's hidden taken before its final norm"),
)


def tiny_config(**overrides) -> dict:
    """A config.json for a tiny dense Qwen3.5 head (fixtures and the family contract test)."""
    text = {"model_type": "qwen3_5_text", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 32, "intermediate_size": 96, "vocab_size": 512, "rms_norm_eps": 1e-6,
            "max_position_embeddings": 4096, "num_hidden_layers": 1, "layer_types": ["full_attention"],
            "mtp_num_hidden_layers": 1, "tie_word_embeddings": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                                "mrope_section": [2, 1, 1], "mrope_interleaved": True}}
    text.update(overrides)
    return {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"], "text_config": text}


def dense_layout(cfg: HeadConfig, names: set[str]) -> TensorLayout:
    check_layer_count(cfg, names)
    shapes = head_tensor_shapes(cfg)
    return TensorLayout(shapes | fp8_scale_shapes(cfg, shapes, names))


def fp8_scale_shapes(cfg: HeadConfig, linears: dict[str, tuple[int, ...]], names: set[str]) -> dict[str, tuple]:
    """`X.weight_scale_inv` [ceil(out/bo), ceil(in/bi)] beside each 2-D `X.weight` of `linears` that has one in
    this checkpoint (the head refuses an FP8 weight without its scale). Scales in a checkpoint whose config is
    not quantised are refused: their block size is unknown, and ignoring them would misread the weights."""
    found = {n.removesuffix("weight") + SCALE: s for n, s in linears.items()
             if len(s) == 2 and n.endswith(".weight") and n.removesuffix("weight") + SCALE in names}
    if found and cfg.weight_block_size is None:
        raise CheckpointError(f"the checkpoint has FP8 block scales ({', '.join(sorted(found)[:3])}) but config.json "
                              f"has no quantization_config; add the release's quantization_config (quant_method "
                              f"fp8, weight_block_size [128, 128]).")
    return {n: scale_shape(s, cfg.weight_block_size) for n, s in found.items()}


def attention_fusions(cfg: HeadConfig, layout: TensorLayout) -> dict[str, Fusion]:
    """vLLM's fused attention input of each layer: `qkv_proj` = cat(q_proj (q and gate rows), k_proj, v_proj)
    along rows."""
    attns = [f"{cfg.layer_prefix(i)}self_attn." for i in range(cfg.num_mtp_layers)]
    return {a + "qkv_proj.weight": Fusion(tuple(a + p + "_proj.weight" for p in "qkv")) for a in attns}


def dense_fusions(cfg: HeadConfig, layout: TensorLayout) -> dict[str, Fusion]:
    """The attention fusions plus each dense MLP's `gate_up_proj` = cat(gate_proj, up_proj) rows."""
    mlps = [f"{cfg.layer_prefix(i)}mlp." for i in range(cfg.num_mtp_layers)]
    return attention_fusions(cfg, layout) | {m + "gate_up_proj.weight": Fusion((m + "gate_proj.weight",
                                                                        m + "up_proj.weight")) for m in mlps}


def spine_dims(cfg: HeadConfig) -> Dims:
    return Dims(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok)


# ---- the sparse MoE block of Qwen3.5-MoE and Qwen3-Next (their layout files are declarations over it) --------
#
# Experts come in two layouts, both found in released checkpoints (shared/reference/mtp_wiring.md §3.1):
# per-expert `mtp.layers.0.mlp.experts.{e}.{gate,up,down}_proj.weight`, or fused `mtp.layers.0.mlp.experts.gate_up_proj`
# [E, 2I, D] (gate rows first) and `experts.down_proj` [E, D, I].
# FP8: per-expert routed experts carry `experts.{e}.{gate,up,down}_proj.weight_scale_inv` like any other linear, as
# the -FP8 releases name them. Fused experts with block scales have no released layout to check against (where would
# [E, 2I, D]'s scale grid and its gate/up split lie?), so a fused FP8 checkpoint is refused rather than guessed; fused
# bf16 experts beside FP8 linears are read as usual.

MLP = "mtp.layers.0.mlp."
FUSED = {"gate_up": MLP + "experts.gate_up_proj", "down": MLP + "experts.down_proj"}
PER_EXPERT = {p: MLP + "experts.{e}." + p + "_proj.weight" for p in ("gate", "up", "down")}

MOE_VARIANTS = (
    Variant("topk_not_renormalised", "top-k weights used as softmax probabilities, not renormalised to sum 1"),
    Variant("shared_ungated", "shared expert added without its sigmoid(shared_expert_gate) factor"),
)


def moe_block_shapes(cfg: HeadConfig) -> dict[str, tuple[int, ...]]:
    """Router, shared expert and its gate (the routed experts are the ExpertLayout)."""
    d, s = cfg.hidden_size, cfg.shared_expert_intermediate_size
    return {MLP + "gate.weight": (cfg.num_experts, d),
            MLP + "shared_expert.gate_proj.weight": (s, d), MLP + "shared_expert.up_proj.weight": (s, d),
            MLP + "shared_expert.down_proj.weight": (d, s), MLP + "shared_expert_gate.weight": (1, d)}


def moe_layout(cfg: HeadConfig, names: set[str]) -> TensorLayout:
    """The stem, attention and MoE block, with the experts in whichever layout the checkpoint uses."""
    fused = any(n in names for n in FUSED.values())
    if fused:
        _refuse_fused_fp8_scales(names)
    per_expert = any(n.startswith(MLP + "experts.") and n not in FUSED.values() for n in names)
    if fused and per_expert:
        raise CheckpointError("the checkpoint holds both fused (experts.gate_up_proj) and per-expert "
                              "(experts.{e}.*_proj.weight) expert tensors; keep one layout.")
    experts = ExpertLayout("fused" if fused else "per_expert", cfg.num_experts, cfg.moe_intermediate_size,
                           cfg.hidden_size, FUSED if fused else PER_EXPERT)
    check_layer_count(cfg, names)
    dense = stem_and_attention_shapes(cfg) | moe_block_shapes(cfg)
    # expert scales (small) are digested with the dense tensors, as DeepSeek's are
    return TensorLayout(dense | fp8_scale_shapes(cfg, dense | experts.shapes(), names), experts)


def _refuse_fused_fp8_scales(names: set[str]) -> None:
    """A scale beside fused experts (`experts.gate_up_proj_scale_inv`, `experts.gate_up_proj.weight_scale_inv`, ...)
    has no confirmed layout; refuse it by name instead of calling it a second expert layout."""
    scales = sorted(n for n in names if n.startswith(MLP + "experts.") and "scale" in n)
    if scales:
        raise CheckpointError(f"fused routed experts ({FUSED['gate_up']}) with FP8 block scales "
                              f"({', '.join(scales[:3])}): no released checkpoint stores fused FP8 experts, so their "
                              f"scale layout cannot be checked; this oracle refuses to guess it. Store the experts per "
                              f"expert (experts.{{e}}.gate_proj.weight with its {SCALE}), as the -FP8 releases do.")


def moe_fusions(cfg: HeadConfig, layout: TensorLayout) -> dict[str, Fusion]:
    """vLLM's names: `qkv_proj`, the shared expert's `gate_up_proj`, and FusedMoE `experts.w13_weight` [E, 2I, D]
    (per expert cat(gate, up); a fused checkpoint's `gate_up_proj` as is) and `experts.w2_weight` [E, D, I]."""
    shared, fused = MLP + "shared_expert.", layout.experts is not None and layout.experts.kind == "fused"
    experts = ({MLP + "experts.w13_weight": Fusion((FUSED["gate_up"],)),
                MLP + "experts.w2_weight": Fusion((FUSED["down"],))} if fused else
               {MLP + "experts.w13_weight": Fusion((PER_EXPERT["gate"], PER_EXPERT["up"]), experts=cfg.num_experts),
                MLP + "experts.w2_weight": Fusion((PER_EXPERT["down"],), experts=cfg.num_experts)})
    return attention_fusions(cfg, layout) | experts | {
        shared + "gate_up_proj.weight": Fusion((shared + "gate_proj.weight", shared + "up_proj.weight"))}


def moe_spec(name: str, model_types: tuple[str, ...], architectures: tuple[str, ...],
             main_model_prefixes: tuple[str, ...], mrope: bool, tiny_config, notes: tuple[str, ...] = ()) -> FamilySpec:
    """A Qwen-stem MoE family's spec: the stem with the MoE block (layout, stages, variants, fusions); the family
    says what differs (names, model types, where its main model lies, mrope or plain RoPE, tiny config, notes)."""
    def head_config_from_json(raw: dict, source: str) -> HeadConfig:
        return parse_qwen_config(raw, source, name, model_types, moe=True, mrope=mrope)

    return FamilySpec(
        name=name, model_types=model_types, architectures=architectures, parse_config=head_config_from_json,
        layout=moe_layout, head_prefix="mtp.", stages=lambda cfg: with_draft(with_moe(SPINE)), dims=spine_dims,
        main_model_prefixes=main_model_prefixes, lm_head=LM_HEAD, head_module=f"oracle.families.{name}",
        variants=QWEN_VARIANTS + MOE_VARIANTS, tiny_config=tiny_config, fusions=moe_fusions, one_plus_norms=True,
        notes=notes)


SPEC = FamilySpec(
    name=FAMILY, model_types=MODEL_TYPES,
    architectures=("Qwen3_5ForConditionalGeneration", "Qwen3_5ForCausalLM"),
    parse_config=head_config_from_json, layout=dense_layout, head_prefix="mtp.",
    stages=lambda cfg: with_draft(SPINE), dims=spine_dims, main_model_prefixes=MAIN_MODEL_PREFIXES, lm_head=LM_HEAD,
    head_module="oracle.families.qwen3_5", variants=QWEN_VARIANTS, tiny_config=tiny_config,
    fusions=dense_fusions,
    one_plus_norms=True,
)
