"""Engines' own dumps, read by their own names: `mtp-probe diff REF DUMP --names MAP`.

DUMP is a directory of tensors an engine wrote under its own names; MAP says which name is which stage:
  llama.cpp  its cb() names (`mtp_enorm-4`, ...: probe/adapters/llama_cpp.py LLAMA_CPP_NAMES), one file per name
  sglang     SGLang's dumper (python/sglang/srt/debug_utils/dumper.py): files `key=value___...___name=NAME.pt` holding a
             tensor or {"value": tensor, "meta": {...}}; its non-intrusive mode names module outputs
             `non_intrusive__<module path>.output`. `step` (or `forward_pass_id`) orders the forward passes, `rank`
             names a tensor-parallel shard
  vllm       module paths as forward hooks see them in vLLM's MTP predictors (Qwen3_5MultiTokenPredictor:
             `model.pre_fc_norm_embedding`, `model.fc`, `model.layers.0.self_attn`, ...; DeepSeekMultiTokenPredictor:
             `enorm`, `hnorm`, `eh_proj`, `shared_head.norm`); `PATH:I` is output I of a module returning a tuple
             (vLLM's fused add-RMSNorm returns (normed, residual))
  FILE       a user map, JSON or TOML: {"names": {"engine name": "stage", ...}}
A map key matches a name exactly, or as the last dotted components of a module path (`fc` matches `model.fc`).
Files: .npy, .safetensors (every tensor in it, by its key), .pt (torch.load, weights_only=True), or raw .bin
described by an index.json {"file.bin": {"name": ..., "dtype": "float32", "shape": [...]}}. Beside the name, a file
name may say `step=N` (or `forward_pass_id=N`: rows of one pass, passes in order) and `rank=R` (shards of one tensor:
identical shards, as after an all-reduce, are one; otherwise concatenated along the last axis in rank order). A file
the map does not place is listed (`unmapped`), never silently dropped; a stage no file gives is not captured.
"""

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from oracle.stages import DRAFT, HC_STAGES, INDEX_SET, SPINE, with_moe
from probe.adapters.llama_cpp import LLAMA_CPP_INTERMEDIATES, LLAMA_CPP_NAMES, base_name
from probe.errors import CandidateError

_SPINE_PATHS = {  # module path suffix -> stage, Qwen3.5 / Qwen3-Next MTP predictors (vLLM 0.33.0, SGLang)
    "pre_fc_norm_embedding": "e", "pre_fc_norm_hidden": "h", "fc": "fc", "layers.0.input_layernorm": "ah",
    "layers.0.self_attn": "attn", "layers.0.post_attention_layernorm:0": "mh",
    "layers.0.post_attention_layernorm:1": "res1", "layers.0.mlp": "mlp", "norm:0": "out", "norm:1": "res2",
    # DeepSeek-V3 / GLM-4.5 nextn layers
    "enorm": "e", "hnorm": "h", "eh_proj": "fc", "shared_head.norm": "out",
}
BUILT_IN = {
    "llama.cpp": LLAMA_CPP_NAMES,
    "vllm": _SPINE_PATHS,
    # the non-intrusive dumper names module outputs `non_intrusive__<path>.output`, tuple items `.output.<i>`
    "sglang": {k.partition(":")[0] + ".output" + ("." + k.partition(":")[2] if ":" in k else ""): v
               for k, v in _SPINE_PATHS.items()},
}
_TAG = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)=(.*)$")
SUFFIXES = (".npy", ".safetensors", ".pt", ".bin")


@dataclass
class NamedDump:
    stages: dict[str, np.ndarray]
    unmapped: list[str] = field(default_factory=list)
    sources: dict[str, list[str]] = field(default_factory=dict)  # stage -> the files it was built from


def load_map(spec: str) -> dict[str, str]:
    """A built-in map by name, or a user's JSON/TOML file {"names": {...}}."""
    if spec in BUILT_IN:
        return BUILT_IN[spec]
    path = Path(spec)
    if not path.is_file():
        raise CandidateError(f"--names {spec}: neither a built-in map ({', '.join(BUILT_IN)}) nor a readable file. "
                             f"A map file is JSON or TOML: {{\"names\": {{\"engine name\": \"stage\"}}}}.")
    text = path.read_text(errors="replace")
    try:
        if path.suffix == ".toml":
            import tomllib

            data = tomllib.loads(text)
        else:
            data = json.loads(text)
    except (ValueError, RecursionError) as err:
        raise CandidateError(f"--names {path}: not valid {'TOML' if path.suffix == '.toml' else 'JSON'} ({err}).") from None
    names = data.get("names") if isinstance(data, dict) else None
    if not isinstance(names, dict) or not names or not all(isinstance(k, str) and isinstance(v, str)
                                                           for k, v in names.items()):
        raise CandidateError(f"--names {path}: expected {{\"names\": {{\"engine name\": \"stage\", ...}}}} with "
                             f"string keys and values.")
    return names


def read_named_dump(folder: Path, names: dict[str, str], num_tokens: int, known_stages: tuple[str, ...]) -> NamedDump:
    """Stage -> [T, width] rows from an engine's dump folder (see the module docstring)."""
    bad = sorted({v for v in names.values() if v not in known_stages})
    if bad:
        raise CandidateError(f"the name map places tensors on {', '.join(bad)}, which the reference has no stage "
                             f"named; its stages: {', '.join(known_stages)}.")
    pieces: dict[str, dict[tuple[int, int], tuple[str, np.ndarray]]] = {}
    unmapped = []
    for name, tags, array, file in _tensors(folder):
        stage = _stage_of(name, names)
        if stage is None:
            if base_name(name) not in LLAMA_CPP_INTERMEDIATES:
                unmapped.append(f"{name} ({file})")
            continue
        key = (int(tags.get("step", tags.get("forward_pass_id", 0))), int(tags.get("rank", 0)))
        if key in pieces.setdefault(stage, {}):
            raise CandidateError(f"{file} and {pieces[stage][key][0]} both give stage {stage} at step {key[0]}, "
                                 f"rank {key[1]}; give a name map that picks one (--names).")
        pieces[stage][key] = (file, array)
    dump = NamedDump({}, unmapped)
    for stage, parts in pieces.items():
        dump.stages[stage] = _assembled(stage, parts, num_tokens)
        dump.sources[stage] = [parts[k][0] for k in sorted(parts)]
    return dump


def _stage_of(name: str, names: dict[str, str]) -> str | None:
    """The stage a dumped name is, by exact name, cb() base name, or the longest matching module-path suffix
    (a key `path:I` matches a name `path:I`, as a tuple output is dumped)."""
    for candidate in (name, base_name(name)):
        if candidate in names:
            return names[candidate]
    matches = [k for k in names if name.endswith("." + k) or name.endswith("__" + k)]
    return names[max(matches, key=len)] if matches else None


def _assembled(stage: str, parts: dict, num_tokens: int) -> np.ndarray:
    steps = sorted({s for s, _ in parts})
    blocks = []
    for step in steps:
        shards = [parts[(s, r)][1] for s, r in sorted(parts) if s == step]
        rows = [np.asarray(a).reshape(-1, np.asarray(a).shape[-1]) if np.asarray(a).ndim else np.asarray(a)[None, None]
                for a in shards]
        if len(rows) > 1 and all(r.shape == rows[0].shape and np.array_equal(r, rows[0]) for r in rows[1:]):
            rows = rows[:1]  # replicated on every rank (after an all-reduce)
        if len({r.shape[0] for r in rows}) != 1:
            raise CandidateError(f"stage {stage}: the ranks of step {step} hold different row counts "
                                 f"({[r.shape[0] for r in rows]}); cannot join the shards.")
        blocks.append(np.concatenate(rows, axis=1))
    widths = sorted({b.shape[1] for b in blocks})
    if len(widths) > 1:
        odd = [s for s, b in zip(steps, blocks) if b.shape[1] != blocks[0].shape[1]]
        raise CandidateError(f"stage {stage}: the steps' rows differ in width ({widths}; step(s) {odd[:5]} differ from "
                             f"step {steps[0]}): a tensor-parallel shard missing (rank=R in the file names)?")
    values = np.concatenate(blocks, axis=0)
    if values.shape[0] != num_tokens:
        files = ", ".join(p[0] for p in list(parts.values())[:3])
        raise CandidateError(f"stage {stage} ({files}) holds {values.shape[0]} rows over {len(steps)} step(s); the "
                             f"reference has {num_tokens} steps. Dump every step (one file per step with step=N in "
                             f"its name, or one file with all of them).")
    return values.astype(np.int64) if stage in INDEX_SET_STAGES else values.astype(np.float32)


# Stages compared as sets of ids (topk_ids, the draft token): int64, whatever dtype the engine dumped them in.
INDEX_SET_STAGES = frozenset(s.name for s in (*with_moe(SPINE), *HC_STAGES, DRAFT) if s.kind == INDEX_SET)


def _tensors(folder: Path):
    """(name, tags, array, file name) of every tensor in the folder."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CandidateError(f"{folder} is not a directory of dumped tensors.")
    index = _bin_index(folder)
    files = sorted(p for p in folder.iterdir() if p.suffix in SUFFIXES and p.is_file())
    if not files:
        raise CandidateError(f"{folder} holds no .npy, .safetensors, .pt or .bin files.")
    for path in files:
        for name, array in _arrays(path, index):
            name, tags = _tags(name)
            yield name, tags, array, path.name


def _tags(stem: str) -> tuple[str, dict]:
    """`step=0___rank=1___name=foo` -> ("foo", {"step": "0", "rank": "1"}); a plain stem is its own name."""
    fields = stem.split("___")
    tags = dict(m.groups() for f in fields if (m := _TAG.match(f)))
    if "name" in tags and len(tags) == len(fields):
        name = tags.pop("name")
        for key in ("step", "forward_pass_id", "rank"):
            if key in tags and not tags[key].isdigit():
                tags.pop(key)
        return name, tags
    return stem, {}


def _arrays(path: Path, index: dict):
    try:
        if path.suffix == ".npy":
            yield path.stem, np.load(path, allow_pickle=False)
        elif path.suffix == ".safetensors":
            from safetensors.numpy import load_file

            yield from load_file(str(path)).items()
        elif path.suffix == ".pt":
            yield path.stem, _torch_value(path)
        elif path.name in index:
            entry = index[path.name]
            yield entry["name"], np.fromfile(path, dtype=np.dtype(entry["dtype"]).newbyteorder("<")).reshape(entry["shape"])
    except CandidateError:
        raise
    except Exception as err:  # a file of the engine's that cannot be read: name it
        raise CandidateError(f"{path}: cannot be read as a dumped tensor ({type(err).__name__}: {err}).") from None


def _torch_value(path: Path) -> np.ndarray:
    import torch

    value = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(value, dict) and "value" in value:  # SGLang's dumper: {"value": tensor, "meta": {...}}
        value = value["value"]
    if not isinstance(value, torch.Tensor):
        raise CandidateError(f"{path} holds a {type(value).__name__}, not a tensor.")
    return value.detach().float().numpy() if value.is_floating_point() else value.numpy()


def _bin_index(folder: Path) -> dict:
    index = folder / "index.json"
    if not index.is_file():
        return {}
    try:
        data = json.loads(index.read_text())
        assert isinstance(data, dict) and all(isinstance(v, dict) and {"name", "dtype", "shape"} <= set(v)
                                              for v in data.values())
        return data
    except (ValueError, AssertionError):
        raise CandidateError(f"{index}: expected {{\"file.bin\": {{\"name\", \"dtype\", \"shape\"}}}}.") from None


def diff_named_dump(ref_path: Path, folder: Path, map_spec: str, tols, fail_fast: bool = False):
    """`diff_traces` for an engine dump read by names: (DiffReport, what was listed but not placed)."""
    from oracle.trace import read_trace
    from probe.adapters.trace_file import open_reference
    from probe.diff import diff_sources
    from probe.run import ArraySource
    from probe.selfcheck import check_reference

    names = load_map(map_spec)
    with open_reference(ref_path) as ref:
        check_reference(ref)
        with read_trace(ref_path) as reader:
            inputs = reader.inputs()
        if map_spec in BUILT_IN:  # an engine's map names every family's stages; this reference has some of them
            names = {k: v for k, v in names.items() if v in ref.stages}
        dump = read_named_dump(folder, names, inputs.num_tokens, tuple(ref.stages))
        if not dump.stages:
            raise CandidateError(f"no file in {folder} has a name the map ({map_spec}) places on a stage; the files "
                                 f"hold {', '.join(dump.unmapped[:8]) or 'nothing'}. Pass the engine's map or your "
                                 f"own (--names FILE).")
        source = ArraySource(f"{folder} (names: {map_spec})", inputs, dump.stages)
        source.kind = "engine dump"
        source.poisoned = False  # the engine's own files, not poison-filled buffers: an all-zero index row is unwritten
        return diff_sources(ref, source, tols, fail_fast), dump.unmapped

