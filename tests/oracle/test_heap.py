"""oracle/heap.py: memory faulted in on another thread serves the next large allocations (glibc only)."""

import resource
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch  # imported before any reserve: an import's own allocations would take the block

from oracle import heap
from oracle.stages import STAGES, Dims

BLOCK = 48 << 20  # above glibc's largest mmap threshold (32 MB): by default always a fresh, faulting mmap

pytestmark = pytest.mark.skipif(heap._libc() is None, reason="needs glibc's mallopt")


def faults_of_a_fresh_array() -> int:
    """Faults while a fresh torch tensor of BLOCK bytes is written (as the forward's tensors are: numpy would ask
    for huge pages itself)."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    tensor = torch.empty(BLOCK, dtype=torch.uint8)
    tensor.fill_(1)
    del tensor
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def test_a_reserved_block_touched_on_another_thread_serves_the_next_allocation_without_faults():
    reserve = heap.ReservedHeap(BLOCK + (8 << 20))
    try:
        toucher = threading.Thread(target=reserve.touch)
        toucher.start()
        toucher.join()
        reserve.release()
        assert faults_of_a_fresh_array() < 0.05 * BLOCK / 4096
    finally:
        reserve.close()


def test_without_the_reserve_the_same_allocation_faults_every_page():
    # the twin, in a fresh process (here, a block freed by another test would serve it)
    code = ("import tests.oracle.test_heap as t; from oracle import heap; heap.ReservedHeap(0).close(); "
            "print(t.faults_of_a_fresh_array())")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          cwd=Path(__file__).parents[2])
    assert int(done.stdout.split()[-1]) > 0.9 * BLOCK / 4096


def test_the_reserve_is_twice_the_stage_bytes_of_the_forward():
    dims = Dims(64)
    per_token = sum(s.width(dims) * np.dtype(s.dtype).itemsize for s in STAGES)
    assert heap.forward_bytes(STAGES, dims, 10) == 2 * 10 * per_token > 0
    assert heap.forward_bytes(STAGES, dims, 0) == 0
