"""The DeepSeek-V3 / R1 / V3.1 MTP head: a declaration over the shared MtpLayer head (oracle/families/mtp_layer.py):
transformers' own `MtpLayer` holding an official `DeepseekV3DecoderLayer` (MLA `DeepseekV3Attention` with or without
q_lora, YaRN softmax scale; `DeepseekV3MoE`: the noaux_tc `DeepseekV3TopkRouter`, eager `DeepseekV3Experts`, shared
experts) and `DeepseekV3RMSNorm`s, with `DeepseekV3RotaryEmbedding` (YaRN). This file says only what DeepSeek-V3
adds: its official classes, MLA's config keywords, its q/k-part variants and its `--explain` variants; the torch-free
half is oracle/families/deepseek_v3_layout.py.
"""

import copy

import numpy as np
from transformers.models.deepseek_v3.configuration_deepseek_v3 import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (DeepseekV3DecoderLayer, DeepseekV3Model,
                                                                  DeepseekV3RMSNorm, DeepseekV3RotaryEmbedding)

from oracle.families.deepseek_v3_layout import SPEC
from oracle.families.mtp_layer import (AttentionPass, MtpLayerHead, OfficialMtpLayer,  # noqa: F401  (head module)
                                       attention_with_uniform_weights, causal_mask, embedding_rows, main_model_hidden,
                                       official_layer_stepwise, qk_output_projection, run_batched, run_stepwise,
                                       torch_weights)
from oracle.families.mtp_layer_explain import COMMON, MtpLayerOps, _copy, explain_ops  # noqa: F401  (head module)
from oracle.qk_parts import PartVariant, rotary_off, swapped
from oracle.trace import TraceInputs

OFFICIAL = OfficialMtpLayer(
    DeepseekV3Config, DeepseekV3DecoderLayer, DeepseekV3RMSNorm, DeepseekV3RotaryEmbedding, DeepseekV3Model,
    attention_config=lambda cfg: dict(
        kv_lora_rank=cfg.kv_lora_rank, q_lora_rank=cfg.q_lora_rank, qk_rope_head_dim=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim, qk_nope_head_dim=cfg.qk_nope_head_dim, rope_interleave=cfg.rope_interleave,
        attention_bias=False),
    layout=SPEC.layout)
build_head, load_main_model = OFFICIAL.build_head, OFFICIAL.load_main_model
head_text_config, main_text_config = OFFICIAL.head_text_config, OFFICIAL.main_text_config


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


# ---- --explain: MLA's own wiring variants (the shared ones: mtp_layer_explain.COMMON) ---------------------------

def rope_not_interleaved(ops: MtpLayerOps) -> "MtpLayerOps | str":
    """The official attention reading a config copy with rope_interleave false (its NeoX-halves branch)."""
    if not getattr(ops.attn.config, "rope_interleave", False):
        return "the reference itself does not interleave (rope_interleave false)"
    text = copy.copy(ops.attn.config)
    text.rope_interleave = False
    return ops.replaced(("attn",), _copy(ops.attn, config=text))


def no_yarn_mscale(ops: MtpLayerOps) -> "MtpLayerOps | str":
    plain = ops.attn.qk_head_dim ** -0.5
    if ops.attn.scaling == plain:
        return "the softmax scale has no YaRN mscale in this config: the variant changes nothing"
    return ops.replaced(("attn",), _copy(ops.attn, scaling=plain))


def latent_norm_eps(ops: MtpLayerOps) -> "MtpLayerOps | str":
    eps = ops.cfg.rms_norm_eps
    norms = [n for n in ("q_a_layernorm", "kv_a_layernorm") if getattr(ops.attn, n, None) is not None]
    if all(getattr(ops.attn, n).variance_epsilon == eps for n in norms):
        return f"rms_norm_eps is {eps:g}, the latent norms' own eps: the variant changes nothing"
    attn = _copy(ops.attn, **{n: _copy(getattr(ops.attn, n), variance_epsilon=eps) for n in norms})
    return ops.replaced(("attn",), attn)


EXPLAIN_VARIANTS = COMMON | {"rope_not_interleaved": ("attn", rope_not_interleaved),
                             "no_yarn_mscale": ("attn", no_yarn_mscale), "latent_norm_eps": ("attn", latent_norm_eps)}
