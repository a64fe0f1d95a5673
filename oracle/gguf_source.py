"""A GGUF file as the oracle's checkpoint: llama.cpp's names, dequantized to float32 by the `gguf` package.

`mtp-oracle export FILE.gguf` (or a folder holding one `.gguf` and no safetensors) reads the MTP head from the
GGUF, dequantizes it with `gguf.quants.dequantize` (every type the package knows: F32, F16, BF16, Q8_0, Q4_K, Q5_K,
Q6_K, …) and writes it once, as float32 safetensors under the checkpoint names, into a cache folder
(`$MTP_PROBE_CACHE` or `~/.cache/mtp-probe/gguf/<key>`, keyed by the file's identity and a beside config.json: `cache_key`); the Checkpoint
reads that folder. The folder's `gguf_source.json` records the source (format, file, quant type of every tensor),
which the trace's provenance carries. The cache is written a slice at a time (stacked experts one expert at a
time), so memory never holds the head; but every expert is dequantized into it once, routed or not: the trace
then widens only the experts its tokens route to, from the cache.

Names (llama.cpp's convert_hf_to_gguf.py, the MTP layer as block N = num_hidden_layers):
  blk.N.nextn.eh_proj -> mtp.fc, nextn.enorm -> mtp.pre_fc_norm_embedding, nextn.hnorm -> mtp.pre_fc_norm_hidden,
  nextn.shared_head_norm -> mtp.norm, and the layer's usual names (attn_norm, attn_q/k/v, attn_output,
  attn_q_norm/k_norm, post_attention_norm, ffn_gate/up/down; MoE ffn_gate_inp, ffn_{gate,up,down}_exps or
  ffn_gate_up_exps, ffn_{gate,up,down}_shexp, ffn_gate_inp_shexp) -> mtp.layers.0.*; token_embd, output.
  Stacked experts (numpy [E, I, D] gate/up, [E, D, I] down; GGUF's ne reversed) become the fused checkpoint layout
  gate_up_proj [E, 2I, D] (gate rows first, as the converter's --fuse-gate-up-exps cat([gate, up], dim=1)) and
  down_proj [E, D, I]. A MoE block without its router or one of its stacked experts is refused by GGUF name.
Norms: llama.cpp's RMSNorm multiplies by w, so its Qwen converter stores the (1+w) norms as 1 + w; the reader
subtracts 1 (recorded as `norm_offset` in the source record).
Config: a `config.json` beside the GGUF when there is one, else rebuilt from the GGUF's metadata (a MoE head's
expert_count, expert_feed_forward_length, expert_shared_feed_forward_length checked against its tensors).
"""

import errno
import hashlib
import json
import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from oracle.errors import CheckpointError
from oracle.reading import read_json

SOURCE_RECORD = "gguf_source.json"
CHUNK_BYTES = 16 << 20  # float32 dequantized per write (gguf.quants needs ~4x that): never the whole head
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
    root = _cache_root()
    _check_outside(root, file)
    target = root / f"{file.stem}-{cache_key(file)}"
    if not (target / SOURCE_RECORD).is_file():
        _remove_stale_builds(target)
        _materialize(file, target)
    return target


def cache_key(file: Path) -> str:
    """What the cached folder was built from: the GGUF's path, size, mtime, and its inode and ctime (a file replaced
    by another of the same size with its mtime copied, as `cp -p`, `rsync -t` or `tar x` do, had reused the stale
    cache: a trace of the old weights, exit 0; no user tool sets a ctime back), and the bytes of a config.json beside
    it (which overrides the metadata: adding or editing one had been ignored)."""
    stat = file.stat()
    config = file.parent / "config.json"
    try:
        beside = hashlib.sha256(config.read_bytes()).hexdigest() if config.is_file() else "none"
    except OSError as err:
        raise CheckpointError(f"{config} cannot be read ({err.strerror}); fix its permissions or remove it.") from None
    text = (f"{file.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{stat.st_dev}|{stat.st_ino}|{stat.st_ctime_ns}|"
            f"{beside}")
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def cache_files(path: Path) -> Path | None:
    """The cache folder a GGUF checkpoint argument reads (an input: no output may be written into it), else None."""
    file = gguf_file(Path(path))
    return None if file is None else _cache_root() / f"{file.stem}-{cache_key(file)}"


def _cache_root() -> Path:
    return cache_base() / "gguf"


def cache_base() -> Path:
    """mtp-probe's cache folder: $MTP_PROBE_CACHE, else ~/.cache/mtp-probe. CheckpointError when neither can be
    found (HOME unset and no passwd entry: Path.home() raises, or gives a relative path, the current folder)."""
    given = os.environ.get("MTP_PROBE_CACHE")
    if given:
        return Path(given).absolute()  # fixed now: a later chdir must not move it
    try:
        home = Path.home()
    except (RuntimeError, KeyError, OSError):
        home = None
    if home is None or not home.is_absolute():
        raise CheckpointError("mtp-probe's cache has no folder: MTP_PROBE_CACHE is not set and the home directory "
                              "cannot be found (HOME is unset or empty). Set MTP_PROBE_CACHE to a writable folder "
                              "(or HOME).")
    return home / ".cache" / "mtp-probe"


def _check_outside(root: Path, file: Path) -> None:
    """The cache's folders (config.json, model.safetensors each) must not be written into the GGUF's own folder
    (MTP_PROBE_CACHE=DIR with the GGUF in DIR/gguf): nothing an export writes may sit beside the input it reads."""
    try:
        same = root.resolve() == file.parent.resolve()
    except (OSError, RuntimeError):
        same = False
    if same:
        raise CheckpointError(f"the GGUF cache {root} is the folder of {file}; the dequantized checkpoint must be "
                              f"written elsewhere. Set MTP_PROBE_CACHE to another folder.")


def _remove_stale_builds(target: Path) -> None:
    """Temporary folders of builds of `target` whose process is gone (killed mid-dequant: hundreds of MB each)."""
    for tmp in target.parent.glob(f".{target.name}.tmp-*"):
        pid = tmp.name.rpartition("-")[2]
        if pid.isdigit() and int(pid) != os.getpid() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(tmp, ignore_errors=True)


def source_of(path: Path) -> dict:
    """What the checkpoint was read from (the trace's provenance records it): a GGUF cache folder's record, which
    must be the JSON object this module wrote; a safetensors checkpoint has none."""
    record = Path(path) / SOURCE_RECORD
    if not os.path.lexists(record):
        return {"format": "safetensors"}
    try:
        data = read_json(record, "GGUF cache record", CheckpointError)
    except CheckpointError as err:
        raise CheckpointError(f"{err} The cache folder {record.parent} is damaged: remove it, and it is rebuilt "
                              f"from the GGUF.") from None
    if not isinstance(data, dict) or data.get("format") != "gguf" or not isinstance(data.get("file"), str):
        raise CheckpointError(f"GGUF cache record {record} is not the record mtp-oracle writes (an object with "
                              f"format \"gguf\" and the file); remove {record.parent}, and it is rebuilt from the "
                              f"GGUF.")
    return data


def _materialize(file: Path, target: Path) -> None:
    reader = _reader(file)
    arch = _field(reader, "general.architecture")
    plan = plan_head(reader, arch, file)
    config = _beside_config(file) or config_from_metadata(reader, arch, {n: p.shape for n, p in plan.items()}, file)
    if not any(n.endswith(("embed_tokens.weight", "lm_head.weight")) for n in plan):
        raise CheckpointError(f"{file} holds neither token_embd.weight nor output.weight; the head reads the "
                              f"embedding table (and acceptance the output projection). Convert the whole model, "
                              f"not the MTP block alone.")
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
    except OSError as err:
        raise CheckpointError(f"the GGUF cache folder {tmp.parent} cannot be created ({err.strerror}); set "
                              f"MTP_PROBE_CACHE to a writable folder.") from None
    try:
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        _write_safetensors(tmp / "model.safetensors", plan, file)
        record = {"format": "gguf", "file": str(file.resolve()), "architecture": arch,
                  "norm_offset": "1 subtracted from every (1+w) RMSNorm" if arch in ONE_PLUS_W_ARCHS else "none",
                  "quant_types": {n: plan[n].qtype for n in sorted(plan)}, "dequantized_by": f"gguf {_gguf_version()}"}
        (tmp / SOURCE_RECORD).write_text(json.dumps(record, indent=2) + "\n")
    except OSError as err:  # a full disk or quota, an I/O error: the user's to fix, and no half cache is kept
        shutil.rmtree(tmp, ignore_errors=True)
        full = err.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
        raise CheckpointError(f"{'no space left on' if full else 'cannot write'} {tmp.parent} while dequantizing "
                              f"{file.name} into the GGUF cache ({err.strerror or err}); nothing was kept. Free "
                              f"space there, or set MTP_PROBE_CACHE to a folder with room for the float32 head.") \
            from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # no half-written cache folder left behind
        raise
    shutil.rmtree(target, ignore_errors=True)
    os.replace(tmp, target)


def _reader(file: Path):
    from gguf import GGUFReader

    try:
        return GGUFReader(file)
    except (ValueError, OSError, KeyError, IndexError, TypeError, struct.error) as err:  # bad magic, truncated
        # (a cut inside the header reads past the end: IndexError), unknown quant type id
        raise CheckpointError(f"{file} is not a readable GGUF file ({err}).") from None


@dataclass(frozen=True)
class Planned:
    """One cache tensor: its checkpoint shape, its GGUF type, and the GGUF tensors whose slices along their leading
    dimension, dequantized in turn, make it (`sources` = (gate, up): expert e's gate rows, then its up rows, as
    the checkpoint's fused gate_up_proj [E, 2I, D] holds them). `offset` is subtracted ((1+w) norms: 1)."""
    shape: tuple[int, ...]
    qtype: str
    sources: tuple
    offset: float = 0.0

    def chunks(self, file: Path):
        """The tensor's float32 values in C order, a slice at a time: memory holds one slice, never the head."""
        lead = self.sources[0]
        if len(lead.data.shape) == 1:  # 1-D (norms): whole
            yield _rows(lead, None, file) - np.float32(self.offset)
            return
        if len(self.sources) > 1:  # per expert: gate rows, then up rows
            for e in range(self.shape[0]):
                for source in self.sources:
                    yield _rows(source, slice(e, e + 1), file)
            return
        row_bytes = 4 * int(np.prod(self.shape[1:], dtype=np.int64))
        step = max(1, CHUNK_BYTES // row_bytes)
        for start in range(0, self.shape[0], step):
            yield _rows(lead, slice(start, start + step), file) - np.float32(self.offset)


def plan_head(reader, arch: str, file: Path) -> dict[str, Planned]:
    """The head's tensors (checkpoint name -> Planned), the embedding and lm_head: names mapped, shapes checked,
    nothing dequantized yet but one row of each (so that a type the gguf package cannot read is refused first)."""
    names = {t.name: t for t in reader.tensors}
    empty = next((t.name for t in reader.tensors if 0 in _shape(t)), None)
    if empty is not None:
        raise CheckpointError(f"{file}: tensor {empty} has a dimension of 0 ({list(_shape(names[empty]))}); re-convert "
                              f"the model.")
    blocks = sorted({int(n.split(".")[1]) for n in names if n.startswith("blk.") and ".nextn.eh_proj" in n})
    if len(blocks) != 1:
        raise CheckpointError(f"{file}: {'no' if not blocks else len(blocks)} MTP block"
                              f"{'s' if len(blocks) != 1 else ''} (blk.N.nextn.eh_proj.weight); this oracle reads "
                              f"a GGUF holding exactly one MTP layer (llama.cpp's converter writes it with --mtp).")
    prefix = f"blk.{blocks[0]}."
    plan, experts = {}, {}
    for name, tensor in names.items():
        target = _checkpoint_name(name, prefix, arch)
        if target is None:
            continue
        if target.startswith("experts:"):
            experts[target.removeprefix("experts:")] = tensor
            continue
        short = name[len(prefix):].removesuffix(".weight") if name.startswith(prefix) else name
        shape = _shape(tensor)
        if short == "ffn_gate_inp_shexp" and len(shape) == 1:  # converters that squeeze write [1, D] as [D]
            shape = (1, *shape)
        offset = 1.0 if arch in ONE_PLUS_W_ARCHS and short in NORMS else 0.0
        plan[target] = Planned(shape, tensor.tensor_type.name, (tensor,), offset)
    if "lm_head.weight" not in plan and "model.embed_tokens.weight" in plan:  # tied output
        plan["lm_head.weight"] = plan["model.embed_tokens.weight"]
    plan |= _planned_experts(experts, plan.get("mtp.layers.0.mlp.gate.weight"), prefix, file)
    for planned in plan.values():
        for source in planned.sources:
            _rows(source, slice(0, 1) if len(source.data.shape) > 1 else None, file)
    if arch in ("qwen35", "qwen35moe") and "model.embed_tokens.weight" in plan:  # the main model's prefix
        plan["model.language_model.embed_tokens.weight"] = plan.pop("model.embed_tokens.weight")
    return plan


def _planned_experts(experts: dict, router: Planned | None, prefix: str, file: Path) -> dict[str, Planned]:
    """Stacked GGUF experts -> the fused checkpoint layout (gate_up_proj [E, 2I, D], down_proj [E, D, I]). A MoE
    block (any routed-expert tensor or a router) must hold the router and a complete set of stacked experts whose
    shapes agree: gate/up [E, I, D] (or ffn_gate_up_exps [E, 2I, D]), down [E, D, I], router [E, D]."""
    if not experts and router is None:
        return {}
    if "ffn_gate_up_exps" in experts and {"ffn_gate_exps", "ffn_up_exps"} & set(experts):
        raise CheckpointError(f"{file}: the MTP block holds both {prefix}ffn_gate_up_exps.weight and separate "
                              f"ffn_gate_exps/ffn_up_exps; which ones the engine reads is ambiguous. Re-convert with "
                              f"or without --fuse-gate-up-exps, not both.")
    needed = ["ffn_down_exps"] + (["ffn_gate_up_exps"] if "ffn_gate_up_exps" in experts
                                  else ["ffn_gate_exps", "ffn_up_exps"])
    missing = [f"{prefix}{part}.weight" for part in needed if part not in experts]
    if router is None:
        missing.append(f"{prefix}ffn_gate_inp.weight")
    if missing:
        raise CheckpointError(f"{file}: the MTP block is a MoE layer but {', '.join(missing)} "
                              f"{'is' if len(missing) == 1 else 'are'} missing; re-convert the head (llama.cpp's "
                              f"converter writes the router and every stacked expert tensor).")
    shapes = {part: _shape(t) for part, t in experts.items()} | {"ffn_gate_inp": router.shape}
    down = shapes["ffn_down_exps"]
    if "ffn_gate_up_exps" in experts:
        count, rows, hidden = shapes["ffn_gate_up_exps"] if len(shapes["ffn_gate_up_exps"]) == 3 else (0, 1, 0)
        inter, agree = rows // 2, rows % 2 == 0
        sources = (experts["ffn_gate_up_exps"],)
    else:
        count, inter, hidden = shapes["ffn_gate_exps"] if len(shapes["ffn_gate_exps"]) == 3 else (0, 0, 0)
        agree = shapes["ffn_up_exps"] == shapes["ffn_gate_exps"]
        sources = (experts["ffn_gate_exps"], experts["ffn_up_exps"])
    if not (count and agree and down == (count, hidden, inter) and router.shape == (count, hidden)):
        raise CheckpointError(f"{file}: the MTP block's expert tensors disagree in shape (numpy order, GGUF's "
                              f"reversed): {({k: list(v) for k, v in shapes.items()})}; expected ffn_gate_exps and "
                              f"ffn_up_exps [E, I, D] (or ffn_gate_up_exps [E, 2I, D]), ffn_down_exps [E, D, I], "
                              f"ffn_gate_inp [E, D].")
    types = sorted({t.tensor_type.name for t in sources})
    stem = "mtp.layers.0.mlp.experts."
    return {stem + "gate_up_proj": Planned((count, 2 * inter, hidden), "+".join(types), sources),
            stem + "down_proj": Planned(down, experts["ffn_down_exps"].tensor_type.name,
                                        (experts["ffn_down_exps"],))}


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


def _shape(tensor) -> tuple[int, ...]:
    return tuple(int(n) for n in reversed(tensor.shape))  # ggml's ne is innermost first


def _rows(tensor, rows: slice | None, file: Path) -> np.ndarray:
    """Rows `rows` (along the leading numpy dimension; None: all) of a GGUF tensor, dequantized to float32."""
    from gguf import quants

    data = tensor.data if rows is None else tensor.data[rows]
    try:
        values = quants.dequantize(data, tensor.tensor_type)
    except NotImplementedError:
        raise CheckpointError(f"GGUF tensor {tensor.name} in {file.name} is {tensor.tensor_type.name}, a type the gguf "
                              f"package cannot dequantize.") from None
    return np.asarray(values, dtype=np.float32)


def _dequantized(tensor, file: Path) -> np.ndarray:
    """A whole GGUF tensor as float32 in its numpy shape."""
    return _rows(tensor, None, file).reshape(_shape(tensor))


def _write_safetensors(path: Path, plan: dict[str, Planned], file: Path) -> None:
    """A float32 safetensors file written tensor by tensor, slice by slice, so that a head of hundreds of experts
    never sits in memory whole (safetensors' save_file would need every tensor at once)."""
    header, offset = {}, 0
    for name, planned in plan.items():
        nbytes = 4 * int(np.prod(planned.shape, dtype=np.int64))
        header[name] = {"dtype": "F32", "shape": list(planned.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for name, planned in plan.items():
            written = 0
            for chunk in planned.chunks(file):
                chunk = np.ascontiguousarray(chunk, dtype="<f4")
                f.write(memoryview(chunk).cast("B"))
                written += chunk.nbytes
            start, end = header[name]["data_offsets"]
            if written != end - start:
                raise RuntimeError(f"{name}: wrote {written} bytes for a {planned.shape} float32 tensor")  # a bug
        f.flush()
        os.fsync(f.fileno())  # a filesystem that allocates at writeback reports a full disk here, not later


def _beside_config(file: Path) -> dict | None:
    config = file.parent / "config.json"
    if not os.path.lexists(config):
        return None
    try:
        data = read_json(config, "config.json", CheckpointError)
    except CheckpointError as err:
        why = str(err).removeprefix(f"config.json {config} ")
        raise CheckpointError(f"{config} (beside {file.name}) is not readable JSON: {why} Fix it, or remove it to "
                              f"use the GGUF's metadata.") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{config} (beside {file.name}) does not hold a JSON object; fix it, or remove it to "
                              f"use the GGUF's metadata.")
    return data


def config_from_metadata(reader, arch: str, shapes: dict[str, tuple[int, ...]], file: Path) -> dict:
    """A config.json for the family parser from the GGUF's metadata (llama.cpp's `{arch}.*` keys); a MoE head's
    expert keys are checked against the shapes of its stacked expert tensors, and a wrong or missing key is named."""
    if arch not in ARCH_MODEL_TYPE:
        raise CheckpointError(f"{file}: architecture {arch!r} has no config.json beside it and this oracle rebuilds "
                              f"configs only for {', '.join(ARCH_MODEL_TYPE)}; put the model's config.json beside it.")
    missing = []

    def get(key, default=None, required=True):
        value = _field(reader, f"{arch}.{key}", default)
        if value is None and required:
            missing.append(f"{arch}.{key}")
        numbers = value if isinstance(value, list) else [value]
        if value is not None and not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in numbers):
            raise CheckpointError(f"{file}: metadata {arch}.{key} is {value!r:.80}; it must be a number (or a list "
                                  f"of numbers). Re-convert, or put the model's config.json beside the GGUF.")
        return value[-1] if isinstance(value, list) and key != "rope.dimension_sections" else value

    head_dim = get("attention.key_length")
    blocks = get("block_count")
    text = {"model_type": ARCH_MODEL_TYPE[arch], "hidden_size": get("embedding_length"),
            "num_attention_heads": get("attention.head_count"), "num_key_value_heads": get("attention.head_count_kv"),
            "head_dim": head_dim, "vocab_size": int(shapes["lm_head.weight"][0]),
            "rms_norm_eps": get("attention.layer_norm_rms_epsilon"), "max_position_embeddings": get("context_length"),
            "mtp_num_hidden_layers": 1}
    rope_dims, theta, nextn = get("rope.dimension_count"), get("rope.freq_base"), get("nextn_predict_layers", 1)
    if not missing:
        _check_block_metadata(reader, arch, blocks, nextn, file)
        text |= {"num_hidden_layers": blocks - nextn,
                 "rope_parameters": {"rope_type": "default", "rope_theta": theta,
                                     "partial_rotary_factor": rope_dims / head_dim}}
    sections = get("rope.dimension_sections", required=False)
    if sections and arch != "qwen3next" and "rope_parameters" in text:
        text["rope_parameters"] |= {"mrope_section": [int(s) for s in sections if s][:3], "mrope_interleaved": True}
    if arch in MOE_ARCHS or "mtp.layers.0.mlp.gate.weight" in shapes:
        text |= {"num_experts": get("expert_count"), "num_experts_per_tok": get("expert_used_count"),
                 "moe_intermediate_size": get("expert_feed_forward_length"),
                 "shared_expert_intermediate_size": get("expert_shared_feed_forward_length")}
    else:
        text["intermediate_size"] = get("feed_forward_length")
    if missing:
        raise CheckpointError(f"{file}: the GGUF metadata lacks {', '.join(missing)}; put the model's config.json "
                              f"beside the GGUF, or re-convert it with llama.cpp's converter (which writes them).")
    _check_expert_metadata(text, shapes, arch, file)
    return text


def _check_block_metadata(reader, arch: str, blocks: int, nextn: int, file: Path) -> None:
    """`nextn_predict_layers` must be 1 (the one MTP layer this oracle reads) and the MTP block must be the last of
    `block_count` (llama.cpp puts it at N = num_hidden_layers): contradictory metadata would build a config with
    the wrong num_hidden_layers, or hide a second MTP layer (red team 2)."""
    mtp = sorted({int(t.name.split(".")[1]) for t in reader.tensors
                  if t.name.startswith("blk.") and ".nextn.eh_proj" in t.name})
    if nextn != 1:
        raise CheckpointError(f"{file}: {arch}.nextn_predict_layers is {nextn}; this oracle reads a GGUF with exactly "
                              f"one MTP layer (1). Re-convert, or put the model's config.json beside the GGUF.")
    if mtp and mtp[-1] != blocks - 1:
        raise CheckpointError(f"{file}: {arch}.block_count is {blocks}, so the MTP block should be blk.{blocks - 1}, "
                              f"but it is blk.{mtp[-1]}; the metadata and the tensors disagree (re-convert, or put "
                              f"the model's config.json beside the GGUF).")


def _check_expert_metadata(text: dict, shapes: dict, arch: str, file: Path) -> None:
    """The expert keys must describe the stacked tensors: a wrong count would build a head of the wrong shape."""
    if "mtp.layers.0.mlp.gate.weight" not in shapes:
        return
    down = shapes["mtp.layers.0.mlp.experts.down_proj"]  # [E, D, I], checked against the router by _planned_experts
    shared = shapes.get("mtp.layers.0.mlp.shared_expert.gate_proj.weight")
    found = {"expert_count": (text["num_experts"], down[0], "blk.N.ffn_*_exps and ffn_gate_inp"),
             "expert_feed_forward_length": (text["moe_intermediate_size"], down[2], "blk.N.ffn_*_exps"),
             "expert_shared_feed_forward_length": (text["shared_expert_intermediate_size"],
                                                   None if shared is None else shared[0], "blk.N.ffn_*_shexp")}
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
