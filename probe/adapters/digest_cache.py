"""A checkpoint's head digest, remembered between runs of a C library (probe/adapters/cabi_worker.py).

The digest (oracle/checkpoint.py `head_digest`, sha256 over every dense head tensor) is what proves that the library
was handed the weights the reference was exported from. At Qwen3.5-27B scale it hashes 850 MB: ~0.6 s of a core
that, beside the library's single-threaded steps on a 2-core machine, slowed those steps by about as much. A user
iterating on a kernel reruns the same checkpoint, so the digest is stored under a key that changes whenever the bytes
it covers can have changed:

    the checkpoint's resolved path; every dense head tensor's name, dtype, shape, file and byte range (so a new
    index or header is a new key); each of those files' device, inode, size, mtime and ctime (a rewrite in place
    changes the ctime, which no user tool sets back; a copy or a replaced file is a new inode); and the bytecode of
    the digest functions themselves (a changed definition is a new key).

A file changed within the last SETTLED_NS is never remembered (a write in the same timestamp tick could leave mtime
and ctime as they were: git's "racily clean" case), nor a digest whose files changed while it was being computed.
The store is `$MTP_PROBE_CACHE` (or ~/.cache/mtp-probe), as for GGUF checkpoints, one small file per key written
atomically; anything unreadable there is ignored and the head is hashed, so the memo can only save time.
"""

import hashlib
import json
import os
import re
import time
from pathlib import Path

from oracle.checkpoint import Checkpoint
from oracle.errors import CheckpointError
from oracle.gguf_source import cache_base

SETTLED_NS = 2_000_000_000  # files changed more recently than this are hashed every time
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
_CODE = hashlib.sha256(Checkpoint.head_digest.__code__.co_code + Checkpoint.digest.__code__.co_code).hexdigest()


def cache_dir() -> Path:
    """OSError where there is no cache folder (HOME unset): the digest is then computed, only not remembered."""
    try:
        return cache_base() / "head-digests"
    except CheckpointError as err:
        raise OSError(str(err)) from None


def remembered_digest(ckpt: Checkpoint) -> str | None:
    """The head digest stored for exactly these bytes, or None (never stored, or anything unreadable)."""
    return _lookup(_key(ckpt)[0])


def head_digest(ckpt: Checkpoint) -> str:
    """ckpt.head_digest(), from the store when these exact bytes were hashed before; else computed and stored
    (when the files are settled and did not change meanwhile)."""
    key, newest = _key(ckpt)
    remembered = _lookup(key)
    if remembered is not None:
        return remembered
    digest = ckpt.head_digest()
    if _key(ckpt)[0] == key and time.time_ns() - newest > SETTLED_NS:
        _store(key, digest)
    return digest


def _lookup(key: str) -> str | None:
    try:
        text = (cache_dir() / f"{key}.txt").read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return text if _DIGEST.fullmatch(text) else None


def _key(ckpt: Checkpoint) -> tuple[str, int]:
    """(the key of the bytes head_digest covers, the newest mtime/ctime of their files in ns)."""
    entries = [ckpt.entry(name) for name in sorted(ckpt.layout().dense)]
    stats = {str(file): os.stat(file) for file in sorted({e.file for e in entries})}
    record = {"code": _CODE, "checkpoint": str(Path(ckpt.path).resolve()),
              "tensors": [[e.name, e.dtype, list(e.shape), str(e.file), e.offset, e.nbytes] for e in entries],
              "files": {f: [s.st_dev, s.st_ino, s.st_size, s.st_mtime_ns, s.st_ctime_ns] for f, s in stats.items()}}
    newest = max((max(s.st_mtime_ns, s.st_ctime_ns) for s in stats.values()), default=0)
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest(), newest


def _store(key: str, digest: str) -> None:
    try:
        folder = cache_dir()
    except OSError:  # no cache folder at all (HOME unset): nothing is remembered
        return
    tmp = folder / f".{key}.tmp-{os.getpid()}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp.write_text(digest + "\n")
        os.replace(tmp, folder / f"{key}.txt")
    except OSError:  # a read-only or full cache folder: the digest is still right, only not remembered
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
