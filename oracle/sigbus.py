"""A shard cut short while the process reads it through a mapping: exit 2 naming the shard, never a bare SIGBUS.

Why mappings at all: the export reads the head's dense tensors from the page cache through a mapping
(Checkpoint(map_dense=True)) rather than copying them into private memory with pread. A private copy faults in
fresh pages, and on a VM that hands freed memory back to its host (free page reporting) a fresh page costs
~10 us: 0.4 GB/s, measured here, against 10-25 GB/s for mapping pages the page cache already holds
(Step-3.7-Flash-shaped head, 1.7 GB of bf16 layers: 4.9 s of pread against 0.1-0.3 s).

What a mapping risks: a page past the end of a file truncated meanwhile raises SIGBUS when touched, which by
default kills the process (exit -7, no message). `guard(view, path)` registers the address range of a mapping;
the first call installs a SIGBUS handler (sigaction with SA_SIGINFO, through ctypes) that looks the faulting
address up. Inside a registered range it prints what happened and what to do, removes the command's temporary
outputs (oracle/output.py remove_pending) and ends the process with exit 2; any other SIGBUS goes to the handler
that was there before (faulthandler's, or the default), as if this one did not exist.

The handler is a ctypes callback: it runs on the faulting thread (the main thread, an OpenMP worker of a torch
matmul, or the thread hashing the head) and takes the GIL first, which every such thread can: torch and hashlib
release it around the work that touches the mapping, and a thread that holds it takes it again at no cost.

`available()` is False where the C library or the platform's struct layout is not the one written here (glibc on
64-bit Linux); the export then reads with pread as before. A shard rewritten in place, not cut, is seen by
Checkpoint.check_unchanged (its ctime changes whatever the writer does), before anything is written.
"""

import ctypes
import itertools
import os
import platform
import signal
import sys
import threading

SA_SIGINFO = 4
_SUPPORTED = sys.platform == "linux" and platform.machine() in ("x86_64", "aarch64") and ctypes.sizeof(
    ctypes.c_void_p) == 8


class _SigInfo(ctypes.Structure):  # the head of glibc's siginfo_t on 64-bit Linux: si_addr at offset 16
    _fields_ = [("si_signo", ctypes.c_int), ("si_errno", ctypes.c_int), ("si_code", ctypes.c_int),
                ("_pad", ctypes.c_int), ("si_addr", ctypes.c_void_p)]


class _SigAction(ctypes.Structure):  # glibc's struct sigaction (sigset_t: 1024 bits)
    _fields_ = [("sa_handler", ctypes.c_void_p), ("sa_mask", ctypes.c_ulong * 16), ("sa_flags", ctypes.c_int),
                ("sa_restorer", ctypes.c_void_p)]


_HANDLER_TYPE = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.POINTER(_SigInfo), ctypes.c_void_p)

_lock = threading.Lock()
_keys = itertools.count()
_ranges: dict[int, tuple[int, int, str]] = {}  # id -> (first address, past the last, shard path)
_state: dict = {}  # libc, the handler kept alive, the previous action


def _libc():
    if not _SUPPORTED:
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.sigaction.argtypes = [ctypes.c_int, ctypes.POINTER(_SigAction), ctypes.POINTER(_SigAction)]
        libc.sigaction.restype = ctypes.c_int
        return libc
    except (OSError, AttributeError):
        return None


def available() -> bool:
    """Whether a SIGBUS in a guarded mapping can be turned into exit 2 here (installs the handler once)."""
    with _lock:
        if "installed" not in _state:
            _state["installed"] = _install()
        return _state["installed"]


def _install() -> bool:
    libc = _libc()
    if libc is None:
        return False
    handler = _HANDLER_TYPE(_on_sigbus)
    action, previous = _SigAction(), _SigAction()
    action.sa_handler = ctypes.cast(handler, ctypes.c_void_p).value
    action.sa_flags = SA_SIGINFO
    if libc.sigaction(signal.SIGBUS, ctypes.byref(action), ctypes.byref(previous)) != 0:
        return False
    _state.update(libc=libc, handler=handler, previous=previous)
    return True


def guard(address: int, nbytes: int, path: str) -> int:
    """Register [address, address + nbytes) as a mapping of `path`; returns the key `unguard` takes."""
    with _lock:
        key = next(_keys)
        _ranges[key] = (address, address + nbytes, str(path))
    return key


def unguard(key: int) -> None:
    with _lock:
        _ranges.pop(key, None)


def _owner(address: int) -> str | None:
    for start, stop, path in list(_ranges.values()):
        if start <= address < stop:
            return path
    return None


def message(path: str) -> str:
    return (f"Error: {path} was cut short while it was being read (a page of its tensors lies past the file's new "
            f"end). Re-copy the shard and run again once nothing writes to the checkpoint.")


def _on_sigbus(signum: int, info, context) -> None:
    path = _owner(info.contents.si_addr or 0) if info else None
    if path is None:  # not ours: the previous action, which the faulting instruction then meets again
        _state["libc"].sigaction(signal.SIGBUS, ctypes.byref(_state["previous"]), None)
        return
    try:
        os.write(2, ("\n" + message(path) + "\n").encode())
        from oracle.output import remove_pending

        remove_pending()  # the command's temporary files (never raises)
    finally:
        os._exit(2)
