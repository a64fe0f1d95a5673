"""Torch-free parts shared by the DeepSeek-V3 and GLM-4.5 MTP heads (transformers' `MtpLayer` families), and the
declaration a family of that kind makes (`MtpLayerFamily`, `declare`): its config keys and defaults, its attention
fields and tensors, its wiring variants and tiny config; everything else is here, once.

Both release their MTP layer as one more decoder layer of the main stack, `model.layers.{num_hidden_layers}.*`
(shared/reference/mtp_wiring.md §3.3-3.4):

    enorm.weight, hnorm.weight [D]          the stem's two plain (w * x̂) RMSNorms
    eh_proj.weight [D, 2D]                  over concat(enorm(embed), hnorm(H)), embedding first
    input_layernorm, self_attn.*, post_attention_layernorm, mlp.*      the decoder layer (always MoE)
    shared_head.norm.weight [D]             the head's final norm (transformers: MtpLayer.post_norm)
    shared_head.head.weight [V, D]          a copy of lm_head (optional; accept uses it where present)
    embed_tokens.weight [V, D]              a copy of the embedding (optional; export uses it where present)

The MoE block is the `noaux_tc` router: sigmoid scores, `e_score_correction_bias` added for the choice only,
group-limited top-k (`n_group` groups scored by their top-2 sum, `topk_group` kept), weights from the unbiased
scores, renormalised when `norm_topk_prob`, times `routed_scaling_factor`; plus `n_shared_experts` shared experts,
added unscaled. Routed experts are per-expert tensors, `mlp.experts.{e}.{gate,up,down}_proj.weight`.

FP8 (DeepSeek-V3/R1 as released, `quantization_config.quant_method = "fp8"`): a linear stored as F8_E4M3 has a
`weight_scale_inv` beside it (oracle/fp8.py); the layout accepts a scale exactly where the checkpoint has one.

Position-0 embedding mask: an engine convention (vLLM zeroes the embedding at absolute position 0; transformers'
MtpLayer and SGLang do not). Off by default; `mask_pos0_embedding` in the head config turns it on
(`mtp-oracle export --mask-pos0-embedding`), and the trace's config and evidence rules record it.
"""

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from oracle.errors import CheckpointError
from oracle.families.spec import (MAIN_LM_HEAD, NO_POS0_STEP, ExpertLayout, FamilySpec, TensorLayout, Variant,
                                  has_position_0)
from oracle.fp8 import scale_shape
from oracle.stages import SPINE, Dims, StageList, with_draft, with_moe

HEAD_PREFIX = "model.layers.{num_hidden_layers}."  # formatted with the config's num_hidden_layers
MAIN_MODEL_PREFIXES = ("model.",)
SHARED_HEAD = HEAD_PREFIX + "shared_head.head.weight"  # the lm_head copy acceptance uses where present
_SCALE = "weight_scale_inv"


@dataclass(frozen=True, kw_only=True)
class MtpLayerConfig:
    """What both families' heads read. Family configs add their attention fields."""

    family: str
    hidden_size: int
    vocab_size: int
    max_position_embeddings: int
    num_hidden_layers: int  # the MTP layer's index in the checkpoint: model.layers.{num_hidden_layers}.
    num_attention_heads: int
    num_key_value_heads: int
    rms_norm_eps: float
    rope_parameters: dict  # as transformers reads it: rope_type, rope_theta (+ yarn fields, partial_rotary_factor)
    num_experts: int  # n_routed_experts
    num_experts_per_tok: int
    moe_intermediate_size: int
    n_shared_experts: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    weight_block_size: tuple[int, int] | None = None  # FP8 block scales (quantization_config), None for bf16
    mask_pos0_embedding: bool = False  # engine convention: zero the embedding at absolute position 0

    @property
    def head_prefix(self) -> str:
        return HEAD_PREFIX.format(num_hidden_layers=self.num_hidden_layers)

    @property
    def intermediate_size(self) -> int:  # MLP width a token passes through, for memory estimates (oracle/limits.py)
        return self.moe_intermediate_size * (self.num_experts_per_tok + self.n_shared_experts)

    @property
    def rope_theta(self) -> float:
        return self.rope_parameters["rope_theta"]

    def to_dict(self) -> dict:
        d = asdict(self)
        d["weight_block_size"] = list(self.weight_block_size) if self.weight_block_size else None
        return d


# ---------------------------------------------------------------------------------------------------------------
# config.json fields, each checked for its JSON type where it is read


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def positive_int(raw: dict, key: str, source: str, default=None) -> int:
    value = raw.get(key, default)
    if not is_int(value) or value <= 0:
        raise CheckpointError(f"{source}: {key} must be a positive integer, found {value!r}.")
    return value


def positive_number(raw: dict, key: str, source: str, default=None) -> float:
    value = raw.get(key, default)
    if not (is_int(value) or isinstance(value, float)) or not math.isfinite(value) or value <= 0:
        raise CheckpointError(f"{source}: {key} must be a positive finite number, found {value!r}.")
    return float(value)


def boolean(raw: dict, key: str, source: str, default: bool) -> bool:
    value = raw.get(key, default)
    if not isinstance(value, bool):
        raise CheckpointError(f"{source}: {key} must be true or false, found {value!r}.")
    return value


def require(raw: dict, key: str, expected, source: str, default=None) -> None:
    value = raw.get(key, expected if default is None else default)
    if value != expected or type(value) is not type(expected):
        raise CheckpointError(f"{source}: {key} = {value!r}; this oracle supports only {key} = {expected!r}.")


def rope_parameters(raw: dict, source: str, allowed: tuple[str, ...], partial_rotary_factor: float | None) -> dict:
    """`rope_parameters` (transformers 5) or legacy `rope_scaling` + `rope_theta`, as one dict transformers reads.
    rope_theta is required (transformers would silently use 1e4)."""
    for key in ("rope_parameters", "rope_scaling"):
        if raw.get(key) is not None and not isinstance(raw[key], dict):
            raise CheckpointError(f"{source}: {key} must be an object or null, found {raw[key]!r}.")
    rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    rope_type = rope.pop("rope_type", rope.pop("type", "default"))
    if rope_type not in allowed:
        raise CheckpointError(f"{source}: rope type {rope_type!r} is not supported for this family "
                              f"(supported: {', '.join(allowed)}).")
    theta = rope.pop("rope_theta", raw.get("rope_theta"))
    if theta is None:
        raise CheckpointError(f"{source}: no rope_theta (looked in rope_parameters.rope_theta and rope_theta); the "
                              f"transformers default of 10000 would be silently wrong. Add the model's value.")
    out = {"rope_type": rope_type, "rope_theta": positive_number({"rope_theta": theta}, "rope_theta", source)}
    if rope_type == "yarn":
        out["factor"] = positive_number(rope, "factor", source)
        out["original_max_position_embeddings"] = positive_int(rope, "original_max_position_embeddings", source)
        for key, default in (("beta_fast", 32), ("beta_slow", 1)):
            out[key] = positive_number(rope, key, source, default)
        for key in ("mscale", "mscale_all_dim", "attention_factor"):
            if rope.get(key) is not None:
                value = rope[key]
                if not (is_int(value) or isinstance(value, float)) or not math.isfinite(value) or value < 0:
                    raise CheckpointError(f"{source}: rope {key} must be a non-negative number, found {value!r}.")
                out[key] = float(value)
        if "truncate" in rope:
            out["truncate"] = boolean(rope, "truncate", source, True)
    if partial_rotary_factor is not None:
        out["partial_rotary_factor"] = partial_rotary_factor
    return out


def weight_block_size(raw: dict, source: str) -> tuple[int, int] | None:
    """The FP8 block size from `quantization_config` (DeepSeek's block fp8), None when the checkpoint is not
    quantised. Any other quantisation is refused, never read as if it were plain weights."""
    quant = raw.get("quantization_config")
    if quant is None:
        return None
    if not isinstance(quant, dict) or quant.get("quant_method") != "fp8" or quant.get("fmt", "e4m3") != "e4m3":
        raise CheckpointError(f"{source}: quantization_config {quant!r} is not supported; this oracle reads "
                              f"bf16 weights and DeepSeek's block FP8 (quant_method fp8, fmt e4m3, "
                              f"weight_block_size).")
    block = quant.get("weight_block_size", [128, 128])
    if not isinstance(block, list) or len(block) != 2 or not all(is_int(b) and b > 0 for b in block):
        raise CheckpointError(f"{source}: quantization_config.weight_block_size must be [rows, cols], found "
                              f"{block!r}.")
    return tuple(block)


def moe_fields(raw: dict, source: str, defaults: dict) -> dict:
    """The noaux_tc MoE block's fields, checked for consistency (the router's group arithmetic must be exact)."""
    require(raw, "hidden_act", "silu", source)
    for key, expected in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
        if key in raw:
            require(raw, key, expected, source)
    if raw.get("moe_layer_freq", 1) != 1:
        raise CheckpointError(f"{source}: moe_layer_freq {raw['moe_layer_freq']!r}: the MTP layer must be MoE every "
                              f"layer (moe_layer_freq 1).")
    f = {"num_experts": positive_int(raw, "n_routed_experts", source, defaults.get("n_routed_experts")),
         "num_experts_per_tok": positive_int(raw, "num_experts_per_tok", source, defaults.get("num_experts_per_tok")),
         "moe_intermediate_size": positive_int(raw, "moe_intermediate_size", source,
                                               defaults.get("moe_intermediate_size")),
         "n_shared_experts": positive_int(raw, "n_shared_experts", source, defaults.get("n_shared_experts")),
         "n_group": positive_int(raw, "n_group", source, defaults.get("n_group")),
         "topk_group": positive_int(raw, "topk_group", source, defaults.get("topk_group")),
         "routed_scaling_factor": positive_number(raw, "routed_scaling_factor", source,
                                                  defaults.get("routed_scaling_factor")),
         "norm_topk_prob": boolean(raw, "norm_topk_prob", source, defaults.get("norm_topk_prob", True))}
    e, g, kg, k = f["num_experts"], f["n_group"], f["topk_group"], f["num_experts_per_tok"]
    if e % g or e // g < 2:
        raise CheckpointError(f"{source}: n_routed_experts {e} must split into n_group {g} equal groups of at least "
                              f"2 experts (a group is scored by its top-2 sum).")
    if kg > g or k > kg * (e // g):
        raise CheckpointError(f"{source}: topk_group {kg} of n_group {g} groups of {e // g} experts cannot hold "
                              f"num_experts_per_tok {k}.")
    return f


def common_fields(raw: dict, source: str, model_types: tuple[str, ...], family: str, defaults: dict) -> dict:
    model_type = raw.get("model_type")
    if model_type not in model_types:
        raise CheckpointError(f"{source}: model_type {model_type!r} is not a {family} model "
                              f"(expected one of {', '.join(model_types)}).")
    layers = raw.get("num_nextn_predict_layers", raw.get("num_mtp_layers", 1))
    if layers != 1 or not is_int(layers):
        raise CheckpointError(f"{source}: num_nextn_predict_layers = {layers!r}; this oracle supports one MTP layer.")
    heads = positive_int(raw, "num_attention_heads", source)
    # absent: the family's config class default (GLM: 8), or, where it has none that fits (DeepSeek-V3's 128 is
    # V3's head count; MLA keeps keys and values per attention head), the head count
    kv_heads = positive_int(raw, "num_key_value_heads", source, defaults.get("num_key_value_heads", heads))
    if heads % kv_heads:
        given = "" if "num_key_value_heads" in raw else f" ({family}'s default: config.json does not set it)"
        raise CheckpointError(f"{source}: num_attention_heads {heads} is not a multiple of num_key_value_heads "
                              f"{kv_heads}{given}.")
    return {"family": family, "hidden_size": positive_int(raw, "hidden_size", source),
            "vocab_size": positive_int(raw, "vocab_size", source),
            "max_position_embeddings": positive_int(raw, "max_position_embeddings", source,
                                                    defaults["max_position_embeddings"]),
            "num_hidden_layers": positive_int(raw, "num_hidden_layers", source),
            "num_attention_heads": heads, "num_key_value_heads": kv_heads,
            "rms_norm_eps": positive_number(raw, "rms_norm_eps", source, defaults["rms_norm_eps"]),
            "weight_block_size": weight_block_size(raw, source)}


# ---------------------------------------------------------------------------------------------------------------
# tensors


@dataclass(frozen=True)
class MtpLayerTensors(TensorLayout):
    """The head's tensors; `copies` are the MTP layer's own embedding/lm_head copies where the checkpoint has them.
    They are shape-checked and read only where used (embedding rows at export, the head at accept), and left out
    of `dense`, so the head digest does not hash two vocabulary-sized tables (export records the embedding rows in
    /inputs/embed)."""

    copies: dict = field(default_factory=dict)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return super().shapes() | self.copies


def expert_names(cfg: MtpLayerConfig) -> dict[str, str]:
    mlp = cfg.head_prefix + "mlp."
    return {p: mlp + "experts.{e}." + p + "_proj.weight" for p in ("gate", "up", "down")}


def layer_tensors(cfg: MtpLayerConfig, attention: dict[str, tuple[int, ...]], names: set[str]) -> MtpLayerTensors:
    """Stem, `attention` (the family's self_attn.* shapes, prefixed), norms, the MoE block; FP8 scales beside the
    linears that have one in this checkpoint; the optional embedding/lm_head copies."""
    p, d, e = cfg.head_prefix, cfg.hidden_size, cfg.num_experts
    shared = cfg.moe_intermediate_size * cfg.n_shared_experts
    dense = {p + "enorm.weight": (d,), p + "hnorm.weight": (d,), p + "eh_proj.weight": (d, 2 * d),
             p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
             p + "shared_head.norm.weight": (d,),
             p + "mlp.gate.weight": (e, d), p + "mlp.gate.e_score_correction_bias": (e,),
             p + "mlp.shared_experts.gate_proj.weight": (shared, d),
             p + "mlp.shared_experts.up_proj.weight": (shared, d),
             p + "mlp.shared_experts.down_proj.weight": (d, shared)}
    dense |= {p + "self_attn." + n: s for n, s in attention.items()}
    experts = ExpertLayout("per_expert", e, cfg.moe_intermediate_size, d, expert_names(cfg))
    block = cfg.weight_block_size or (128, 128)
    linears = {n: s for n, s in (dense | experts.shapes()).items() if len(s) == 2 and n.endswith(".weight")}
    # FP8 scales (small) are digested with the dense tensors, the experts' too
    dense |= {n.removesuffix("weight") + _SCALE: scale_shape(s, block) for n, s in linears.items()
              if n.removesuffix("weight") + _SCALE in names}
    copies = {p + n: (cfg.vocab_size, d) for n in ("embed_tokens.weight", "shared_head.head.weight") if p + n in names}
    return MtpLayerTensors(dense, experts, copies)


# ---------------------------------------------------------------------------------------------------------------
# stages, evidence, variants


def mtp_layer_stages(cfg: MtpLayerConfig) -> StageList:
    docs = {
        "e": "enorm(embedding row) (MTP layer's enorm, plain w * x̂ RMSNorm; zero row at absolute position 0 when "
             "mask_pos0_embedding)",
        "h": "hnorm(H): the MTP layer's hnorm of the main model's post-final-norm hidden",
        "fc_in": "concat(e, h), embedding first: the input of eh_proj",
        "fc": "eh_proj(fc_in), [2D] -> [D]",
        "ah": "input_layernorm(fc): the attention input",
        "attn": "self_attn output after o_proj, before the residual add (DeepSeek: MLA; GLM: GQA, partial RoPE)",
        "router_logits": "mlp.gate linear output in float32 (before sigmoid and e_score_correction_bias)",
        "topk_ids": "experts chosen by the noaux_tc router: sigmoid + e_score_correction_bias, group-limited top-k; "
                    "compared as a set",
        "topk_weights": "the chosen experts' weights: unbiased sigmoid scores, renormalised when norm_topk_prob, "
                        "times routed_scaling_factor",
        "shared": "the shared experts' output (n_shared_experts fused, added unscaled)",
        "routed": "the weighted sum of the chosen routed experts' outputs",
        "mlp": "MoE output: routed + shared",
        "out": "shared_head.norm(res2) (transformers: MtpLayer.post_norm): fed to shared_head.head, recycled as H",
    }
    return StageList(s.with_doc(docs[s.name]) if s.name in docs else s
                     for s in with_draft(with_moe(SPINE)))


def dims(cfg: MtpLayerConfig) -> Dims:
    return Dims(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok)


POS0_OBSERVABLE = ("position 0 observable: the embedding at absolute position 0 is zeroed (mask_pos0_embedding), "
                   "so a candidate whose positions are shifted, or that masks another position or none, differs at "
                   "e; other absolute positions are not evidenced (RoPE scores depend only on relative positions)")


@dataclass(frozen=True)
class MtpLayerSpec(FamilySpec):
    """A FamilySpec whose evidence rules depend on the position-0 embedding mask."""

    def evidence_rules(self, cfg, positions=None) -> dict:
        rules = super().evidence_rules(cfg, positions)
        if getattr(cfg, "mask_pos0_embedding", False):  # observable only where a step sits at position 0
            rules["absolute_positions"] = POS0_OBSERVABLE if has_position_0(positions) else NO_POS0_STEP
        rules["router_group_limited"] = ("/evidence/router_group_limited [T, 1]: 1 where the group limit (n_group, "
                                         "topk_group) changed the token's expert choice; a group-limit error can "
                                         "show only at those tokens")
        return rules


VARIANTS = (
    Variant("concat_swap", "fc_in is [h, e], expected [e, h]"),
    Variant("pre_norm_hidden", "the main model's hidden taken before its final norm"),
    Variant("main_norm_for_out", "out normed with the main model's model.norm instead of shared_head.norm"),
    Variant("pos0_mask_missing", "the embedding at absolute position 0 not zeroed, although the reference masks it "
                                 "(mask_pos0_embedding on)"),
    Variant("pos0_mask_extra", "the embedding at absolute position 0 zeroed (vLLM's convention), although the "
                               "reference does not mask it"),
    Variant("embed_main_copy", "the main model's embed_tokens used where the MTP layer has its own (differing) copy"),
    Variant("bias_in_weights", "topk_weights taken from the biased scores (sigmoid + e_score_correction_bias)"),
    Variant("no_correction_bias", "experts chosen without e_score_correction_bias"),
    Variant("no_group_limit", "top-k over all experts, ignoring n_group/topk_group"),
    Variant("not_renormalised", "top-k weights not renormalised although norm_topk_prob"),
    Variant("no_routed_scaling", "routed_scaling_factor not applied to the routed experts' weights"),
    Variant("shared_scaled", "routed_scaling_factor applied to the shared experts' output too"),
    Variant("gate_up_swap", "gate and up projections swapped in the routed experts"),
    Variant("fp8_scale_transposed", "FP8 block scales indexed [col block, row block]"),
    Variant("pos_frozen", "every step at the first position"),
)


# ---------------------------------------------------------------------------------------------------------------
# declarations


@dataclass(frozen=True)
class MtpLayerFamily:
    """What one MtpLayer family says beyond the shared code (the torch half declares its official classes:
    oracle/families/mtp_layer.py `OfficialMtpLayer`)."""

    name: str  # also the torch half's module: oracle.families.{name}
    model_types: tuple[str, ...]
    architectures: tuple[str, ...]
    head_config: type  # the family's MtpLayerConfig subclass: its attention fields
    defaults: dict  # transformers' config-class defaults for the keys a config.json may omit
    # (raw config.json, its path, the shared fields) -> the family's own fields, rope_parameters included; raises
    # CheckpointError for what the family does not support
    attention_fields: Callable[[dict, str, dict], dict]
    attention_shapes: Callable[[MtpLayerConfig], dict[str, tuple[int, ...]]]  # self_attn.* name -> shape
    tiny_config: Callable[..., dict]
    engine_mtp: str  # vLLM's MTP model of the family (the one that zeroes the position-0 embedding)
    variants: tuple[Variant, ...] = ()  # the family's own, after the shared VARIANTS


def head_config_from_json(declared: MtpLayerFamily, raw: dict, source: str) -> MtpLayerConfig:
    """The head config of a flat config.json: the shared fields, the family's attention fields, the MoE block."""
    if isinstance(raw.get("text_config"), dict):
        raise CheckpointError(f"{source}: a {declared.name} config.json is flat; this one nests text_config.")
    fields = common_fields(raw, source, declared.model_types, declared.name, declared.defaults)
    own = declared.attention_fields(raw, source, fields)
    return declared.head_config(**fields, **own, **moe_fields(raw, source, declared.defaults))


def declare(declared: MtpLayerFamily) -> MtpLayerSpec:
    """The FamilySpec of one declared MtpLayer family."""
    return MtpLayerSpec(
        name=declared.name, model_types=declared.model_types, architectures=declared.architectures,
        parse_config=lambda raw, source: head_config_from_json(declared, raw, source),
        layout=lambda cfg, names: layer_tensors(cfg, declared.attention_shapes(cfg), names),
        head_prefix=HEAD_PREFIX, stages=mtp_layer_stages, dims=dims, main_model_prefixes=MAIN_MODEL_PREFIXES,
        lm_head=SHARED_HEAD, head_module=f"oracle.families.{declared.name}", variants=VARIANTS + declared.variants,
        tiny_config=declared.tiny_config,
        notes=(f"mask_pos0_embedding: off as transformers' MtpLayer and SGLang; vLLM's {declared.engine_mtp} zeroes "
               f"the embedding at position 0 (export --mask-pos0-embedding)",
               "embedding/lm_head: the MTP layer's own copies where present (trace attribute `embedding`)"))
