"""The Qwen3-Next MTP head: a declaration over the Qwen stem (oracle/families/qwen3_5_stem.py) with the classes
named here: `Qwen3NextDecoderLayer` (gated full attention, `Qwen3NextSparseMoeBlock` whose `Qwen3NextTopKRouter`
reads `norm_topk_prob`, eager experts, the shared expert behind its sigmoid gate), `Qwen3NextRMSNorm` (1+w) norms
and `Qwen3NextRotaryEmbedding` (plain partial RoPE). The stem records the MoE stages by hooks on the official
submodules and widens (or dequantizes, FP8) routed experts only where tokens route.
"""

from functools import partial

from transformers.models.qwen3_next.configuration_qwen3_next import Qwen3NextConfig
from transformers.models.qwen3_next.modeling_qwen3_next import (Qwen3NextDecoderLayer, Qwen3NextModel,
                                                                Qwen3NextRMSNorm, Qwen3NextRotaryEmbedding)

from oracle.families import qwen3_5_stem as stem
from oracle.families.qwen3_5_explain import EXPLAIN_VARIANTS, explain_ops  # noqa: F401  (the Explainer's)
from oracle.families.qwen3_5_stem import *  # noqa: F401,F403  (the seam's functions the Qwen stem shares)

CLASSES = stem.QwenClasses(Qwen3NextConfig, Qwen3NextDecoderLayer, Qwen3NextRMSNorm, Qwen3NextRotaryEmbedding,
                           Qwen3NextModel)


def head_text_config(cfg):
    """The stem's one-layer config with the MoE block on layer 0 (its own router reads norm_topk_prob)."""
    return stem.stem_text_config(cfg, CLASSES, **stem.moe_keys(cfg), norm_topk_prob=cfg.norm_topk_prob,
                                 decoder_sparse_step=1, mlp_only_layers=[])


def build_head(cfg, weights):
    return stem.build_stem_head(cfg, weights, head_text_config(cfg), CLASSES)


load_main_model = partial(stem.load_main_model, classes=CLASSES)
