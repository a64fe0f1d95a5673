"""The family seam: what every model family declares, with no torch or transformers import.

A family is two files: `oracle/families/<family>_layout.py` (torch-free: config parsing and validation, tensor
names and shapes in each layout, the stage list, evidence rules, the catalogue of known wiring variants, a tiny
config for fixtures) and `oracle/families/<family>.py` (the head built from the official transformers classes,
named by `head_module`). The registry (oracle/families/registry.py) finds the family from config.json. Nothing
outside oracle/families/ names a family.
"""

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from oracle.stages import Dims, StageList


# Head-config fields that are engine conventions, not facts of the checkpoint: set by export options, recorded in
# the trace's config, and handed to a candidate from the reference (not from config.json) by `mtp-probe run`.
CONVENTIONS = ("norm_topk_prob", "mask_pos0_embedding")
NO_POS0_STEP = ("absolute positions are not evidenced: the position-0 embedding is masked (mask_pos0_embedding), "
                "but no step of this trace sits at absolute position 0 (e.g. --start-pos > 0), so neither the mask "
                "nor a shift of every position can show; RoPE scores depend only on relative positions")


def has_position_0(positions) -> bool:
    """Whether a step sits at absolute position 0 (the one the position-0 embedding mask zeroes)."""
    return positions is not None and any(int(p) == 0 for p in positions)


class HeadConfig(Protocol):
    """What code outside a family may read from any family's head config."""

    family: str
    hidden_size: int
    vocab_size: int
    max_position_embeddings: int

    def to_dict(self) -> dict: ...


MAIN_LM_HEAD = "lm_head.weight"  # the main model's output projection as HF checkpoints name it (any family)


@dataclass(frozen=True)
class ExpertLayout:
    """Where a MoE head's routed experts lie in the checkpoint, in one of two layouts.

    fused:       `gate_up` [E, 2I, D] (gate rows first) and `down` [E, D, I]
    per_expert:  `gate`, `up` [I, D] and `down` [D, I] per expert, names from the templates with {e}
    The head reads only the experts the traced tokens route to (widened one at a time)."""

    kind: str  # "fused" | "per_expert"
    num_experts: int
    intermediate: int
    hidden: int
    names: dict[str, str]  # fused: {"gate_up", "down"}; per_expert: {"gate", "up", "down"} with "{e}"

    def tensor_names(self) -> list[str]:
        if self.kind == "fused":
            return [self.names["gate_up"], self.names["down"]]
        return [self.names[p].format(e=e) for e in range(self.num_experts) for p in ("gate", "up", "down")]

    def shapes(self) -> dict[str, tuple[int, ...]]:
        e, i, d = self.num_experts, self.intermediate, self.hidden
        if self.kind == "fused":
            return {self.names["gate_up"]: (e, 2 * i, d), self.names["down"]: (e, d, i)}
        per = {"gate": (i, d), "up": (i, d), "down": (d, i)}
        return {self.names[p].format(e=x): per[p] for x in range(e) for p in ("gate", "up", "down")}


@dataclass(frozen=True)
class TensorLayout:
    """The head's tensors as one checkpoint stores them: dense tensors (name -> shape) plus, for MoE, the experts."""

    dense: dict[str, tuple[int, ...]]
    experts: ExpertLayout | None = None

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return self.dense | (self.experts.shapes() if self.experts else {})


@dataclass(frozen=True)
class Variant:
    """A known wiring mistake that still runs (the probe's diagnosis uses these)."""

    name: str
    description: str  # what the candidate does, e.g. "fc_in is [h, e], expected [e, h]"


@dataclass(frozen=True)
class Fusion:
    """How an engine's fused tensor is assembled from checkpoint tensors (the load audit, `mtp-probe weights`).

    The parts are concatenated along `axis` in order (vLLM's `qkv_proj` = cat(q, k, v) rows, `gate_up_proj` =
    cat(gate, up)); with `experts` > 0 the parts are templates with {e} and the result stacks expert e's
    concatenation along a new first axis (vLLM's FusedMoE `w13_weight` [E, 2I, D]). One part is an alias."""

    parts: tuple[str, ...]
    axis: int = 0
    experts: int = 0


@dataclass(frozen=True)
class FamilySpec:
    name: str
    model_types: tuple[str, ...]  # config.json model_type (top level or text_config)
    architectures: tuple[str, ...]
    parse_config: Callable[[dict, str], HeadConfig]  # (raw config.json, its path) -> validated head config
    layout: Callable[[HeadConfig, set[str]], TensorLayout]  # (config, checkpoint tensor names) -> the layout used
    head_prefix: str  # every head tensor starts with it; one that the layout does not name is refused
    stages: Callable[[HeadConfig], StageList]
    dims: Callable[[HeadConfig], Dims]
    main_model_prefixes: tuple[str, ...]  # where the shared embedding lies: <prefix><embedding>
    lm_head: str
    head_module: str  # the torch half: build_head, run_batched, run_stepwise, ...
    qk_dependent_from: str = "attn"  # this stage and every later one see q/k only through the attention weights
    variants: tuple[Variant, ...] = ()
    tiny_config: Callable[..., dict] | None = None  # (**overrides) -> a config.json dict for fixtures
    notes: tuple[str, ...] = field(default=())  # conventions recorded in the trace (e.g. top-k renormalisation)
    # engine-side fused tensor name -> how it is built from this checkpoint's tensors ((config, layout) -> {name:
    # Fusion}); used by the load audit (`mtp-probe weights`) to read dumps that use the engine's fused names
    fusions: Callable[[HeadConfig, TensorLayout], dict[str, Fusion]] | None = None
    # the decoder layer's input and output stages (the family contract test runs the official layer between them)
    layer_input: str = "fc"
    layer_output: str = "res2"
    # the stage whose rows draft j+1 of an `accept` chain reads as its hidden (DeepSeek-V4: the block's streams,
    # before the head collapses them); `out` (the lm_head input) for every family that recycles it
    recycled: str = "out"
    # the head's RMSNorms scale by (1 + w) (Qwen: a fresh norm's w is 0) rather than by w (DeepSeek, GLM: 1); the
    # load audit names an all-0 or all-1 norm weight by it
    one_plus_norms: bool = False
    # the un-normed tensor an engine may recycle instead (vLLM 0.33.0's GLM-4.5 MTP recycles its residual): the
    # trace records what recycling it would have given (h_if_prenorm) and `export --recycle` can choose it; None
    # where the family has no pre-norm tensor of the recycled width (DeepSeek-V4: head_collapsed is D, not hc·D)
    recycle_prenorm: str | None = "res2"
    # the shared embedding's name after its main-model prefix (Inkling's release: model.llm.embed.weight)
    embedding: str = "embed_tokens.weight"

    def layer_count(self, cfg: HeadConfig) -> int:
        """N, the head's MTP layers (depth j runs layer j-1 where N > 1): the config's `num_mtp_layers` where the
        family records one, else 1."""
        return int(getattr(cfg, "num_mtp_layers", 1))

    def hidden_width(self, cfg: HeadConfig) -> int:
        """Width of the hidden H one step consumes: hc·D (DeepSeek-V4: the main model's hc_mult residual streams),
        D for every family without hyper-connection streams."""
        return self.dims(cfg).hc_mult * cfg.hidden_size

    def attention_window(self, cfg: HeadConfig) -> int | None:
        """How many keys a step's query sees, itself included (a sliding window: DeepSeek-V4), or None: every
        earlier step of the head's own cache. `accept` masks its bridge pass and chains with it."""
        return None

    def evidence_rules(self, cfg: HeadConfig, positions=None) -> dict:
        """What the probe needs to know about this head's evidence, stored with the trace; `positions`: the trace's
        step positions (a statement about one position holds only where a step sits there)."""
        return {"qk_dependent": list(self.stages(cfg).after(self.qk_dependent_from)),
                "absolute_positions": "not evidenced"}
