"""Convention 5: every adapter meets one contract on the tiny fixture — a dict keyed by stage names, float32
arrays of the declared shapes, the weights digest of the reference's checkpoint, and two runs bit-identical
unless the adapter declares itself non-deterministic."""

import shutil
import subprocess

import numpy as np
import pytest

from oracle.stages import STAGE_BY_NAME, STAGE_NAMES
from oracle.trace import read_trace
from probe.adapters.cabi import CAbiAdapter, build_library
from probe.run import adapter_from_spec
from tests.helpers import ROOT, TINY, TINY_REF

CANDIDATES = ROOT / "fixtures" / "candidates"


def _gpu() -> bool:
    try:
        return subprocess.run(["nvidia-smi", "-L"], capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _c_adapter(tmp_path, source="mtp_step.c"):
    return CAbiAdapter(build_library(CANDIDATES / source, tmp_path), TINY)


ADAPTERS = {
    "c": lambda tmp: _c_adapter(tmp),
    "cuda": lambda tmp: _c_adapter(tmp, "mtp_step.cu"),
    "python": lambda tmp: adapter_from_spec("python:numpy_step:make_head", TINY),
    "torch_cpu_f32": lambda tmp: adapter_from_spec("torch:cpu:float32", TINY),
    "torch_cpu_bf16": lambda tmp: adapter_from_spec("torch:cpu:bfloat16", TINY),
    "torch_cuda_f32": lambda tmp: adapter_from_spec("torch:cuda:float32", TINY),
}
NEEDS_GPU = {"cuda", "torch_cuda_f32"}


@pytest.fixture
def adapter(request, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(CANDIDATES))
    if request.param in NEEDS_GPU:
        if request.param == "cuda" and shutil.which("nvcc") is None:
            pytest.skip("nvcc not found")
        if not _gpu():
            pytest.skip("no CUDA device")
    return ADAPTERS[request.param](tmp_path)


@pytest.mark.parametrize("adapter", [pytest.param(n, marks=pytest.mark.gpu) if n in NEEDS_GPU else n
                                     for n in ADAPTERS], indirect=True)
def test_adapter_contract(adapter):
    with read_trace(TINY_REF) as ref:
        inputs, digest = ref.inputs(), ref.attrs["checkpoint_digest"]
    first = adapter.run(inputs)
    assert isinstance(first, dict) and set(first) <= set(STAGE_NAMES) and "out" in first
    for name, arr in first.items():
        assert isinstance(arr, np.ndarray) and arr.dtype == np.float32
        assert arr.shape == (inputs.num_tokens, STAGE_BY_NAME[name].width(inputs.hidden_size)), name
    assert adapter.weights_digest == digest
    assert isinstance(adapter.name, str) and isinstance(adapter.deterministic, bool)
    if adapter.deterministic:
        second = adapter.run(inputs)
        assert second.keys() == first.keys()
        for name in first:
            assert first[name].tobytes() == second[name].tobytes(), name
