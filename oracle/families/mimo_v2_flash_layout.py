"""MiMo-V2-Flash / MiMo-V2.5 multi-layer MTP heads (issue 25), torch-free half: the config read onto the official
config's fields, the tensor layout (`model.mtp.layers.{l}.*`), stages. The head is oracle/families/mimo_v2_flash.py.

Layer l of the N the release ships (`num_nextn_predict_layers`, 3 for MiMo-V2-Flash), as vLLM
(`vllm/model_executor/models/mimo_v2_mtp.py` `MiMoV2MTPLayer.forward`) and SGLang
(`python/sglang/srt/models/mimo_v2_flash_nextn.py`) run it, depth l+1:

    e = enorm(embed)   h = hnorm(H)   fc = eh_proj(concat(e, h))                       # [e, h]
    res1 = fc + attn(input_layernorm(fc))      sliding-window attention, per-head sink bias, V scaled
    res2 = res1 + mlp(pre_mlp_layernorm(res1))  dense SwiGLU (intermediate_size), never MoE
    out  = final_layernorm(res2)                -> the main lm_head; recycled as H of depth l+2

Every MTP layer uses the SWA attention configuration (vLLM: "MTP uses the SWA attention configuration"): the
`swa_*` head counts and dims, `swa_rope_theta`, `sliding_window_size`, `add_swa_attention_sink_bias`. Each layer
has its own norms, attention, MLP and final_layernorm; the embedding and lm_head are the main model's.

transformers 5.24 builds no MTP for this model type (`MiMoV2FlashConfig` deletes `num_mtp_layers`,
modular_mimo_v2_flash.py:109; the model ignores `model.mtp.*`, modeling_mimo_v2_flash.py:472), and it does not
read the release's `swa_*` keys at all. So the release keys are translated here onto the official config's
fields (`official_kwargs`): the torch half builds `MiMoV2FlashConfig` from them, sets the MTP count and layer
types itself, and composes transformers' own `MtpModel` of official `MiMoV2FlashDecoderLayer`s.
"""

import re

from oracle.errors import CheckpointError
from oracle.families.mtp_layer_layout import (MtpLayerTensors, is_int, positive_int, positive_number,
                                              weight_block_size)
from oracle.families.mtp_model_layout import VARIANTS, HeadConfig, MtpModelSpec, _check_layers_alike, dims
from oracle.stages import SPINE, StageList, with_draft

MTP_PREFIX = "model.mtp."  # HeadConfig.mtp_prefix: layer l is model.mtp.layers.{l}.
HEAD_PREFIX = MTP_PREFIX + "layers."
LAYER = re.compile(r"^model\.mtp\.layers\.(\d+)\.")
LAYERS_KEY = "num_nextn_predict_layers"


def _key(text: dict, keys: tuple[str, ...]) -> str:
    """The first of `keys` (the release's, then the official one) the config has; the last when it has none."""
    return next((k for k in keys if k in text), keys[-1])


def _sliding_rope(text: dict, source: str) -> dict:
    """The rope of the MTP layers: `swa_rope_theta` and `partial_rotary_factor` (the release), else the official
    nested `rope_parameters["sliding_attention"]`. A flat `rope_parameters` holds the *full* layers' theta, so it
    is never used for the MTP: a config with neither is refused rather than guessed."""
    nested = text.get("rope_parameters") if isinstance(text.get("rope_parameters"), dict) else {}
    sliding = nested.get("sliding_attention") if isinstance(nested.get("sliding_attention"), dict) else {}
    theta = text.get("swa_rope_theta", sliding.get("rope_theta"))
    factor = text.get("partial_rotary_factor", sliding.get("partial_rotary_factor"))
    for key, value in (("swa_rope_theta", theta), ("partial_rotary_factor", factor)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise CheckpointError(f"{source}: {key} = {value!r}; the MiMo MTP layers' rope needs it (or the official "
                                  f"rope_parameters['sliding_attention']).")
    return {"rope_type": "default", "rope_theta": float(theta), "partial_rotary_factor": float(factor)}


def _window(text: dict, source: str) -> int:
    """Keys a query sees, itself included, as transformers reads it: `sliding_window_size` + 1 where the release
    key is present (configuration_mimo_v2_flash.py: "attends to `sliding_window_size` previous tokens plus the
    query"), else the official `sliding_window`."""
    if "sliding_window_size" in text:
        return positive_int(text, "sliding_window_size", source) + 1
    return positive_int(text, "sliding_window", source)


def _swa_heads(text: dict, source: str) -> tuple[int, int]:
    heads = positive_int(text, _key(text, ("swa_num_attention_heads", "num_attention_heads")), source)
    official_kv = text.get("num_key_value_heads")
    kv = text.get("swa_num_key_value_heads", 2 * official_kv if is_int(official_kv) else official_kv)
    if not is_int(kv) or kv <= 0 or kv % 2 or heads % kv:
        raise CheckpointError(f"{source}: the MTP layers' KV heads (swa_num_key_value_heads) = {kv!r}: transformers' "
                              f"MiMoV2FlashAttention gives sliding layers 2 x num_key_value_heads, so it must be an "
                              f"even positive integer dividing the {heads} attention heads.")
    return heads, kv


def official_kwargs(text: dict, source: str) -> dict:
    """MiMoV2FlashConfig keyword arguments whose sliding-attention, dense-MLP layer is the release's MTP layer."""
    if text.get("attention_projection_layout", "split") != "split":
        raise CheckpointError(f"{source}: attention_projection_layout {text['attention_projection_layout']!r} (a "
                              f"fused qkv_proj, MiMo-V2.5/Pro); transformers' MiMoV2FlashAttention has separate "
                              f"q/k/v projections and no conversion for a fused one. Only 'split' is supported.")
    if text.get("add_swa_attention_sink_bias", True) is not True:
        raise CheckpointError(f"{source}: add_swa_attention_sink_bias is {text['add_swa_attention_sink_bias']!r}; "
                              f"transformers' MiMoV2FlashAttention always has sinks on sliding layers, so an MTP "
                              f"layer without them is not representable with the official class.")
    scale = text.get("attention_value_scale", "absent")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float)) or scale <= 0):
        raise CheckpointError(f"{source}: attention_value_scale = {scale!r}; engines default it differently (vLLM: "
                              f"none, transformers: 0.707), so the MiMo MTP head needs it set: a positive number, "
                              f"or null for no scaling.")
    heads, kv = _swa_heads(text, source)
    eps = positive_number(text, _key(text, ("layernorm_epsilon", "rms_norm_eps")), source)
    return {
        "vocab_size": positive_int(text, "vocab_size", source),
        "hidden_size": positive_int(text, "hidden_size", source),
        "intermediate_size": positive_int(text, "intermediate_size", source),
        "num_hidden_layers": positive_int(text, "num_hidden_layers", source),
        "max_position_embeddings": positive_int(text, "max_position_embeddings", source),
        "num_attention_heads": heads, "num_key_value_heads": kv // 2,
        "head_dim": positive_int(text, _key(text, ("swa_head_dim", "head_dim")), source),
        "v_head_dim": positive_int(text, _key(text, ("swa_v_head_dim", "v_head_dim")), source),
        "sliding_window": _window(text, source), "rms_norm_eps": eps,
        "attention_value_scale": text["attention_value_scale"],
        "attention_bias": bool(text.get("attention_bias", False)), "hidden_act": text.get("hidden_act", "silu"),
        "rope_parameters": {"sliding_attention": _sliding_rope(text, source)},
        # the main layers are never run (only their class is read): sliding and dense, so the one rope above serves
        # and the meta-device main model stays small at real scale
        "layer_types": ["sliding_attention"] * text["num_hidden_layers"],
        "mlp_layer_types": ["dense"] * text["num_hidden_layers"],
    }


def head_config_from_json(raw: dict, source: str) -> HeadConfig:
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
    layers = text.get(LAYERS_KEY)
    if not is_int(layers) or layers < 1:
        raise CheckpointError(f"{source}: {LAYERS_KEY} = {layers!r}; a MiMo-V2 MTP head needs it set to its layer "
                              f"count (>= 1). Without it the layer count is unknown and a loader that trusts the config "
                              f"drops the head's tensors: set it to the number of model.mtp.layers.* the checkpoint "
                              f"holds.")
    official = official_kwargs(text, source)
    # the MtpModel families' one HeadConfig; what differs is MiMo's: `text` holds the translated official kwargs,
    # every layer one SWA window and V width, dense MLPs, FP8 block scales (the draft logits: lm_head(out), whole)
    return HeadConfig(
        family="mimo_v2_flash", hidden_size=official["hidden_size"], vocab_size=official["vocab_size"],
        max_position_embeddings=official["max_position_embeddings"], num_hidden_layers=official["num_hidden_layers"],
        num_mtp_layers=layers, num_attention_heads=official["num_attention_heads"],
        num_key_value_heads=2 * official["num_key_value_heads"], head_dim=official["head_dim"],
        num_experts=0, num_experts_per_tok=0, moe_intermediate_size=0,
        intermediate_size=official["intermediate_size"], v_head_dim=official["v_head_dim"],
        sliding_window=official["sliding_window"], weight_block_size=_fp8_block(raw, source), text=official,
        mtp_prefix=MTP_PREFIX)


def _fp8_block(raw: dict, source: str) -> tuple[int, int] | None:
    """Block FP8 (e4m3 with weight_scale_inv) as MiMo-V2-Flash is released; a packed store format is refused."""
    quant = raw.get("quantization_config")
    if isinstance(quant, dict) and quant.get("store_dtype") not in (None, "fp8", "e4m3"):
        raise CheckpointError(f"{source}: quantization_config.store_dtype {quant['store_dtype']!r} is not supported "
                              f"(block FP8 e4m3 with weight_scale_inv, or bf16/f32, are).")
    return weight_block_size(raw, source)


def layout(cfg: HeadConfig, names: set[str]) -> MtpLayerTensors:
    """Every tensor of model.mtp.layers.0..N-1 (shapes are checked by the strict load against the official
    modules; FP8 weights and their weight_scale_inv by the head's dequantization). A layer count that disagrees
    with the layers present is refused naming both; so are a fused qkv_proj (not supported) and anything under
    model.mtp. outside its layers."""
    present = sorted({int(m.group(1)) for n in names if (m := LAYER.match(n))})
    expected = list(range(cfg.num_mtp_layers))
    if present != expected:
        missing, extra = sorted(set(expected) - set(present)), sorted(set(present) - set(expected))
        raise CheckpointError(
            f"the config declares {cfg.num_mtp_layers} MTP layer(s) ({LAYERS_KEY}: {HEAD_PREFIX}0..{expected[-1]}) "
            f"but the checkpoint holds {HEAD_PREFIX}* of layers {present or 'none'}: "
            f"{'missing ' + str(missing) if missing else ''}{' ' if missing and extra else ''}"
            f"{'extra ' + str(extra) if extra else ''}. Fix {LAYERS_KEY} in config.json, or the checkpoint.")
    head = {n for n in names if LAYER.match(n)}
    stray = sorted(n for n in names if n.startswith("model.mtp.") and n not in head)
    fused = sorted(n for n in head if ".qkv_proj." in n)
    if stray or fused:
        raise CheckpointError(f"the MiMo MTP head holds tensors this oracle cannot load: "
                              f"{', '.join((stray + fused)[:5])} (a fused qkv_proj, MiMo-V2.5/Pro, is not supported: "
                              f"split it into q_proj, k_proj, v_proj first; nothing else may lie under model.mtp.).")
    _check_layers_alike(cfg, head)
    return MtpLayerTensors({n: None for n in sorted(head)}, None, {})


def stages(cfg: HeadConfig) -> StageList:
    docs = {"e": "enorm(embedding row) of the depth's MTP layer", "h": "hnorm(recycled hidden) of the depth's layer",
            "fc_in": "the input of eh_proj: concat(e, h)", "fc": "eh_proj(fc_in)",
            "attn": "sliding-window attention with per-head sinks (V scaled by attention_value_scale), o_proj",
            "mh": "pre_mlp_layernorm(res1)", "mlp": "dense SwiGLU MLP",
            "out": "final_layernorm(res2) of the depth's layer: the main lm_head's input, recycled to the next depth"}
    return StageList(s.with_doc(docs[s.name]) if s.name in docs else s for s in with_draft(SPINE))


def tiny_config(**overrides) -> dict:
    """A tiny MiMo-V2-Flash config.json in the release's keys: 3 MTP layers; a sliding window of 4 keys."""
    config = {"model_type": "mimo_v2_flash", "architectures": ["MiMoV2FlashForCausalLM"], "hidden_size": 64,
              "intermediate_size": 96, "moe_intermediate_size": 32, "n_routed_experts": 8, "num_experts_per_tok": 2,
              "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 16,
              "v_head_dim": 8, "swa_num_attention_heads": 4, "swa_num_key_value_heads": 2, "swa_head_dim": 16,
              "swa_v_head_dim": 8, "vocab_size": 512, "max_position_embeddings": 4096, "rope_theta": 5000000.0,
              "swa_rope_theta": 10000.0, "partial_rotary_factor": 0.5, "sliding_window_size": 3,
              "add_swa_attention_sink_bias": True, "add_full_attention_sink_bias": False,
              "attention_value_scale": 0.707, "attention_projection_layout": "split", "layernorm_epsilon": 1e-5,
              "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False, LAYERS_KEY: 3}
    return config | overrides


SPEC = MtpModelSpec(
    name="mimo_v2_flash", model_types=("mimo_v2_flash", "mimo_v2"),
    architectures=("MiMoV2FlashForCausalLM", "MiMoV2ForCausalLM"), parse_config=head_config_from_json,
    layout=layout, head_prefix=HEAD_PREFIX, stages=stages, dims=dims, main_model_prefixes=("model.",),
    lm_head="lm_head.weight", head_module="oracle.families.mimo_v2_flash", variants=VARIANTS,
    tiny_config=tiny_config, recycle_prenorm="res2",
    notes=("depth j runs MTP layer j-1 (model.mtp.layers.{j-1}), each layer its own cache (transformers' MtpModel "
           "composed over MiMoV2FlashDecoderLayer: every layer sliding-window attention with sinks, dense MLP)",
           "draft projection: the main lm_head (MiMo's MTP layers have no head of their own)"))
