"""The GLM-4.5 / 4.6 MTP head: transformers' own `MtpLayer` holding an official `Glm4MoeDecoderLayer`
(`Glm4MoeAttention`: GQA, q/k/v bias, optional q/k norm before partial NeoX RoPE; `Glm4MoeMoE`: the noaux_tc
`Glm4MoeTopkRouter`, eager `Glm4MoeExperts`, shared experts) and `Glm4MoeRMSNorm`s, with `Glm4MoeRotaryEmbedding`.
Stages are recorded by hooks (oracle/families/mtp_layer.py); the torch-free half is
oracle/families/glm4_moe_layout.py.
"""

import sys

import numpy as np
import torch
from transformers.models.glm4_moe.configuration_glm4_moe import Glm4MoeConfig
from transformers.models.glm4_moe.modeling_glm4_moe import (Glm4MoeDecoderLayer, Glm4MoeModel, Glm4MoeRMSNorm,
                                                            Glm4MoeRotaryEmbedding)

from oracle.families.glm4_moe_layout import HeadConfig, layout
from oracle.families.mtp_layer import (AttentionPass, MtpLayerHead, attention_with_uniform_weights,
                                       build_mtp_layer_head, causal_mask, embedding_rows, load_official_main_model,
                                       main_model_hidden, official_layer_stepwise, qk_output_projection, run_batched,
                                       run_stepwise, torch_weights)
from oracle.families.mtp_layer_explain import GLM4_MOE as EXPLAIN_VARIANTS
from oracle.families.mtp_layer_explain import explain_ops
from oracle.qk_parts import (PartVariant, interleaved_pairs, neox_cos_sin, other_norm_form, rotary_off,
                             skipped, swapped)
from oracle.trace import TraceInputs

__all__ = ["EXPLAIN_VARIANTS", "MtpLayerHead", "attention_with_uniform_weights", "build_head", "causal_mask",
           "embedding_rows", "explain_ops", "head_text_config", "load_main_model", "main_model_hidden",
           "main_text_config", "official_layer_stepwise", "qk_output_projection", "qk_part_variants", "run_batched",
           "run_stepwise", "torch_weights"]


def head_text_config(cfg: HeadConfig) -> Glm4MoeConfig:
    """A one-layer config as transformers' get_mtp_config makes it: first_k_dense_replace 0 (the MTP layer is MoE)."""
    return text_config(cfg, num_hidden_layers=1, first_k_dense_replace=0, intermediate_size=cfg.moe_intermediate_size)


def main_text_config(cfg: HeadConfig, raw: dict) -> Glm4MoeConfig:
    """The main model's config: the head's fields with the main stack's depth, dense-layer count and dense MLP width
    (config.json's, else transformers' defaults)."""
    main = {k: raw[k] for k in ("first_k_dense_replace", "intermediate_size") if k in raw}
    return text_config(cfg, num_hidden_layers=cfg.num_hidden_layers, **main)


def load_main_model(checkpoint) -> Glm4MoeModel:
    """The official Glm4MoeModel over the checkpoint's layers 0..N-1 (float32), for --main-model."""
    text = main_text_config(checkpoint.config, checkpoint.raw_config)
    return load_official_main_model(checkpoint, Glm4MoeModel, text, Glm4MoeRotaryEmbedding)


def text_config(cfg: HeadConfig, **layers) -> Glm4MoeConfig:
    return Glm4MoeConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, hidden_act="silu",
        max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.rms_norm_eps,
        rope_parameters=dict(cfg.rope_parameters), attention_bias=cfg.attention_bias,
        moe_intermediate_size=cfg.moe_intermediate_size, num_experts_per_tok=cfg.num_experts_per_tok,
        n_shared_experts=cfg.n_shared_experts, n_routed_experts=cfg.num_experts,
        routed_scaling_factor=cfg.routed_scaling_factor, n_group=cfg.n_group, topk_group=cfg.topk_group,
        norm_topk_prob=cfg.norm_topk_prob, use_qk_norm=cfg.use_qk_norm, num_nextn_predict_layers=1,
        tie_word_embeddings=False, **layers)


def build_head(cfg: HeadConfig, weights: dict[str, torch.Tensor]):
    return build_mtp_layer_head(cfg, head_text_config(cfg), Glm4MoeDecoderLayer, Glm4MoeRMSNorm,
                                Glm4MoeRotaryEmbedding, layout(cfg, set(weights)), weights)


def qk_part_variants(head: MtpLayerHead, rotary, inputs: TraceInputs, ah: np.ndarray, mask_of=None) -> list[PartVariant]:
    """The wrong variants of each q/k-path part of Glm4MoeAttention (oracle/qk_parts.py): RoPE (cos = 1 and
    sin = 0; NeoX over all head dims instead of the partial rotary ones; interleaved pairs on the rotary slice),
    q_norm and k_norm where use_qk_norm ((w) norms: skipped, or scaling by 1 + w) and the KV append."""
    p = AttentionPass.of(head, rotary, inputs, ah, mask_of)
    theta, head_dim = head.text_config.rope_parameters["rope_theta"], p.module.head_dim
    variants = [PartVariant("rope", "absent", p.run(rope=rotary_off(*p.rope)))]
    if p.rope[0].shape[-1] < head_dim:
        variants.append(PartVariant("rope", "all_dims", p.run(rope=neox_cos_sin(p.positions, theta, head_dim))))
    module = sys.modules[type(p.module).__module__]
    variants.append(PartVariant("rope", "interleaved",
                                p.under(swapped, module, "apply_rotary_pos_emb",
                                        interleaved_pairs(module.apply_rotary_pos_emb))))
    if getattr(p.module, "use_qk_norm", False):
        for part in ("q_norm", "k_norm"):
            norm = getattr(p.module, part)
            variants += [PartVariant(part, "absent", p.under(skipped, norm)),
                         PartVariant(part, "1_plus_w_not_w", p.under(swapped, norm, "weight",
                                                                      other_norm_form(norm, False)))]
    return variants + p.kv_append()
