"""The library API checks its arguments as the CLI does: token ids must be a 1-D integer array (never cast from
floats, bools or text), HiddenSource takes exactly one source, mode is one of MODES; each is an InputError that
names the parameter and the CLI option, raised before any work (nothing is written)."""

from pathlib import Path

import numpy as np
import pytest

from oracle.accept import measure_acceptance
from oracle.errors import InputError
from oracle.export import HiddenSource, export_trace
from oracle.trace import read_trace
from tests.helpers import TINY

BAD_TOKENS = [
    (np.array([[5, 17, 3]]), r"1-D integer array .* int64 of shape \(1, 3\)\. Pass one sequence"),
    (np.array([5.0, 17.0, 3.0]), r"found float64 of shape \(3,\)\. Cast whole-number ids"),
    (np.array([True, False]), r"found bool"),
    ("5,17,3", r"token_ids_from_text"),
    (np.array([], dtype=np.int64), r"holds no token ids"),
    ([5, 2**64 - 1], r"(1-D integer array|does not fit in int64)"),
]


@pytest.mark.parametrize("tokens, message", BAD_TOKENS)
def test_export_trace_refuses_bad_token_arrays_before_any_work(tokens, message, tmp_path):
    with pytest.raises(InputError, match=message):
        export_trace(TINY, tmp_path / "ref.h5", tokens, HiddenSource(seed=0))
    assert list(tmp_path.iterdir()) == []


def test_measure_acceptance_refuses_a_batch_of_sequences():
    with pytest.raises(InputError, match=r"sequence must be a 1-D integer array"):
        measure_acceptance(TINY, np.zeros((2, 20), dtype=np.int64), HiddenSource(seed=0), k=2)


@pytest.mark.parametrize("kwargs, message", [
    ({}, r"exactly one of file=.*got none"),
    ({"seed": 0, "main_model": True}, r"got seed, main_model"),
    ({"seed": "0"}, r"the seed is an integer"),
    ({"seed": True}, r"the seed is an integer"),
])
def test_hidden_source_takes_exactly_one_source(kwargs, message):
    with pytest.raises(InputError, match=message):
        HiddenSource(**kwargs)


def test_an_unknown_mode_is_refused(tmp_path):
    with pytest.raises(InputError, match=r"mode 'fast': use one of batched, stepwise \(CLI: --mode\)"):
        export_trace(TINY, tmp_path / "ref.h5", [5, 17, 3], HiddenSource(seed=0), mode="fast")


def test_twin_a_list_or_int32_ids_and_a_path_hidden_file_export(tmp_path):
    """What the checks must still let through: any 1-D integer array or list, a Path for the hidden file."""
    np.save(tmp_path / "h.npy", np.random.default_rng(0).standard_normal((3, 64), dtype=np.float32))
    out = export_trace(TINY, tmp_path / "a.h5", np.array([5, 17, 3], dtype=np.int32),
                       HiddenSource(file=Path(tmp_path / "h.npy")))
    with read_trace(out) as ref:
        assert ref.inputs().token_ids.tolist() == [5, 17, 3]
        assert ref.attrs["provenance"]["hidden"] == {"kind": "file", "file": str(tmp_path / "h.npy")}
    export_trace(TINY, tmp_path / "b.h5", [5, 17, 3], HiddenSource(seed=0))
