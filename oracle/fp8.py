"""FP8 weights as DeepSeek-V3/R1 release them: `float8_e4m3fn` values with `weight_scale_inv` block scales.

A quantised linear `W` [out, in] is stored as `W.weight` (F8_E4M3, one byte per element) and `W.weight_scale_inv`
(F32 [ceil(out/bo), ceil(in/bi)], block (bo, bi) = `quantization_config.weight_block_size`, [128, 128] as
released). The weight the model means is

    W[r, c] = e4m3(W.weight[r, c]) * W.weight_scale_inv[r // bo, c // bi]       (DeepSeek-V3 README_WEIGHTS)

Decoding e4m3 to float32 is exact (3 mantissa bits, exponents 2^-9 .. 2^8); the product is one float32 multiply,
rounded once, exactly as `w.to(torch.float32) * scale` per element (tests/families/test_deepseek_glm.py holds the
two bit-equal). Torch-free: the checkpoint reader uses it.

`dequantize_numpy` is the specification. oracle/_fp8dequant.c computes the same float32 bits about five times
faster (the decode was most of the time of a DeepSeek-V3-scale export); setuptools builds it as the optional
extension `oracle._fp8dequant` when the package is installed (`pip install -e .`), and it is loaded here with
ctypes. Without it (no C compiler at install time) the numpy code runs instead, with the same results, and
`kernel_note()` says so (printed once, to stderr, the first time a weight is dequantized without it).
"""

import ctypes
import importlib.util
import sys
from functools import cache

import numpy as np

from oracle.errors import CheckpointError

KERNEL_VERSION = 1  # = FP8DEQUANT_VERSION in _fp8dequant.c; bump both when the kernel's meaning changes

E4M3 = "F8_E4M3"


def _e4m3_table() -> np.ndarray:
    """float32 value of each of the 256 float8_e4m3fn bit patterns: 1 sign, 4 exponent (bias 7), 3 mantissa bits;
    no infinities, S.1111.111 is NaN (max finite 448)."""
    bits = np.arange(256)
    sign = np.where(bits & 0x80, -1.0, 1.0)
    exponent, mantissa = (bits >> 3) & 0xF, bits & 0x7
    value = np.where(exponent == 0, mantissa / 8.0 * 2.0**-6,  # subnormals
                     (1.0 + mantissa / 8.0) * 2.0 ** (exponent - 7.0))
    value = np.where((exponent == 15) & (mantissa == 7), np.nan, value)
    return (sign * value).astype(np.float32)  # every value is exact in float32 (and float64)


E4M3_TABLE = _e4m3_table()


def decode_e4m3(stored: np.ndarray) -> np.ndarray:
    """uint8 bit patterns -> float32 values (exact), no scale applied."""
    return E4M3_TABLE[np.asarray(stored, dtype=np.uint8)]


def scale_shape(shape: tuple[int, int], block: tuple[int, int]) -> tuple[int, int]:
    """The `weight_scale_inv` shape of a [out, in] weight quantised in (bo, bi) blocks (partial blocks at the edges)."""
    return (-(-shape[0] // block[0]), -(-shape[1] // block[1]))


def check_scale_shape(shape: tuple[int, ...], scales: tuple[int, ...], block: tuple[int, int], name: str) -> None:
    """Refuse block scales whose grid does not fit the weight (a transposed grid, another block size)."""
    expected = scale_shape(shape, block)
    if tuple(scales) != expected:
        raise CheckpointError(f"{name}: weight {list(shape)} in {list(block)} blocks needs weight_scale_inv "
                              f"{list(expected)}, found {list(scales)} (transposed or another block size?).")


def dequantize(stored: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int], name: str = "weight",
               out: np.ndarray | None = None) -> np.ndarray:
    """float32 [out, in] from e4m3 bit patterns [out, in] (uint8) and their block scales (float32; UE8M0 scales
    decoded to float32 first, as the checkpoint reader does); one rounding per element. Written into `out` (float32
    [out, in], e.g. rows of a reused expert buffer) when given. The compiled kernel when built, else the numpy
    specification: the same bits either way."""
    stored = np.asarray(stored)
    scale_inv = np.ascontiguousarray(scale_inv, dtype=np.float32)
    if stored.ndim != 2 or stored.dtype != np.uint8:
        raise CheckpointError(f"{name}: an FP8 weight must be 2-D e4m3 bytes, found {stored.dtype} {stored.shape}.")
    check_scale_shape(stored.shape, scale_inv.shape, block, name)
    if out is None:
        out = np.empty(stored.shape, dtype=np.float32)
    elif out.shape != stored.shape or out.dtype != np.float32:  # a caller's bug, not the checkpoint's
        raise ValueError(f"{name}: output buffer {out.dtype} {out.shape} for a weight {list(stored.shape)}")
    kernel = _kernel()
    if kernel is None or not (_rows_contiguous(stored) and _rows_contiguous(out)):
        if kernel is None:
            _note_once()
        return dequantize_numpy(stored, scale_inv, block, out)
    kernel(stored.ctypes.data, stored.strides[0], scale_inv.ctypes.data, stored.shape[0], stored.shape[1],
           block[0], block[1], out.ctypes.data, out.strides[0] // out.itemsize)
    return out


def dequantize_numpy(stored: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int],
                     out: np.ndarray) -> np.ndarray:
    """The specification of `dequantize` (and the fallback), for checked shapes: table decode, then one float32
    multiply by the block's scale.

    One block row at a time: decoded by table into the output, then scaled in place while those rows are still in
    cache (no full-size temporary, one pass over memory instead of two; 1.5x faster on a 2048 x 7168 expert than
    decode-then-scale, bit-identical: the same float32 product per element)."""
    expected = scale_shape(stored.shape, block)
    bo, bi = block
    whole = stored.shape[1] % bi == 0 and out.flags.c_contiguous  # column blocks as a reshaped view of each row block
    for r in range(expected[0]):
        rows = out[r * bo:(r + 1) * bo]
        np.take(E4M3_TABLE, stored[r * bo:(r + 1) * bo], out=rows)  # float32, exact
        if whole:  # [rows, col blocks, bi] *= scale per col block: float32 x float32, rounded once, in place
            view = rows.reshape(rows.shape[0], expected[1], bi)
            np.multiply(view, scale_inv[r][None, :, None], out=view)
        else:  # a partial last column block: column c -> c // bi
            rows *= np.repeat(scale_inv[r], bi)[: stored.shape[1]]
    return out


def kernel_note() -> str | None:
    """None when the compiled dequant kernel is in use, else a one-line note for the user."""
    lib, why = _library()
    if lib is not None:
        return None
    return (f"note: the compiled FP8 dequant kernel (oracle._fp8dequant) {why}, so FP8 weights are dequantized "
            f"with numpy, about five times slower; run `pip install -e .` again (with a C compiler) to build it")


def _rows_contiguous(a: np.ndarray) -> bool:
    """Elements of a row adjacent (rows may be strided): what the kernel walks. Anything else goes to numpy."""
    return a.shape[1] <= 1 or a.strides[1] == a.itemsize


@cache
def _note_once() -> None:
    print(kernel_note(), file=sys.stderr)


@cache
def _library() -> tuple[ctypes.CDLL | None, str]:
    """The built kernel, or None and why it is not used (not built; a stale build after the source changed)."""
    spec = importlib.util.find_spec("oracle._fp8dequant")  # the built extension's path (not imported: no PyInit)
    if spec is None or spec.origin is None:
        return None, "is not built"
    lib = ctypes.CDLL(spec.origin)
    found = lib.mtp_fp8dequant_version() if hasattr(lib, "mtp_fp8dequant_version") else 0
    if found != KERNEL_VERSION:
        return None, f"is stale (version {found}; this code needs version {KERNEL_VERSION})"
    lib.mtp_fp8_dequant.restype = None
    lib.mtp_fp8_dequant.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                    ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64]
    return lib, ""


def _kernel():
    lib, _ = _library()
    return lib.mtp_fp8_dequant if lib is not None else None
