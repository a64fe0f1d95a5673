"""Memory for the export's forward, faulted in while the imports run, so the forward does not pay for it.

A batched forward at T=1024 allocates ~1.4 GB of fresh tensors (attention scores, MLP intermediates, the stages):
glibc serves each block over ~32 MB with a fresh mmap and unmaps it when freed, so every page of every such tensor
faults and is zeroed by the kernel inside the forward (340k faults, 0.3-0.65 s of system time on the
Qwen3.5-27B-shaped head). `ReservedHeap` makes glibc serve large blocks from its heap and keep what is freed
(mallopt M_MMAP_MAX=0, M_TRIM_THRESHOLD at its maximum), allocates a block on the calling thread, has another
thread write it (`touch`: the kernel's faults run there, on the core the single-threaded imports leave idle) and
frees it before the forward, whose tensors then reuse those pages and the ones freed by earlier tensors; the export
keeps these settings until its trace is written (its chains, drafts and evidence reuse the pages too).
Values are untouched: this only changes where blocks live. Where glibc's mallopt is missing (another C library),
it does nothing.
"""

import ctypes

M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
DEFAULTS = {M_MMAP_MAX: 65536, M_TRIM_THRESHOLD: 128 * 1024}  # glibc's (the dynamic threshold is not restored)
KEEP = {M_MMAP_MAX: 0, M_TRIM_THRESHOLD: 2**31 - 1}


def _libc():
    try:
        libc = ctypes.CDLL(None)
        mallopt, malloc, free, memset = libc.mallopt, libc.malloc, libc.free, libc.memset
    except (OSError, AttributeError):
        return None
    malloc.restype, malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    free.argtypes = [ctypes.c_void_p]
    memset.restype, memset.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return libc


def forward_bytes(stage_list, dims, num_tokens: int) -> int:
    """What to reserve for a forward of `num_tokens` steps: twice its stages' bytes (the stages stay alive until the
    trace is written; the intermediates alive beside them, MLP and attention, are of the same order). A lower
    bound of the forward's own peak, so reserving it does not raise the export's peak RSS."""
    import numpy as np

    return 2 * num_tokens * sum(s.width(dims) * np.dtype(s.dtype).itemsize for s in stage_list)


class ReservedHeap:
    """`reserve = ReservedHeap(n)` on the thread that runs the forward (glibc gives each thread its own arena);
    `reserve.touch()` on another thread; `reserve.release()` once it has returned, before the forward;
    `reserve.close()` after the forward: glibc's defaults again."""

    def __init__(self, nbytes: int) -> None:
        self.libc = _libc()
        self.block = None
        if self.libc is None or nbytes <= 0:
            return
        for option, value in KEEP.items():
            self.libc.mallopt(option, value)
        self.nbytes = nbytes
        self.block = self.libc.malloc(nbytes)  # heap address space only: no page is touched yet

    def touch(self) -> None:
        """Fault every page in (ctypes releases the GIL for the call: the imports go on)."""
        if self.block:
            self.libc.memset(self.block, 0, self.nbytes)

    def release(self) -> None:
        """Give the block back to glibc, which keeps it (and its faulted pages) for the next allocations."""
        if self.block:
            self.libc.free(self.block)
        self.block = None

    def close(self) -> None:
        self.release()
        if self.libc is not None:
            for option, value in DEFAULTS.items():
                self.libc.mallopt(option, value)
            self.libc = None
