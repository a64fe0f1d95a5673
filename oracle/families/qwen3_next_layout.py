"""Qwen3-Next (`qwen3_next`) MTP head, torch-free half: the Qwen stem and gated attention (plain partial RoPE, no
mrope) with the same sparse MoE block as Qwen3.5-MoE; `norm_topk_prob` is read by transformers' own router. The
head itself is `oracle/families/qwen3_next.py`. Released checkpoints use per-expert names; fused ones are
accepted too."""

from oracle.families.qwen3_5_layout import (LM_HEAD, QWEN_VARIANTS, HeadConfig, parse_qwen_config, spine_dims)
from oracle.families.qwen3_5_moe_layout import MOE_VARIANTS, moe_fusions, moe_layout
from oracle.families.spec import FamilySpec
from oracle.stages import SPINE, with_draft, with_moe

FAMILY = "qwen3_next"
MODEL_TYPES = ("qwen3_next",)
MAIN_MODEL_PREFIXES = ("model.",)


def head_config_from_json(raw: dict, source: str) -> HeadConfig:
    return parse_qwen_config(raw, source, FAMILY, MODEL_TYPES, moe=True, mrope=False)


def tiny_config(**overrides) -> dict:
    config = {"model_type": "qwen3_next", "architectures": ["Qwen3NextForCausalLM"], "hidden_size": 64,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 512,
              "intermediate_size": 128, "rms_norm_eps": 1e-6, "max_position_embeddings": 4096, "num_experts": 8,
              "num_experts_per_tok": 2, "moe_intermediate_size": 48, "shared_expert_intermediate_size": 40,
              "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "num_hidden_layers": 1,
              "layer_types": ["full_attention"], "tie_word_embeddings": False,
              "rope_parameters": {"rope_type": "default", "rope_theta": 5000000.0, "partial_rotary_factor": 0.25}}
    config.update(overrides)
    return config


SPEC = FamilySpec(
    name=FAMILY, model_types=MODEL_TYPES, architectures=("Qwen3NextForCausalLM",),
    parse_config=head_config_from_json, layout=moe_layout, head_prefix="mtp.",
    stages=lambda cfg: with_draft(with_moe(SPINE)), dims=spine_dims, main_model_prefixes=MAIN_MODEL_PREFIXES, lm_head=LM_HEAD,
    head_module="oracle.families.qwen3_next", variants=QWEN_VARIANTS + MOE_VARIANTS, tiny_config=tiny_config,
    fusions=moe_fusions,
    one_plus_norms=True,
)
