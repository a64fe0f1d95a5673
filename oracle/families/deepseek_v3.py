"""The DeepSeek-V3 / R1 / V3.1 MTP head: transformers' own `MtpLayer` holding an official `DeepseekV3DecoderLayer`
(MLA `DeepseekV3Attention` with or without q_lora, YaRN softmax scale; `DeepseekV3MoE`: the noaux_tc
`DeepseekV3TopkRouter`, eager `DeepseekV3Experts`, shared experts) and `DeepseekV3RMSNorm`s, with
`DeepseekV3RotaryEmbedding` (YaRN). Stages are recorded by hooks (oracle/families/mtp_layer.py); the torch-free
half is oracle/families/deepseek_v3_layout.py.
"""

import numpy as np
import torch
from transformers.models.deepseek_v3.configuration_deepseek_v3 import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (DeepseekV3DecoderLayer, DeepseekV3Model,
                                                                  DeepseekV3RMSNorm, DeepseekV3RotaryEmbedding)

from oracle.families.deepseek_v3_layout import HeadConfig, layout
from oracle.families.mtp_layer import (AttentionPass, MtpLayerHead, attention_with_uniform_weights,
                                       build_mtp_layer_head, causal_mask, embedding_rows, load_official_main_model,
                                       main_model_hidden, official_layer_stepwise, qk_output_projection, run_batched,
                                       run_stepwise, torch_weights)
from oracle.families.mtp_layer_explain import DEEPSEEK_V3 as EXPLAIN_VARIANTS
from oracle.families.mtp_layer_explain import explain_ops
from oracle.qk_parts import PartVariant, rotary_off, swapped
from oracle.trace import TraceInputs

__all__ = ["EXPLAIN_VARIANTS", "MtpLayerHead", "attention_with_uniform_weights", "build_head", "causal_mask",
           "embedding_rows", "explain_ops", "head_text_config", "load_main_model", "main_model_hidden",
           "main_text_config", "official_layer_stepwise", "qk_output_projection", "qk_part_variants", "run_batched",
           "run_stepwise", "torch_weights"]


def head_text_config(cfg: HeadConfig) -> DeepseekV3Config:
    """A one-layer config as transformers' get_mtp_config makes it: first_k_dense_replace 0 (the MTP layer is MoE)."""
    return text_config(cfg, num_hidden_layers=1, first_k_dense_replace=0, intermediate_size=cfg.moe_intermediate_size)


def main_text_config(cfg: HeadConfig, raw: dict) -> DeepseekV3Config:
    """The main model's config: the head's fields with the main stack's depth, dense-layer count and dense MLP width
    (config.json's, else transformers' defaults)."""
    main = {k: raw[k] for k in ("first_k_dense_replace", "intermediate_size") if k in raw}
    return text_config(cfg, num_hidden_layers=cfg.num_hidden_layers, **main)


def load_main_model(checkpoint) -> DeepseekV3Model:
    """The official DeepseekV3Model over the checkpoint's layers 0..N-1 (float32), for --main-model."""
    text = main_text_config(checkpoint.config, checkpoint.raw_config)
    return load_official_main_model(checkpoint, DeepseekV3Model, text, DeepseekV3RotaryEmbedding)


def text_config(cfg: HeadConfig, **layers) -> DeepseekV3Config:
    return DeepseekV3Config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, moe_intermediate_size=cfg.moe_intermediate_size,
        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
        n_shared_experts=cfg.n_shared_experts, n_routed_experts=cfg.num_experts,
        routed_scaling_factor=cfg.routed_scaling_factor, kv_lora_rank=cfg.kv_lora_rank, q_lora_rank=cfg.q_lora_rank,
        qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim, qk_nope_head_dim=cfg.qk_nope_head_dim,
        n_group=cfg.n_group, topk_group=cfg.topk_group, num_experts_per_tok=cfg.num_experts_per_tok,
        norm_topk_prob=cfg.norm_topk_prob, hidden_act="silu",
        max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.rms_norm_eps,
        rope_parameters=dict(cfg.rope_parameters), rope_interleave=cfg.rope_interleave, attention_bias=False,
        num_nextn_predict_layers=1, tie_word_embeddings=False, **layers)


def build_head(cfg: HeadConfig, weights: dict[str, torch.Tensor]):
    return build_mtp_layer_head(cfg, head_text_config(cfg), DeepseekV3DecoderLayer, DeepseekV3RMSNorm,
                                DeepseekV3RotaryEmbedding, layout(cfg, set(weights)), weights)


def qk_part_variants(head: MtpLayerHead, rotary, inputs: TraceInputs, ah: np.ndarray, mask_of=None) -> list[PartVariant]:
    """The wrong variants of each q/k-path part of MLA DeepseekV3Attention (oracle/qk_parts.py): RoPE (cos = 1 and
    sin = 0; the other pairing: config.rope_interleave flipped, so the module runs its other official RoPE
    function) and the KV append. MLA has no per-head q_norm/k_norm (its q_a_layernorm and kv_a_layernorm act on
    the latents, weights the --explain coverage measures), and RoPE covers exactly the qk_rope_head_dim slice by
    construction (the split comes before it), so there is no "all dims" variant."""
    p = AttentionPass.of(head, rotary, inputs, ah, mask_of)
    config = head.text_config
    other = "neox_halves" if config.rope_interleave else "interleaved"
    return [PartVariant("rope", "absent", p.run(rope=rotary_off(*p.rope))),
            PartVariant("rope", other, p.under(swapped, config, "rope_interleave", not config.rope_interleave)),
            *p.kv_append()]
