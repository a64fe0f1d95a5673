"""C ABI version 2 (fixtures/candidates/mtp_probe_v2.h), for the worker: ctypes mirrors of its tables and the run.

`probe.adapters.cabi_worker` calls `run_v2` when the library exports `mtp2_abi_version`. Where v1 hands 15 float32
pointers and a 10-pointer trace struct (dense Qwen3.5 only), v2 hands:

    weights  every head tensor under its checkpoint name, in its stored dtype (bf16 stays bf16: nothing is widened
             to float32), pointing into the mapped checkpoint (routed experts are read only where touched)
    config   the head config's scalar fields as (key, int64 | double) entries, plus max_steps and hidden_width, and
             the whole config as JSON
    stages   per step, (name, dtype, width, row pointer) for each stage of the family's list the library captures:
             float rows poison-filled, index sets (topk_ids) -1-filled

so any family's head can be driven from C. The header is the contract; the structs below mirror it field for field
(tests/probe/test_cabi_v2.py parses the header and checks them).
"""

import ctypes
import dataclasses
import json
from ctypes import POINTER, Structure, c_char_p, c_double, c_int, c_int32, c_int64, c_size_t, c_void_p
from pathlib import Path

import numpy as np

from oracle.checkpoint import Checkpoint
from oracle.stages import INDEX_SET, StageList
from probe.errors import AdapterError
from probe.poison import poison

ABI_VERSION = 2  # MTP2_ABI_VERSION
MAX_DIMS = 8  # MTP2_MAX_DIMS
ERR_LEN = 1024  # bytes of the err buffer mtp2_create may write its reason into
# mtp2_dtype: checkpoint dtype (safetensors spelling) -> enum value
DTYPES = {"F32": 0, "BF16": 1, "F16": 2, "I64": 3, "F8_E4M3": 4, "F8_E8M0": 5}
F32, I64 = DTYPES["F32"], DTYPES["I64"]
INT, DOUBLE = 0, 1  # mtp2_value_type
RETURN_CODES = {  # mtp2_step's codes -> (name, what it means for the user)
    1: ("MTP2_ERR_ARG", "the library rejected an argument or a value it does not support"),
    2: ("MTP2_ERR_ALLOC", "the library ran out of host or device memory"),
    3: ("MTP2_ERR_CAPACITY", "the library says its KV cache is full; the probe passes max_steps = T"),
    4: ("MTP2_ERR_DEVICE", "a CUDA (or other device) call failed; see the library's stderr"),
    5: ("MTP2_ERR_STAGE", "the library cannot write an entry of the stage table (its name, dtype or width)"),
}


class Mtp2Tensor(Structure):
    _fields_ = [("name", c_char_p), ("dtype", c_int32), ("ndim", c_int32), ("shape", c_int64 * MAX_DIMS),
                ("data", c_void_p)]


class Mtp2Stage(Structure):
    _fields_ = [("name", c_char_p), ("dtype", c_int32), ("width", c_int32), ("data", c_void_p)]


class Mtp2ConfigEntry(Structure):
    _fields_ = [("key", c_char_p), ("type", c_int32), ("i", c_int64), ("d", c_double)]


class Mtp2Config(Structure):
    _fields_ = [("abi_version", c_int32), ("n_entries", c_int32), ("entries", POINTER(Mtp2ConfigEntry)),
                ("family", c_char_p), ("json", c_char_p)]


REQUIRED = {  # symbol -> (restype, argtypes)
    "mtp2_abi_version": (c_int, []),
    "mtp2_create": (c_void_p, [POINTER(Mtp2Config), POINTER(Mtp2Tensor), c_int, c_char_p, c_size_t]),
    "mtp2_step": (c_int, [c_void_p, c_int64, c_void_p, c_void_p, c_void_p, POINTER(Mtp2Stage), c_int]),
    "mtp2_destroy": (None, [c_void_p]),
}
OPTIONAL = {"mtp2_capture": (c_char_p, []), "mtp2_last_error": (c_char_p, [c_void_p]),
            "mtp2_draft_step": (c_int, [c_void_p, c_int32, c_int64, c_int64, c_void_p, c_void_p, POINTER(Mtp2Stage),
                                        c_int])}


def declare(lib: ctypes.CDLL, path: Path) -> None:
    """Declare v2's signatures on `lib`; AdapterError names a missing symbol or a wrong version."""
    for name, (restype, argtypes) in REQUIRED.items():
        if not hasattr(lib, name):
            raise AdapterError(f"{path} exports mtp2_abi_version, so it is a C ABI v2 library, but not {name}. "
                               f"Export it with C linkage, as declared in mtp_probe_v2.h (non-static; extern \"C\" "
                               f"in C++/CUDA).")
        getattr(lib, name).restype, getattr(lib, name).argtypes = restype, argtypes
    for name, (restype, argtypes) in OPTIONAL.items():
        if hasattr(lib, name):
            getattr(lib, name).restype, getattr(lib, name).argtypes = restype, argtypes
    version = lib.mtp2_abi_version()
    if version != ABI_VERSION:
        raise AdapterError(f"{path}: mtp2_abi_version() returned {version}; this probe speaks C ABI version "
                           f"{ABI_VERSION} (mtp_probe_v2.h). Rebuild the library against that header.")


LIBRARY_TEXT_CHARS = 2000  # of a string the library returns, quoted in a message (one returned 20 MB: 84 MB printed)


def library_text(raw: bytes) -> str:
    """A string from the library (mtp2_capture, mtp2_last_error) as a message quotes it: decoded, and cut to
    LIBRARY_TEXT_CHARS characters with the length said."""
    text = raw.decode("utf-8", "replace")
    if len(text) <= LIBRARY_TEXT_CHARS:
        return text
    return f"{text[:LIBRARY_TEXT_CHARS]}… ({len(text) - LIBRARY_TEXT_CHARS} more characters)"


def captured_stages(lib: ctypes.CDLL, stages: StageList, family: str, path: Path) -> list[str]:
    """The family's stages the library captures, in the family's order: all but `out` without mtp2_capture (or
    when it returns NULL), else the names it lists, each of which must be one of them exactly once."""
    traceable = [n for n in stages.names if n != "out"]
    raw = lib.mtp2_capture() if hasattr(lib, "mtp2_capture") else None
    if raw is None:
        return traceable
    names = [n.strip() for n in raw.decode("utf-8", "replace").split(",")] if raw.strip() else []
    unknown = [n for n in names if n not in traceable]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if unknown or repeated:
        what = (f"names {library_text(', '.join(repr(n) for n in unknown).encode())}, which the {family} head "
                f"does not have" if unknown else
                f"names {library_text(', '.join(repr(n) for n in repeated).encode())} more than once")
        out = " (`out` is mtp2_step's own argument, always written, not a stage to capture)" if "out" in unknown else ""
        raise AdapterError(f"{path}: mtp2_capture() returned {library_text(raw)!r}: it {what}{out}. "
                           f"The {family} stages a library can capture are: {', '.join(traceable)}. Fix the "
                           f"names in mtp2_capture (comma-separated, each at most once).")
    return [n for n in traceable if n in names]


def config_table(config: dict, family: str, num_steps: int, hidden_width: int) -> tuple[Mtp2Config, list]:
    """The config struct and what it points at (kept alive by the caller): every int/bool/float field as an
    entry, lists and strings in the JSON only, plus max_steps and hidden_width."""
    values = {**config, "max_steps": num_steps, "hidden_width": hidden_width}
    rows = []
    for key, value in values.items():
        if isinstance(value, (bool, int, np.integer)):
            rows.append(Mtp2ConfigEntry(key.encode(), INT, int(value), float(value)))
        elif isinstance(value, (float, np.floating)):
            rows.append(Mtp2ConfigEntry(key.encode(), DOUBLE, 0, float(value)))
    entries = (Mtp2ConfigEntry * len(rows))(*rows)
    text = json.dumps({**config, "max_steps": num_steps, "hidden_width": hidden_width}, default=list).encode()
    struct = Mtp2Config(ABI_VERSION, len(rows), entries, family.encode(), text)
    return struct, [entries, rows, text]


def weight_table(tensors: dict[str, np.ndarray], dtypes: dict[str, str]) -> tuple[ctypes.Array, list]:
    """One Mtp2Tensor per head tensor, in name order, pointing at the stored (mapped) bytes; a tensor whose address
    is not a multiple of its element size (safetensors does not promise alignment) is copied once."""
    rows, keep = [], []
    for name in sorted(tensors):
        arr, dtype = tensors[name], dtypes[name]
        if dtype not in DTYPES:
            raise AdapterError(f"head tensor {name} is stored as {dtype}, which C ABI v2 has no dtype for "
                               f"({', '.join(DTYPES)}).")
        if arr.ndim > MAX_DIMS:
            raise AdapterError(f"head tensor {name} has {arr.ndim} dims; C ABI v2 passes at most {MAX_DIMS}.")
        if not arr.flags.c_contiguous or arr.ctypes.data % max(arr.itemsize, 1):
            arr = np.ascontiguousarray(arr).copy()
        keep.append(arr)
        shape = (c_int64 * MAX_DIMS)(*arr.shape)
        rows.append(Mtp2Tensor(name.encode(), DTYPES[dtype], arr.ndim, shape, arr.ctypes.data))
    table = (Mtp2Tensor * len(rows))(*rows)
    return table, [rows, keep]


def run_v2(lib: ctypes.CDLL, path: Path, ckpt: Checkpoint, inputs, progress,
           capture_only: list[str] | None) -> dict[str, np.ndarray]:
    """Create, step over `inputs` (cabi_worker.StepInputs: rows, positions and the reference's conventions),
    destroy; returns {stage: [T, width] buffer} of the captured stages and `out`, rows the library never wrote still
    holding poison (float) or -1 (index sets)."""
    from probe.adapters.cabi_worker import return_code_message  # the worker imports this module

    declare(lib, path)
    family = ckpt.family
    fields = {f.name for f in dataclasses.fields(ckpt.config)}
    # the reference's conventions (e.g. norm_topk_prob), not config.json's, as the Python adapter does
    cfg = dataclasses.replace(ckpt.config, **{k: v for k, v in inputs.conventions.items() if k in fields})
    stages, dims = family.stages(cfg), family.dims(cfg)
    captured = captured_stages(lib, stages, family.name, path)
    if capture_only is not None:
        captured = [n for n in captured if n in capture_only]
    embed, hidden, positions = inputs.embed, inputs.hidden, inputs.positions
    num_steps, d = len(positions), cfg.hidden_size
    buffers = {n: np.full((num_steps, stages[n].width(dims)), -1, dtype=np.int64) if stages[n].kind == INDEX_SET
               else poison((num_steps, stages[n].width(dims))) for n in captured}
    buffers["out"] = poison((num_steps, stages["out"].width(dims) if "out" in stages.names else d))
    # Locals, so the tables and the arrays they point at outlive the context (a library may keep pointers).
    head = ckpt.read_head(widen=False, digest=False)  # as stored: bf16 stays bf16, experts stay mapped
    weights, weights_alive = weight_table(head.tensors, head.dtypes)
    config, config_alive = config_table(cfg.to_dict(), family.name, num_steps, dims.hc_mult * d)
    names = [n.encode() for n in captured]
    table = (Mtp2Stage * max(len(captured), 1))(*[
        Mtp2Stage(name, I64 if stages[n].kind == INDEX_SET else F32, stages[n].width(dims), None)
        for name, n in zip(names, captured)])
    err = ctypes.create_string_buffer(ERR_LEN)
    progress("create")
    ctx = lib.mtp2_create(ctypes.byref(config), weights, len(weights), err, ERR_LEN)
    if not ctx:
        said = library_text(err.value).strip() or "(it wrote no reason into err)"
        raise AdapterError(f"mtp2_create returned NULL for the {family.name} head of {ckpt.path}: {said}")
    chain = inputs.chain if hasattr(lib, "mtp2_draft_step") else {}
    depths = {j: {n: np.full((len(part["token_ids"]), stages[n].width(dims)), -1, dtype=np.int64)
                  if stages[n].kind == INDEX_SET else poison((len(part["token_ids"]), stages[n].width(dims)))
                  for n in [*captured, "out"]} for j, part in chain.items()}
    try:
        for t, pos in enumerate(positions.tolist()):
            progress(f"step {t}")
            _point(table, captured, buffers, t)  # [T, w] row-major: row t's address
            code = lib.mtp2_step(ctx, pos, embed[t].ctypes.data, hidden[t].ctypes.data, _row(buffers["out"], t),
                                 table, len(captured))
            _check(lib, ctx, "mtp2_step", code, f"at step {t} (token row {t}, position {pos})")
            for j in (j for j in sorted(depths) if t < len(chain[j]["token_ids"])):  # bridge t's chain
                part = chain[j]
                _point(table, captured, depths[j], t)
                code = lib.mtp2_draft_step(ctx, j, int(part["token_ids"][t]), int(part["positions"][t]),
                                           np.ascontiguousarray(part["embed"][t], dtype=np.float32).ctypes.data,
                                           _row(depths[j]["out"], t), table, len(captured))
                _check(lib, ctx, "mtp2_draft_step", code, f"at depth {j} of bridge {t}")
    finally:
        progress("destroy")
        lib.mtp2_destroy(ctx)
    del weights_alive, config_alive
    return buffers | {f"d{j}": part for j, part in depths.items()}


def _row(buffer: np.ndarray, t: int) -> int:
    return buffer.ctypes.data + t * buffer.strides[0]


def _point(table, captured: list[str], buffers: dict[str, np.ndarray], t: int) -> None:
    """Every stage entry at row t of its buffer."""
    for i, n in enumerate(captured):
        table[i].data = _row(buffers[n], t)


def _check(lib, ctx, function: str, code: int, where: str) -> None:
    if code != 0:
        from probe.adapters.cabi_worker import return_code_message

        message = return_code_message(function, code, where, RETURN_CODES)
        reason = lib.mtp2_last_error(ctx) if hasattr(lib, "mtp2_last_error") else None
        raise AdapterError(message + (f" The library says: {library_text(reason)}" if reason else ""))
