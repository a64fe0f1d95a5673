"""The Qwen3.5 (dense) MTP head: a declaration over the Qwen stem (oracle/families/qwen3_5_stem.py), which builds
`MtpHead` (one line per stage) from the classes named here: `Qwen3_5DecoderLayer` (gated attention, `Qwen3_5MLP`),
`Qwen3_5RMSNorm` (1+w) norms and `Qwen3_5TextRotaryEmbedding` (text mrope), loaded strictly with the checkpoint's 15
`mtp.*` tensors. --explain's operators and variants: oracle/families/qwen3_5_explain.py.
"""

from functools import partial

from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import (Qwen3_5DecoderLayer, Qwen3_5RMSNorm, Qwen3_5TextModel,
                                                          Qwen3_5TextRotaryEmbedding)

from oracle.families import qwen3_5_stem as stem
from oracle.families.qwen3_5_explain import EXPLAIN_VARIANTS, explain_ops  # noqa: F401  (the Explainer's)
from oracle.families.qwen3_5_stem import *  # noqa: F401,F403  (the seam's functions the Qwen stem shares)

CLASSES = stem.QwenClasses(Qwen3_5TextConfig, Qwen3_5DecoderLayer, Qwen3_5RMSNorm, Qwen3_5TextRotaryEmbedding,
                           Qwen3_5TextModel)


def head_text_config(cfg):
    """The stem's one-layer config with the dense MLP."""
    return stem.stem_text_config(cfg, CLASSES, intermediate_size=cfg.intermediate_size)


def build_head(cfg, weights):
    return stem.build_stem_head(cfg, weights, head_text_config(cfg), CLASSES)


load_main_model = partial(stem.load_main_model, classes=CLASSES)
