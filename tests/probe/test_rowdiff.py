"""The compiled row kernel (probe/_rowdiff.c) against its specification, probe.rule.RULE.specification."""

import json

import numpy as np
import pytest

from probe import rowdiff
from probe.poison import poison
from probe.rule import RULE
from probe.tolerance import DEFAULT, Tol

EXACT_FIELDS = ("index", "n_mismatch", "n_poison", "max_abs", "e_max")  # the sums agree to rounding only
SUM_FIELDS = ("aa", "ee", "dd", "ae")


def disagreements(kernel: np.ndarray, spec: np.ndarray) -> list[str]:
    """Fields where the kernel's sums differ from the specification's (exact fields bit for bit)."""
    bad = [f for f in EXACT_FIELDS if not np.array_equal(kernel[f], spec[f], equal_nan=True)]
    return bad + [f for f in SUM_FIELDS if not np.allclose(kernel[f], spec[f], rtol=1e-12, atol=0, equal_nan=True)]


def rows_of_every_kind(width: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    expected = rng.standard_normal((12, width)).astype(np.float32)
    actual = expected * (1 + 1e-7 * rng.standard_normal((12, width))).astype(np.float32)
    if width:
        actual[1] *= np.float32(1 + 3e-5)
        actual[2] *= np.float32(1.01)
        actual[3, width // 2] = np.nan
        actual[4] = poison(width)
        actual[5] = 0.0
        actual[6, 0] = np.inf
        expected[7] = 0.0
        actual[8, width - 1] += 1  # the greatest difference in the last element (the kernel's scalar tail)
        expected[9], actual[9] = 0.5, 1.5  # every difference equal: index 0
        actual[10] = expected[10]
        expected[10, [width // 3, 2 * width // 3]] = 0.0  # a tie between two vector lanes or iterations
        actual[10, [width // 3, 2 * width // 3]] = 2.0
        actual[11, width // 3] = -np.inf
    return actual, expected


def test_the_kernel_is_built_and_used():
    """The README install builds probe._rowdiff; without it the diff silently runs several times slower."""
    assert rowdiff.kernel_note() is None, rowdiff.kernel_note()
    assert rowdiff.vector_bytes() in (16, 32)


@pytest.mark.parametrize("width", [0, 1, 3, 4, 5, 7, 8, 9, 17, 300, 5120, 10240])
@pytest.mark.parametrize("tol", [DEFAULT, Tol(0.0, 0.0, "exact"), Tol(5e-2, 1e-3, "bf16")], ids=str)
def test_kernel_matches_the_numpy_specification(width, tol):
    actual, expected = rows_of_every_kind(width)
    kernel, spec = RULE.sums(actual, expected, tol), RULE.specification(actual, expected, tol)
    assert disagreements(kernel, spec) == []


def test_the_agreement_check_catches_a_wrong_kernel():
    """Twin: the comparison above would notice an index off by one, a miscount, a maximum one ulp off or a sum
    off by 1e-9 relative."""
    actual, expected = rows_of_every_kind(300)
    spec = RULE.specification(actual, expected, DEFAULT)
    changes = {"index": lambda x: x + 1, "n_mismatch": lambda x: x + 1, "n_poison": lambda x: x + 1,
               "max_abs": lambda x: np.nextafter(x, np.inf), "e_max": lambda x: np.nextafter(x, 0),
               "ae": lambda x: x * (1 + 1e-9)}
    for field, change in changes.items():
        wrong = spec.copy()
        wrong[field][2] = change(wrong[field][2])
        assert disagreements(wrong, spec) == [field], field


def test_kernel_counts_mismatches_and_poison():
    actual, expected = rows_of_every_kind(300)
    sums = RULE.sums(actual, expected, DEFAULT)
    assert sums["n_poison"].tolist() == [0, 0, 0, 0, 300] + [0] * 7
    assert sums["n_mismatch"][[0, 1, 8, 9]].tolist() == [0, 0, 1, 300]
    assert sums["index"][[3, 8, 9, 10, 11]].tolist() == [150, 299, 0, 100, 100]


def test_without_the_kernel_the_diff_reads_the_same_and_says_so(monkeypatch, tmp_path):
    """An install without a C compiler compares rows with numpy: same verdict and rows, and a note on stderr."""
    from click.testing import CliRunner

    from probe.cli import cli
    from tests.helpers import TINY_REF
    from tests.probe.tracekit import load_trace, write_h5

    inputs, stages = load_trace(TINY_REF)
    stages["mlp"][3:] *= np.float32(1.001)
    cand = write_h5(tmp_path / "cand.h5", inputs, stages)
    runs = {}
    for route in ("kernel", "numpy"):
        if route == "numpy":
            monkeypatch.setattr(rowdiff, "_library", lambda: (None, "is not built"))
        result = CliRunner().invoke(cli, ["diff", str(TINY_REF), str(cand), "--json", str(tmp_path / f"{route}.json")])
        runs[route] = result
        assert result.exit_code == 1, result.output
    assert "not built" not in runs["kernel"].stderr and "not built" in runs["numpy"].stderr
    same_name = runs["numpy"].stdout.replace("numpy.json", "kernel.json")  # the "wrote --json …" line names each
    assert runs["kernel"].stdout == same_name and "wrote --json" in same_name
    kernel, spec = (json.loads((tmp_path / f"{r}.json").read_text())["rows"] for r in ("kernel", "numpy"))
    def exact(rows):
        return [(r["stage"], r["token"], r["status"], r["max_abs_index"], r["n_mismatch"], r["max_abs"]) for r in rows]

    assert exact(kernel) == exact(spec) and len(kernel) == 11 * 8


def test_a_stale_kernel_is_not_used(monkeypatch):
    """A build older than the source (another version or row layout) falls back to numpy and says why."""
    monkeypatch.setattr(rowdiff, "KERNEL_VERSION", rowdiff.KERNEL_VERSION + 1)
    rowdiff._library.cache_clear()
    try:
        assert "is stale" in rowdiff.kernel_note() and rowdiff.vector_bytes() == 0
        actual, expected = rows_of_every_kind(300)
        assert disagreements(RULE.sums(actual, expected, DEFAULT),
                             RULE.specification(actual, expected, DEFAULT)) == []
    finally:
        monkeypatch.undo()
        rowdiff._library.cache_clear()
    assert rowdiff.kernel_note() is None  # twin: the current build is used
