"""Shared pytest fixtures; plain constants and helpers live in tests/helpers.py."""

import pytest

from tests.helpers import TINY, TINY_REF, TINY_SHARDED, load_script, run_cli  # noqa: F401  (re-exported)


@pytest.fixture(scope="session")
def make_fixtures():
    """scripts/make_fixtures.py as a module (write_checkpoint, TINY dims, REF_TOKENS, ...)."""
    return load_script("make_fixtures")
