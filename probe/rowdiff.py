"""The compiled kernel of the tolerance rule's per-row sums (probe/_rowdiff.c), loaded with ctypes.

The rule, its numpy specification and the fields are in probe/rule.py (`RULE`); this module only finds the
kernel and calls it. The kernel computes the same fields as the specification in one pass, about ten times faster
than numpy on this machine; setuptools builds it as the optional extension `probe._rowdiff` when the package is
installed (`pip install -e .`). Without it (no C compiler at install time) `RULE` runs the specification instead,
with the same results, and `kernel_note()` says so.
"""

import ctypes
import importlib.util
from functools import cache

import numpy as np

from probe.tolerance import Tol

KERNEL_VERSION = 1  # = ROWDIFF_VERSION in _rowdiff.c; bump both when the kernel's meaning changes
ROW_SUMS = np.dtype([("max_abs", "f8"), ("e_max", "f8"), ("aa", "f8"), ("ee", "f8"), ("dd", "f8"), ("ae", "f8"),
                     ("index", "i8"), ("n_mismatch", "i8"), ("n_poison", "i8")])  # = row_sums in _rowdiff.c


def kernel_sums(actual: np.ndarray, expected: np.ndarray, tol: Tol) -> np.ndarray | None:
    """ROW_SUMS (probe/rule.py) of each row of two float32 [rows, width] arrays of one shape; None when the
    kernel is not in use."""
    kernel = _kernel()
    if kernel is None:
        return None
    actual, expected = (np.ascontiguousarray(x, dtype=np.float32) for x in (actual, expected))
    rows, width = expected.shape
    out = np.empty(rows, dtype=ROW_SUMS)
    kernel(actual.ctypes.data, expected.ctypes.data, rows, width, tol.rtol, tol.atol, out.ctypes.data)
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
