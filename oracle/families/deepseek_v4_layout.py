"""DeepSeek-V4 (`deepseek_v4`) MTP head, torch-free half: config parsing, the release's tensor names and shapes, the
stage list, evidence rules, known wiring variants and a tiny config. The head itself, built from transformers'
official `DeepseekV4*` classes, is `oracle/families/deepseek_v4.py`.

The head (shared/reference/mtp_wiring.md §3.7; seed 002, V4's `MTPBlock`), one step:

    e      = enorm(embed[t])                              plain w·x̂ RMSNorm, fp32 weights
    h      = hnorm(H)                                     H: [hc, D], the main model's LAST BLOCK OUTPUT STREAMS
                                                          (before its hc_head and final norm); RMS per stream, over D
    x_in   = h_proj(h) + e_proj(e)                        the e term broadcast to every stream
    block  = one V4 decoder block on the streams:         mHC collapse -> attn_norm -> sliding-window attention with
                                                          per-head sinks -> mHC expand/mix; the same around ffn_norm
                                                          -> top-k MoE (sqrtsoftplus scores, selection bias)
    out    = norm(hc_head(block_out))                     the MTP's OWN hc_head_{fn,base,scale} and norm, then the
                                                          shared lm_head (`head.weight`)
    draft k+1 recycles block_out (the streams before hc_head) as its H.

Tensors (native names, all under `mtp.0.`; embedding `embed.weight` and lm_head `head.weight` are the main model's):
`e_proj`, `h_proj`, `enorm`, `hnorm`, `norm`, `hc_head_{fn,base,scale}`, `attn_norm`, `ffn_norm`,
`hc_{attn,ffn}_{fn,base,scale}`, `attn.{wq_a,q_norm,wq_b,wkv,kv_norm,wo_a,wo_b,attn_sink}`, `ffn.gate.{weight,bias}`,
`ffn.experts.{e}.w{1,2,3}` (w1 gate, w3 up, w2 down), `ffn.shared_experts.w{1,2,3}`. FP8 linears carry a `.scale`
block scale beside `.weight` (`X.scale` is what transformers renames to `X.weight_scale_inv`); F32 or UE8M0 scales.

Config: `config.json` as transformers' `DeepseekV4Config` reads it, or the release's own key names (`dim`,
`n_heads`, `window_size`, `compress_ratios`, `n_activated_experts`, `moe_inter_dim`, `score_func`, `route_scale`,
`norm_eps`, `rope_head_dim`, ...; a key given under both names must agree). The MTP layer's attention type: a
`compress_ratios` list one longer than the main stack ends with the MTP layer's ratio, which must be 0 (pure sliding
window, no compressor or indexer: seed 002 §11.10); with no entry for it (or `layer_types`, which transformers
truncates to the main stack) the MTP layer is taken to be sliding-window (shared/reference/mtp_wiring.md §3.7 marks
this UNVERIFIED for the release).
"""

import math
from dataclasses import asdict, dataclass, replace

from oracle.errors import CheckpointError
from oracle.families.spec import NO_POS0_STEP, ExpertLayout, FamilySpec, TensorLayout, Variant, has_position_0
from oracle.fp8 import scale_shape
from oracle.stages import (AFTER_ATTN, AH, ATTN, BLOCK_OUT, DRAFT, E, E_PROJ, H, H_PROJ, HEAD_COLLAPSED, MH, MLP, MOE,
                           OUT, X_IN, Dims, StageList)

FAMILY = "deepseek_v4"
MODEL_TYPES = ("deepseek_v4",)
ARCHITECTURES = ("DeepseekV4ForCausalLM",)
HEAD_PREFIX = "mtp.0."
EMBED = "embed.weight"  # the release's top-level embedding (transformers renames it to model.embed_tokens.weight)
LM_HEAD = "head.weight"  # the shared lm_head (transformers: lm_head.weight)
SCORING = ("sqrtsoftplus", "sigmoid")  # what transformers' DeepseekV4TopKRouter can apply (ACT2FN[scoring_func])
_SCALE = "scale"

# The release's (inference/config.json) key names beside transformers' DeepseekV4Config names.
ALIASES = {
    "hidden_size": ("dim",), "num_attention_heads": ("n_heads",), "num_hidden_layers": ("n_layers",),
    "sliding_window": ("window_size",), "num_experts_per_tok": ("n_activated_experts",),
    "moe_intermediate_size": ("moe_inter_dim",), "scoring_func": ("score_func",),
    "routed_scaling_factor": ("route_scale",), "rms_norm_eps": ("norm_eps",), "qk_rope_head_dim": ("rope_head_dim",),
    "num_nextn_predict_layers": ("n_mtp_layers",),
}
# transformers' DeepseekV4Config defaults (V4-Flash-like) for fields a config.json may omit.
DEFAULTS = {"num_key_value_heads": 1, "head_dim": 512, "q_lora_rank": 1024, "num_experts_per_tok": 6,
            "n_routed_experts": 256, "n_shared_experts": 1, "scoring_func": "sqrtsoftplus", "norm_topk_prob": True,
            "routed_scaling_factor": 1.5, "max_position_embeddings": 1048576, "hc_mult": 4, "hc_sinkhorn_iters": 20,
            "hc_eps": 1e-6, "swiglu_limit": 10.0, "sliding_window": 128, "o_groups": 8, "o_lora_rank": 1024,
            "rms_norm_eps": 1e-6, "moe_intermediate_size": 2048, "hidden_act": "silu"}


@dataclass(frozen=True)
class HeadConfig:
    hidden_size: int
    vocab_size: int
    max_position_embeddings: int
    num_hidden_layers: int  # the main stack's (the MTP layer is not one of them)
    num_attention_heads: int
    head_dim: int
    q_lora_rank: int
    qk_rope_head_dim: int  # the trailing slice of each head that RoPE rotates (interleaved pairs)
    o_groups: int
    o_lora_rank: int
    sliding_window: int  # W: query t sees its own key and the W-1 before it
    rope_theta: float  # the sliding-window ("main") RoPE base; the MTP layer has no compressor
    rms_norm_eps: float
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    n_shared_experts: int
    scoring_func: str
    routed_scaling_factor: float
    swiglu_limit: float
    norm_topk_prob: bool = True  # transformers' DeepseekV4TopKRouter always renormalises; false is refused
    weight_block_size: tuple[int, int] | None = None  # FP8 block scales, None for bf16
    mask_pos0_embedding: bool = False  # engine convention (vLLM masks, the official reference does not)
    family: str = FAMILY
    num_key_value_heads: int = 1  # shared-KV MQA: one KV head, read as both key and value

    @property
    def partial_rotary_factor(self) -> float:
        return self.qk_rope_head_dim / self.head_dim

    @property
    def intermediate_size(self) -> int:  # MLP width a token passes through (oracle/limits.py's memory estimate)
        return self.moe_intermediate_size * (self.num_experts_per_tok + self.n_shared_experts)

    @property
    def hidden_width(self) -> int:
        """The width of the hidden H each step consumes: hc_mult streams of D."""
        return self.hc_mult * self.hidden_size

    def to_dict(self) -> dict:
        d = asdict(self)
        d["weight_block_size"] = list(self.weight_block_size) if self.weight_block_size else None
        return d


def _get(raw: dict, key: str, source: str, default=None):
    """raw[key] under transformers' name or the release's; both present must agree."""
    names = [n for n in (key, *ALIASES.get(key, ())) if n in raw]
    values = {repr(raw[n]) for n in names}
    if len(values) > 1:
        raise CheckpointError(f"{source}: {' and '.join(names)} disagree ({', '.join(f'{n}={raw[n]!r}' for n in names)});"
                              f" they name the same field.")
    return raw[names[0]] if names else DEFAULTS.get(key, default)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int(raw: dict, key: str, source: str, default=None, minimum: int = 1) -> int:
    value = _get(raw, key, source, default)
    if not _is_int(value) or value < minimum:
        raise CheckpointError(f"{source}: {key} must be an integer >= {minimum}, found {value!r}.")
    return value


def _number(raw: dict, key: str, source: str, default=None) -> float:
    value = _get(raw, key, source, default)
    if not (_is_int(value) or isinstance(value, float)) or not math.isfinite(value) or value <= 0:
        raise CheckpointError(f"{source}: {key} must be a positive finite number, found {value!r}.")
    return float(value)


def head_config_from_json(raw: dict, source: str) -> HeadConfig:
    """The V4 MTP head's config from config.json (transformers' or the release's key names)."""
    if raw.get("model_type") not in MODEL_TYPES:
        raise CheckpointError(f"{source}: model_type {raw.get('model_type')!r} is not a {FAMILY} model.")
    layers = _get(raw, "num_nextn_predict_layers", source, 1)
    if layers != 1 or not _is_int(layers):
        raise CheckpointError(f"{source}: num_nextn_predict_layers = {layers!r}; this oracle supports one MTP layer.")
    act = _get(raw, "hidden_act", source)
    if act != "silu":
        raise CheckpointError(f"{source}: hidden_act {act!r}; the V4 head uses silu.")
    n = _int(raw, "num_hidden_layers", source)
    _check_mtp_attention(raw, n, source)
    quant = raw.get("quantization_config")
    scoring = _get(raw, "scoring_func", source)
    if scoring == "softmax":  # listed by DeepSeek's reference Gate, which then also skips the top-k renormalisation
        raise CheckpointError(f"{source}: scoring_func 'softmax' is not supported: transformers' DeepseekV4TopKRouter "
                              f"scores with ACT2FN[scoring_func], which has no softmax, so there is no official "
                              f"module to build the head from (supported: {', '.join(SCORING)}).")
    if scoring not in SCORING:
        raise CheckpointError(f"{source}: scoring_func {scoring!r}; expected one of {', '.join(SCORING)}.")
    norm_topk = _get(raw, "norm_topk_prob", source, True)
    if not isinstance(norm_topk, bool):
        raise CheckpointError(f"{source}: norm_topk_prob must be true or false, found {norm_topk!r}.")
    rope = raw.get("rope_parameters") if isinstance(raw.get("rope_parameters"), dict) else {}
    main = rope.get("main") if isinstance(rope.get("main"), dict) else rope
    theta = main.get("rope_theta", raw.get("rope_theta"))
    if theta is None:
        raise CheckpointError(f"{source}: no rope_theta (looked in rope_parameters.main.rope_theta and rope_theta); "
                              f"add the model's value (V4: 10000) rather than rely on a default.")
    if main.get("rope_type", "default") != "default":
        raise CheckpointError(f"{source}: the sliding-window RoPE type is {main.get('rope_type')!r}; V4 uses plain "
                              f"RoPE there (YaRN applies only to compressed layers).")
    head_dim = _int(raw, "head_dim", source)
    rope_dim = _get(raw, "qk_rope_head_dim", source)
    if rope_dim is None:
        factor = main.get("partial_rotary_factor", raw.get("partial_rotary_factor", 64 / 512))
        rope_dim = int(head_dim * factor) if isinstance(factor, (int, float)) else factor
    if not _is_int(rope_dim) or rope_dim <= 0 or rope_dim % 2 or rope_dim > head_dim:
        raise CheckpointError(f"{source}: qk_rope_head_dim {rope_dim!r} must be even and in 2..head_dim {head_dim}.")
    cfg = HeadConfig(
        hidden_size=_int(raw, "hidden_size", source), vocab_size=_int(raw, "vocab_size", source),
        max_position_embeddings=_int(raw, "max_position_embeddings", source), num_hidden_layers=n,
        num_attention_heads=_int(raw, "num_attention_heads", source), head_dim=head_dim,
        q_lora_rank=_int(raw, "q_lora_rank", source), qk_rope_head_dim=rope_dim,
        o_groups=_int(raw, "o_groups", source), o_lora_rank=_int(raw, "o_lora_rank", source),
        sliding_window=_int(raw, "sliding_window", source, minimum=2),
        rope_theta=_number({"rope_theta": theta}, "rope_theta", source),
        rms_norm_eps=_number(raw, "rms_norm_eps", source), hc_mult=_int(raw, "hc_mult", source),
        hc_sinkhorn_iters=_int(raw, "hc_sinkhorn_iters", source), hc_eps=_number(raw, "hc_eps", source),
        num_experts=_int(raw, "n_routed_experts", source), num_experts_per_tok=_int(raw, "num_experts_per_tok", source),
        moe_intermediate_size=_int(raw, "moe_intermediate_size", source),
        n_shared_experts=_int(raw, "n_shared_experts", source), scoring_func=scoring,
        routed_scaling_factor=_number(raw, "routed_scaling_factor", source),
        swiglu_limit=_number(raw, "swiglu_limit", source), norm_topk_prob=norm_topk,
        weight_block_size=_weight_block_size(quant, raw, source),
        num_key_value_heads=_int(raw, "num_key_value_heads", source),
    )
    _check(cfg, source)
    return cfg


def _check_mtp_attention(raw: dict, n: int, source: str) -> None:
    ratios = raw.get("compress_ratios")
    if ratios is None:
        return
    if not isinstance(ratios, list) or not all(_is_int(r) and r >= 0 for r in ratios):
        raise CheckpointError(f"{source}: compress_ratios must be a list of non-negative integers, found {ratios!r}.")
    if len(ratios) > n and ratios[n] != 0:
        raise CheckpointError(f"{source}: compress_ratios[{n}] = {ratios[n]} is the MTP layer's: a compressed-attention "
                              f"MTP layer (compressor/indexer) is not supported; the released V4 MTP layer is pure "
                              f"sliding window (ratio 0).")


def _weight_block_size(quant, raw: dict, source: str) -> tuple[int, int] | None:
    if raw.get("expert_dtype") not in (None, "fp8", "bf16"):
        raise CheckpointError(f"{source}: expert_dtype {raw['expert_dtype']!r}: FP4 experts are not supported by this "
                              f"oracle (FP8 e4m3 with block scales and bf16 are).")
    if quant is None:
        return None
    if not isinstance(quant, dict) or quant.get("quant_method") != "fp8" or quant.get("fmt", "e4m3") != "e4m3":
        raise CheckpointError(f"{source}: quantization_config {quant!r} is not supported; this oracle reads bf16 and "
                              f"block FP8 (quant_method fp8, fmt e4m3, weight_block_size, `.scale` tensors).")
    if quant.get("expert_dtype") not in (None, "fp8", "bf16"):
        raise CheckpointError(f"{source}: quantization_config.expert_dtype {quant['expert_dtype']!r}: FP4 experts "
                              f"are not supported by this oracle.")
    if quant.get("scale_fmt", "float") not in ("float", "ue8m0"):
        raise CheckpointError(f"{source}: quantization_config.scale_fmt {quant['scale_fmt']!r}; expected float or "
                              f"ue8m0.")
    block = quant.get("weight_block_size", [128, 128])
    if not isinstance(block, list) or len(block) != 2 or not all(_is_int(b) and b > 0 for b in block):
        raise CheckpointError(f"{source}: quantization_config.weight_block_size must be [rows, cols], found {block!r}.")
    return tuple(block)


def _check(cfg: HeadConfig, source: str) -> None:
    problems = []
    if cfg.num_key_value_heads != 1:
        problems.append(f"num_key_value_heads {cfg.num_key_value_heads} (V4 attention is shared-KV MQA: 1)")
    if cfg.num_attention_heads * cfg.head_dim % cfg.o_groups:
        problems.append(f"num_attention_heads x head_dim {cfg.num_attention_heads * cfg.head_dim} not divisible by "
                        f"o_groups {cfg.o_groups}")
    if cfg.num_attention_heads % cfg.o_groups:
        problems.append(f"num_attention_heads {cfg.num_attention_heads} not divisible by o_groups {cfg.o_groups}")
    if cfg.num_experts_per_tok > cfg.num_experts:
        problems.append(f"num_experts_per_tok {cfg.num_experts_per_tok} > n_routed_experts {cfg.num_experts}")
    if cfg.n_shared_experts != 1:
        problems.append(f"n_shared_experts {cfg.n_shared_experts} (transformers' DeepseekV4MLP builds one shared "
                        f"expert of moe_intermediate_size)")
    if problems:
        raise CheckpointError(f"{source}: " + "; ".join(problems) + ".")


# ---------------------------------------------------------------------------------------------------------------
# tensors


@dataclass(frozen=True)
class V4Tensors(TensorLayout):
    """The head's tensors; `copies` are the MTP layer's own embedding/lm_head copies where present (shape-checked,
    left out of the digest; export uses the embedding copy's rows and records that it did)."""

    copies: dict = None

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return super().shapes() | (self.copies or {})


def expert_names() -> dict[str, str]:
    experts = HEAD_PREFIX + "ffn.experts.{e}."
    return {"gate": experts + "w1.weight", "up": experts + "w3.weight", "down": experts + "w2.weight"}


def head_tensor_shapes(cfg: HeadConfig) -> dict[str, tuple[int, ...]]:
    """Every dense `mtp.0.*` tensor (routed experts aside) and its shape ([out, in] for linears)."""
    p, d, hc = HEAD_PREFIX, cfg.hidden_size, cfg.hc_mult
    heads, hd, g = cfg.num_attention_heads, cfg.head_dim, cfg.o_groups
    mix = (2 + hc) * hc  # pre (hc) + post (hc) + comb (hc x hc)
    shared = cfg.moe_intermediate_size * cfg.n_shared_experts
    shapes = {
        "e_proj.weight": (d, d), "h_proj.weight": (d, d), "enorm.weight": (d,), "hnorm.weight": (d,),
        "norm.weight": (d,), "hc_head_fn": (hc, hc * d), "hc_head_base": (hc,), "hc_head_scale": (1,),
        "attn_norm.weight": (d,), "ffn_norm.weight": (d,),
        "hc_attn_fn": (mix, hc * d), "hc_attn_base": (mix,), "hc_attn_scale": (3,),
        "hc_ffn_fn": (mix, hc * d), "hc_ffn_base": (mix,), "hc_ffn_scale": (3,),
        "attn.wq_a.weight": (cfg.q_lora_rank, d), "attn.q_norm.weight": (cfg.q_lora_rank,),
        "attn.wq_b.weight": (heads * hd, cfg.q_lora_rank), "attn.wkv.weight": (hd, d), "attn.kv_norm.weight": (hd,),
        "attn.wo_a.weight": (g * cfg.o_lora_rank, heads * hd // g), "attn.wo_b.weight": (d, g * cfg.o_lora_rank),
        "attn.attn_sink": (heads,),
        "ffn.gate.weight": (cfg.num_experts, d), "ffn.gate.bias": (cfg.num_experts,),
        "ffn.shared_experts.w1.weight": (shared, d), "ffn.shared_experts.w3.weight": (shared, d),
        "ffn.shared_experts.w2.weight": (d, shared),
    }
    return {p + k: v for k, v in shapes.items()}


def v4_layout(cfg: HeadConfig, names: set[str]) -> V4Tensors:
    """Dense tensors, per-expert routed experts, `.scale` beside each linear that has one in this checkpoint, and
    the optional own embedding/lm_head copies."""
    dense = head_tensor_shapes(cfg)
    experts = ExpertLayout("per_expert", cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size, expert_names())
    block = cfg.weight_block_size or (128, 128)
    linears = {n: s for n, s in (dense | experts.shapes()).items() if len(s) == 2 and n.endswith(".weight")
               and not n.startswith(HEAD_PREFIX + "hc_")}
    dense |= {scale_name(n): scale_shape(s, block) for n, s in linears.items() if scale_name(n) in names}
    copies = {HEAD_PREFIX + n: (cfg.vocab_size, cfg.hidden_size) for n in ("emb.tok_emb.weight", "head.weight")
              if HEAD_PREFIX + n in names}
    return V4Tensors(dense, experts, copies)


def scale_name(weight: str) -> str:
    """`X.weight` -> `X.scale` (the release's block scale; transformers' `X.weight_scale_inv`)."""
    return weight.removesuffix("weight") + _SCALE


# ---------------------------------------------------------------------------------------------------------------
# stages, evidence, variants

_DOCS = {
    "e": "enorm(embed[t]): the MTP's enorm, a plain w·x̂ RMSNorm (fp32 weight); zero row at absolute position 0 when "
         "mask_pos0_embedding",
    "h": "hnorm(H) per stream (RMS over D within each of the hc streams, not over hc·D); H = the main model's last "
         "block output streams, before its hc_head and final norm",
    "ah": "attn_norm (input_layernorm) of the streams collapsed by the attention hyper-connection's pre weights",
    "attn": "sliding-window attention (window W, per-head sink in the softmax, shared-KV MQA, interleaved RoPE on "
            "each head's trailing rope dims, output de-rotated) after wo_a/wo_b, before the hyper-connection",
    "mh": "ffn_norm (post_attention_layernorm) of the streams collapsed by the MLP hyper-connection's pre weights",
    "router_logits": "ffn.gate linear output (before scoring_func and the selection bias)",
    "topk_ids": "experts selected: top-k of scoring_func(logits) + ffn.gate.bias (the selection bias, not hash "
                "routing); compared as a set",
    "topk_weights": "the selected experts' unbiased scores, renormalised to sum 1, times routed_scaling_factor",
    "shared": "the shared expert's output (silu(min(w1 x, L)) * clamp(w3 x, ±L), then w2; L = swiglu_limit), ungated",
    "routed": "the weighted sum of the selected experts' outputs (same clamped SwiGLU)",
    "mlp": "MoE output: routed + shared",
    "out": "norm(head_collapsed): the MTP's own final norm, fed to the shared lm_head (head.weight)",
}


def v4_stages(cfg: HeadConfig) -> StageList:
    h = replace(H, shape="Txhc*D")
    order = (E, h, E_PROJ, H_PROJ, X_IN, AH, ATTN, AFTER_ATTN, MH, *MOE, MLP, BLOCK_OUT, HEAD_COLLAPSED, OUT,
             DRAFT)
    return StageList(s.with_doc(_DOCS[s.name]) if s.name in _DOCS else s for s in order)


def dims(cfg: HeadConfig) -> Dims:
    return Dims(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok, cfg.hc_mult)


T0_NOTE = ("t=0: the query sees one key plus the per-head sink, so its weight is sigmoid(q·k·scale - sink): unlike "
           "a sink-free softmax (≡ 1) it depends on q, k, q_norm, kv_norm, the softmax scale and the sinks, and "
           "/evidence/attn_uniform (every visible key and the sink at one equal logit: each key 1/(n+1)) measures "
           "it. It does not evidence RoPE (query and key at one position: the rotation cancels in q·k and the "
           "output de-rotation undoes the value's), the window, or positions")
POSITIONS_NOTE = ("absolute positions are not evidenced: the sliding-window attention's scores and its de-rotated "
                  "output depend only on relative positions, so a uniform offset p+k matches to rounding")
POS0_OBSERVABLE = ("position 0 observable: the embedding at absolute position 0 is zeroed (mask_pos0_embedding); "
                   "other absolute positions are not evidenced (relative-position RoPE)")


@dataclass(frozen=True)
class V4Spec(FamilySpec):
    """A FamilySpec whose evidence rules add the window, the t=0 meaning and the routing-dependent stages."""

    def attention_window(self, cfg: HeadConfig) -> int | None:
        return cfg.sliding_window

    def evidence_rules(self, cfg: HeadConfig, positions=None) -> dict:
        rules = super().evidence_rules(cfg, positions)
        rules["absolute_positions"] = (POSITIONS_NOTE if not cfg.mask_pos0_embedding else
                                       POS0_OBSERVABLE if has_position_0(positions) else NO_POS0_STEP)
        rules["window"] = cfg.sliding_window  # only steps t >= W drop a key: a trace with T <= W cannot evidence W
        rules["t0"] = T0_NOTE
        rules["routing_dependent"] = ["topk_weights", "routed", "mlp", "block_out", "head_collapsed", "out"]
        return rules


VARIANTS = (
    Variant("hnorm_over_streams", "hnorm's RMS taken over all hc·D instead of per stream over D"),
    Variant("e_h_proj_swapped", "e_proj applied to h and h_proj to e"),
    Variant("e_first_stream_only", "the e_proj(e) term added to stream 0 only instead of broadcast to every stream"),
    Variant("collapsed_hidden", "the main model's collapsed, normed output fed (broadcast) instead of its last block "
                                "output streams"),
    Variant("main_hc_head", "the main model's hc_head/norm used for the MTP's output instead of its own"),
    Variant("comb_not_transposed", "the hyper-connection residual mixed as comb @ x instead of comb^T @ x"),
    Variant("no_sink", "attention softmax without the per-head sink"),
    Variant("full_attention", "causal attention over every earlier step instead of the W-step window"),
    Variant("window_off_by_one", "W+1 (or W-1) visible keys instead of W"),
    Variant("rope_halves", "RoPE on NeoX halves instead of V4's interleaved pairs"),
    Variant("rope_leading_dims", "RoPE on each head's leading dims instead of its trailing qk_rope_head_dim"),
    Variant("no_output_derotation", "attention output's rope slice not rotated back by -position"),
    Variant("hash_routing", "the MTP layer routed by tid2eid hash (main layer 0's type) instead of top-k"),
    Variant("no_selection_bias", "experts chosen without ffn.gate.bias"),
    Variant("no_swiglu_clamp", "experts' gate/up pre-activations not clamped at swiglu_limit"),
    Variant("recycle_out", "draft k+1 recycles out (post hc_head/norm) instead of the block_out streams"),
)


def tiny_config(**overrides) -> dict:
    """A config.json for a tiny V4 head (fixtures and the family contract test): transformers' key names, with the
    release's `compress_ratios` (main layers and the MTP layer's 0 last)."""
    raw = {"model_type": "deepseek_v4", "architectures": ["DeepseekV4ForCausalLM"], "hidden_size": 64,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 32,
           "q_lora_rank": 48, "qk_rope_head_dim": 8, "o_groups": 2, "o_lora_rank": 24, "vocab_size": 512,
           "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "n_shared_experts": 1,
           "scoring_func": "sqrtsoftplus", "routed_scaling_factor": 1.5, "norm_topk_prob": True, "hc_mult": 3,
           "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "rms_norm_eps": 1e-6, "sliding_window": 4, "swiglu_limit": 1.5,
           "rope_theta": 10000.0, "compress_rope_theta": 160000.0, "compress_ratios": [4, 128, 0],
           "max_position_embeddings": 4096, "num_nextn_predict_layers": 1, "hidden_act": "silu",
           "tie_word_embeddings": False}
    raw.update(overrides)
    return raw


SPEC = V4Spec(
    name=FAMILY, model_types=MODEL_TYPES, architectures=ARCHITECTURES, parse_config=head_config_from_json,
    layout=v4_layout, head_prefix="mtp.", stages=v4_stages, dims=dims, main_model_prefixes=("model.",),
    lm_head=LM_HEAD, head_module="oracle.families.deepseek_v4", variants=VARIANTS, tiny_config=tiny_config,
    layer_input="x_in", layer_output="block_out", recycled="block_out", recycle_prenorm=None,
    notes=("norm_topk_prob: transformers' DeepseekV4TopKRouter always renormalises the top-k weights; false is "
           "refused",
           "the MTP layer is built with layer_types ['sliding_attention'] and mlp_layer_types ['moe'], never as "
           "layer 0 of the main config (compressed attention, hash routing)"),
)
