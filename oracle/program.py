"""The programs' entry points ([project.scripts] in pyproject.toml; `python -m oracle`): an interrupt ends the
program quietly from its first instruction on.

Until `MtpGroup.main` (oracle/errors.py) installs the handler that also removes unfinished outputs, the imports of
click, numpy and h5py take a while, and a SIGINT there was Python's default: a KeyboardInterrupt traceback and exit
1 ("diverged"). This module imports only what the interpreter has already loaded (`_signal` is the C half of
`signal`, whose import alone takes tens of milliseconds), so the guard is in place at once. Only the interpreter's
own start-up (before any of this runs) keeps Python's defaults."""

import _signal
import os

_GUARDED = {_signal.SIGINT: "SIGINT", _signal.SIGTERM: "SIGTERM"}


def _ended_while_starting(signum, frame) -> None:
    """Nothing has been written yet: say so and end with 128 + signal, as the CLIs' own handler does."""
    os.write(2, f"\nInterrupted ({_GUARDED.get(signum, signum)}) while starting; nothing was written.\n".encode())
    os._exit(128 + signum)


def guard_start() -> None:
    """Install `_ended_while_starting` for SIGINT and SIGTERM (but where the parent set them to be ignored)."""
    for signum in _GUARDED:
        if _signal.getsignal(signum) is not _signal.SIG_IGN:
            _signal.signal(signum, _ended_while_starting)


def oracle_main() -> None:
    """`mtp-oracle`."""
    guard_start()
    from oracle.heap import enable_huge_pages

    enable_huge_pages()  # before anything imports torch, which reads it once (oracle/heap.py)
    from oracle.cli import main

    main()
