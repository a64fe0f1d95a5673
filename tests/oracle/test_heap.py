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



# --- the export keeps its heap until the trace is written, and gives glibc its defaults back whatever happens ------

def _export_recording(tmp_path, monkeypatch, events: list[str], fail_in: str | None = None) -> None:
    """Run a chained export of the tiny fixture, appending to `events` when the heap is closed, the chains run and
    the trace is written (`fail_in`: that step raises instead)."""
    from oracle import export
    from tests.helpers import TINY

    class Recorded(heap.ReservedHeap):
        def close(self) -> None:
            events.append("close")
            super().close()

    def recorded(name, real):
        def run(*args, **kwargs):
            events.append(name)
            if name == fail_in:
                raise RuntimeError(f"{name} failed (the test's fault)")
            return real(*args, **kwargs)
        return run

    monkeypatch.setattr(export, "ReservedHeap", Recorded)
    monkeypatch.setattr(export, "_chain_records", recorded("chains", export._chain_records))
    monkeypatch.setattr(export, "write_trace", recorded("write", export.write_trace))
    export.export_trace(TINY, tmp_path / "t.h5", np.array([1, 2, 3, 4]), export.HiddenSource(seed=0),
                        chain=export.ChainOptions(2))


def test_the_chains_and_the_write_run_on_the_kept_heap(tmp_path, monkeypatch):
    # closed before the chains, their tensors (and the draft sweep's) faulted fresh pages again: on this machine's
    # VM ~10 us a page (Qwen3.5-27B-shaped --chain 4, T=169: chains 7.1 -> 5.1 s, drafts 4.6 -> 3.2 s)
    events = []
    _export_recording(tmp_path, monkeypatch, events)
    assert events == ["chains", "write", "close"]


def test_twin_a_failing_export_still_closes_its_heap(tmp_path, monkeypatch):
    events = []
    with pytest.raises(RuntimeError, match="chains failed"):
        _export_recording(tmp_path, monkeypatch, events, fail_in="chains")
    assert events == ["chains", "close"] and not (tmp_path / "t.h5").exists()
