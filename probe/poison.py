"""The poison pattern: how an engine's capture buffers prove that every row was written.

For engine authors: before running the steps, fill every capture buffer (each `[T, width]` float32 stage buffer,
C ABI or raw `<stage>.bin`) with the 32-bit pattern POISON_BITS = 0x7FDEAD00. It is a quiet float32 NaN whose
payload (0x5EAD00) arithmetic never produces: computed NaNs are the canonical 0x7FC00000 / 0xFFC00000. An element
that still holds exactly these bits afterwards was never written, and `mtp-probe diff` reports its row as
unwritten (verdict invalid, exit 2) instead of as a divergence. A NaN the engine computed is a divergence (exit 1).

    C:      uint32_t p = 0x7FDEAD00u; for (i = 0; i < n; i++) memcpy(&buf[i], &p, 4);
    numpy:  buf = probe.poison.poison((T, width))
"""

import numpy as np

POISON_BITS = 0x7FDEAD00


def poison(shape: int | tuple[int, ...]) -> np.ndarray:
    """A float32 array of `shape` filled with the poison pattern."""
    return np.full(shape, POISON_BITS, dtype=np.uint32).view(np.float32)


def is_poison(arr: np.ndarray) -> np.ndarray:
    """Boolean mask of the elements of a float32 array that still hold the poison pattern, bit for bit."""
    # NaN != NaN, so only the bit pattern can tell poison from a computed NaN.
    return np.ascontiguousarray(arr, dtype=np.float32).view(np.uint32) == POISON_BITS
