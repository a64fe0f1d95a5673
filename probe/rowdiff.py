"""Per-row sums for comparing two [rows, width] float32 blocks: what `compare_block` (probe/compare.py) needs.

`row_sums_numpy` is the specification. probe/_rowdiff.c computes the same fields in one pass in C, about ten times
faster than numpy on this machine; setuptools builds it as the optional extension `probe._rowdiff` when the
package is installed (`pip install -e .`), and it is loaded here with ctypes. Without it (no C compiler at install
time) the numpy code runs instead, with the same results, and `kernel_note()` says so.

Fields, per row, with a and e widened to float64 and d_i = |a_i - e_i|:
    max_abs, index   the largest d_i and its first index; a NaN d_i ranks above every number
    e_max            max_i |e_i|
    aa, ee, dd, ae   sums of a_i², e_i², (a_i - e_i)², a_i·e_i
    n_mismatch       elements with d_i >= max(atol, rtol·e_max) or NaN, and d_i != 0 (probe/compare.py)
    n_poison         elements of a that still hold the poison pattern (probe/poison.py)
A row whose oracle side holds NaN/Inf is refused by the caller before these are used (e_max is unspecified there).
"""

import ctypes
import importlib.util
from functools import cache

import numpy as np

from probe.poison import is_poison
from probe.tolerance import Tol

KERNEL_VERSION = 1  # = ROWDIFF_VERSION in _rowdiff.c; bump both when the kernel's meaning changes
ROW_SUMS = np.dtype([("max_abs", "f8"), ("e_max", "f8"), ("aa", "f8"), ("ee", "f8"), ("dd", "f8"), ("ae", "f8"),
                     ("index", "i8"), ("n_mismatch", "i8"), ("n_poison", "i8")])  # = row_sums in _rowdiff.c


def row_sums(actual: np.ndarray, expected: np.ndarray, tol: Tol) -> np.ndarray:
    """ROW_SUMS for each row of two float32 [rows, width] arrays of the same shape (the kernel when built)."""
    kernel = _kernel()
    if kernel is None:
        return row_sums_numpy(actual, expected, tol)
    actual, expected = (np.ascontiguousarray(x, dtype=np.float32) for x in (actual, expected))
    rows, width = expected.shape
    out = np.empty(rows, dtype=ROW_SUMS)
    kernel(actual.ctypes.data, expected.ctypes.data, rows, width, tol.rtol, tol.atol, out.ctypes.data)
    return out


def row_sums_numpy(actual: np.ndarray, expected: np.ndarray, tol: Tol) -> np.ndarray:
    """The specification of ROW_SUMS (and the fallback): plain numpy, one row per row of the inputs."""
    a, e = actual.astype(np.float64), expected.astype(np.float64)
    signed = a - e
    d = np.abs(signed)
    rank = np.where(np.isnan(d), np.inf, d)
    rows = np.arange(len(d))
    out = np.empty(len(d), dtype=ROW_SUMS)
    out["index"] = rank.argmax(axis=1) if d.shape[1] else 0
    out["max_abs"] = d[rows, out["index"]] if d.shape[1] else 0.0
    out["e_max"] = np.abs(e).max(axis=1, initial=0.0)
    for field, x, y in (("aa", a, a), ("ee", e, e), ("dd", signed, signed), ("ae", a, e)):
        out[field] = np.einsum("ij,ij->i", x, y)
    limit = np.maximum(tol.atol, tol.rtol * out["e_max"])
    out["n_mismatch"] = np.count_nonzero(~(d < limit[:, None]) & (d != 0), axis=1)  # a NaN counts
    out["n_poison"] = np.count_nonzero(is_poison(actual), axis=1)
    return out


def kernel_note() -> str | None:
    """None when the compiled kernel is in use, else a one-line note for the user."""
    lib, why = _library()
    if lib is not None:
        return None
    return (f"note: the compiled diff kernel (probe._rowdiff) {why}, so rows are compared with numpy, several "
            f"times slower; run `pip install -e .` again (with a C compiler) to build it")


def vector_bytes() -> int:
    """The SIMD width the kernel runs with (16: SSE2/NEON, 32: AVX2); 0 when it is not in use."""
    lib, _ = _library()
    return int(lib.mtp_rowdiff_vector_bytes()) if lib is not None else 0


@cache
def _library() -> tuple[ctypes.CDLL | None, str]:
    """The built kernel, or None and why it is not used (not built; a stale build after the source changed)."""
    spec = importlib.util.find_spec("probe._rowdiff")  # the built extension's path (not imported: no PyInit)
    if spec is None or spec.origin is None:
        return None, "is not built"
    lib = ctypes.CDLL(spec.origin)
    found = (lib.mtp_rowdiff_version(), lib.mtp_rowdiff_struct_bytes()) if hasattr(lib, "mtp_rowdiff_version") \
        else (0, 0)
    if found != (KERNEL_VERSION, ROW_SUMS.itemsize):
        return None, (f"is stale (version {found[0]} with {found[1]}-byte rows; this code needs version "
                      f"{KERNEL_VERSION} with {ROW_SUMS.itemsize}-byte rows)")
    lib.mtp_rowdiff.restype = None
    lib.mtp_rowdiff.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_double,
                                ctypes.c_double, ctypes.c_void_p]
    return lib, ""


def _kernel():
    lib, _ = _library()
    return lib.mtp_rowdiff if lib is not None else None
