"""The llama.cpp worker: `python -m probe.adapters.llama_cpp_worker MODEL.gguf WORK`, run in a child process by
probe/adapters/llama_cpp.py, so that a crash or abort inside llama.cpp is reported, never the probe's own death.

It drives llama.cpp's own MTP graph (an `LLAMA_CONTEXT_TYPE_MTP` context over the GGUF's MTP block: `graph_mtp` in
src/models/qwen35.cpp, qwen35moe.cpp, qwen3next.cpp) through llama-cpp-python's ctypes bindings, on the inputs the
probe wrote into WORK: token_ids.npy (the token each step feeds, x_{i+1}), positions.npy (p_i) and hidden.npy (H_i,
float32 [T, D], set as each entry's embedding beside its token id, as common/speculative.cpp's MTP driver does). The T bridge
steps go in one batch through the head's own KV cache (causal: step i sees steps 0..i), as llama.cpp's draft
context processes a prompt. The scheduler's eval callback (`cb_eval`) copies every tensor the graph names with
`cb()` (names end in `-<layer>`) into WORK/captured/<name>.npy, float32 or int32 [T, width]; the logits of each step
are kept as `result_output` (the draft token is their argmax). WORK/result.json says what ran: the library, the
names captured, and the ones the graph offered that were not contiguous (not captured, listed, never dropped).

K/V cache in float32 and flash attention off by default (request.json may turn them on: llama.cpp casts K/V to f16
with flash attention, which an f16 tolerance profile then judges). LLAMA_CPP_LIB_PATH (a folder holding
libllama.so and libggml-base.so) runs a user's own build; the parent sets it from `--impl llama.cpp:MODEL:LIB`.
"""

import ctypes
import json
import os
import sys
import traceback
from pathlib import Path

import numpy as np

GGML_F32, GGML_F16, GGML_I32 = 0, 1, 26
_NUMPY = {GGML_F32: np.float32, GGML_F16: np.float16, GGML_I32: np.int32}


class GgmlTensor(ctypes.Structure):
    """The leading fields of ggml.h's `struct ggml_tensor` (stable since 2024): type, buffer, ne, nb, ... name."""

    _fields_ = [("type", ctypes.c_int), ("buffer", ctypes.c_void_p), ("ne", ctypes.c_int64 * 4),
                ("nb", ctypes.c_size_t * 4), ("op", ctypes.c_int), ("op_params", ctypes.c_int32 * 16),
                ("flags", ctypes.c_int32), ("src", ctypes.c_void_p * 10), ("view_src", ctypes.c_void_p),
                ("view_offs", ctypes.c_size_t), ("data", ctypes.c_void_p), ("name", ctypes.c_char * 64)]


def _ggml_base(llama_cpp) -> ctypes.CDLL:
    """libggml-base (ggml_backend_tensor_get) from the folder the llama library was loaded from."""
    folder = Path(os.environ.get("LLAMA_CPP_LIB_PATH") or Path(llama_cpp.__file__).parent / "lib")
    for name in ("libggml-base.so", "libggml.so"):
        if (folder / name).is_file():
            lib = ctypes.CDLL(str(folder / name))
            lib.ggml_backend_tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
            lib.ggml_backend_tensor_get.restype = None
            return lib
    raise RuntimeError(f"no libggml-base.so or libggml.so in {folder}")


class Capture:
    """The eval callback: asks for every named tensor and copies each float/int one after it is computed, in
    numpy order [ne3, ne2, ne1, ne0] (strided views read through their strides)."""

    def __init__(self, ggml):
        self.ggml, self.rows, self.skipped = ggml, {}, {}

    def __call__(self, tensor_ptr, ask, _user) -> bool:
        t = GgmlTensor.from_address(tensor_ptr)
        name = t.name.decode(errors="replace")
        if ask:
            return bool(name)
        dtype = _NUMPY.get(t.type)
        if dtype is None:
            self.skipped[name] = f"ggml type {t.type}"
            return True
        ne, nb = [int(x) for x in t.ne], [int(x) for x in t.nb]
        if 0 in ne:
            return True
        extent = sum((n - 1) * b for n, b in zip(ne, nb)) + np.dtype(dtype).itemsize  # a view's bytes, strides
        raw = np.empty(extent, dtype=np.uint8)
        self.ggml.ggml_backend_tensor_get(tensor_ptr, raw.ctypes.data, 0, extent)
        # numpy order [ne3, ne2, ne1, ne0] with ggml's byte strides (views such as ffn_moe_topk are strided)
        values = _strided(raw, dtype, ne, nb)
        self.rows.setdefault(name, []).append(values.astype(np.float32) if dtype == np.float16 else values)
        return True


def _strided(raw: np.ndarray, dtype, ne: list[int], nb: list[int]) -> np.ndarray:
    """A copy of the tensor as numpy [ne3, ne2, ne1, ne0] from its bytes and ggml's byte strides."""
    base = np.frombuffer(raw.tobytes() + b"\0" * (-len(raw) % np.dtype(dtype).itemsize), dtype=dtype)
    return np.lib.stride_tricks.as_strided(base, shape=tuple(ne[::-1]), strides=tuple(nb[::-1])).copy()


def run(model_path: Path, work: Path) -> dict:
    import llama_cpp

    request = json.loads((work / "request.json").read_text())
    tokens = np.load(work / "token_ids.npy")
    positions = np.load(work / "positions.npy").astype(np.int32)
    hidden = np.ascontiguousarray(np.load(work / "hidden.npy"), dtype=np.float32)
    n = len(tokens)
    llama_cpp.llama_backend_init()
    mparams = llama_cpp.llama_model_default_params()
    mparams.load_mtp = True
    mparams.use_mmap = True
    model = llama_cpp.llama_model_load_from_file(str(model_path).encode(), mparams)
    if not model:
        raise RuntimeError(f"llama.cpp could not load {model_path} (its log is above)")
    n_nextn = llama_cpp.llama_model_n_layer_nextn(model)
    if n_nextn < 1:
        raise RuntimeError(f"{model_path} has no MTP layer for llama.cpp (nextn_predict_layers = {n_nextn})")
    ggml = _ggml_base(llama_cpp)
    capture = Capture(ggml)
    callback = llama_cpp.ggml_backend_sched_eval_callback(capture)
    cparams = llama_cpp.llama_context_default_params()
    cparams.ctx_type = llama_cpp.LLAMA_CONTEXT_TYPE_MTP if hasattr(llama_cpp, "LLAMA_CONTEXT_TYPE_MTP") else 1
    size = max(64, int(n) + 16)
    cparams.n_ctx, cparams.n_batch, cparams.n_ubatch, cparams.n_seq_max = size, size, size, 1
    cparams.n_threads = cparams.n_threads_batch = int(request.get("threads", 1))
    cparams.flash_attn_type = 1 if request.get("flash_attn") else 0
    kv = GGML_F16 if request.get("kv_f16") else GGML_F32
    cparams.type_k, cparams.type_v = kv, kv
    cparams.cb_eval, cparams.cb_eval_user_data = callback, None
    ctx = llama_cpp.llama_init_from_model(model, cparams)
    if not ctx:
        raise RuntimeError("llama.cpp could not create an MTP context for the model (its log is above)")
    batch = llama_cpp.llama_batch_ext_init(ctx)
    width = hidden.shape[1]
    for i in range(n):
        idx = llama_cpp.llama_batch_ext_add_token(batch, 0, int(tokens[i]))
        if idx < 0:
            raise RuntimeError(f"llama_batch_ext_add_token failed at step {i} ({idx})")
        pos = llama_cpp.llama_pos(int(positions[i]))
        if not llama_cpp.llama_batch_ext_set_pos(batch, idx, ctypes.pointer(pos)):
            raise RuntimeError(f"llama_batch_ext_set_pos failed at step {i}")
        row = hidden[i]
        embd = llama_cpp.llama_embd(row.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), 1, width)
        # H goes in as the entry's embedding beside its token id, as common/speculative.cpp's MTP driver sets it
        # (common_batch::set_embd): llama_batch_ext_set_embd_state is still a stub returning false in this release,
        # and the MTP graph reads the hidden from the ubatch's embd ("for now ... provided as an embedding")
        if not llama_cpp.llama_batch_ext_set_embd_token(batch, idx, embd):
            raise RuntimeError(f"llama_batch_ext_set_embd_token refused step {i}'s hidden row")
        if not llama_cpp.llama_batch_ext_set_output_logits(batch, idx, True):
            raise RuntimeError(f"llama_batch_ext_set_output_logits failed at step {i}")
    rc = llama_cpp.llama_process(ctx, llama_cpp.LLAMA_PROCESS_TYPE_DECODE, batch)
    if rc != 0:
        raise RuntimeError(f"llama_process (decode) returned {rc}")
    vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
    logits = np.stack([np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, i), shape=(vocab,)).copy()
                       for i in range(n)])
    captured = work / "captured"
    captured.mkdir()
    names = {}
    for name, parts in capture.rows.items():
        if len(parts) != 1:  # one ubatch holds every step (n_ubatch = n_ctx): a second call is another graph
            capture.skipped[name] = f"computed {len(parts)} times"
            continue
        rows = parts[0]
        np.save(captured / f"{name}.npy", rows)
        names[name] = list(rows.shape)
    np.save(captured / "result_output.npy", logits.astype(np.float32))
    names["result_output"] = list(logits.shape)
    llama_cpp.llama_batch_ext_free(batch)
    llama_cpp.llama_free(ctx)
    llama_cpp.llama_model_free(model)
    return {"library": str(Path(llama_cpp.llama_cpp._lib._name).resolve()), "version": getattr(llama_cpp, "__version__", "?"),
            "captured": names, "skipped": capture.skipped, "steps": int(n)}


def main(argv: list[str]) -> int:
    model_path, work = Path(argv[1]), Path(argv[2])
    try:
        result = {"status": "ok", **run(model_path, work)}
        code = 0
    except Exception as error:  # reported to the parent, which names it: the engine's failure, not the probe's
        result = {"status": "error", "error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()}
        code = 3
    (work / "result.json").write_text(json.dumps(result))
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv))
