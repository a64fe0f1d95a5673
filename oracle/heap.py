"""Memory for the export's forward, faulted in while the imports run, so the forward does not pay for it.

A batched forward at T=1024 allocates ~1.4 GB of fresh tensors (attention scores, MLP intermediates, the stages):
glibc serves each block over ~32 MB with a fresh mmap and unmaps it when freed, so every page of every such tensor
faults and is zeroed by the kernel inside the forward (340k faults, 0.3-0.65 s of system time on the
Qwen3.5-27B-shaped head). `ReservedHeap` makes glibc serve large blocks from its heap and keep what is freed
(mallopt M_MMAP_MAX=0, M_TRIM_THRESHOLD at its maximum), allocates a block on the calling thread, has another
thread write it (`touch`: the kernel's faults run there, on the core the single-threaded imports leave idle) and
frees it before the forward, whose tensors then reuse those pages and the ones freed by earlier tensors. A chained
export closes it after its chain steps (`close`: glibc's defaults, and what the heap holds free goes back to the
kernel): kept longer, the chain q/k parts' and the draft sweep's blocks of other sizes fragmented it and it grew
past the plain export's peak (Qwen3.5-27B-shaped --chain 4, a memory timeline: peak RSS 2.26 GB kept to the write,
1.88 GB closed after the chain steps with the free pages returned again before the draft sweep, huge pages on).
Huge pages (`enable_huge_pages`) make the faults cheap wherever the heap is not kept.
Values are untouched: this only changes where blocks live. Where glibc's mallopt is missing (another C library),
it does nothing.
"""

import ctypes
import os
import sys

M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
DEFAULTS = {M_MMAP_MAX: 65536, M_TRIM_THRESHOLD: 128 * 1024}  # glibc's (the dynamic threshold is not restored)
KEEP = {M_MMAP_MAX: 0, M_TRIM_THRESHOLD: 2**31 - 1}


THP = "THP_MEM_ALLOC_ENABLE"  # torch's CPU allocator: blocks >= 2 MB 2 MB-aligned and madvise(MADV_HUGEPAGE)


def enable_huge_pages() -> bool:
    """Ask torch's CPU allocator for transparent huge pages (THP_MEM_ALLOC_ENABLE=1), unless the user set the
    variable: one fault per 2 MB instead of per 4 kB page (this VM: ~10 us a fault; 2 GB of fresh tensors 1.79 ->
    0.34 s, the 27B-shaped --chain 4 export's faults 1.0M -> 0.26-0.28M; its peak RSS fell too, with the plain
    export's). Torch reads the variable once, at its first allocation: this works only before `import torch`, so
    the CLI calls it first (oracle/program.py); returns whether it took effect. Where the kernel's THP mode is
    `never` the advice is ignored. Values are untouched."""
    if "torch" in sys.modules:
        return os.environ.get(THP) == "1"
    os.environ.setdefault(THP, "1")
    return os.environ[THP] == "1"


def _libc():
    try:
        libc = ctypes.CDLL(None)
        mallopt, malloc, free, memset, trim = libc.mallopt, libc.malloc, libc.free, libc.memset, libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.restype, trim.argtypes = ctypes.c_int, [ctypes.c_size_t]
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


def return_free_pages() -> None:
    """Give the kernel back what glibc holds free (malloc_trim): even with its defaults, blocks under the mmap
    threshold that are freed below a live one stay in its heap and arenas, where trimming the top never reaches
    them (the chain q/k parts left ~70 MB so, under the draft sweep's peak). A no-op without glibc."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


class ReservedHeap:
    """`reserve = ReservedHeap(n)` on the thread that runs the forward (glibc gives each thread its own arena);
    `reserve.touch()` on another thread; `reserve.release()` once it has returned, before the forward;
    `reserve.close()` once no later work should reuse its pages: glibc's defaults again, and the free pages
    returned (malloc_trim). Closing twice is closing once."""

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
            self.libc.malloc_trim(0)  # the kept free blocks go back to the kernel, not only the heap's top
            self.libc = None
