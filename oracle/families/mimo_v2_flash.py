"""MiMo-V2-Flash / V2.5 multi-layer MTP heads on transformers' own `MtpModel` (issue 25); the torch-free half (the
release config read onto the official config, layout, stages) is oracle/families/mimo_v2_flash_layout.py.

What it is: the official `MiMoV2FlashForCausalLM` built on the meta device from `MiMoV2FlashConfig(**cfg.text)`
(the release's keys translated, mimo_v2_flash_layout.official_kwargs), whose MTP count (`num_mtp_layers`) and MTP
layer types (`mtp_layer_types` = sliding_attention, `mtp_mlp_layer_types` = dense, per layer) are set here, because
transformers 5.24 deletes the count from this config (modular_mimo_v2_flash.py:109) and `get_mtp_config` raises
without it. Over it, `MtpModel(main, N)`: N official `MtpLayer`s of `MiMoV2FlashDecoderLayer` (its SWA attention: 2 x num_key_value_heads, sinks, sliding window, V
scale; its dense MLP) and `MiMoV2FlashRMSNorm`, rope from the official `MiMoV2FlashRotaryEmbedding` asked for the
sliding layer type. Loading goes through `MtpModel.get_weight_conversions` (which already maps
`model.mtp.layers.{l}.*` onto layer l and `attention_sink_bias` onto `sinks`) plus the two renamings transformers
has no entry for, written with its own `WeightRenaming`: `pre_mlp_layernorm` -> the decoder layer's
`post_attention_layernorm` and `final_layernorm` -> `post_norm`, as SGLang's `map_model_name_to_mtp_param_name`
maps them. Strict, as every MtpModel family (oracle/families/mtp_model.py, whose head, hooks and runs this reuses).
FP8 linears (e4m3 beside `weight_scale_inv`, as released) are dequantized to float32 with their block scales
before the load (oracle/fp8.py, exact), the rest widened as stored.
What it is not: the fused-qkv (V2.5/Pro) releases (refused by the layout), and `--main-model`.
"""

import importlib

import torch
from torch import nn

from oracle.errors import CheckpointError
from oracle.families.torch_parts import FP8_SCALE, Fp8Weights
from oracle.families.mtp_model import (MtpModelHead, attention_with_uniform_weights, layer_mask,  # noqa: F401
                                       load_main_model, main_model_hidden, official_layer_stepwise,
                                       qk_output_projection, qk_part_variants, run_batched, run_stepwise)
from oracle.families.mtp_model import build_head as _build_head
from oracle.families.mtp_model import torch_weights  # noqa: F401  (stored tensors; FP8 as e4m3 bytes)

MODELING = "transformers.models.mimo_v2_flash.modeling_mimo_v2_flash"
CONFIGURATION = "transformers.models.mimo_v2_flash.configuration_mimo_v2_flash"
# release name -> MtpLayer parameter name, where MtpModel's conversions have none (SGLang maps them the same way)
RENAMES = ((r"\.pre_mlp_layernorm\.", ".post_attention_layernorm."),
           (r"^model\.mtp\.layers\.(\d+)\.final_layernorm\.", r"model.mtp.layers.\1.post_norm."))


def official_config(cfg):
    """MiMoV2FlashConfig of the MTP layers, with the MTP count and layer types transformers would need to build
    them (every MTP layer: sliding attention, dense MLP)."""
    config = getattr(importlib.import_module(CONFIGURATION), "MiMoV2FlashConfig")(**cfg.text)
    n = cfg.num_mtp_layers
    config.num_mtp_layers = n
    config.mtp_layer_types = ["sliding_attention"] * n
    config.mtp_mlp_layer_types = ["dense"] * n
    return config


class MiMoMtpHead(MtpModelHead):
    """MtpModelHead over the MiMo main class built from the translated config, with MiMo's two renamings."""

    def main_model(self, cfg) -> nn.Module:
        return getattr(importlib.import_module(MODELING), "MiMoV2FlashForCausalLM")(official_config(cfg))

    def weight_conversions(self) -> list:
        from transformers.core_model_loading import WeightRenaming

        own = [WeightRenaming(source_patterns=a, target_patterns=b) for a, b in RENAMES]
        return own + super().weight_conversions()


def build_head(cfg, weights: dict[str, torch.Tensor]):
    return _build_head(cfg, dequantized(cfg, weights), MiMoMtpHead)


def dequantized(cfg, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """FP8 linears (e4m3 bytes, torch_weights) widened to float32 with their weight_scale_inv block scales, their
    scales dropped; every other tensor as stored. FP8 tensors without a quantization_config are refused."""
    fp8 = Fp8Weights(weights, cfg.weight_block_size)
    if fp8.fp8 and cfg.weight_block_size is None:
        raise CheckpointError(f"{sorted(fp8.fp8)[0]} is FP8 but config.json has no quantization_config (quant_method "
                              f"fp8, weight_block_size): the block size of its scales is unknown.")
    return {name: fp8.value(name) for name in weights if not name.endswith(FP8_SCALE)}
