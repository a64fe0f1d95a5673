"""oracle/heap.py: memory faulted in on another thread serves the next large allocations (glibc only)."""

import os
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
    assert printed_by_a_fresh_process(code, huge=False) > 0.9 * BLOCK / 4096


def printed_by_a_fresh_process(code: str, huge: bool) -> int:
    """The last number `code` prints, run by a fresh interpreter with torch's huge pages asked for or not."""
    env = {k: v for k, v in os.environ.items() if k != heap.THP} | ({heap.THP: "1"} if huge else {})
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          cwd=Path(__file__).parents[2], env=env)
    return int(done.stdout.split()[-1])


def _thp_mode() -> str:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "absent"
    return text[text.index("[") + 1:text.index("]")] if "[" in text else "absent"


@pytest.mark.skipif(_thp_mode() not in ("always", "madvise"), reason="the kernel offers no transparent huge pages")
def test_with_huge_pages_a_fresh_array_faults_once_per_2_mb_not_per_page():
    # what enable_huge_pages asks torch for, before torch is imported (the CLI's order, oracle/program.py)
    code = ("from oracle import heap; import os; os.environ.pop(heap.THP, None); assert heap.enable_huge_pages(); "
            "import tests.oracle.test_heap as t; heap.ReservedHeap(0).close(); print(t.faults_of_a_fresh_array())")
    assert printed_by_a_fresh_process(code, huge=False) < 0.05 * BLOCK / 4096


def test_twin_after_torch_is_imported_huge_pages_are_not_claimed():
    # torch read the variable at its first allocation: setting it now would change nothing, and it says so
    code = ("import torch; from oracle import heap; import os; took = heap.enable_huge_pages(); "
            "assert not took and heap.THP not in os.environ; "
            "import tests.oracle.test_heap as t; heap.ReservedHeap(0).close(); print(t.faults_of_a_fresh_array())")
    assert printed_by_a_fresh_process(code, huge=False) > 0.9 * BLOCK / 4096


def test_a_user_who_turned_huge_pages_off_keeps_them_off():
    code = ("import os; os.environ['THP_MEM_ALLOC_ENABLE'] = '0'; from oracle import heap; "
            "print(int(heap.enable_huge_pages()))")
    assert printed_by_a_fresh_process(code, huge=False) == 0


def test_closing_gives_the_kept_free_pages_back():
    code = ("import torch; from oracle import heap; import tests.oracle.test_heap as t; "
            "r = heap.ReservedHeap(1); r.release(); "
            "x = torch.ones(4 * t.BLOCK, dtype=torch.uint8); y = torch.ones(t.BLOCK, dtype=torch.uint8); del x; "
            "kept = t.rss(); r.close(); print(kept - t.rss())")  # y above x's block: only a trim can return it
    assert printed_by_a_fresh_process(code, huge=False) > 3 * BLOCK


def test_twin_without_the_close_the_kept_pages_stay():
    code = ("import torch; from oracle import heap; import tests.oracle.test_heap as t; "
            "r = heap.ReservedHeap(1); r.release(); "
            "x = torch.ones(4 * t.BLOCK, dtype=torch.uint8); y = torch.ones(t.BLOCK, dtype=torch.uint8); del x; "
            "kept = t.rss(); print(kept - t.rss())")
    assert printed_by_a_fresh_process(code, huge=False) < BLOCK


_FRAGMENTED = ("import numpy as np; from oracle import heap; import tests.oracle.test_heap as t; "
               "heap.ReservedHeap(1).close(); "  # glibc's defaults, as after the export's close
               "blocks = [np.ones(100_000 // 8) for _ in range(t.BLOCK // 100_000)]; last = blocks[-1]; del blocks; "
               "kept = t.rss(); ")  # blocks under the mmap threshold, freed below a live one: no trim of the top


def test_returning_free_pages_gives_back_blocks_freed_inside_the_heap():
    # what the chain q/k parts leave free in glibc's heap and arenas (~70 MB at 27B shape) before the draft sweep
    assert printed_by_a_fresh_process(_FRAGMENTED + "heap.return_free_pages(); print(kept - t.rss())",
                                      huge=False) > 0.8 * BLOCK


def test_twin_without_returning_them_glibc_keeps_them():
    assert printed_by_a_fresh_process(_FRAGMENTED + "print(kept - t.rss())", huge=False) < 0.1 * BLOCK


def rss() -> int:
    """This process's resident bytes now."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_the_reserve_is_twice_the_stage_bytes_of_the_forward():
    dims = Dims(64)
    per_token = sum(s.width(dims) * np.dtype(s.dtype).itemsize for s in STAGES)
    assert heap.forward_bytes(STAGES, dims, 10) == 2 * 10 * per_token > 0
    assert heap.forward_bytes(STAGES, dims, 0) == 0



# --- the export keeps its heap through the chain steps, and gives glibc its defaults back whatever happens -----

def _export_recording(tmp_path, monkeypatch, events: list[str], fail_in: str | None = None) -> None:
    """Run a chained export of the tiny fixture, appending to `events` when the heap is closed, the chains run and
    the trace is written (`fail_in`: that step raises instead)."""
    from oracle import export
    from tests.helpers import TINY

    class Recorded(heap.ReservedHeap):
        def close(self) -> None:
            if self.libc is not None:  # a second close does nothing, and is not an event
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
    monkeypatch.setattr(export, "_chain_qk_parts", recorded("qk_parts", export._chain_qk_parts))
    monkeypatch.setattr(export, "write_trace", recorded("write", export.write_trace))
    export.export_trace(TINY, tmp_path / "t.h5", np.array([1, 2, 3, 4]), export.HiddenSource(seed=0),
                        chain=export.ChainOptions(2))


def test_the_chain_steps_run_on_the_kept_heap_and_it_closes_before_their_q_k_parts(tmp_path, monkeypatch):
    # closed before the chains, their tensors faulted fresh pages again: on this machine's VM ~10 us a page
    # (Qwen3.5-27B-shaped --chain 4, T=169: chains 7.1 -> 5.1 s kept). Kept past them, the q/k parts' and the draft
    # sweep's blocks of other sizes fragmented it: peak RSS 2.26 GB kept to the write, 1.88 GB closed here
    # (with return_free_pages before the sweep and torch's huge pages).
    events = []
    _export_recording(tmp_path, monkeypatch, events)
    assert events == ["chains", "close", "qk_parts", "write"]


def test_twin_a_failing_export_still_closes_its_heap(tmp_path, monkeypatch):
    events = []
    with pytest.raises(RuntimeError, match="chains failed"):
        _export_recording(tmp_path, monkeypatch, events, fail_in="chains")
    assert events == ["chains", "close"] and not (tmp_path / "t.h5").exists()


def test_twin_an_export_failing_after_the_close_closes_once(tmp_path, monkeypatch):
    events = []
    with pytest.raises(RuntimeError, match="qk_parts failed"):
        _export_recording(tmp_path, monkeypatch, events, fail_in="qk_parts")
    assert events == ["chains", "close", "qk_parts"] and not (tmp_path / "t.h5").exists()
