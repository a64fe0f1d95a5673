"""The llama.cpp worker: `python -m probe.adapters.llama_cpp_worker MODEL.gguf WORK`, run in a child process by
probe/adapters/llama_cpp.py, so that a crash or abort inside llama.cpp is reported, never the probe's own death.

It drives llama.cpp's own MTP graph (an `LLAMA_CONTEXT_TYPE_MTP` context over the GGUF's MTP block: `graph_mtp` in
src/models/qwen35.cpp, qwen35moe.cpp, qwen3next.cpp) through llama-cpp-python's ctypes bindings, on the inputs the
probe wrote into WORK: token_ids.npy (the token each step feeds, x_{i+1}), positions.npy (p_i) and hidden.npy (H_i,
float32 [T, D], set as each entry's embedding beside its token id, as common/speculative.cpp's MTP driver does).

Without WORK/chain.npz the T bridge steps go in one batch through the head's own KV cache (causal: step i sees
steps 0..i), as llama.cpp's draft context processes a prompt. With it (d{j}.token_ids, d{j}.positions: the probe's
token and position per depth j and bridge), the worker runs llama.cpp's draft loop as its driver does
(`drive_loop`): bridge step i alone, then its chain, one decode per depth, each fed the nextn embedding llama.cpp
returns for the entry just decoded (llama_get_embeddings_nextn_ith: the graph's `t_h_nextn`, i.e. h_nextn, the
head's normed output), then the chain's KV removed from p_i + 1 on (llama_memory_seq_rm), then bridge step i+1.

The scheduler's eval callback (`cb_eval`) copies every tensor the graph names with `cb()` (names end in
`-<layer>`) after each decode: WORK/captured/<name>.npy for depth 1 and WORK/captured/d{j}/<name>.npy for depth j,
float32 or int32 [rows, width]; each decode's logits are kept as `result_output` (the draft token is their argmax).
WORK/result.json says what ran: the library, the names captured per depth, the ones the graph offered that were not
captured (listed, never dropped), and `chain_skipped` where the library lacks the nextn API (depth 1 only then).

K/V cache in float32 and flash attention off by default (request.json may turn them on: llama.cpp casts K/V to f16
with flash attention, which an f16 tolerance profile then judges). request.json's `mutant` (LOOP_MUTANTS) runs a
driver loop bug, for the twins only. LLAMA_CPP_LIB_PATH (a folder holding libllama.so and libggml-base.so) runs a
user's own build; the parent sets it from `--impl llama.cpp:MODEL:LIB`.
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

    def take(self, one_row: bool) -> dict[str, np.ndarray]:
        """The tensors the last llama_process call computed, each named once (a name computed twice was another
        graph: listed in `skipped`), and forget them; `one_row`: the call decoded one entry."""
        taken = {}
        for name, parts in self.rows.items():
            if len(parts) != 1:
                self.skipped[name] = f"computed {len(parts)} times in one decode"
                continue
            taken[name] = parts[0].reshape(1, -1) if one_row else parts[0]
        self.rows = {}
        return taken


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
    chain = _chain_inputs(work)
    mutant = request.get("mutant")
    if mutant is not None and mutant not in LOOP_MUTANTS:
        raise RuntimeError(f"unknown loop mutant {mutant!r}; known: {', '.join(LOOP_MUTANTS)}")
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
    capture = Capture(_ggml_base(llama_cpp))
    callback = llama_cpp.ggml_backend_sched_eval_callback(capture)
    cparams = llama_cpp.llama_context_default_params()
    cparams.ctx_type = llama_cpp.LLAMA_CONTEXT_TYPE_MTP if hasattr(llama_cpp, "LLAMA_CONTEXT_TYPE_MTP") else 1
    size = max(64, int(n) + len(chain or {}) + 16)
    cparams.n_ctx, cparams.n_batch, cparams.n_ubatch, cparams.n_seq_max = size, size, size, 1
    cparams.n_threads = cparams.n_threads_batch = int(request.get("threads", 1))
    cparams.flash_attn_type = 1 if request.get("flash_attn") else 0
    kv = GGML_F16 if request.get("kv_f16") else GGML_F32
    cparams.type_k, cparams.type_v = kv, kv
    cparams.cb_eval, cparams.cb_eval_user_data = callback, None
    ctx = llama_cpp.llama_init_from_model(model, cparams)
    if not ctx:
        raise RuntimeError("llama.cpp could not create an MTP context for the model (its log is above)")
    vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
    engine = Engine(llama_cpp, ctx, vocab, hidden.shape[1])
    result = {"library": str(Path(llama_cpp.llama_cpp._lib._name).resolve()),
              "version": getattr(llama_cpp, "__version__", "?"), "steps": int(n)}
    nextn = (_nextn_api(llama_cpp) if mutant != "no_nextn_api" else "the nextn API is withheld (loop mutant "
             "no_nextn_api)") if chain else None
    if chain and isinstance(nextn, str):
        result["chain_skipped"] = nextn  # depth 1 still runs; the verdict says the loop was not checked
        chain = None
    if chain:
        nextn.enable(ctx)
        depths = drive_loop(engine, capture, nextn, tokens, positions, hidden, chain, mutant)
    else:
        depths = {1: bridge_batch(engine, capture, tokens, positions, hidden)}
    result |= save_depths(work / "captured", depths, capture)
    engine.free()
    llama_cpp.llama_model_free(model)
    return result


# Driver loop bugs for the twins (tests, selftest): reachable only through LlamaCppAdapter(mutant=...), never --impl.
LOOP_MUTANTS = {
    "chain_kv_kept": "the chain's KV entries are not removed before the next bridge step",
    "chain_position_frozen": "every depth of a chain runs at its bridge's position",
    "chain_position_skips": "depth j runs at p_i + j (one past the draft loop's p_i + j - 1)",
    "recycle_main": "every depth is fed the main model's H_i instead of the previous depth's hidden",
    "recycle_prenorm": "depth j is fed depth j-1's mtp_post_ffn (the residual before the final norm)",
    "no_nextn_api": "as a build without llama-ext.h's nextn API: depth 1 runs, no chain",
}


class Engine:
    """One llama.cpp MTP context: decodes entries (token, position, hidden) as one batch, as common_batch does."""

    def __init__(self, llama_cpp, ctx, vocab: int, width: int):
        self.lib, self.ctx, self.vocab, self.width = llama_cpp, ctx, vocab, width
        self.batch = llama_cpp.llama_batch_ext_init(ctx)

    def decode(self, entries: list[tuple[int, int, np.ndarray]], what: str) -> np.ndarray:
        """Decode `entries` (token id, position, hidden row) in one llama_process call; their logits [n, vocab]."""
        lib, batch = self.lib, self.batch
        lib.llama_batch_ext_clear(batch)
        rows = []
        for k, (token, pos, row) in enumerate(entries):
            idx = lib.llama_batch_ext_add_token(batch, 0, int(token))
            if idx < 0:
                raise RuntimeError(f"llama_batch_ext_add_token failed at {what} ({idx})")
            position = lib.llama_pos(int(pos))
            if not lib.llama_batch_ext_set_pos(batch, idx, ctypes.pointer(position)):
                raise RuntimeError(f"llama_batch_ext_set_pos failed at {what}")
            rows.append(np.ascontiguousarray(row, dtype=np.float32))  # alive until llama_process has read it
            embd = lib.llama_embd(rows[-1].ctypes.data_as(ctypes.POINTER(ctypes.c_float)), 1, self.width)
            # H goes in as the entry's embedding beside its token id, as common/speculative.cpp's MTP driver sets it
            # (common_batch::set_embd): llama_batch_ext_set_embd_state is still a stub returning false in this
            # release, and the MTP graph reads the hidden from the ubatch's embd ("for now ... provided as an
            # embedding")
            if not lib.llama_batch_ext_set_embd_token(batch, idx, embd):
                raise RuntimeError(f"llama_batch_ext_set_embd_token refused the hidden row of {what}")
            if not lib.llama_batch_ext_set_output_logits(batch, idx, True):
                raise RuntimeError(f"llama_batch_ext_set_output_logits failed at {what}")
        rc = lib.llama_process(self.ctx, lib.LLAMA_PROCESS_TYPE_DECODE, batch)
        if rc != 0:
            raise RuntimeError(f"llama_process (decode) returned {rc} at {what} (llama.cpp's log says why)")
        return np.stack([np.ctypeslib.as_array(lib.llama_get_logits_ith(self.ctx, k), shape=(self.vocab,)).copy()
                         for k in range(len(entries))])

    def drop_from(self, pos: int) -> None:
        """llama_memory_seq_rm(mem, 0, pos, -1), as the server drops a draft's KV from the draft context right after
        common_speculative_draft (tools/server/server-context.cpp: `llama_memory_seq_rm(llama_get_memory(ctx_dft),
        slot.id, ckpt.pos_max + 1, -1)`, "for now, always re-evaluate"): pos = the bridge's position + 1."""
        if not self.lib.llama_memory_seq_rm(self.lib.llama_get_memory(self.ctx), 0, int(pos), -1):
            raise RuntimeError(f"llama_memory_seq_rm refused to remove positions >= {pos}")

    def free(self) -> None:
        self.lib.llama_batch_ext_free(self.batch)
        self.lib.llama_free(self.ctx)


def bridge_batch(engine: Engine, capture: Capture, tokens, positions, hidden) -> dict:
    """The T bridge steps in one batch (step i: x_{i+1}, p_i, H_i), as the draft context processes a prompt; no
    chain asked for. Returns depth 1's {name: [T, ...]} and its logits."""
    logits = engine.decode([(tokens[i], positions[i], hidden[i]) for i in range(len(tokens))], "the bridge steps")
    return {"named": capture.take(one_row=False), "logits": logits}


def drive_loop(engine: Engine, capture: Capture, nextn, tokens, positions, hidden, chain: dict,
               mutant: str | None) -> dict:
    """The engine's own draft loop, in its order: bridge step i (x_{i+1}, p_i, H_i), then its chain, depth j = 2..
    (the probe's token and position; the hidden is the engine's: llama_get_embeddings_nextn_ith of the entry just
    decoded, as common_speculative_impl_draft_mtp::draft recycles it), then the chain's KV removed
    (llama_memory_seq_rm from p_i + 1, as the server does right after drafting), then bridge step i+1. Every
    decode holds one entry; its named tensors are depth j's row i."""
    depths = {j: {"named": [], "logits": []} for j in [1, *sorted(chain)]}

    def step(depth: int, i: int, token: int, pos: int, row: np.ndarray) -> dict:
        logits = engine.decode([(token, pos, row)], f"depth {depth} of bridge {i}")
        named = capture.take(one_row=True)
        depths[depth]["named"].append(named)
        depths[depth]["logits"].append(logits[0])
        return named

    for i in range(len(tokens)):
        named = step(1, i, tokens[i], positions[i], hidden[i])
        ran = False
        for j in (j for j in sorted(chain) if i < len(chain[j]["token_ids"])):
            recycled = _recycled(nextn, engine, named, hidden[i], mutant)
            pos = int(chain[j]["positions"][i])
            pos = {"chain_position_frozen": int(positions[i]), "chain_position_skips": pos + 1}.get(mutant, pos)
            named = step(j, i, int(chain[j]["token_ids"][i]), pos, recycled)
            ran = True
        if ran and mutant != "chain_kv_kept":
            engine.drop_from(int(positions[i]) + 1)
    return {j: {"named": _stacked(part["named"], j, capture.skipped), "logits": np.stack(part["logits"])}
            for j, part in depths.items()}


def _recycled(nextn, engine: Engine, named: dict, main_row: np.ndarray, mutant: str | None) -> np.ndarray:
    """What the next depth is fed: the engine's nextn embedding of the entry just decoded (or a mutant's choice)."""
    if mutant == "recycle_main":
        return main_row
    if mutant == "recycle_prenorm":
        pre = [v for k, v in named.items() if k.startswith("mtp_post_ffn")]
        if len(pre) != 1:
            raise RuntimeError("recycle_prenorm: the graph named no single mtp_post_ffn tensor")
        return pre[0].reshape(-1)
    pointer = nextn(engine.ctx, 0)
    if not pointer:
        raise RuntimeError("llama_get_embeddings_nextn_ith returned NULL for the entry just decoded")
    return np.ctypeslib.as_array(pointer, shape=(engine.width,)).copy()


def _nextn_api(llama_cpp):
    """llama_get_embeddings_nextn_ith (src/llama-ext.h, the staging API common/speculative.cpp's MTP driver uses),
    with the context set to output nextn embeddings of its output rows, or why it is not there. llama-ext.h has no
    extern "C" in this release, so the library exports it under its C++ name; a build that adds extern "C"
    exports the plain one."""
    lib = llama_cpp.llama_cpp._lib
    names = {"set": ("llama_set_embeddings_nextn", "_Z26llama_set_embeddings_nextnP13llama_contextbb"),
             "get": ("llama_get_embeddings_nextn_ith", "_Z30llama_get_embeddings_nextn_ithP13llama_contexti")}
    found = {}
    for role, candidates in names.items():
        for name in candidates:
            try:
                found[role] = getattr(lib, name)
                break
            except AttributeError:
                continue
        else:
            return (f"the library exports no {candidates[0]} (llama-ext.h's staging API, which llama.cpp's MTP "
                    f"draft driver recycles its hidden through)")
    found["set"].argtypes, found["set"].restype = [ctypes.c_void_p, ctypes.c_bool, ctypes.c_bool], None
    found["get"].argtypes, found["get"].restype = [ctypes.c_void_p, ctypes.c_int32], ctypes.POINTER(ctypes.c_float)

    def get(ctx, i):
        return found["get"](ctx, i)

    get.enable = lambda ctx: found["set"](ctx, True, True)  # masked: rows of output entries, as ctx_dft is set
    return get


def _chain_inputs(work: Path) -> dict[int, dict[str, np.ndarray]] | None:
    """chain.npz ({d{j}.token_ids, d{j}.positions}: the probe's token and position per depth and bridge), or None."""
    path = work / "chain.npz"
    if not path.is_file():
        return None
    with np.load(path) as saved:
        keys = list(saved.files)
        depths = sorted({int(k.split(".")[0][1:]) for k in keys})
        return {j: {name: saved[f"d{j}.{name}"].astype(np.int64) for name in ("token_ids", "positions")}
                for j in depths}


def _stacked(calls: list[dict], depth: int, skipped: dict) -> dict:
    """Per-call {name: one row} -> {name: [n, ...]}; a name not named by every decode of the depth (or in another
    width) is listed in `skipped`, never stacked into rows that mix steps."""
    every = set.union(*(set(named) for named in calls)) if calls else set()
    out = {}
    for name in sorted(every):
        rows = [named.get(name) for named in calls]
        if any(r is None for r in rows) or len({r.size for r in rows}) != 1:
            skipped[f"{name} (depth {depth})"] = "not named alike by every decode of the depth"
            continue
        out[name] = np.stack([r.reshape(-1) for r in rows])
    return out


def save_depths(folder: Path, depths: dict, capture: Capture) -> dict:
    """WORK/captured/[d{j}/]<name>.npy for every depth, the logits as result_output; what was captured and skipped."""
    captured = {}
    for depth, part in depths.items():
        where = folder if depth == 1 else folder / f"d{depth}"
        where.mkdir(parents=True)
        names = {}
        for name, rows in part["named"].items():
            np.save(where / f"{name}.npy", rows)
            names[name] = list(rows.shape)
        np.save(where / "result_output.npy", part["logits"].astype(np.float32))
        names["result_output"] = list(part["logits"].shape)
        captured[str(depth)] = names
    return {"captured": captured["1"], "chain_captured": {k: v for k, v in captured.items() if k != "1"},
            "skipped": capture.skipped}


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
