"""The Qwen3.5-MoE MTP head, rebuilt from the official transformers classes.

What it is: the Qwen stem and tail of oracle/families/qwen3_5.py (`MtpHead`, one line per stage) around an official
`Qwen3_5MoeDecoderLayer` whose MLP is the official `Qwen3_5MoeSparseMoeBlock` (router, top-k, eager experts, shared
expert behind its sigmoid gate), with `Qwen3_5MoeRMSNorm` (1+w) norms and `Qwen3_5MoeTextRotaryEmbedding`. The MoE
stages (router_logits, topk_ids, topk_weights, shared, routed) are recorded by hooks on the official submodules.
Routed experts are widened only where tokens route (oracle/families/moe_experts.py); FP8 linears are dequantized with
their block scales, FP8 routed experts one expert at a time where tokens route (qwen3_5.routed_experts).

Top-k renormalisation: the official `Qwen3_5MoeTopKRouter` always renormalises. With `norm_topk_prob` false (the
config says so, or `export --no-norm-topk-prob`), the router is the official `Qwen3NextTopKRouter` instead: the same
softmax top-k, with the flag honoured. The trace's config records which.
"""

import torch
from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import (Qwen3_5MoeDecoderLayer, Qwen3_5MoeRMSNorm,
                                                                  Qwen3_5MoeTextModel, Qwen3_5MoeTextRotaryEmbedding)

from oracle.families.qwen3_5 import (MtpHead, QwenClasses, attention_with_uniform_weights, build_qwen_head,
                                     causal_mask, load_main_model as _load_main_model, main_model_hidden,
                                     official_layer_stepwise, qk_output_projection, qk_part_variants,
                                     routed_experts, run_batched, run_stepwise, torch_weights)
from oracle.families.qwen3_5_layout import HeadConfig
from oracle.families.qwen3_5_moe_layout import moe_layout

CLASSES = QwenClasses(Qwen3_5MoeTextConfig, Qwen3_5MoeDecoderLayer, Qwen3_5MoeRMSNorm, Qwen3_5MoeTextRotaryEmbedding,
                      Qwen3_5MoeTextModel)
__all__ = ["CLASSES", "MtpHead", "attention_with_uniform_weights", "build_head", "causal_mask", "head_text_config",
           "load_main_model", "main_model_hidden", "official_layer_stepwise", "qk_output_projection",
           "qk_part_variants", "run_batched", "run_stepwise", "torch_weights"]


def head_text_config(cfg: HeadConfig) -> Qwen3_5MoeTextConfig:
    """A one-layer config: layer 0 full attention with a sparse MoE MLP; eager attention (our mask) and experts."""
    text = Qwen3_5MoeTextConfig(
        hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, vocab_size=cfg.vocab_size,
        rms_norm_eps=cfg.rms_norm_eps, max_position_embeddings=cfg.max_position_embeddings, hidden_act="silu",
        attention_bias=False, num_hidden_layers=1, layer_types=["full_attention"],
        num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
        moe_intermediate_size=cfg.moe_intermediate_size,
        shared_expert_intermediate_size=cfg.shared_expert_intermediate_size,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta,
                         "partial_rotary_factor": cfg.partial_rotary_factor,
                         "mrope_section": list(cfg.mrope_section), "mrope_interleaved": cfg.mrope_interleaved},
    )
    text.norm_topk_prob = cfg.norm_topk_prob  # read only by the Qwen3NextTopKRouter swapped in when false
    text._attn_implementation = "eager"
    text._experts_implementation = "eager"
    return text


def build_head(cfg: HeadConfig, weights: dict[str, torch.Tensor]):
    text = head_text_config(cfg)
    experts, weights = routed_experts(cfg, moe_layout(cfg, set(weights)).experts, weights)
    classes = CLASSES if cfg.norm_topk_prob else _with_flagged_router(CLASSES)
    return build_qwen_head(text, classes, weights, experts)


def _with_flagged_router(classes: QwenClasses) -> QwenClasses:
    """The decoder layer with its router replaced by the official Qwen3NextTopKRouter (honours norm_topk_prob)."""
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextTopKRouter

    class DecoderLayer(classes.decoder_layer):
        def __init__(self, config, layer_idx):
            super().__init__(config, layer_idx)
            self.mlp.gate = Qwen3NextTopKRouter(config)

    return QwenClasses(classes.text_config, DecoderLayer, classes.rms_norm, classes.rotary, classes.text_model)


def load_main_model(checkpoint):
    return _load_main_model(checkpoint, CLASSES)
