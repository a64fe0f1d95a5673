"""The head digest remembered between C-library runs (probe/adapters/digest_cache.py): it is the checkpoint's own
head_digest, given without hashing for the same bytes, and recomputed whenever those bytes may have changed: a
shard rewritten in place even with its mtime put back, a file written moments ago, an unreadable memo."""

import os
import shutil

import pytest

from oracle.checkpoint import Checkpoint
from probe.adapters import digest_cache
from tests.helpers import TINY

SHARD = "model.safetensors"


@pytest.fixture
def ckpt_dir(tmp_path, monkeypatch):
    """A copy of the tiny checkpoint, its files counted as settled, and an empty store."""
    monkeypatch.setenv("MTP_PROBE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(digest_cache, "SETTLED_NS", 0)
    return shutil.copytree(TINY, tmp_path / "ckpt")


def no_hashing(monkeypatch):
    def refuse(self):
        raise AssertionError("hashed although remembered")

    monkeypatch.setattr(Checkpoint, "head_digest", refuse)


def test_the_digest_is_remembered_for_the_same_bytes(ckpt_dir, monkeypatch):
    truth = Checkpoint(ckpt_dir).head_digest()
    assert digest_cache.remembered_digest(Checkpoint(ckpt_dir)) is None
    assert digest_cache.head_digest(Checkpoint(ckpt_dir)) == truth
    no_hashing(monkeypatch)
    assert digest_cache.head_digest(Checkpoint(ckpt_dir)) == truth
    assert digest_cache.remembered_digest(Checkpoint(ckpt_dir)) == truth


def test_a_shard_rewritten_in_place_with_its_mtime_put_back_is_hashed_again(ckpt_dir):
    """Twin: same path, size and mtime, other bytes: the ctime changed, so the memo does not answer."""
    before = digest_cache.head_digest(Checkpoint(ckpt_dir))
    shard = ckpt_dir / SHARD
    stat = shard.stat()
    entry = Checkpoint(ckpt_dir).entry("mtp.fc.weight")
    with open(shard, "r+b") as f:  # flip one byte of a head tensor
        f.seek(entry.offset)
        byte = f.read(1)
        f.seek(entry.offset)
        f.write(bytes([byte[0] ^ 0x40]))
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert shard.stat().st_mtime_ns == stat.st_mtime_ns and shard.stat().st_size == stat.st_size
    assert digest_cache.remembered_digest(Checkpoint(ckpt_dir)) is None
    after = digest_cache.head_digest(Checkpoint(ckpt_dir))
    assert after != before and after == Checkpoint(ckpt_dir).head_digest()


def test_files_written_moments_ago_are_not_remembered(ckpt_dir, monkeypatch):
    monkeypatch.setattr(digest_cache, "SETTLED_NS", 3600 * 10**9)  # everything counts as just written
    assert digest_cache.head_digest(Checkpoint(ckpt_dir)) == Checkpoint(ckpt_dir).head_digest()
    assert digest_cache.remembered_digest(Checkpoint(ckpt_dir)) is None


def test_an_unreadable_memo_is_ignored_and_an_unwritable_store_costs_nothing(ckpt_dir, tmp_path, monkeypatch):
    truth = digest_cache.head_digest(Checkpoint(ckpt_dir))
    (memo,) = digest_cache.cache_dir().iterdir()
    memo.write_text("sha256:not-a-digest\n")
    assert digest_cache.remembered_digest(Checkpoint(ckpt_dir)) is None
    assert digest_cache.head_digest(Checkpoint(ckpt_dir)) == truth  # hashed again, and stored again
    assert memo.read_text().strip() == truth
    blocked = tmp_path / "file"
    blocked.write_text("")
    monkeypatch.setenv("MTP_PROBE_CACHE", str(blocked))  # the store would have to be under a plain file
    assert digest_cache.head_digest(Checkpoint(ckpt_dir)) == truth
