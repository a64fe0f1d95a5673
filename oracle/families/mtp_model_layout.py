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
COPIES = ("shared_head.head.weight", "embed_tokens.weight")  # per-layer vocabulary copies MtpModel does not load


@dataclass(frozen=True, kw_only=True)
class HeadConfig:
    family: str
    hidden_size: int
    vocab_size: int
    max_position_embeddings: int
    num_hidden_layers: int  # main layers: MTP layer l is model.layers.{num_hidden_layers + l}
    num_mtp_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_experts: int  # 0: dense MTP layers
    num_experts_per_tok: int
    moe_intermediate_size: int
    text: dict = field(default_factory=dict)  # the raw text config, handed to the official config class

    @property
    def head_prefix(self) -> str:
        return HEAD_PREFIX.format(num_hidden_layers=self.num_hidden_layers)

    @property
    def intermediate_size(self) -> int:  # for memory estimates (oracle/limits.py)
        return self.moe_intermediate_size * max(self.num_experts_per_tok, 1) * 2

    def layer_prefix(self, layer: int) -> str:
        return f"model.layers.{self.num_hidden_layers + layer}."

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class MtpModelFamily:
    """A declaration: what a model type needs beyond the shared code."""

    name: str
    model_types: tuple[str, ...]  # config.json model_type, top level or text_config
    architectures: tuple[str, ...]
    layers_key: str  # the text config key holding the MTP layer count
    experts_key: str  # the text config key holding the routed expert count
    tiny_config: Callable[..., dict]
    variants: tuple[Variant, ...] = ()


def head_config_from_json(declared: MtpModelFamily, raw: dict, source: str) -> HeadConfig:
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
    layers = text.get(declared.layers_key)
    if not is_int(layers) or layers < 1:
        raise CheckpointError(f"{source}: {declared.layers_key} = {layers!r}; a {declared.name} MTP head needs it set "
                              f"to its layer count (>= 1). Without it transformers builds no MTP and drops the "
                              f"head's tensors: set it to the number of MTP layers the checkpoint holds.")
    heads = positive_int(text, "num_attention_heads", source)
    hidden = positive_int(text, "hidden_size", source)
    experts = text.get(declared.experts_key, 0) or 0
    return HeadConfig(
        family=declared.name, hidden_size=hidden, vocab_size=positive_int(text, "vocab_size", source),
        max_position_embeddings=positive_int(text, "max_position_embeddings", source),
        num_hidden_layers=positive_int(text, "num_hidden_layers", source), num_mtp_layers=layers,
        num_attention_heads=heads, num_key_value_heads=positive_int(text, "num_key_value_heads", source, heads),
        head_dim=positive_int(text, "head_dim", source, hidden // heads),
        num_experts=experts if is_int(experts) else 0,
        num_experts_per_tok=text.get("num_experts_per_tok", 0) if experts else 0,
        moe_intermediate_size=text.get("moe_intermediate_size", 0) if experts else 0,
        text=dict(raw))


def layout(cfg: HeadConfig, names: set[str]) -> TensorLayout:
    """Every tensor of layers num_hidden_layers .. +N-1 (shapes are checked by the strict load against the
    official modules); the vocabulary copies apart. A layer count that disagrees with the tensors present is
    refused, naming both: missing layers (the silent-drop bug) and extra ones alike."""
    present = sorted({int(m.group(1)) for n in names if (m := LAYER.match(n)) and int(m.group(1)) >=
                      cfg.num_hidden_layers})
    expected = list(range(cfg.num_hidden_layers, cfg.num_hidden_layers + cfg.num_mtp_layers))
    if present != expected:
        raise CheckpointError(
            f"the config declares {cfg.num_mtp_layers} MTP layer(s) (model.layers.{expected[0]}..{expected[-1]}, "
            f"num_hidden_layers {cfg.num_hidden_layers}) but the checkpoint holds tensors of layers "
            f"{present or 'none'} at or past num_hidden_layers: "
            f"{'missing ' + str(sorted(set(expected) - set(present))) if set(expected) - set(present) else ''}"
            f"{' extra ' + str(sorted(set(present) - set(expected))) if set(present) - set(expected) else ''}. "
            f"Fix the MTP layer count in config.json, or the checkpoint.")
    head = {n for n in names if (m := LAYER.match(n)) and int(m.group(1)) in expected}
    _check_layers_alike(cfg, head)
    copies = {n for n in head if n.split(".", 3)[3] in COPIES}
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


def stages(cfg: HeadConfig) -> StageList:
    docs = {"e": "enorm(embedding row) of the depth's MTP layer", "h": "hnorm(recycled hidden) of the depth's layer",
            "fc_in": "the input of eh_proj: concat(e, h) (concat(h, e) where mtp_hidden_states_first)",
            "fc": "eh_proj(fc_in)", "out": "post_norm(res2) of the depth's layer: recycled to the next depth"}
    spine = with_moe(SPINE) if cfg.num_experts else SPINE
    return StageList(s.with_doc(docs[s.name]) if s.name in docs else s for s in with_draft(spine))


def dims(cfg: HeadConfig) -> Dims:
    return Dims(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok)


@dataclass(frozen=True)
class MtpModelSpec(FamilySpec):
    """A FamilySpec over N layers: depth j runs layer j-1; `layer_count` tells the draft loop N."""

    def layer_count(self, cfg: HeadConfig) -> int:
        return cfg.num_mtp_layers


VARIANTS = (
    Variant("layer0_reused", "layer 0 run at every depth (vLLM's proposer without spec_step_idx, vllm#52688)"),
    Variant("layer_caches_swapped", "two layers' KV caches swapped"),
    Variant("shared_head_shared", "one layer's post_norm used at every depth"),
)


def declare(declared: MtpModelFamily) -> MtpModelSpec:
    """The FamilySpec of one declared model type."""
    return MtpModelSpec(
        name=declared.name, model_types=declared.model_types, architectures=declared.architectures,
        parse_config=lambda raw, source: head_config_from_json(declared, raw, source), layout=layout,
        head_prefix=HEAD_PREFIX, stages=stages, dims=dims, main_model_prefixes=("model.",), lm_head="lm_head.weight",
        head_module="oracle.families.mtp_model", variants=VARIANTS + declared.variants,
        tiny_config=declared.tiny_config, recycle_prenorm="res2",
        notes=("depth j runs MTP layer j-1, each layer its own cache (transformers' MtpModel)",
               "draft projection: the main lm_head, as MtpModel drafts (per-layer shared_head.head copies unread)"))


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


STEP3P7 = MtpModelFamily("step3p7", ("step3p7", "step3p5"), ("Step3p7ForConditionalGeneration",),
                         "num_nextn_predict_layers", "n_routed_experts", step3p7_tiny_config)

SPECS = (declare(STEP3P7),)
