"""Fixtures for the probe's tests."""

import pytest


@pytest.fixture(scope="session", autouse=True)
def digest_memo_in_a_scratch_folder(tmp_path_factory):
    """C-library runs remember head digests under $MTP_PROBE_CACHE (probe/adapters/digest_cache.py): the tests' go to
    a scratch folder, never the user's ~/.cache (the worker processes inherit the environment)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MTP_PROBE_CACHE", str(tmp_path_factory.mktemp("mtp-probe-cache")))
        yield
