"""Qwen3.5-MoE (`qwen3_5_moe`) MTP head, torch-free half: the Qwen stem of oracle/families/qwen3_5_layout.py with a
sparse MoE block (router, top-k, routed experts, a shared expert behind a sigmoid gate). The head itself is
`oracle/families/qwen3_5_moe.py`.

Experts come in two layouts, both found in released checkpoints (shared/reference/mtp_wiring.md §3.1):
per-expert `mtp.layers.0.mlp.experts.{e}.{gate,up,down}_proj.weight`, or fused `mtp.layers.0.mlp.experts.gate_up_proj`
[E, 2I, D] (gate rows first) and `experts.down_proj` [E, D, I].

FP8 (oracle/families/qwen3_5_layout.py): per-expert routed experts carry
`experts.{e}.{gate,up,down}_proj.weight_scale_inv` like any other linear, as the -FP8 releases name them. Fused
experts with block scales have no released layout to check against (where would [E, 2I, D]'s scale grid and its
gate/up split lie?), so a fused FP8 checkpoint is refused rather than guessed; fused bf16 experts beside FP8 linears
are read as usual.

Top-k renormalisation: transformers' Qwen3_5MoeTopKRouter always renormalises the top-k weights to sum 1, and the
release config has no `norm_topk_prob` key; engines read `norm_topk_prob`. The oracle follows the config when it
has the key and transformers (true) otherwise, records the value in the trace's config, and
`mtp-oracle export --norm-topk-prob/--no-norm-topk-prob` overrides it.
"""

from oracle.errors import CheckpointError
from oracle.families.qwen3_5_layout import (LM_HEAD, MAIN_MODEL_PREFIXES, QWEN_VARIANTS, SCALE, HeadConfig,
                                            attention_fusions, fp8_scale_shapes, parse_qwen_config, spine_dims,
                                            stem_and_attention_shapes)
from oracle.families.spec import ExpertLayout, FamilySpec, Fusion, TensorLayout, Variant
from oracle.stages import SPINE, with_draft, with_moe

FAMILY = "qwen3_5_moe"
MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")
MLP = "mtp.layers.0.mlp."
FUSED = {"gate_up": MLP + "experts.gate_up_proj", "down": MLP + "experts.down_proj"}
PER_EXPERT = {p: MLP + "experts.{e}." + p + "_proj.weight" for p in ("gate", "up", "down")}

MOE_VARIANTS = (
    Variant("topk_not_renormalised", "top-k weights used as softmax probabilities, not renormalised to sum 1"),
    Variant("shared_ungated", "shared expert added without its sigmoid(shared_expert_gate) factor"),
)


def head_config_from_json(raw: dict, source: str) -> HeadConfig:
    return parse_qwen_config(raw, source, FAMILY, MODEL_TYPES, moe=True, mrope=True)


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


def tiny_config(**overrides) -> dict:
    text = {"model_type": "qwen3_5_moe_text", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 32, "vocab_size": 512, "rms_norm_eps": 1e-6, "max_position_embeddings": 4096,
            "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 48,
            "shared_expert_intermediate_size": 40, "num_hidden_layers": 1, "layer_types": ["full_attention"],
            "mtp_num_hidden_layers": 1, "tie_word_embeddings": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                                "mrope_section": [2, 1, 1], "mrope_interleaved": True}}
    text.update(overrides)
    return {"model_type": "qwen3_5_moe", "architectures": ["Qwen3_5MoeForConditionalGeneration"],
            "text_config": text}


SPEC = FamilySpec(
    name=FAMILY, model_types=MODEL_TYPES,
    architectures=("Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeForCausalLM"),
    parse_config=head_config_from_json, layout=moe_layout, head_prefix="mtp.",
    stages=lambda cfg: with_draft(with_moe(SPINE)), dims=spine_dims, main_model_prefixes=MAIN_MODEL_PREFIXES, lm_head=LM_HEAD,
    head_module="oracle.families.qwen3_5_moe", variants=QWEN_VARIANTS + MOE_VARIANTS, tiny_config=tiny_config,
    fusions=moe_fusions,
    one_plus_norms=True,
    notes=("norm_topk_prob: transformers' Qwen3_5MoeTopKRouter always renormalises; the oracle follows the config's "
           "norm_topk_prob when present, else true (recorded in config)",),
)
