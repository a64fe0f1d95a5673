"""Tiny checkpoints WITH main layers, for `--main-model` (DeepSeek-V3, GLM-4.5, DeepSeek-V4).

The tiny fixture writers (scripts/make_fixtures.py) write the MTP layer and only the few main tensors it shares. Here
the main model's parameters are listed by the official base model (built on the meta device from config.json by
transformers itself, never by the oracle), given seeded values, and written under the names each release uses:
the HF layout (`model.layers.N.*`, per-expert `mlp.experts.{e}.{gate,up,down}_proj`) for DeepSeek-V3/GLM-4.5, and
DeepSeek-V4's own release names (`layers.N.attn.wq_a`, `ffn.experts.{e}.w1`, `hc_head_fn`, ...) written from the
release's naming by hand below, not from transformers' conversion mapping, which the oracle uses.

Each writer returns the reference model: the official base model loaded with the same values (FP8 as the
straightforward dequantization of what was written), for the tests to run by hand.
"""

import json
import re
import zlib
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from tests.helpers import load_script

FIXTURES = load_script("make_fixtures")


def _values(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Norms around 1, small biases, a router scaled so its choice depends on the logits, linears ~ 1/sqrt(fan_in);
    hyper-connection mixes of order 1 and sinks around 0 (V4)."""
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    leaf = name.rsplit(".", 1)[-1]
    if name.endswith(("e_score_correction_bias", "position_bias")) or leaf in ("base", "hc_base"):
        return torch.from_numpy((0.3 * rng.standard_normal(shape)).astype(np.float32))
    if leaf in ("scale", "hc_scale"):
        return torch.from_numpy(rng.uniform(0.5, 2.0, shape).astype(np.float32))
    if leaf == "sinks" or name == "embed_tokens.weight":
        return torch.from_numpy(rng.standard_normal(shape).astype(np.float32))
    if len(shape) == 1:
        return torch.from_numpy((1.0 + 0.3 * rng.standard_normal(shape)).astype(np.float32))
    fan_in = shape[-1]
    scale = 3.0 if name.endswith("mlp.gate.weight") else 1.5 if leaf in ("fn", "hc_fn") else 1.0
    return torch.from_numpy((scale * rng.standard_normal(shape) / np.sqrt(fan_in)).astype(np.float32))


def _official(model_class, config):
    with torch.device("meta"):
        return model_class(config)


def _stored(value: torch.Tensor, fp8_block, quantize) -> tuple[dict, torch.Tensor]:
    """(what the checkpoint stores for a weight W under the suffix keys 'weight'/'scale', the value it means)."""
    if fp8_block and value.dim() == 2:
        q, s = quantize(value, fp8_block)
        full = s.float().repeat_interleave(fp8_block[0], 0).repeat_interleave(fp8_block[1], 1)
        return {"weight": q, "scale": s}, q.float() * full[: value.shape[0], : value.shape[1]]
    stored = value.to(torch.bfloat16)
    return {"weight": stored}, stored.float()


def _real_rotaries(model, config):
    """Every rotary embedding (the model's, V4's compressors') rebuilt for real: computed buffers, never loaded."""
    rotary = type(model.rotary_emb)
    for parent in list(model.modules()):
        for name, child in parent.named_children():
            if isinstance(child, rotary):
                setattr(parent, name, rotary(config))
    return model.eval()


def _write(ckpt: Path, tensors: dict) -> None:
    """Into the single file, or (a sharded checkpoint) into one more shard listed in the index."""
    index = ckpt / "model.safetensors.index.json"
    if not index.exists():
        file = ckpt / "model.safetensors"
        save_file(load_file(file) | tensors, file, metadata={"format": "pt"})
        return
    shard = "model-main.safetensors"
    save_file(tensors, ckpt / shard, metadata={"format": "pt"})
    data = json.loads(index.read_text())
    for old in {data["weight_map"][name] for name in tensors if name in data["weight_map"]}:
        kept = {k: v for k, v in load_file(ckpt / old).items() if k not in tensors}  # each tensor stored once
        save_file(kept, ckpt / old, metadata={"format": "pt"})
    data["weight_map"] |= {name: shard for name in tensors}
    index.write_text(json.dumps(data, indent=2, sort_keys=True))


# ---------------------------------------------------------------------------------------------------------------
# DeepSeek-V3 / GLM-4.5: the HF layout


def with_hf_main_layers(ckpt: Path, family: str, seed: int = 1, fp8_block=None):
    """Add `model.layers.0..N-1.*`, `model.embed_tokens`, `model.norm` to a tiny DeepSeek-V3/GLM-4.5 checkpoint;
    return the reference base model (float32) holding the values written."""
    if family == "deepseek_v3":
        from transformers import DeepseekV3Config as Config
        from transformers import DeepseekV3Model as Model
    else:
        from transformers import Glm4MoeConfig as Config
        from transformers import Glm4MoeModel as Model
    raw = json.loads((ckpt / "config.json").read_text())
    config = Config(**{k: v for k, v in raw.items() if not k.startswith("_") and k != "quantization_config"})
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"
    meant, written = {}, {}
    for name, param in _official(Model, config).state_dict().items():
        value = _values(name, tuple(param.shape), seed)
        experts = re.match(r"(.*\.experts)\.(gate_up_proj|down_proj)$", name)
        if experts:  # the release stores one tensor per expert and projection
            parts = (("gate_proj", "up_proj") if experts[2] == "gate_up_proj" else ("down_proj",))
            rows = value.shape[1] // len(parts)
            per_expert = []
            for e in range(value.shape[0]):
                pieces = []
                for j, part in enumerate(parts):
                    store, mean = _stored(value[e, j * rows:(j + 1) * rows], fp8_block, FIXTURES.fp8_quantize)
                    key = f"model.{experts[1]}.{e}.{part}."
                    written |= {key + "weight": store["weight"]}
                    if "scale" in store:
                        written[key + "weight_scale_inv"] = store["scale"]
                    pieces.append(mean)
                per_expert.append(torch.cat(pieces))
            meant[name] = torch.stack(per_expert)
            continue
        linear = value.dim() == 2 and "embed_tokens" not in name and "mlp.gate.weight" not in name
        store, meant[name] = _stored(value, fp8_block if linear else None, FIXTURES.fp8_quantize)
        if name.endswith("e_score_correction_bias"):
            store, meant[name] = {"weight": value}, value  # f32 as released
        written["model." + name] = store["weight"]
        if "scale" in store:
            written["model." + name.removesuffix("weight") + "weight_scale_inv"] = store["scale"]
    if fp8_block:
        raw["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(fp8_block)}
        (ckpt / "config.json").write_text(json.dumps(raw))
    _write(ckpt, written)
    with torch.device("meta"):
        model = Model(config)
    model.load_state_dict(meant, strict=True, assign=True)
    return _real_rotaries(model, config)


# ---------------------------------------------------------------------------------------------------------------
# DeepSeek-V4: the release's own names

# transformers' DeepseekV4Model parameter name -> the release's name (seed 002 / the V4 release's inference code;
# shared/reference/mtp_wiring.md §3.7 lists the MTP layer's, which the main layers share), most specific first
V4_RELEASE_NAMES = [
    (r"^embed_tokens\.weight$", "embed.weight"), (r"^hc_head\.hc_(fn|base|scale)$", r"hc_head_\1"),
    (r"\.self_attn\.compressor\.indexer\.scorer\.weights_proj\.", ".attn.indexer.weights_proj."),
    (r"\.self_attn\.compressor\.indexer\.q_b_proj\.", ".attn.indexer.wq_b."),
    (r"\.self_attn\.compressor\.indexer\.", ".attn.indexer.compressor."),
    (r"\.self_attn\.compressor\.", ".attn.compressor."),
    (r"\.compressor\.position_bias$", ".compressor.ape"), (r"\.compressor\.kv_proj\.", ".compressor.wkv."),
    (r"\.compressor\.gate_proj\.", ".compressor.wgate."), (r"\.compressor\.kv_norm\.", ".compressor.norm."),
    (r"\.self_attn\.sinks$", ".attn.attn_sink"), (r"\.self_attn\.q_a_proj\.", ".attn.wq_a."),
    (r"\.self_attn\.q_a_norm\.", ".attn.q_norm."), (r"\.self_attn\.q_b_proj\.", ".attn.wq_b."),
    (r"\.self_attn\.kv_proj\.", ".attn.wkv."), (r"\.self_attn\.kv_norm\.", ".attn.kv_norm."),
    (r"\.self_attn\.o_a_proj\.", ".attn.wo_a."), (r"\.self_attn\.o_b_proj\.", ".attn.wo_b."),
    (r"\.mlp\.gate\.e_score_correction_bias$", ".ffn.gate.bias"), (r"\.mlp\.gate\.", ".ffn.gate."),
    (r"\.mlp\.shared_experts\.gate_proj\.", ".ffn.shared_experts.w1."),
    (r"\.mlp\.shared_experts\.up_proj\.", ".ffn.shared_experts.w3."),
    (r"\.mlp\.shared_experts\.down_proj\.", ".ffn.shared_experts.w2."),
    (r"\.input_layernorm\.", ".attn_norm."), (r"\.post_attention_layernorm\.", ".ffn_norm."),
    (r"\.attn_hc\.(fn|base|scale)$", r".hc_attn_\1"), (r"\.ffn_hc\.(fn|base|scale)$", r".hc_ffn_\1"),
]


def v4_release_name(name: str) -> str:
    for pattern, repl in V4_RELEASE_NAMES:
        name = re.sub(pattern, repl, name)
    return name


def v4_config(ckpt: Path):
    """DeepseekV4Config from config.json as transformers reads it (transformers' key names; the fixture's)."""
    from transformers import DeepseekV4Config

    raw = json.loads((ckpt / "config.json").read_text())
    config = DeepseekV4Config(**{k: v for k, v in raw.items() if not k.startswith("_") and k != "quantization_config"})
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"
    return config


def with_v4_main_layers(ckpt: Path, seed: int = 1, fp8_block=None):
    """Add the main model (`embed.weight`, `layers.0..N-1.*`, `norm.weight`, `hc_head_*`) under the release's names
    to a tiny DeepSeek-V4 checkpoint; return the reference DeepseekV4Model (float32) holding the values written."""
    from transformers import DeepseekV4Model

    config = v4_config(ckpt)
    old = load_file(ckpt / "model.safetensors")
    meant, written = {}, {}
    for name, param in _official(DeepseekV4Model, config).state_dict().items():
        if name == "embed_tokens.weight":  # the fixture's shared table (the head reads it too)
            meant[name] = old["embed.weight"].float()
            continue
        if not param.is_floating_point():  # the hash router's token -> experts table
            table = np.random.default_rng(seed).integers(0, config.n_routed_experts, tuple(param.shape))
            written[v4_release_name(name)] = torch.from_numpy(table.astype(np.int32))
            meant[name] = torch.from_numpy(table)
            continue
        value = _values(name, tuple(param.shape), seed)
        experts = re.match(r"(.*)\.mlp\.experts\.(gate_up_proj|down_proj)$", name)
        if experts:
            parts = ("w1", "w3") if experts[2] == "gate_up_proj" else ("w2",)
            rows = value.shape[1] // len(parts)
            stacked = []
            for e in range(value.shape[0]):
                pieces = []
                for j, part in enumerate(parts):
                    store, mean = _stored(value[e, j * rows:(j + 1) * rows], fp8_block, FIXTURES.fp8_quantize_ue8m0)
                    key = f"{v4_release_name(experts[1])}.ffn.experts.{e}.{part}."
                    written |= {key + k: v for k, v in store.items()}
                    pieces.append(mean)
                stacked.append(torch.cat(pieces))
            meant[name] = torch.stack(stacked)
            continue
        release = v4_release_name(name)
        if value.dim() == 2 and release.endswith(".weight") and not release.endswith(".ffn.gate.weight"):
            store, meant[name] = _stored(value, fp8_block, FIXTURES.fp8_quantize_ue8m0)  # a linear: bf16 or FP8
            written |= {release.removesuffix("weight") + k: v for k, v in store.items()}
            continue
        f32 = "hc_" in release or release.endswith(("attn_sink", "gate.bias", ".ape"))  # as released
        written[release] = value if f32 else value.to(torch.bfloat16)
        meant[name] = written[release].float()
    _write(ckpt, written)
    with torch.device("meta"):
        model = DeepseekV4Model(config)
    model.load_state_dict(meant, strict=True, assign=True)
    return _real_rotaries(model, config)
