"""Shared pytest fixtures; plain constants and helpers live in tests/helpers.py."""

import pytest

from tests.helpers import load_script


@pytest.fixture(scope="session")
def make_fixtures():
    """scripts/make_fixtures.py as a module (write_checkpoint, TINY dims, REF_TOKENS, ...)."""
    return load_script("make_fixtures")
