"""compare_rows on hand-made rows: exact metrics, statuses, and NaN never passing."""

import math

import numpy as np
import pytest

from probe.compare import compare_rows
from probe.poison import poison
from probe.tolerance import DEFAULT, Tol


def f32(*values) -> np.ndarray:
    return np.array(values, dtype=np.float32)


def test_exact_metrics_of_a_divergent_row():
    d = compare_rows(f32(1, -2, 4.5, 0), f32(1, -2, 4, 0), DEFAULT)
    assert d.status == "values" and not d
    assert d.max_abs == 0.5 and d.max_abs_index == 2
    assert d.max_rel == 0.5 / 4  # max|a-e| / max|e|
    assert d.budget_used == pytest.approx(min(0.125 / 1e-4, 0.5 / 1e-5))  # 1250x
    assert d.n_mismatch == 1 and d.n_total == 4 and d.n_poison == 0
    assert d.worst[0] == (2, 4.0, 4.5)
    assert d.expected_stats.absmax == 4 and d.actual_stats.absmax == 4.5


def test_within_tolerance_by_max_rel_only():
    expected, actual = f32(1, 2, 4, 8), f32(1, 2, 4, 8.0005)
    gap = float(actual[3]) - 8.0
    d = compare_rows(actual, expected, DEFAULT)
    assert d and d.status == "ok"
    assert d.max_abs == pytest.approx(gap) and d.max_abs > DEFAULT.atol
    assert d.max_rel == pytest.approx(gap / 8) and d.budget_used == pytest.approx(gap / 8 / 1e-4)
    assert d.budget_used < 1 and d.n_mismatch == 0


def test_within_tolerance_by_max_abs_only():
    d = compare_rows(f32(1e-6, 0), f32(0, 1e-6), DEFAULT)  # max_rel = 1, max_abs = 1e-6 < atol
    assert d and d.max_rel == pytest.approx(1.0) and d.budget_used == pytest.approx(0.1)


def test_just_outside_both_limits_fails():
    expected = f32(1, 0.5)
    actual = expected + f32(2e-4, 0)  # max_rel 2e-4 >= 1e-4 and max_abs 2e-4 >= 1e-5
    d = compare_rows(actual, expected, DEFAULT)
    assert not d and 1 < d.budget_used < 3 and d.n_mismatch == 1


def test_n_mismatch_counts_elements_that_alone_fail_the_row():
    expected = f32(10, 0.1, 5)
    actual = f32(10, 0.1 + 5e-4, 5.002)  # limit max(1e-5, 1e-4 * 10) = 1e-3: only the last element fails
    d = compare_rows(actual, expected, DEFAULT)
    assert d.n_mismatch == 1 and not d and d.max_abs_index == 2


def test_rel_l2_and_cosine():
    same = compare_rows(f32(3, 4), f32(3, 4), DEFAULT)
    assert same.rel_l2 == 0 and same.cosine == pytest.approx(1.0) and same.budget_used == 0
    swapped = compare_rows(f32(4, 3), f32(3, 4), DEFAULT)
    assert swapped.rel_l2 == pytest.approx(math.sqrt(2) / 5) and swapped.cosine == pytest.approx(24 / 25)
    assert swapped.expected_stats.mean == swapped.actual_stats.mean  # same statistics, different values


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nonfinite_candidate_never_passes(bad):
    d = compare_rows(f32(1, bad, 3), f32(1, 2, 3), Tol(1e9, 1e9, "huge"))
    assert d.status == "nonfinite" and not d and d.budget_used == math.inf
    assert d.actual_stats.n_nonfinite == 1 and d.max_abs_index == 1


def test_nan_never_matches_nan():
    d = compare_rows(f32(np.nan), f32(np.nan), DEFAULT)
    assert d.status == "nonfinite" and not d


def test_zero_reference_row():
    assert compare_rows(f32(0, 0), f32(0, 0), DEFAULT).status == "ok"
    tiny = compare_rows(f32(0, 1e-6), f32(0, 0), DEFAULT)
    assert tiny and tiny.max_rel == math.inf and tiny.budget_used == pytest.approx(0.1)
    big = compare_rows(f32(0, 1e-3), f32(0, 0), DEFAULT)
    assert big.status == "values" and big.max_rel == math.inf


def test_unwritten_rows():
    expected = f32(1, 2, 3)
    row = expected.copy()
    row[1:] = poison(2)
    left = compare_rows(row, expected, DEFAULT)
    assert left.status == "unwritten" and left.n_poison == 2 and not left
    zeros = compare_rows(np.zeros(3, np.float32), expected, DEFAULT)
    assert zeros.status == "unwritten" and zeros.n_poison == 0
    computed_nan = compare_rows(f32(1, np.nan, 3), expected, DEFAULT)
    assert computed_nan.status == "nonfinite" and computed_nan.n_poison == 0


def test_layout_is_checked_before_values():
    assert compare_rows(f32(1, 2), f32(1, 2, 3), DEFAULT).status == "shape"
    d = compare_rows(np.array([1, 2], np.float64), f32(1, 2), DEFAULT)
    assert d.status == "dtype" and not d


def test_zero_tolerance_means_exact_equality():
    exact = Tol(0, 0, "exact")
    assert compare_rows(f32(1, 2), f32(1, 2), exact)
    ulp = np.nextafter(np.float32(2), np.float32(3))
    d = compare_rows(f32(1, ulp), f32(1, 2), exact)
    assert not d and d.n_mismatch == 1


def test_worst_elements_are_ordered_by_difference():
    d = compare_rows(f32(0, 0.3, 0.1, 0.2, 0, 0, 0.4), np.zeros(7, np.float32) + f32(1, 0, 0, 0, 0, 0, 0), DEFAULT)
    assert [i for i, _, _ in d.worst] == [0, 6, 1, 3, 2]


def _rows_of_every_kind() -> tuple[np.ndarray, np.ndarray]:
    from probe.poison import poison

    rng = np.random.default_rng(3)
    expected = rng.standard_normal((10, 300)).astype(np.float32)
    actual = expected.copy()
    actual[1] *= np.float32(1 + 3e-5)  # within tolerance
    actual[2] *= np.float32(1.01)  # out of tolerance
    actual[3, 7] = np.nan  # a computed NaN
    actual[4] = poison(300)  # never written
    actual[5] = 0.0  # a zero-initialised row
    actual[6, 0] = np.inf
    expected[7] = 0.0  # zero reference, candidate not
    actual[8] = expected[8]
    actual[9, [40, 200]] = expected[9, [40, 200]] + 1  # two equal greatest differences: the first index counts
    return actual, expected


def test_compare_block_agrees_with_compare_rows_row_by_row():
    """The block path (columns from the compiled kernel) and the per-row path give the same status and metrics on
    every kind of row, and a row given full detail reads exactly as compare_rows."""
    from probe.compare import compare_block

    actual, expected = _rows_of_every_kind()
    for tol in (DEFAULT, Tol(0.0, 0.0, "exact")):
        block = compare_block("fc", 5, actual, expected, tol)
        assert list(block.tokens) == list(range(5, 15))
        for row in range(len(expected)):
            single, columns = compare_rows(actual[row], expected[row], tol), block.diff(5 + row)
            assert columns.status == single.status, row
            for field in ("n_total", "n_mismatch", "n_poison", "max_abs_index"):
                assert getattr(columns, field) == getattr(single, field), (row, field)
            for field in ("max_abs", "max_rel", "budget_used", "rel_l2", "cosine"):
                np.testing.assert_allclose(getattr(columns, field), getattr(single, field), rtol=1e-12, atol=1e-15,
                                           err_msg=f"row {row} {field}")
            assert columns.expected_stats is None and columns.worst == ()
            block.add_detail(5 + row, actual[row], expected[row])
            assert repr(block.diff(5 + row)) == repr(single)  # repr: NaN != NaN


def test_compare_block_statuses_and_their_twins():
    """Each status comes from its own cause: removing the cause turns the row ok."""
    from probe.compare import compare_block

    actual, expected = _rows_of_every_kind()
    block = compare_block("fc", 0, actual, expected, DEFAULT)
    statuses = [block.diff(t).status for t in range(10)]
    assert statuses == ["ok", "ok", "values", "nonfinite", "unwritten", "unwritten", "nonfinite", "values", "ok",
                        "values"]
    fixed = compare_block("fc", 0, expected.copy(), expected, DEFAULT)
    assert [fixed.diff(t).status for t in range(10)] == ["ok"] * 10


def test_an_all_zero_top_k_row_is_unwritten_where_zeros_mean_unwritten():
    """k >= 2 zeros select expert 0 twice, which no top-k does: in a dump nothing says was pre-filled it is a row
    never written (it had been a computed divergence, exit 1). Twins: flagged off, compared; k = 1, a real choice."""
    from probe.compare import compare_index_sets

    expected = np.array([[3, 5], [1, 2]])
    actual = np.array([[0, 0], [2, 1]])
    flagged = compare_index_sets("topk_ids", 0, actual, expected, DEFAULT, zero_is_unwritten=True)
    assert list(flagged.has_status({"unwritten"})) == [True, False] and list(flagged.has_status({"ok"})) == [False, True]
    plain = compare_index_sets("topk_ids", 0, actual, expected, DEFAULT)
    assert list(plain.has_status({"values"})) == [True, False]
    single = compare_index_sets("topk_ids", 0, np.array([[0]]), np.array([[4]]), DEFAULT, zero_is_unwritten=True)
    assert list(single.has_status({"values"})) == [True]
