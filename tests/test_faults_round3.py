"""Issue 29, "Faults and bad input" (round 3): the checkpoint changing under an export, sizes files claim, malformed
values, outputs that change what an input means, and the smaller points. Every case runs the real CLI (in a
subprocess where the fault could kill or hang the process) and asserts exit 2, a message naming the file, no
traceback, no leftover, inputs unchanged; each cause has its honest twin."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

import oracle.cli
import probe.cli
from oracle.checkpoint import Checkpoint
from tests.helpers import FIXTURES, ROOT, TINY, TINY_REF, run_cli
from tests.test_bad_inputs import assert_refused, checkpoint_copy, digests, leftovers

MOE = FIXTURES / "qwen3_5_moe_tiny"
TOKENS = "17,42,3,255"


def run_program(args, timeout=120, env=None, code=None) -> subprocess.CompletedProcess:
    """`python -c code args` (default: the mtp-oracle CLI as the program), in a subprocess: a fault that kills or
    hangs the process fails this test, not the suite."""
    code = code or "import sys; from oracle.cli import main; main()"
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=env)


def assert_exit_2(result, pattern, *dirs):
    out = result.stdout + result.stderr
    assert result.returncode == 2, out
    assert "Traceback" not in out, out
    assert pattern in out, out
    assert not leftovers(*dirs), leftovers(*dirs)


# --- cause 2: the digest vouches for the bytes used; a checkpoint cut short is exit 2, not SIGBUS --------------

# A fault injected at a named moment of a real export (the CLI as the program): "before-read" just before the
# head's bytes are read, "after-forward" once the stages are computed. "truncate" halves the shard, "rewrite"
# overwrites the head's first tensor in place (same size, so only the bytes and the times change).
_FAULT_DRIVER = """
import os, sys
from pathlib import Path
import oracle.checkpoint, oracle.export
shard, when, how = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
def fault():
    if how == "truncate":
        os.truncate(shard, shard.stat().st_size // 2)
    elif how == "rewrite":
        entry = min(oracle.checkpoint._read_safetensors_header(shard).values(), key=lambda e: e.offset)
        with open(shard, "r+b") as f:
            f.seek(entry.offset)
            f.write(b"\\x3f" * entry.nbytes)
def wrap(owner, name):
    real = getattr(owner, name)
    def hooked(*a, **k):
        if when == "before-read" and name == "check_head":
            out = real(*a, **k); fault(); return out
        if when == "after-forward" and name == "check_finite_reference":
            fault()
        return real(*a, **k)
    setattr(owner, name, hooked)
wrap(oracle.checkpoint.Checkpoint, "check_head")
wrap(oracle.export, "check_finite_reference")
from oracle.cli import main
main(sys.argv[4:])
"""


def _export_with_fault(ckpt: Path, out: Path, when: str, how: str):
    return run_program([ckpt / "model.safetensors", when, how, "export", ckpt, "--out", out, "--tokens", TOKENS,
                        "--hidden-seed", "0", "-q"], code=_FAULT_DRIVER)


@pytest.mark.parametrize("source, when", [(TINY, "before-read"), (TINY, "after-forward"), (MOE, "before-read")],
                         ids=["dense-before-read", "dense-after-forward", "moe-before-read"])
def test_a_checkpoint_cut_short_during_an_export_is_exit_2_naming_the_shard(tmp_path, source, when):
    ckpt = checkpoint_copy(tmp_path, source)
    result = _export_with_fault(ckpt, tmp_path / "ref.h5", when, "truncate")
    assert result.returncode != -7, "SIGBUS: a mapped page past the new end of the shard was read"
    assert_exit_2(result, str(ckpt / "model.safetensors"), tmp_path)
    assert not (tmp_path / "ref.h5").exists()


@pytest.mark.parametrize("when", ["before-read", "after-forward"])
def test_a_checkpoint_rewritten_in_place_during_an_export_is_refused(tmp_path, when):
    ckpt = checkpoint_copy(tmp_path)
    result = _export_with_fault(ckpt, tmp_path / "ref.h5", when, "rewrite")
    assert_exit_2(result, "changed while it was being read", tmp_path)
    assert not (tmp_path / "ref.h5").exists()


def test_twin_an_undisturbed_export_records_the_digest_of_the_checkpoint(tmp_path):
    ckpt = checkpoint_copy(tmp_path)
    result = _export_with_fault(ckpt, tmp_path / "ref.h5", "none", "none")
    assert result.returncode == 0, result.stdout + result.stderr
    with h5py.File(tmp_path / "ref.h5") as f:
        recorded = f.attrs["checkpoint_digest"]
    assert (recorded.decode() if isinstance(recorded, bytes) else recorded) == Checkpoint(ckpt).head_digest()


def _sha256_of(weights) -> str:
    """Checkpoint.digest's formula over the arrays the head is built from."""
    digest = hashlib.sha256()
    for name in sorted(weights.layout.dense):
        stored = weights.tensors[name]
        digest.update(f"{name}|{weights.dtypes[name]}|{list(stored.shape)}|".encode())
        digest.update(np.ascontiguousarray(stored).tobytes())
    return "sha256:" + digest.hexdigest()


def test_the_digest_is_of_the_bytes_the_head_is_built_from_even_if_the_file_changes(tmp_path):
    """The head's arrays are the bytes that were hashed: rewriting the shard afterwards (in place, same size)
    changes neither them nor the digest; it changes the file's own digest and is seen by check_unchanged."""
    ckpt_dir = checkpoint_copy(tmp_path)
    ckpt = Checkpoint(ckpt_dir)
    weights = ckpt.read_head(widen=False, digest=True)
    before = {n: np.array(a) for n, a in weights.tensors.items() if n in weights.layout.dense}
    shard = ckpt_dir / "model.safetensors"
    entry = ckpt.entry(sorted(weights.layout.dense)[0])
    with open(shard, "r+b") as f:
        f.seek(entry.offset)
        f.write(b"\x3f" * entry.nbytes)
    assert _sha256_of(weights) == weights.digest  # the bytes used are the bytes hashed
    for name, values in before.items():
        np.testing.assert_array_equal(weights.tensors[name], values, err_msg=name)
    assert ckpt.head_digest() == weights.digest  # what this Checkpoint read
    assert Checkpoint(ckpt_dir).head_digest() != weights.digest  # the file now holds other bytes
    with pytest.raises(Exception, match="changed while it was being read"):
        ckpt.check_unchanged()


def test_twin_an_unchanged_checkpoint_passes_check_unchanged(tmp_path):
    ckpt = Checkpoint(checkpoint_copy(tmp_path))
    ckpt.read_head(widen=False, digest=True)
    ckpt.check_unchanged()
