"""A GGUF file as the oracle's checkpoint: llama.cpp's names, dequantized to float32 by the `gguf` package.

`mtp-oracle export FILE.gguf` (or a folder holding one `.gguf` and no safetensors) reads the MTP head from the
GGUF, dequantizes it with `gguf.quants.dequantize` (every type the package knows: F32, F16, BF16, Q8_0, Q4_K, Q5_K,
Q6_K, …) and writes it once, as float32 safetensors under the checkpoint names, into a cache folder
(`$MTP_PROBE_CACHE` or `~/.cache/mtp-probe/gguf/<key>`, keyed by the file's path, size and mtime); the Checkpoint
reads that folder. The folder's `gguf_source.json` records the source (format, file, quant type of every tensor),
which the trace's provenance carries.

Names (llama.cpp's convert_hf_to_gguf.py, the MTP layer as block N = num_hidden_layers):
  blk.N.nextn.eh_proj -> mtp.fc, nextn.enorm -> mtp.pre_fc_norm_embedding, nextn.hnorm -> mtp.pre_fc_norm_hidden,
  nextn.shared_head_norm -> mtp.norm, and the layer's usual names (attn_norm, attn_q/k/v, attn_output,
  attn_q_norm/k_norm, post_attention_norm, ffn_gate/up/down; MoE ffn_gate_inp, ffn_{gate,up,down}_exps or
  ffn_gate_up_exps, ffn_{gate,up,down}_shexp, ffn_gate_inp_shexp) -> mtp.layers.0.*; token_embd, output.
Norms: llama.cpp's RMSNorm multiplies by w, so its Qwen converter stores the (1+w) norms as 1 + w; the reader
subtracts 1 (recorded as `norm_offset` in the source record).
Config: a `config.json` beside the GGUF when there is one, else rebuilt from the GGUF's metadata.
"""

import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np

from oracle.errors import CheckpointError

SOURCE_RECORD = "gguf_source.json"
# llama.cpp architecture -> the HF text model_type the family registry knows
ARCH_MODEL_TYPE = {"qwen35": "qwen3_5_text", "qwen35moe": "qwen3_5_moe_text", "qwen3next": "qwen3_next"}
ONE_PLUS_W_ARCHS = set(ARCH_MODEL_TYPE)  # every RMSNorm of these heads is (1 + w)
MOE_ARCHS = {"qwen35moe", "qwen3next"}  # their MTP layer is a MoE layer: expert keys, not feed_forward_length
STEM = {"nextn.eh_proj": "mtp.fc", "nextn.enorm": "mtp.pre_fc_norm_embedding",
        "nextn.hnorm": "mtp.pre_fc_norm_hidden", "nextn.shared_head_norm": "mtp.norm"}
LAYER = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
         "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
         "attn_k_norm": "self_attn.k_norm", "post_attention_norm": "post_attention_layernorm",
         "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
         "ffn_down": "mlp.down_proj", "ffn_gate_inp": "mlp.gate", "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
         "ffn_up_shexp": "mlp.shared_expert.up_proj", "ffn_down_shexp": "mlp.shared_expert.down_proj",
         "ffn_gate_inp_shexp": "mlp.shared_expert_gate"}
NORMS = ("nextn.enorm", "nextn.hnorm", "nextn.shared_head_norm", "attn_norm", "post_attention_norm", "ffn_norm",
         "attn_q_norm", "attn_k_norm")


def gguf_file(path: Path) -> Path | None:
    """The GGUF a checkpoint argument names: the file itself, or the one `.gguf` in a folder without safetensors."""
    if path.is_file():
        return path if path.suffix == ".gguf" else None
    if not path.is_dir() or any(path.glob("*.safetensors")) or (path / "model.safetensors.index.json").exists():
        return None
    found = sorted(path.glob("*.gguf"))
    if len(found) > 1:
        raise CheckpointError(f"{path} holds {len(found)} GGUF files ({', '.join(p.name for p in found[:4])}); "
                              f"pass the one to read.")
    return found[0] if found else None


def checkpoint_dir(path: Path) -> Path:
    """`path` itself for a safetensors checkpoint; for a GGUF, the cache folder holding it dequantized."""
    file = gguf_file(Path(path))
    if file is None:
        return Path(path)
    stat = file.stat()
    key = hashlib.sha256(f"{file.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:20]
    root = Path(os.environ.get("MTP_PROBE_CACHE") or Path.home() / ".cache" / "mtp-probe") / "gguf"
    target = root / f"{file.stem}-{key}"
    if not (target / SOURCE_RECORD).is_file():
        _materialize(file, target)
    return target


def source_of(path: Path) -> dict:
    """What the checkpoint was read from (the trace's provenance records it)."""
    record = Path(path) / SOURCE_RECORD
    return json.loads(record.read_text()) if record.is_file() else {"format": "safetensors"}


def _materialize(file: Path, target: Path) -> None:
    from safetensors.numpy import save_file

    reader = _reader(file)
    arch = _field(reader, "general.architecture")
    tensors, types = read_head_tensors(reader, arch, file)
    config = _beside_config(file) or config_from_metadata(reader, arch, tensors, file)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file({k: np.ascontiguousarray(v, dtype=np.float32) for k, v in tensors.items()}, tmp / "model.safetensors")
    record = {"format": "gguf", "file": str(file.resolve()), "architecture": arch,
              "norm_offset": "1 subtracted from every (1+w) RMSNorm" if arch in ONE_PLUS_W_ARCHS else "none",
              "quant_types": dict(sorted(types.items())), "dequantized_by": f"gguf {_gguf_version()}"}
    (tmp / SOURCE_RECORD).write_text(json.dumps(record, indent=2) + "\n")
    shutil.rmtree(target, ignore_errors=True)
    os.replace(tmp, target)


def _reader(file: Path):
    from gguf import GGUFReader

    try:
        return GGUFReader(file)
    except (ValueError, OSError, KeyError) as err:  # bad magic, truncated, unknown quant type id
        raise CheckpointError(f"{file} is not a readable GGUF file ({err}).") from None


def read_head_tensors(reader, arch: str, file: Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """The head's tensors (checkpoint name -> float32), the embedding and lm_head, and each one's GGUF type."""
    names = {t.name: t for t in reader.tensors}
    blocks = sorted({int(n.split(".")[1]) for n in names if n.startswith("blk.") and ".nextn.eh_proj" in n})
    if len(blocks) != 1:
        raise CheckpointError(f"{file}: {'no' if not blocks else len(blocks)} MTP block"
                              f"{'s' if len(blocks) != 1 else ''} (blk.N.nextn.eh_proj.weight); this oracle reads "
                              f"a GGUF holding exactly one MTP layer (llama.cpp's converter writes it with --mtp).")
    prefix = f"blk.{blocks[0]}."
    out, types = {}, {}
    for name, tensor in names.items():
        target = _checkpoint_name(name, prefix, arch)
        if target is None:
            continue
        values = _dequantized(tensor, file)
        short = name[len(prefix):].removesuffix(".weight") if name.startswith(prefix) else name
        if arch in ONE_PLUS_W_ARCHS and short in NORMS:
            values = values - np.float32(1.0)
        if short == "ffn_gate_inp_shexp" and values.ndim == 1:  # converters that squeeze write [1, D] as [D]
            values = values[None]
        for key, part in _split_experts(target, values):
            out[key], types[key] = part, tensor.tensor_type.name
    if "lm_head.weight" not in out and "model.embed_tokens.weight" in out:  # tied output
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
        types["lm_head.weight"] = types["model.embed_tokens.weight"]
    _check_experts(out, prefix, file)
    return _main_prefixed(out, arch), _main_prefixed(types, arch)


def _check_experts(tensors: dict[str, np.ndarray], prefix: str, file: Path) -> None:
    """A MoE block (any routed-expert tensor or a router) must hold the router and a complete set of stacked
    experts whose shapes agree: gate/up [E, I, D] (or ffn_gate_up_exps [E, 2I, D]), down [E, D, I], router [E, D]."""
    experts = "mtp.layers.0.mlp.experts."
    parts = {k.removeprefix(experts): v for k, v in tensors.items() if k.startswith(experts)}
    router = tensors.get("mtp.layers.0.mlp.gate.weight")
    if not parts and router is None:
        return
    gguf_name = {"gate": "ffn_gate_exps", "up": "ffn_up_exps", "down_proj": "ffn_down_exps",
                 "gate_up_proj": "ffn_gate_up_exps"}
    needed = ["down_proj"] + (["gate_up_proj"] if "gate_up_proj" in parts else ["gate", "up"])
    missing = [f"{prefix}{gguf_name[p]}.weight" for p in needed if p not in parts]
    if router is None:
        missing.append(f"{prefix}ffn_gate_inp.weight")
    if missing:
        raise CheckpointError(f"{file}: the MTP block is a MoE layer but {', '.join(missing)} "
                              f"{'is' if len(missing) == 1 else 'are'} missing; re-convert the head (llama.cpp's "
                              f"converter writes the router and every stacked expert tensor).")
    down = parts["down_proj"]
    gate_up = parts.get("gate_up_proj")
    gate, up = (gate_up[:, :gate_up.shape[1] // 2], gate_up[:, gate_up.shape[1] // 2:]) if gate_up is not None \
        else (parts["gate"], parts["up"])
    count, inter, hidden = gate.shape if gate.ndim == 3 else (None, None, None)
    if (gate.ndim != 3 or up.shape != gate.shape or down.shape != (count, hidden, inter)
            or router.shape != (count, hidden)):
        shapes = {gguf_name[p]: list(v.shape) for p, v in parts.items()} | {"ffn_gate_inp": list(router.shape)}
        raise CheckpointError(f"{file}: the MTP block's expert tensors disagree in shape (numpy order, GGUF's "
                              f"reversed): {shapes}; expected gate/up [E, I, D], down [E, D, I], router [E, D].")


def _checkpoint_name(name: str, prefix: str, arch: str) -> str | None:
    if name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if name == "output.weight":
        return "lm_head.weight"
    if not name.startswith(prefix) or not name.endswith(".weight"):
        return None
    short = name[len(prefix):].removesuffix(".weight")
    if short in STEM:
        return STEM[short] + ".weight"
    if short in LAYER:
        return f"mtp.layers.0.{LAYER[short]}.weight"
    if short in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "ffn_gate_up_exps"):
        return "experts:" + short
    raise CheckpointError(f"GGUF tensor {name} is in the MTP block but is not one this oracle knows for {arch}; "
                          f"refusing to ignore it.")


def _split_experts(target: str, values: np.ndarray):
    """Stacked GGUF experts -> the fused checkpoint layout (gate_up_proj [E, 2I, D], down_proj [E, D, I])."""
    experts = "mtp.layers.0.mlp.experts."
    if not target.startswith("experts:"):
        return [(target, values)]
    part = target.removeprefix("experts:")
    return [({"ffn_gate_up_exps": experts + "gate_up_proj", "ffn_down_exps": experts + "down_proj",
              "ffn_gate_exps": experts + "gate", "ffn_up_exps": experts + "up"}[part], values)]


def _main_prefixed(tensors: dict, arch: str) -> dict:
    """Fused experts assembled; the embedding under the family's main-model prefix."""
    experts = "mtp.layers.0.mlp.experts."
    if experts + "gate" in tensors:
        gate, up = tensors.pop(experts + "gate"), tensors.pop(experts + "up")
        tensors[experts + "gate_up_proj"] = (np.concatenate([gate, up], axis=1) if isinstance(gate, np.ndarray)
                                             else gate)  # (E, I, D) x 2 -> (E, 2I, D); types: the gate's
    if arch in ("qwen35", "qwen35moe") and "model.embed_tokens.weight" in tensors:
        tensors["model.language_model.embed_tokens.weight"] = tensors.pop("model.embed_tokens.weight")
    return tensors


def _dequantized(tensor, file: Path) -> np.ndarray:
    from gguf import quants

    try:
        values = quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError:
        raise CheckpointError(f"GGUF tensor {tensor.name} in {file.name} is {tensor.tensor_type.name}, a type the gguf "
                              f"package cannot dequantize.") from None
    shape = tuple(int(n) for n in reversed(tensor.shape))  # ggml's ne is innermost first
    return np.asarray(values, dtype=np.float32).reshape(shape)


def _beside_config(file: Path) -> dict | None:
    config = file.parent / "config.json"
    return json.loads(config.read_text()) if config.is_file() else None


def config_from_metadata(reader, arch: str, tensors: dict, file: Path) -> dict:
    """A config.json for the family parser from the GGUF's metadata (llama.cpp's `{arch}.*` keys); a MoE head's
    expert keys are checked against its stacked expert tensors, and a wrong or missing key is named."""
    if arch not in ARCH_MODEL_TYPE:
        raise CheckpointError(f"{file}: architecture {arch!r} has no config.json beside it and this oracle rebuilds "
                              f"configs only for {', '.join(ARCH_MODEL_TYPE)}; put the model's config.json beside it.")
    missing = []

    def get(key, default=None, required=True):
        value = _field(reader, f"{arch}.{key}", default)
        if value is None and required:
            missing.append(f"{arch}.{key}")
        return value[-1] if isinstance(value, list) and key != "rope.dimension_sections" else value

    head_dim = get("attention.key_length")
    blocks = get("block_count")
    text = {"model_type": ARCH_MODEL_TYPE[arch], "hidden_size": get("embedding_length"),
            "num_attention_heads": get("attention.head_count"), "num_key_value_heads": get("attention.head_count_kv"),
            "head_dim": head_dim, "vocab_size": int(tensors["lm_head.weight"].shape[0]),
            "rms_norm_eps": get("attention.layer_norm_rms_epsilon"), "max_position_embeddings": get("context_length"),
            "mtp_num_hidden_layers": 1}
    rope_dims, theta, nextn = get("rope.dimension_count"), get("rope.freq_base"), get("nextn_predict_layers", 1)
    if not missing:
        text |= {"num_hidden_layers": blocks - nextn,
                 "rope_parameters": {"rope_type": "default", "rope_theta": theta,
                                     "partial_rotary_factor": rope_dims / head_dim}}
    sections = get("rope.dimension_sections", required=False)
    if sections and arch != "qwen3next" and "rope_parameters" in text:
        text["rope_parameters"] |= {"mrope_section": [int(s) for s in sections if s][:3], "mrope_interleaved": True}
    if arch in MOE_ARCHS or "mtp.layers.0.mlp.gate.weight" in tensors:
        text |= {"num_experts": get("expert_count"), "num_experts_per_tok": get("expert_used_count"),
                 "moe_intermediate_size": get("expert_feed_forward_length"),
                 "shared_expert_intermediate_size": get("expert_shared_feed_forward_length")}
    else:
        text["intermediate_size"] = get("feed_forward_length")
    if missing:
        raise CheckpointError(f"{file}: the GGUF metadata lacks {', '.join(missing)}; put the model's config.json "
                              f"beside the GGUF, or re-convert it with llama.cpp's converter (which writes them).")
    _check_expert_metadata(text, tensors, arch, file)
    return text


def _check_expert_metadata(text: dict, tensors: dict, arch: str, file: Path) -> None:
    """The expert keys must describe the stacked tensors: a wrong count would build a head of the wrong shape."""
    router = tensors.get("mtp.layers.0.mlp.gate.weight")
    if router is None:
        return
    down = tensors["mtp.layers.0.mlp.experts.down_proj"]  # [E, D, I], checked against the router by _check_experts
    shared = tensors.get("mtp.layers.0.mlp.shared_expert.gate_proj.weight")
    found = {"expert_count": (text["num_experts"], down.shape[0], "blk.N.ffn_*_exps and ffn_gate_inp"),
             "expert_feed_forward_length": (text["moe_intermediate_size"], down.shape[2], "blk.N.ffn_*_exps"),
             "expert_shared_feed_forward_length": (text["shared_expert_intermediate_size"],
                                                   None if shared is None else shared.shape[0], "blk.N.ffn_*_shexp")}
    for key, (said, held, where) in found.items():
        if held is not None and said != held:
            raise CheckpointError(f"{file}: {arch}.{key} is {said} but the MTP block's {where} hold {held}; the "
                                  f"metadata and the tensors disagree (re-convert, or put the model's config.json "
                                  f"beside the GGUF).")
    used = text["num_experts_per_tok"]
    if not 1 <= used <= text["num_experts"]:
        raise CheckpointError(f"{file}: {arch}.expert_used_count is {used}; it must be between 1 and "
                              f"{arch}.expert_count ({text['num_experts']}).")


def _field(reader, key: str, default=None):
    field = reader.get_field(key)
    if field is None:
        return default
    value = field.contents()
    if isinstance(value, float):  # GGUF stores float32: its shortest repr is the value written (1e-06, not 9.99e-07)
        return float(str(np.float32(value)))
    return value


def _gguf_version() -> str:
    from importlib.metadata import version

    return version("gguf")
