"""Fixtures for the probe's tests."""

import pytest


@pytest.fixture(scope="session", autouse=True)
def digest_memo_in_a_scratch_folder(tmp_path_factory):
    """C-library runs remember head digests under $MTP_PROBE_CACHE (probe/adapters/digest_cache.py): the tests' go to
    a scratch folder, never the user's ~/.cache (the worker processes inherit the environment)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MTP_PROBE_CACHE", str(tmp_path_factory.mktemp("mtp-probe-cache")))
        yield


@pytest.fixture(scope="session")
def chained(tmp_path_factory):
    """(reference path, depth-1 stages with the draft, {j: depth-j stages}, inputs) of a chain reference: T = 10,
    depths 2..4 (tests/probe/chain_reference.py chain_reference)."""
    import h5py

    from tests.probe.chain_reference import chain_reference
    from tests.probe.tracekit import load_trace

    path = chain_reference(tmp_path_factory.mktemp("chain") / "ref.h5", 4)
    inputs, stages = load_trace(path)
    with h5py.File(path) as f:
        depths = {j: {n: f[f"chain/d{j}/stages/{n}"][()] for n in f[f"chain/d{j}/stages"]} for j in range(2, 5)}
    return path, stages, depths, inputs
