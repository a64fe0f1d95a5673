"""The GLM-4.5 / 4.6 MTP head: a declaration over the shared MtpLayer head (oracle/families/mtp_layer.py):
transformers' own `MtpLayer` holding an official `Glm4MoeDecoderLayer` (`Glm4MoeAttention`: GQA, q/k/v bias,
optional q/k norm before partial NeoX RoPE; `Glm4MoeMoE`: the noaux_tc `Glm4MoeTopkRouter`, eager `Glm4MoeExperts`,
shared experts) and `Glm4MoeRMSNorm`s, with `Glm4MoeRotaryEmbedding`. This file says only what GLM-4.5 adds: its
official classes, GQA's config keywords, its q/k-part variants and its `--explain` variants; the torch-free half is
oracle/families/glm4_moe_layout.py.
"""

import copy
import sys

import numpy as np
import torch
from transformers.models.glm4_moe.configuration_glm4_moe import Glm4MoeConfig
from transformers.models.glm4_moe.modeling_glm4_moe import (Glm4MoeDecoderLayer, Glm4MoeModel, Glm4MoeRMSNorm,
                                                            Glm4MoeRotaryEmbedding)

from oracle.families.glm4_moe_layout import SPEC
from oracle.families.mtp_layer import (AttentionPass, MtpLayerHead, OfficialMtpLayer,  # noqa: F401  (head module)
                                       attention_with_uniform_weights, causal_mask, embedding_rows, main_model_hidden,
                                       official_layer_stepwise, qk_output_projection, run_batched, run_stepwise,
                                       torch_weights)
from oracle.families.mtp_layer_explain import (COMMON, MtpLayerOps, _copy, _param,  # noqa: F401  (head module)
                                               explain_ops)
from oracle.qk_parts import (PartVariant, interleaved_pairs, neox_cos_sin, other_norm_form, rotary_off,
                             skipped, swapped)
from oracle.trace import TraceInputs

OFFICIAL = OfficialMtpLayer(
    Glm4MoeConfig, Glm4MoeDecoderLayer, Glm4MoeRMSNorm, Glm4MoeRotaryEmbedding, Glm4MoeModel,
    attention_config=lambda cfg: dict(head_dim=cfg.head_dim, attention_bias=cfg.attention_bias,
                                      use_qk_norm=cfg.use_qk_norm),
    layout=SPEC.layout)
build_head, load_main_model = OFFICIAL.build_head, OFFICIAL.load_main_model
head_text_config, main_text_config = OFFICIAL.head_text_config, OFFICIAL.main_text_config


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


# ---- --explain: GQA's own wiring variants (the shared ones: mtp_layer_explain.COMMON) ---------------------------

def rope_all_dims(ops: MtpLayerOps) -> "MtpLayerOps | str":
    text = copy.copy(ops.text_config)
    if text.rope_parameters.get("partial_rotary_factor", 1.0) == 1.0:
        return "the reference already rotates every head dim (partial_rotary_factor 1)"
    text.rope_parameters = dict(text.rope_parameters) | {"partial_rotary_factor": 1.0}
    if hasattr(text, "partial_rotary_factor"):
        text.partial_rotary_factor = 1.0
    ops = ops.copy()
    ops.rope = type(ops.rotary)(text)(ops.embed[None], ops.positions)
    return ops


def no_qkv_bias(ops: MtpLayerOps) -> "MtpLayerOps | str":
    projections = [n for n in ("q_proj", "k_proj", "v_proj") if getattr(ops.attn, n).bias is not None]
    if not projections:
        return "the head has no q/k/v bias (attention_bias false)"
    attn = _copy(ops.attn, **{n: _copy(getattr(ops.attn, n), bias=_param(torch.zeros_like(getattr(ops.attn, n).bias)))
                              for n in projections})
    return ops.replaced(("attn",), attn)


def qk_norm_after_rope(ops: MtpLayerOps) -> str:
    if not getattr(ops.attn, "use_qk_norm", False):
        return "the head has no q/k norm (use_qk_norm false)"
    return ("not expressible as a patch of the official attention's modules or weights: it applies q_norm/k_norm "
            "before RoPE inside its forward (a per-element norm weight does not commute with the rotation)")


EXPLAIN_VARIANTS = COMMON | {"rope_all_dims": ("attn", rope_all_dims),
                             "qk_norm_after_rope": ("attn", qk_norm_after_rope), "no_qkv_bias": ("attn", no_qkv_bias)}
