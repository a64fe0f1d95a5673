"""Multi-layer MTP heads that transformers builds with its own `transformers.modeling_layers.MtpModel` (issue 25),
torch-free half: one declaration per model type (`MtpModelFamily`: config keys, where the layers lie, the tiny
config), the config checks, the tensor layout, stages and variants. The head is oracle/families/mtp_model.py.

`MtpModel(main_model, N)` holds N official `MtpLayer`s (enorm, hnorm, eh_proj over concat(e, h), the main model's
decoder layer class as `mtp_block`, post_norm), built from `config.get_mtp_config()`: layer l gets
`mtp_layer_types[l]` (its attention type: full or sliding, and the rope parameters of that type) and
`mtp_mlp_layer_types[l]`. Its forward drafts one token per layer: layer l runs at depth l+1, over the rows of the
previous layer's output (teacher-forced tokens shifted by one per layer), each layer with its own cache. The
checkpoint's `model.layers.{num_hidden_layers + l}.*` tensors are mapped onto it by
`MtpModel.get_weight_conversions` (the oracle loads with exactly those conversions; nothing is renamed here).

The head config keeps the raw text config: the torch half hands it to the official config class, so sliding
windows, per-layer rope and layer types are read as transformers reads them. Only what the torch-free code needs
(sizes, the layer count, the layers' tensors) is parsed here.
"""

import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from oracle.errors import CheckpointError
from oracle.families.mtp_layer_layout import MtpLayerTensors, is_int, positive_int
from oracle.families.spec import FamilySpec, TensorLayout, Variant
from oracle.stages import SPINE, Dims, StageList, with_draft, with_moe

HEAD_PREFIX = "model.layers.{num_hidden_layers}."  # layer 0; layer l is at num_hidden_layers + l
LAYER = re.compile(r"^model\.layers\.(\d+)\.")
# a head stored apart from the main stack (Inkling: model.mtp.layers.{l}., and model.mtp.chain_norm shared by all)
NESTED_LAYER = "{prefix}layers.{layer}."
COPIES = ("shared_head.head.weight", "embed_tokens.weight")  # per-layer vocabulary copies MtpModel does not load


@dataclass(frozen=True, kw_only=True)
class HeadConfig:
    """The head config of every MtpModel family (step3p7, inkling, mimo_v2_flash): what the torch-free code needs,
    and `text`, what the official config class is built from. A family whose layers are all alike in a way the
    others read per layer from `text` (MiMo: one SWA attention for every layer) sets the optional fields."""

    family: str
    hidden_size: int
    vocab_size: int
    max_position_embeddings: int
    num_hidden_layers: int  # main layers: MTP layer l is model.layers.{num_hidden_layers + l}
    num_mtp_layers: int
    num_attention_heads: int  # the MTP layers' attention (MiMo: its SWA one)
    num_key_value_heads: int
    head_dim: int  # q/k
    num_experts: int  # 0: dense MTP layers
    num_experts_per_tok: int
    moe_intermediate_size: int
    # the MLP width a token's rows take, for memory estimates (oracle/limits.py): the dense MLP's intermediate_size
    # (MiMo), or the routed experts' moe_intermediate_size x k x 2
    intermediate_size: int = 0
    v_head_dim: int | None = None  # V width where it differs from head_dim (MiMo); None: head_dim
    sliding_window: int | None = None  # keys a query sees, itself included, where every MTP layer has this one
    #                                    window (MiMo); None: each layer's own, read from `text` (Step-3.7)
    weight_block_size: tuple[int, int] | None = None  # FP8 block scales (quantization_config); None: bf16/f32
    # what the official config class is built from: the raw config.json (mtp_model.official_config), or the
    # release's keys translated onto the official config's fields (MiMo: MiMoV2FlashConfig(**text))
    text: dict = field(default_factory=dict)
    mtp_prefix: str = ""  # "": layer l is model.layers.{num_hidden_layers + l}; else {mtp_prefix}layers.{l}.
    logits_divisor: float = 1.0  # the draft logits are lm_head(out / logits_divisor) (Inkling: muP width multiplier)
    draft_vocab_size: int | None = None  # the draft logits keep the first ids only (Inkling: unpadded_vocab_size)

    @property
    def head_prefix(self) -> str:
        return self.mtp_prefix or HEAD_PREFIX.format(num_hidden_layers=self.num_hidden_layers)

    def layer_prefix(self, layer: int) -> str:
        if self.mtp_prefix:
            return NESTED_LAYER.format(prefix=self.mtp_prefix, layer=layer)
        return f"model.layers.{self.num_hidden_layers + layer}."

    def in_layer(self, name: str, layer: int) -> bool:
        """Whether tensor `name` is read when MTP layer `layer` runs (each layer holds all it reads)."""
        return name.startswith(self.layer_prefix(layer))

    def layer_index(self, name: str) -> int | None:
        """The MTP layer a checkpoint tensor belongs to (None: not a layer tensor of the head); an index past the
        layer count is returned as is (the layout names it as an extra layer)."""
        if self.mtp_prefix:
            m = re.match(re.escape(self.mtp_prefix) + r"layers\.(\d+)\.", name)
            return int(m.group(1)) if m else None
        m = LAYER.match(name)
        return int(m.group(1)) - self.num_hidden_layers if m and int(m.group(1)) >= self.num_hidden_layers else None

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class MtpModelFamily:
    """A declaration: what a model type needs beyond the shared code."""

    name: str
    model_types: tuple[str, ...]  # config.json model_type, top level or text_config
    architectures: tuple[str, ...]
    layers_key: str  # the text config key holding the MTP layer count
    experts_key: str | None  # the text config key holding the routed expert count (None: dense MTP layers)
    tiny_config: Callable[..., dict]
    variants: tuple[Variant, ...] = ()
    # where transformers reads the layer count from (raw config.json, its text config) -> the count; default: the
    # text config's layers_key
    layer_count: Callable[[dict, dict], object] | None = None
    mtp_prefix: str = ""  # see HeadConfig.mtp_prefix
    main_model_prefixes: tuple[str, ...] = ("model.",)
    embedding: str = "embed_tokens.weight"
    lm_head: str = "lm_head.weight"
    # text config keys of the draft logits' muP divisor and unpadded vocabulary (MtpModel._project_to_logits)
    logits_divisor_key: str | None = None
    draft_vocab_key: str | None = None
    stage_docs: dict = field(default_factory=dict)  # stage docs this family's layers need instead of the shared ones
    shared_variants: tuple[str, ...] = ("layer0_reused", "layer_caches_swapped", "shared_head_shared")
    notes: tuple[str, ...] = ()
    refuse: Callable[[dict, dict, str], None] | None = None  # (raw, text, source): raises for what is unsupported
    # (text config) -> whether the MTP layers are MoE, as the official config class derives it (None: they are
    # whenever experts_key is set). Step-3.5/3.7 set n_routed_experts for the main stack while the released MTP
    # layers are dense (moe_layers_enum 3..44 of 45 + 3).
    sparse_mtp: Callable[[dict], bool] | None = None
    # the official text config class's attribute_map {alias: key}: a config.json may spell a key by its alias
    # (Step-3.5/3.7 releases write num_attention_groups for num_key_value_heads), which the class reads as the key.
    # A copy (this half imports no transformers); tests/families/test_mtp_model_aliases.py holds it equal.
    aliases: dict = field(default_factory=dict)


def with_aliases(text: dict, aliases: dict) -> dict:
    """`text` with each aliased key also under its own name, as the official config class reads it (the key itself
    wins where both are given, as the class's attribute setter leaves it)."""
    return {**{key: text[alias] for alias, key in aliases.items() if alias in text and key not in text}, **text}


def head_config_from_json(declared: MtpModelFamily, raw: dict, source: str) -> HeadConfig:
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
    text = with_aliases(text, declared.aliases)
    layers = declared.layer_count(raw, text) if declared.layer_count else text.get(declared.layers_key)
    if declared.refuse:
        declared.refuse(raw, text, source)
    if not is_int(layers) or layers < 1:
        raise CheckpointError(f"{source}: {declared.layers_key} = {layers!r}; a {declared.name} MTP head needs it set "
                              f"to its layer count (>= 1). Without it transformers builds no MTP and drops the "
                              f"head's tensors: set it to the number of MTP layers the checkpoint holds.")
    heads = positive_int(text, "num_attention_heads", source)
    hidden = positive_int(text, "hidden_size", source)
    experts = (text.get(declared.experts_key, 0) or 0) if declared.experts_key else 0
    if declared.sparse_mtp and not declared.sparse_mtp(text):
        experts = 0  # dense MTP layers: no routed stages (the official layers have no router)
    divisor = text.get(declared.logits_divisor_key, 1.0) if declared.logits_divisor_key else 1.0
    draft_vocab = text.get(declared.draft_vocab_key) if declared.draft_vocab_key else None
    if not isinstance(divisor, (int, float)) or isinstance(divisor, bool) or not divisor > 0:
        raise CheckpointError(f"{source}: {declared.logits_divisor_key} = {divisor!r}; it divides the draft logits' "
                              f"input, so it must be a positive number.")
    if draft_vocab is not None and not (is_int(draft_vocab) and 1 <= draft_vocab):
        raise CheckpointError(f"{source}: {declared.draft_vocab_key} = {draft_vocab!r}; it must be a positive "
                              f"vocabulary size, or null.")
    per_tok = text.get("num_experts_per_tok", 0) if experts else 0
    moe_width = text.get("moe_intermediate_size", 0) if experts else 0
    return HeadConfig(
        family=declared.name, hidden_size=hidden, vocab_size=positive_int(text, "vocab_size", source),
        max_position_embeddings=positive_int(text, "max_position_embeddings", source),
        num_hidden_layers=positive_int(text, "num_hidden_layers", source), num_mtp_layers=layers,
        num_attention_heads=heads, num_key_value_heads=positive_int(text, "num_key_value_heads", source, heads),
        head_dim=positive_int(text, "head_dim", source, hidden // heads),
        num_experts=experts if is_int(experts) else 0, num_experts_per_tok=per_tok, moe_intermediate_size=moe_width,
        intermediate_size=moe_width * max(per_tok, 1) * 2,
        text=dict(raw), mtp_prefix=declared.mtp_prefix, logits_divisor=float(divisor),
        draft_vocab_size=draft_vocab)


def layout(cfg: HeadConfig, names: set[str]) -> TensorLayout:
    """Every tensor of layers num_hidden_layers .. +N-1 (shapes are checked by the strict load against the
    official modules); the vocabulary copies apart. A layer count that disagrees with the tensors present is
    refused, naming both: missing layers (the silent-drop bug) and extra ones alike."""
    first = 0 if cfg.mtp_prefix else cfg.num_hidden_layers  # the checkpoint's index of MTP layer 0
    present = sorted({first + i for n in names if (i := cfg.layer_index(n)) is not None})
    expected = list(range(first, first + cfg.num_mtp_layers))
    if present != expected:
        where = (f"{cfg.mtp_prefix}layers.{expected[0]}..{expected[-1]}" if cfg.mtp_prefix else
                 f"model.layers.{expected[0]}..{expected[-1]}, num_hidden_layers {cfg.num_hidden_layers}")
        key = "mtp_config.num_nextn_predict_layers" if cfg.mtp_prefix else "num_nextn_predict_layers"  # as declared
        raise CheckpointError(
            f"config.json: {key} = {cfg.num_mtp_layers}: the config declares {cfg.num_mtp_layers} MTP layer(s) ({where}) but the checkpoint holds tensors of "
            f"layers {present or 'none'}{'' if cfg.mtp_prefix else ' at or past num_hidden_layers'}: "
            f"{'missing ' + str(sorted(set(expected) - set(present))) if set(expected) - set(present) else ''}"
            f"{' extra ' + str(sorted(set(present) - set(expected))) if set(present) - set(expected) else ''}. "
            f"Fix the MTP layer count in config.json, or the checkpoint.")
    layers = {n for n in names if cfg.layer_index(n) is not None}
    _check_layers_alike(cfg, layers)
    shared = {n for n in names if cfg.mtp_prefix and n.startswith(cfg.mtp_prefix)} - layers  # e.g. chain_norm
    head = layers | shared
    copies = {n for n in layers if n.removeprefix(cfg.layer_prefix(cfg.layer_index(n))) in COPIES}
    return MtpLayerTensors({n: None for n in sorted(head - copies)}, None,
                           {n: (cfg.vocab_size, cfg.hidden_size) for n in sorted(copies)})


def _check_layers_alike(cfg: HeadConfig, head: set[str]) -> None:
    """Every MTP layer holds the same tensors (one stage list serves every depth): a tensor the other layers have
    and one lacks is named by its checkpoint name (the official load would name only a parameter)."""
    prefixes = [cfg.layer_prefix(layer) for layer in range(cfg.num_mtp_layers)]
    suffixes = {layer: {n.removeprefix(p) for n in head if n.startswith(p)} - set(COPIES)
                for layer, p in enumerate(prefixes)}
    union = set().union(*suffixes.values())
    missing = sorted(prefixes[layer] + s for layer, have in suffixes.items() for s in union - have)
    if missing:
        raise CheckpointError(f"MTP layers hold different tensors: {', '.join(missing[:5])}"
                              f"{' …' if len(missing) > 5 else ''} missing, which the other layers have. The "
                              f"checkpoint is incomplete (or its layers are of different kinds, not supported).")


def stages(cfg: HeadConfig, family_docs: dict | None = None) -> StageList:
    docs = {"e": "enorm(embedding row) of the depth's MTP layer", "h": "hnorm(recycled hidden) of the depth's layer",
            "fc_in": "the input of eh_proj: concat(e, h) (concat(h, e) where mtp_hidden_states_first)",
            "fc": "eh_proj(fc_in)", "out": "post_norm(res2) of the depth's layer: recycled to the next depth"}
    docs |= family_docs or {}
    spine = with_moe(SPINE) if cfg.num_experts else SPINE
    return StageList(s.with_doc(docs[s.name]) if s.name in docs else s for s in with_draft(spine))


def dims(cfg: HeadConfig) -> Dims:
    return Dims(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok)


@dataclass(frozen=True)
class MtpModelSpec(FamilySpec):
    """A FamilySpec over N layers (`layer_count`, the base's: cfg.num_mtp_layers): depth j runs layer j-1."""

    def kv_values_per_token(self, cfg: HeadConfig) -> int:
        """Values one MTP layer's KV cache holds per token (oracle/speedup.py): K and V of its KV heads, V at
        v_head_dim where it differs (MiMo's SWA layers)."""
        return cfg.num_key_value_heads * (cfg.head_dim + (cfg.v_head_dim or cfg.head_dim))

    def uniform_window(self, cfg: HeadConfig) -> int | None:
        """The window every MTP layer has (MiMo: SWA in every layer), or None: per layer (Step-3.7) or none."""
        return cfg.sliding_window

    def draft_logits(self, cfg: HeadConfig) -> tuple[float, int | None]:
        """(divisor, ids kept): the draft logits are lm_head(out / divisor)[:ids kept], as MtpModel drafts."""
        return cfg.logits_divisor, cfg.draft_vocab_size


VARIANTS = (
    Variant("layer0_reused", "layer 0 run at every depth (vLLM's proposer without spec_step_idx, vllm#52688)"),
    Variant("layer_caches_swapped", "two layers' KV caches swapped"),
    Variant("shared_head_shared", "one layer's post_norm used at every depth"),
)


def declare(declared: MtpModelFamily) -> MtpModelSpec:
    """The FamilySpec of one declared model type."""
    shared = tuple(v for v in VARIANTS if v.name in declared.shared_variants)
    return MtpModelSpec(
        name=declared.name, model_types=declared.model_types, architectures=declared.architectures,
        parse_config=lambda raw, source: head_config_from_json(declared, raw, source), layout=layout,
        head_prefix=declared.mtp_prefix or HEAD_PREFIX, stages=lambda cfg: stages(cfg, declared.stage_docs),
        dims=dims, main_model_prefixes=declared.main_model_prefixes, lm_head=declared.lm_head,
        embedding=declared.embedding, head_module="oracle.families.mtp_model", variants=shared + declared.variants,
        tiny_config=declared.tiny_config, recycle_prenorm="res2",
        notes=("depth j runs MTP layer j-1, each layer its own cache (transformers' MtpModel)",
               "draft projection: the main lm_head, as MtpModel drafts (per-layer shared_head.head copies unread)",
               *declared.notes))


# ---------------------------------------------------------------------------------------------------------------
# declarations


def step3p7_tiny_config(**overrides) -> dict:
    """A tiny Step-3.5/3.7-Flash text config: 3 MTP layers (full, sliding, full), per-layer rope, MoE."""
    n, m = 2, overrides.pop("num_nextn_predict_layers", 3)
    kinds = ["full_attention", "sliding_attention"]
    text = {"model_type": "step3p5", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": n,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 256,
            "moe_intermediate_size": 32, "n_routed_experts": 8, "num_experts_per_tok": 2, "share_expert_dim": 32,
            "num_nextn_predict_layers": m, "sliding_window": 4, "max_position_embeddings": 4096,
            "layer_types": [kinds[i % 2] for i in range(n + m)], "moe_layers_enum": ",".join(map(str, range(1, n + m))),
            "rope_theta": [[10000.0, 5000.0][i % 2] for i in range(n + m)],
            "partial_rotary_factors": [[0.5, 1.0][i % 2] for i in range(n + m)], "rms_norm_eps": 1e-5}
    text.update(overrides)
    return {"model_type": "step3p7", "architectures": ["Step3p7ForConditionalGeneration"], "text_config": text,
            "vision_config": {"width": 32, "layers": 1, "heads": 2}}




def inkling_tiny_config(**overrides) -> dict:
    """A tiny Inkling config as released (the MTP fields in a top-level `mtp_config`): 3 MTP layers with the
    shared chain norm, no rotary (relative position logits over 6 keys, log-scaled logits from position 2),
    short convolutions of width 3, a muP-scaled lm_head padded past its 250 real ids. Overrides go to the text
    config; `num_nextn_predict_layers`, `chain_hidden_post_norm` and `local_layer_ids` to mtp_config."""
    mtp = {"num_nextn_predict_layers": 3, "chain_hidden_post_norm": True}
    mtp |= {k: overrides.pop(k) for k in list(overrides) if k in ("num_nextn_predict_layers",
                                                                   "chain_hidden_post_norm", "local_layer_ids")}
    text = {"model_type": "inkling_text", "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "swa_num_attention_heads": 4, "swa_num_key_value_heads": 2,
            "swa_head_dim": 16, "sliding_window_size": 4, "d_rel": 4, "rel_extent": 6, "log_scaling_n_floor": 2,
            "log_scaling_alpha": 0.5, "vocab_size": 256, "unpadded_vocab_size": 250,
            "logits_mup_width_multiplier": 4.0, "sconv_kernel_size": 3, "intermediate_size": 96,
            "moe_intermediate_size": 32, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
            "max_position_embeddings": 4096, "rms_norm_eps": 1e-6}
    text.update(overrides)
    return {"model_type": "inkling_mm_model", "architectures": ["InklingForConditionalGeneration"],
            "text_config": text, "mtp_config": mtp,
            "vision_config": {"hidden_size": 16, "n_layers": 3, "num_attention_heads": 2, "patch_size": 2,
                              "temporal_patch_size": 2},
            "audio_config": {"n_mel_bins": 4, "mel_vocab_size": 8}}


def inkling_layer_count(raw: dict, text: dict):
    """As InklingConfig reads it: text_config.num_mtp_layers, else mtp_config.num_nextn_predict_layers."""
    if "num_mtp_layers" in text:
        return text["num_mtp_layers"]
    mtp = raw.get("mtp_config") if isinstance(raw.get("mtp_config"), dict) else {}
    return mtp.get("num_nextn_predict_layers")


def inkling_refuse(raw: dict, text: dict, source: str) -> None:
    """Sliding-window MTP layers: transformers 5.24's MtpModel masks a `hybrid_sliding` layer with the plain causal
    mask (masking_utils LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING) while its cache keeps W-1 keys, so a batched and a
    stepwise MtpModel.forward disagree past W rows: no single reference to hold the oracle to (docs/DESIGN.md)."""
    mtp = raw.get("mtp_config") if isinstance(raw.get("mtp_config"), dict) else {}
    local = text["mtp_local_layer_ids"] if "mtp_local_layer_ids" in text else mtp.get("local_layer_ids")
    if local:
        raise CheckpointError(f"{source}: MTP layers {local} use sliding-window attention (mtp_config.local_layer_ids)"
                              f"; not supported for inkling yet: transformers' MtpModel masks them without their "
                              f"window in a batched pass but keeps only the window in its cache, so there is no one "
                              f"reference to hold the head to.")


def step3p7_sparse_mtp(text: dict) -> bool:
    """Whether Step3p7TextConfig makes the MTP layers MoE: `mtp_mlp_layer_types`, else the tail of a padded
    `mlp_layer_types`, else the MTP indices n..n+m-1 in `moe_layers_enum` (default: layers 3..n-1, so dense)."""
    n, m = text.get("num_hidden_layers"), text.get("num_nextn_predict_layers") or 0
    if not (is_int(n) and is_int(m)):
        return True  # malformed: the checks that name the key refuse it
    kinds = text.get("mtp_mlp_layer_types")
    if kinds is None and isinstance(text.get("mlp_layer_types"), list) and len(text["mlp_layer_types"]) == n + m:
        kinds = text["mlp_layer_types"][n:]
    if isinstance(kinds, list):
        return any(k == "sparse" for k in kinds)
    enum = text.get("moe_layers_enum")
    if enum is None:
        return False
    items = enum.split(",") if isinstance(enum, str) else enum
    return any(str(i).strip() and int(i) >= n for i in items)


STEP3P7 = MtpModelFamily("step3p7", ("step3p7", "step3p5"), ("Step3p7ForConditionalGeneration",),
                         "num_nextn_predict_layers", "n_routed_experts", step3p7_tiny_config,
                         sparse_mtp=step3p7_sparse_mtp,
                         aliases={"num_local_experts": "n_routed_experts", "num_attention_groups": "num_key_value_heads",
                                  "moe_num_experts": "n_routed_experts", "moe_top_k": "num_experts_per_tok",
                                  "share_expert_dims": "share_expert_dim",
                                  "num_mtp_layers": "num_nextn_predict_layers"})
INKLING = MtpModelFamily(
    "inkling", ("inkling_mm_model", "inkling_text"), ("InklingForConditionalGeneration",),
    "mtp_config.num_nextn_predict_layers", None, inkling_tiny_config, layer_count=inkling_layer_count,
    mtp_prefix="model.mtp.", main_model_prefixes=("model.llm.",), embedding="embed.weight",
    lm_head="model.llm.unembed.weight", logits_divisor_key="logits_mup_width_multiplier",
    draft_vocab_key="unpadded_vocab_size",
    stage_docs={"fc_in": "the input of eh_proj (input_proj): concat(hnorm(h), enorm(e)), hidden first",
                "attn": "self_attn output (relative position logits, no rotary), before attn_sconv",
                "res1": "fc + attn_sconv(attn) (the short convolution over the layer's rows)",
                "mlp": "dense MLP output (times its global_scale), before mlp_sconv",
                "res2": "res1 + mlp_sconv(mlp)",
                "out": "chain_norm(res2), one norm shared by every layer (chain_hidden_post_norm; res2 without it)"},
    shared_variants=("layer0_reused", "layer_caches_swapped"), refuse=inkling_refuse,
    aliases={"embedding_multiplier": "logits_mup_width_multiplier", "sliding_window": "sliding_window_size",
             "num_local_experts": "n_routed_experts", "sconv_kernel_size": "conv_kernel_size",
             "model_max_length": "max_position_embeddings"},
    notes=("positions come from each layer's cache as MtpCache counts them (row index + layer + 1); position ids "
           "are not read (no rotary)",
           "draft logits: lm_head(out / logits_mup_width_multiplier)[:unpadded_vocab_size]"))

SPECS = (declare(STEP3P7), declare(INKLING))
