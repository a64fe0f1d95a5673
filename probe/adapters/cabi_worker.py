"""The child process that drives one C-ABI shared library through ctypes: ABI v1 (fixtures/candidates/mtp_probe.h,
the dense Qwen3.5 head) or v2 (mtp_probe_v2.h, any family; probe/adapters/cabi_v2.py), told apart by the exported
symbols: a library that exports `mtp2_abi_version` is v2. Given `python:MODULE:FACTORY` instead of LIB, it steps a
Python candidate (probe/adapters/python.py StepDriver) through the same files; abi.txt then holds `python`.
The worker ends with os._exit once its results are written: nothing of the candidate's runs after them.

`probe.adapters.cabi.CAbiAdapter` runs `python -m probe.adapters.cabi_worker LIB CHECKPOINT DIR [REFERENCE]`, so a
segfault or abort in foreign code ends this process, never the probe. Everything passes through files in DIR:

    in     embed.npy, hidden.npy (float32 [T, D] / [T, hidden_width]) and positions.npy (int64 [T]);
           optional conventions.json (the reference's engine conventions, e.g. norm_topk_prob; v2 config).
           With REFERENCE (a worker started before the probe's checks: probe/adapters/cabi_process.py), the
           inputs and conventions are read from that trace instead, and captured.json also records their
           inputs_digest and the conventions, for the probe to check against what it read
           optional chain.npz (d{j}_token_ids, d{j}_positions, d{j}_embed per chain depth j): what a v2 library
           exporting mtp2_draft_step is driven with after each bridge step (read from REFERENCE when given)
    out    <stage>.npy ([T, width]: float32, int64 for index sets) for every captured stage and `out`, and
           d{j}.<stage>.npy ([n_j, width]) per chain depth a draft step wrote; captured.json lists them (depths:
           {j: stages}) with the head's weights_digest; abi.txt holds the ABI version detected (1 or 2)
    progress.txt  the phase about to start, one line each, written unbuffered before it starts ("step 3"):
                  after a crash its last line says where the library died
    error.txt     a failure this worker diagnosed itself (bad library, error code); exit status EXIT_DIAGNOSED;
                  error_kind.txt names its class (CandidateError: the candidate's own fault)
    sys_path.json optional (Python candidates): the probe's sys.path, put first in the worker's
"""

import ctypes
import json
import os
import sys
import time
from collections.abc import Callable
from ctypes import POINTER, byref, c_double, c_int, c_int32, c_uint32, c_void_p
from pathlib import Path

# numpy's bundled OpenBLAS starts a thread per core when numpy is imported, and that thread spins for ~0.1 s waiting
# for work: CPU taken from the library's steps and the probe beside them (import numpy 170 -> 85 ms on 2 busy
# cores). The worker does no BLAS, so in the worker process numpy is imported with one thread, and the user's
# setting is put back (main: restore_blas_setting) before the library under test is loaded, which may read it.
BLAS_THREADS = "OPENBLAS_NUM_THREADS"
_USER_BLAS_THREADS = os.environ.get(BLAS_THREADS)
if __name__ == "__main__":
    os.environ[BLAS_THREADS] = "1"

import numpy as np  # noqa: E402 (after the setting above)

from oracle.checkpoint import Checkpoint  # noqa: E402
from oracle.errors import MtpError  # noqa: E402
from oracle.families.qwen3_5_layout import HeadConfig  # noqa: E402
from oracle.stages import STAGE_BY_NAME, TRACE_STAGE_NAMES  # noqa: E402
from probe.adapters import digest_cache  # noqa: E402
from probe.adapters.cabi_v2 import run_v2  # noqa: E402
from probe.errors import AdapterError  # noqa: E402
from probe.poison import poison  # noqa: E402

EXIT_DIAGNOSED = 3
PROGRESS_FILE, ERROR_FILE, MANIFEST_FILE = "progress.txt", "error.txt", "captured.json"
ERROR_KIND_FILE = "error_kind.txt"  # the class name of the error in error.txt (e.g. CandidateError)
CAPTURE_ONLY_FILE = "capture_only.txt"  # optional, comma-separated stages: capture at most these (--explain)
CONVENTIONS_FILE, ABI_FILE, CHAIN_FILE = "conventions.json", "abi.txt", "chain.npz"
V1_FAMILY = "qwen3_5"  # the one head ABI v1's fixed structs can describe
ABI_VERSION = 1  # MTP_PROBE_ABI_VERSION
ALL_CAPTURED = 0x3FF  # ten trace stages; also what a library without mtp_capture_mask is assumed to capture
RETURN_CODES = {  # mtp_probe.h enum -> (name, what it means for the user)
    1: ("MTP_ERR_ARG", "the library rejected an argument or a config value it does not support"),
    2: ("MTP_ERR_ALLOC", "the library ran out of host or device memory"),
    3: ("MTP_ERR_CAPACITY", "the library says its KV cache is full; the probe passes max_steps = T"),
    4: ("MTP_ERR_DEVICE", "a CUDA (or other device) call failed; see the library's stderr"),
}

# The structs mirror mtp_probe.h, which is the source of truth: same fields, same order, same C types.
# (tests/probe/test_cabi.py parses the header and checks these field lists against it.)


class MtpConfig(ctypes.Structure):
    _fields_ = [("abi_version", c_int32), ("hidden_size", c_int32), ("num_heads", c_int32),
                ("num_kv_heads", c_int32), ("head_dim", c_int32), ("rotary_dim", c_int32),
                ("intermediate_size", c_int32), ("max_steps", c_int32), ("rms_norm_eps", c_double),
                ("rope_theta", c_double)]


WEIGHT_TENSORS = (  # mtp_weights field -> checkpoint tensor
    ("pre_fc_norm_embedding", "mtp.pre_fc_norm_embedding.weight"),
    ("pre_fc_norm_hidden", "mtp.pre_fc_norm_hidden.weight"),
    ("fc", "mtp.fc.weight"),
    ("input_layernorm", "mtp.layers.0.input_layernorm.weight"),
    ("q_proj", "mtp.layers.0.self_attn.q_proj.weight"),
    ("k_proj", "mtp.layers.0.self_attn.k_proj.weight"),
    ("v_proj", "mtp.layers.0.self_attn.v_proj.weight"),
    ("q_norm", "mtp.layers.0.self_attn.q_norm.weight"),
    ("k_norm", "mtp.layers.0.self_attn.k_norm.weight"),
    ("o_proj", "mtp.layers.0.self_attn.o_proj.weight"),
    ("post_attention_layernorm", "mtp.layers.0.post_attention_layernorm.weight"),
    ("gate_proj", "mtp.layers.0.mlp.gate_proj.weight"),
    ("up_proj", "mtp.layers.0.mlp.up_proj.weight"),
    ("down_proj", "mtp.layers.0.mlp.down_proj.weight"),
    ("norm", "mtp.norm.weight"),
)


class MtpWeights(ctypes.Structure):
    _fields_ = [(field, c_void_p) for field, _ in WEIGHT_TENSORS]  # const float *


class MtpTrace(ctypes.Structure):
    _fields_ = [(name, c_void_p) for name in TRACE_STAGE_NAMES]  # float *; the header's order is STAGES order


def open_library(path: Path) -> ctypes.CDLL:
    """dlopen `path`; AdapterError says how to build a loadable one."""
    try:
        return ctypes.CDLL(str(path))
    except OSError as err:
        raise AdapterError(f"cannot load {path}: {err}. Build it as a shared library for this machine "
                           f"(gcc -shared -fPIC ..., or nvcc -shared -Xcompiler -fPIC ...).") from None


def abi_version(lib: ctypes.CDLL) -> int:
    """2 if the library exports mtp2_abi_version (mtp_probe_v2.h), else 1 (mtp_probe.h)."""
    return 2 if hasattr(lib, "mtp2_abi_version") else 1


def load_library(path: Path, lib: ctypes.CDLL | None = None) -> ctypes.CDLL:
    """dlopen `path` (unless given `lib`) and declare ABI v1's signatures; AdapterError names a missing symbol."""
    lib = lib if lib is not None else open_library(path)
    signatures = {"mtp_create": (c_int, [POINTER(MtpConfig), POINTER(MtpWeights), POINTER(c_void_p)]),
                  "mtp_step": (c_int, [c_void_p, c_int, c_void_p, c_void_p, c_void_p, POINTER(MtpTrace)]),
                  "mtp_destroy": (None, [c_void_p])}
    for name, (restype, argtypes) in signatures.items():
        if not hasattr(lib, name):
            v2 = [s for s in ("mtp2_create", "mtp2_step", "mtp2_destroy") if hasattr(lib, s)]
            if v2:  # meant as v2, but without the symbol that says so
                raise AdapterError(f"{path} exports {', '.join(v2)} but not mtp2_abi_version, which is how the "
                                   f"probe tells a C ABI v2 library (mtp_probe_v2.h) from a v1 one. Export "
                                   f"int mtp2_abi_version(void) returning 2.")
            raise AdapterError(f"{path} does not export the symbol {name}. Export it with C linkage, as "
                               f"declared in mtp_probe.h (non-static; extern \"C\" in C++/CUDA).")
        getattr(lib, name).restype, getattr(lib, name).argtypes = restype, argtypes
    return lib


def capture_mask(lib: ctypes.CDLL) -> int:
    if not hasattr(lib, "mtp_capture_mask"):  # optional symbol: without it, all ten stages are captured
        return ALL_CAPTURED
    lib.mtp_capture_mask.restype, lib.mtp_capture_mask.argtypes = c_uint32, []
    return int(lib.mtp_capture_mask()) & ALL_CAPTURED


def config_from_head(cfg: HeadConfig, num_steps: int) -> MtpConfig:
    return MtpConfig(ABI_VERSION, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                     cfg.rotary_dim, cfg.intermediate_size, num_steps, cfg.rms_norm_eps, cfg.rope_theta)


def return_code_message(function: str, code: int, where: str, codes: dict = RETURN_CODES) -> str:
    header = "mtp_probe_v2.h" if codes is not RETURN_CODES else "mtp_probe.h"
    name, meaning = codes.get(code, (f"code {code}", f"not a return code {header} defines"))
    return f"{function} returned {code} ({name}) {where}: {meaning}."


class Progress:
    """Appends each phase to progress.txt with one unbuffered write, so it survives a crash in the next call.
    Each line is `<phase>\t<seconds since start>`: the parent names the phase a crash happened in, and
    scripts/bench.py reads the times (load, step loop) to measure the driver's own overhead."""

    def __init__(self, path: Path):
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._start = time.perf_counter()

    def __call__(self, phase: str) -> None:
        os.write(self._fd, f"{phase}\t{time.perf_counter() - self._start:.6f}\n".encode())


class StepInputs:
    """What the library is stepped over: float32 rows (embed [T, D], hidden [T, hidden_width]), int64 positions, and
    the reference's conventions; `digest` (oracle/trace.py inputs_digest) when read from the reference."""

    def __init__(self, embed, hidden, positions, conventions: dict, digest: str | None = None,
                 chain: dict[int, dict[str, np.ndarray]] | None = None):
        self.embed = np.ascontiguousarray(embed, dtype=np.float32)
        self.hidden = np.ascontiguousarray(hidden, dtype=np.float32)
        self.positions = np.asarray(positions, dtype=np.int64)
        self.conventions, self.digest = conventions, digest
        self.chain = chain or {}  # {j: token_ids, positions, embed of depth j}, row i = bridge i (draft loop)


def directory_inputs(work: Path) -> StepInputs:
    """The inputs the adapter wrote into DIR."""
    conventions = (json.loads((work / CONVENTIONS_FILE).read_text()) if (work / CONVENTIONS_FILE).is_file() else {})
    chain = {}
    if (work / CHAIN_FILE).is_file():
        with np.load(work / CHAIN_FILE) as arrays:
            for key in arrays.files:
                depth, _, name = key.partition("_")
                chain.setdefault(int(depth[1:]), {})[name] = arrays[key]
    return StepInputs(*(np.load(work / f"{n}.npy") for n in ("embed", "hidden", "positions")), conventions,
                      chain=chain)


def reference_inputs(reference: Path) -> StepInputs:
    """The inputs and conventions of the reference trace, as the probe reads them (probe/run.py run_and_diff,
    reference_conventions), with their digest."""
    from oracle.families.spec import CONVENTIONS
    from oracle.trace import inputs_digest, read_trace  # h5py: only a worker started on the reference needs it

    from oracle.trace import ChainDepthReader, chain_info

    with read_trace(reference) as ref:
        inputs, config = ref.inputs(), ref.attrs.get("config") or {}
        info = chain_info(ref)
        chain = {j: {n: ChainDepthReader(ref, j).input_rows(n) for n in ("token_ids", "positions", "embed")}
                 for j in (info.chain_depths if info is not None else ())}
    conventions = {k: config[k] for k in CONVENTIONS if k in config}
    return StepInputs(inputs.embed, inputs.hidden, inputs.positions, conventions, inputs_digest(inputs), chain)


def run_steps(lib: ctypes.CDLL, ctx: c_void_p, inputs: StepInputs, buffers: dict[str, np.ndarray],
              progress: Progress):
    """Step t gets row t of every buffer (trace struct fields left NULL for stages not captured)."""
    embed, hidden, positions = inputs.embed, inputs.hidden, inputs.positions
    for t, pos in enumerate(positions.tolist()):
        progress(f"step {t}")
        rows = {name: buf[t].ctypes.data for name, buf in buffers.items()}  # [T, w] row-major: row t's address
        trace = MtpTrace(**{n: rows[n] for n in TRACE_STAGE_NAMES if n in rows})
        code = lib.mtp_step(ctx, pos, embed[t].ctypes.data, hidden[t].ctypes.data, rows["out"], byref(trace))
        if code != 0:
            raise AdapterError(return_code_message("mtp_step", code, f"at step {t} (token row {t}, position {pos})"))


def run_v1(lib: ctypes.CDLL, path: Path, ckpt: Checkpoint, inputs: StepInputs, progress: Progress,
           capture_only: list[str] | None) -> dict[str, np.ndarray]:
    """ABI v1: the 15 head tensors widened to float32 into mtp_weights, the ten-pointer trace struct."""
    load_library(path, lib)
    if ckpt.family.name != V1_FAMILY:
        raise AdapterError(f"{path.name} implements C ABI v1 (mtp_probe.h), which drives the dense Qwen3.5 head "
                           f"only; {ckpt.path} is a {ckpt.family.name} head. Implement C ABI v2 "
                           f"(fixtures/candidates/mtp_probe_v2.h: weights and stages as named tables, any family), "
                           f"or dump its stages with fixtures/candidates/mtp_trace_writer.h and use mtp-probe diff.")
    tensors = ckpt.read_head(digest=False).tensors
    weights = {field: np.ascontiguousarray(tensors[name], dtype=np.float32) for field, name in WEIGHT_TENSORS}
    num_steps, d = len(inputs.positions), ckpt.config.hidden_size
    mask = capture_mask(lib)
    if capture_only is not None:
        mask &= sum(1 << i for i, n in enumerate(TRACE_STAGE_NAMES) if n in capture_only)
    captured = [n for i, n in enumerate(TRACE_STAGE_NAMES) if mask >> i & 1] + ["out"]
    buffers = {n: poison((num_steps, STAGE_BY_NAME[n].width(d))) for n in captured}
    # Locals, so the structs and the arrays they point at outlive the context (a library may keep pointers).
    config = config_from_head(ckpt.config, num_steps)
    weight_ptrs = MtpWeights(**{field: arr.ctypes.data for field, arr in weights.items()})
    ctx = c_void_p()
    progress("create")
    code = lib.mtp_create(byref(config), byref(weight_ptrs), byref(ctx))
    if code != 0:
        raise AdapterError(return_code_message("mtp_create", code, f"for the config of {ckpt.path}"))
    try:
        run_steps(lib, ctx, inputs, buffers, progress)
    finally:
        progress("destroy")
        lib.mtp_destroy(ctx)
    return buffers


def run_library(lib_path: Path, checkpoint: Path, work: Path, reference: Path | None = None) -> None:
    progress = Progress(work / PROGRESS_FILE)
    progress("load")
    lib = open_library(lib_path)
    abi = abi_version(lib)
    (work / ABI_FILE).write_text(str(abi))  # so the parent names the right functions (mtp_step / mtp2_step)
    ckpt = Checkpoint(checkpoint)
    digest = head_digest_soon(ckpt)
    only = (work / CAPTURE_ONLY_FILE).read_text().split(",") if (work / CAPTURE_ONLY_FILE).is_file() else None
    inputs = reference_inputs(reference) if reference is not None else directory_inputs(work)
    if abi == 2:
        buffers = run_v2(lib, lib_path, ckpt, inputs, progress, only)
    else:
        buffers = run_v1(lib, lib_path, ckpt, inputs, progress, only)
    progress("save")
    manifest = save_buffers(work, buffers) | {"weights_digest": digest(), "abi": abi}
    if reference is not None:
        manifest.update(inputs_digest=inputs.digest, conventions=inputs.conventions)
    (work / MANIFEST_FILE).write_text(json.dumps(manifest))


def save_buffers(work: Path, buffers: dict) -> dict:
    """<stage>.npy per depth-1 buffer and d{j}.<stage>.npy per chain depth ("d{j}": {stage: buffer}); the
    manifest's `captured` and `depths` entries."""
    depths = {k: buffers.pop(k) for k in [k for k in buffers if isinstance(buffers[k], dict)]}  # "d{j}": stages
    for name, buf in buffers.items():
        np.save(work / f"{name}.npy", buf)
    for key, part in depths.items():
        for name, buf in part.items():
            np.save(work / f"{key}.{name}.npy", buf)
    return {"captured": list(buffers), "depths": {key: list(part) for key, part in depths.items()}}


def head_digest_soon(ckpt: Checkpoint) -> Callable[[], str]:
    """The head digest, when asked for: remembered from an earlier run of these exact bytes
    (probe/adapters/digest_cache.py), or else hashed on a thread, on the core the single-threaded step leaves idle."""
    try:
        remembered = digest_cache.remembered_digest(ckpt)
    except (MtpError, OSError):  # e.g. a missing shard: reported where it always was (read_head, or the digest)
        remembered = None
    if remembered is not None:
        return lambda: remembered
    from concurrent.futures import ThreadPoolExecutor  # 8 ms of imports that a remembered digest does not need

    return ThreadPoolExecutor(max_workers=1).submit(digest_cache.head_digest, ckpt).result


def restore_blas_setting() -> None:
    """OPENBLAS_NUM_THREADS as the user had it (numpy was imported with 1; see the top of this module)."""
    if _USER_BLAS_THREADS is None:
        os.environ.pop(BLAS_THREADS, None)
    else:
        os.environ[BLAS_THREADS] = _USER_BLAS_THREADS


PYTHON_TARGET = "python:"  # a worker target `python:MODULE:FACTORY` runs a Python candidate (probe/adapters/python.py)


def run_python(spec: str, checkpoint: Path, work: Path) -> None:
    """Step the Python candidate `spec` (MODULE:FACTORY) over DIR's inputs, imported with the probe's sys.path."""
    from probe.adapters.python import SYS_PATH_FILE, StepDriver

    progress = Progress(work / PROGRESS_FILE)
    progress("load")
    (work / ABI_FILE).write_text("python")
    if (work / SYS_PATH_FILE).is_file():
        probes = json.loads((work / SYS_PATH_FILE).read_text())
        sys.path[:] = probes + [p for p in sys.path if p not in probes]
    inputs = directory_inputs(work)
    driver = StepDriver(spec, checkpoint, inputs.conventions)
    if (work / CAPTURE_ONLY_FILE).is_file():
        driver.capture_only = tuple(n for n in (work / CAPTURE_ONLY_FILE).read_text().split(",") if n)
    buffers = driver.run(inputs.embed, inputs.hidden, inputs.positions, progress, chain=inputs.chain)
    progress("save")
    manifest = save_buffers(work, buffers) | {"weights_digest": driver.weights_digest, "abi": "python"}
    (work / MANIFEST_FILE).write_text(json.dumps(manifest))


def end_worker(status: int) -> None:
    """Flush what the candidate printed (C stdio too) and end at once: an atexit handler, a non-daemon thread or a
    finalizer of the candidate's never runs after its results are written (nor holds the worker open)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    try:
        ctypes.CDLL(None).fflush(None)  # the library's printf buffers
    except (OSError, AttributeError):
        pass
    os._exit(status)


PARENT_PID = "MTP_PROBE_WORKER_PARENT"  # set by probe/adapters/cabi_process.py worker_env
_PR_SET_PDEATHSIG = 1


def die_with_the_probe() -> None:
    """Linux: have the kernel SIGKILL this worker when the probe dies, even by SIGKILL (the worker leads its own
    process group, so a Ctrl-C at the terminal never reaches it; the probe's handler kills it, but a killed probe
    runs no handler). Where prctl is missing nothing changes."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, 9)  # SIGKILL
    except (OSError, AttributeError):
        return
    parent = os.environ.get(PARENT_PID)
    if parent is not None and parent.isdigit() and os.getppid() != int(parent):
        os._exit(1)  # the probe died before the request took effect


def main(argv: list[str]) -> None:
    """TARGET CHECKPOINT DIR [REFERENCE]: run every step of DIR's (or REFERENCE's) inputs through TARGET (a library,
    or python:MODULE:FACTORY), writing results into DIR."""
    die_with_the_probe()
    restore_blas_setting()
    # absolute before the candidate is loaded: its constructor may chdir(), which made a relative --checkpoint "not
    # a directory" (red team)
    target, (checkpoint, work) = argv[0], (Path(a).absolute() for a in argv[1:3])
    reference = Path(argv[3]).absolute() if len(argv) > 3 else None
    try:
        if target.startswith(PYTHON_TARGET):
            run_python(target[len(PYTHON_TARGET):], checkpoint, work)
        else:
            run_library(Path(target).absolute(), checkpoint, work, reference)
    except MtpError as err:  # AdapterError, CheckpointError, TraceFormatError: the parent re-raises the message
        (work / ERROR_KIND_FILE).write_text(type(err).__name__)
        (work / ERROR_FILE).write_text(str(err))
        end_worker(EXIT_DIAGNOSED)
    except BaseException:  # reported by the parent from stderr; never Python's exit, which would wait for threads
        import traceback

        traceback.print_exc()
        end_worker(1)
    end_worker(0)


if __name__ == "__main__":
    main(sys.argv[1:])
