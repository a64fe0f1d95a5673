"""The Qwen3-Next MTP head, rebuilt from the official transformers classes.

What it is: the Qwen stem and tail of oracle/families/qwen3_5.py (`MtpHead`, one line per stage) around an official
`Qwen3NextDecoderLayer` (gated full attention, `Qwen3NextSparseMoeBlock` with `Qwen3NextTopKRouter`, which reads
`norm_topk_prob`, eager experts, the shared expert behind its sigmoid gate), `Qwen3NextRMSNorm` (1+w) norms and
`Qwen3NextRotaryEmbedding` (plain partial RoPE). MoE stages are recorded by hooks on the official submodules; routed
experts are widened only where tokens route (oracle/families/moe_experts.py); FP8 checkpoints are dequantized as
Qwen3.5-MoE's are (qwen3_5.routed_experts).
"""

import torch
from transformers.models.qwen3_next.configuration_qwen3_next import Qwen3NextConfig
from transformers.models.qwen3_next.modeling_qwen3_next import (Qwen3NextDecoderLayer, Qwen3NextModel,
                                                                Qwen3NextRMSNorm, Qwen3NextRotaryEmbedding)

from oracle.families.qwen3_5 import (MtpHead, QwenClasses, attention_with_uniform_weights, build_qwen_head,
                                     causal_mask, load_main_model as _load_main_model, main_model_hidden,
                                     official_layer_stepwise, qk_output_projection, qk_part_variants,
                                     routed_experts, run_batched, run_stepwise, torch_weights)
from oracle.families.qwen3_5_layout import HeadConfig
from oracle.families.qwen3_5_moe_layout import moe_layout

CLASSES = QwenClasses(Qwen3NextConfig, Qwen3NextDecoderLayer, Qwen3NextRMSNorm, Qwen3NextRotaryEmbedding,
                      Qwen3NextModel)
__all__ = ["CLASSES", "MtpHead", "attention_with_uniform_weights", "build_head", "causal_mask", "head_text_config",
           "load_main_model", "main_model_hidden", "official_layer_stepwise", "qk_output_projection",
           "qk_part_variants", "run_batched", "run_stepwise", "torch_weights"]


def head_text_config(cfg: HeadConfig) -> Qwen3NextConfig:
    """A one-layer config: layer 0 full attention with a sparse MoE MLP; eager attention (our mask) and experts."""
    text = Qwen3NextConfig(
        hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, vocab_size=cfg.vocab_size,
        rms_norm_eps=cfg.rms_norm_eps, max_position_embeddings=cfg.max_position_embeddings, hidden_act="silu",
        attention_bias=False, num_hidden_layers=1, layer_types=["full_attention"],
        num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
        moe_intermediate_size=cfg.moe_intermediate_size,
        shared_expert_intermediate_size=cfg.shared_expert_intermediate_size, norm_topk_prob=cfg.norm_topk_prob,
        decoder_sparse_step=1, mlp_only_layers=[],
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta,
                         "partial_rotary_factor": cfg.partial_rotary_factor},
    )
    text._attn_implementation = "eager"
    text._experts_implementation = "eager"
    return text


def build_head(cfg: HeadConfig, weights: dict[str, torch.Tensor]):
    experts, weights = routed_experts(cfg, moe_layout(cfg, set(weights)).experts, weights)
    return build_qwen_head(head_text_config(cfg), CLASSES, weights, experts)


def load_main_model(checkpoint):
    return _load_main_model(checkpoint, CLASSES)
