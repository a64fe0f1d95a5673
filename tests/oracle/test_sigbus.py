"""oracle/sigbus.py: a SIGBUS in a guarded mapping (a shard cut short while mapped) is exit 2 naming the file; any
other SIGBUS is left to the handler that was there before (here: the default, which kills the process)."""

import subprocess
import sys

import pytest

from oracle import sigbus
from tests.helpers import ROOT

pytestmark = pytest.mark.skipif(not sigbus.available(), reason="needs glibc on 64-bit Linux")

# A file mapped, cut to one page, then a page past its new end touched: by numpy holding the GIL, by a torch matmul
# (its OpenMP workers, GIL released) or by hashlib on another thread.
_TOUCH = """
import hashlib, mmap, os, sys, threading
import numpy as np, torch
from oracle import sigbus
path, how, guarded = sys.argv[1], sys.argv[2], sys.argv[3] == "guarded"
np.ones(1 << 20, dtype=np.float32).tofile(path)
mapping = mmap.mmap(os.open(path, os.O_RDONLY), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
view = np.frombuffer(mapping, dtype=np.float32)
assert sigbus.available()
if guarded:
    sigbus.guard(view.ctypes.data, view.nbytes, path)
os.truncate(path, 4096)
if how == "numpy":
    print(float(view.sum()))
elif how == "torch":
    print(float(torch.nn.functional.linear(torch.ones(8, 1024), torch.from_numpy(view.reshape(1024, 1024))).sum()))
else:
    worker = threading.Thread(target=lambda: hashlib.sha256(mapping).hexdigest())
    worker.start()
    worker.join()
print("survived")
"""


def _touch(tmp_path, how: str, guarded: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _TOUCH, str(tmp_path / "shard.bin"), how, guarded], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("how", ["numpy", "torch", "thread"])
def test_a_page_past_the_end_of_a_guarded_mapping_is_exit_2_naming_the_file(tmp_path, how):
    result = _touch(tmp_path, how, "guarded")
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert sigbus.message(str(tmp_path / "shard.bin")) in result.stderr
    assert "Traceback" not in result.stderr and "survived" not in result.stdout


def test_twin_a_mapping_nobody_guarded_still_dies_of_sigbus(tmp_path):
    # the handler is installed (available() above) but the range is not registered: the default action runs
    result = _touch(tmp_path, "numpy", "unguarded")
    assert result.returncode == -7, (result.returncode, result.stderr)
    assert "cut short" not in result.stderr


def test_unguarded_ranges_are_forgotten():
    key = sigbus.guard(4096, 4096, "/x")
    assert sigbus._owner(4096 + 100) == "/x"
    sigbus.unguard(key)
    assert sigbus._owner(4096 + 100) is None
