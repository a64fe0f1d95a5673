"""The Qwen3.5-MoE MTP head: a declaration over the Qwen stem (oracle/families/qwen3_5_stem.py) with the classes
named here: `Qwen3_5MoeDecoderLayer` whose MLP is the official `Qwen3_5MoeSparseMoeBlock` (router, top-k, eager
experts, shared expert behind its sigmoid gate), `Qwen3_5MoeRMSNorm` (1+w) norms and `Qwen3_5MoeTextRotaryEmbedding`.
The stem records the MoE stages by hooks on the official submodules and widens (or dequantizes, FP8) routed experts
only where tokens route.

Top-k renormalisation: the official `Qwen3_5MoeTopKRouter` always renormalises. With `norm_topk_prob` false (the
config says so, or `export --no-norm-topk-prob`), the router is the official `Qwen3NextTopKRouter` instead: the same
softmax top-k, with the flag honoured. The trace's config records which.
"""

from functools import partial

from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import (Qwen3_5MoeDecoderLayer, Qwen3_5MoeRMSNorm,
                                                                  Qwen3_5MoeTextModel, Qwen3_5MoeTextRotaryEmbedding)

from oracle.families import qwen3_5_stem as stem
from oracle.families.qwen3_5_explain import EXPLAIN_VARIANTS, explain_ops  # noqa: F401  (the Explainer's)
from oracle.families.qwen3_5_stem import *  # noqa: F401,F403  (the seam's functions the Qwen stem shares)

CLASSES = stem.QwenClasses(Qwen3_5MoeTextConfig, Qwen3_5MoeDecoderLayer, Qwen3_5MoeRMSNorm,
                           Qwen3_5MoeTextRotaryEmbedding, Qwen3_5MoeTextModel)


def head_text_config(cfg):
    """The stem's one-layer config with the MoE block on layer 0."""
    text = stem.stem_text_config(cfg, CLASSES, **stem.moe_keys(cfg))
    text.norm_topk_prob = cfg.norm_topk_prob  # read only by the Qwen3NextTopKRouter swapped in when false
    return text


def build_head(cfg, weights):
    classes = CLASSES if cfg.norm_topk_prob else _with_flagged_router(CLASSES)
    return stem.build_stem_head(cfg, weights, head_text_config(cfg), classes)


def _with_flagged_router(classes):
    """The decoder layer with its router replaced by the official Qwen3NextTopKRouter (honours norm_topk_prob)."""
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextTopKRouter

    class DecoderLayer(classes.decoder_layer):
        def __init__(self, config, layer_idx):
            super().__init__(config, layer_idx)
            self.mlp.gate = Qwen3NextTopKRouter(config)

    return stem.QwenClasses(classes.text_config, DecoderLayer, classes.rms_norm, classes.rotary, classes.text_model)


load_main_model = partial(stem.load_main_model, classes=CLASSES)
