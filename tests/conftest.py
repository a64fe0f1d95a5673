"""Shared pytest fixtures; plain constants and helpers live in tests/helpers.py."""

import pytest

from tests.helpers import load_script


@pytest.fixture(scope="session")
def make_fixtures():
    """scripts/make_fixtures.py as a module (write_checkpoint, TINY dims, REF_TOKENS, ...)."""
    return load_script("make_fixtures")


@pytest.fixture(autouse=True)
def _signal_handlers_as_a_fresh_process_has_them():
    """Every test starts with Python's own SIGINT/SIGTERM handlers and leaves them as it found them. A command run
    in-process can set SIG_IGN on its way out (the CLIs ignore interrupts once their outputs are published); left
    behind, it made a later interrupt test see no signal at all and fail at random in the full suite."""
    import signal

    saved = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    yield
    for signum, handler in saved.items():
        signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
