"""Comparing one (stage, token) row of a candidate with the oracle: pure data in, a `StageDiff` out.

Definitions (a = actual/candidate row, e = expected/oracle row, both upcast to float64, i over the row):

    max_abs     = max_i |a_i - e_i|                      (max_abs_index: where it occurs)
    max_rel     = max_abs / max_i |e_i|                  the largest difference relative to the row's largest
                                                         reference magnitude; 0 if max_abs == 0, inf if e == 0
    budget_used = min(max_rel / rtol, max_abs / atol)    1 = at the limit
    pass        ⇔ budget_used < 1 ⇔ max_rel < rtol or max_abs < atol   (a zero tolerance means exact equality)
    n_mismatch  = elements with |a_i - e_i| >= max(atol, rtol * max|e|) and > 0: those that alone fail the row,
                  so a row fails iff n_mismatch > 0
    rel_l2      = ||a - e|| / ||e||,   cosine = a·e / (||a|| ||e||)

`compare_chunk` does the same for every row of a [rows, width] chunk, vectorised; rows within tolerance then skip
the per-row statistics and worst elements (None / ()), which only a failing or inspected row needs.

A NaN or Inf on either side never passes. Status, checked in this order: `shape`, `dtype` (the candidate row
must be float32), `unwritten` (an element still holds the poison pattern, or the row is all zeros where the
reference row is not), `nonfinite` (a NaN/Inf the candidate computed), `values` (out of tolerance), `ok`.
"""

from dataclasses import dataclass

import numpy as np

from probe.poison import is_poison
from probe.tolerance import Tol

INVALID_STATUSES = frozenset({"shape", "dtype", "unwritten"})  # a failed self-check: the row is no evidence
DIVERGENT_STATUSES = frozenset({"values", "nonfinite"})
WORST_K = 5


@dataclass(frozen=True, slots=True)
class RowStats:
    mean: float
    std: float
    absmax: float
    n_nonfinite: int


@dataclass(frozen=True, slots=True)
class StageDiff:
    status: str  # ok | values | nonfinite | unwritten | shape | dtype
    n_total: int
    n_mismatch: int
    n_poison: int
    max_abs: float
    max_abs_index: int
    max_rel: float
    budget_used: float
    rel_l2: float
    cosine: float
    expected_stats: RowStats | None  # None: a row within tolerance compared by compare_chunk
    actual_stats: RowStats | None
    tol: Tol
    worst: tuple[tuple[int, float, float], ...]  # (index, oracle, candidate), largest |difference| first

    def __bool__(self) -> bool:
        return self.status == "ok"


@dataclass(frozen=True, slots=True)
class Cell:
    """One compared (stage, token) and whether its comparison is evidence (see probe/evidence.py)."""

    stage: str
    token: int
    diff: StageDiff
    evidential: bool


_NAN = float("nan")
_NO_STATS = RowStats(_NAN, _NAN, _NAN, 0)


def not_compared(status: str, n_total: int, tol: Tol) -> StageDiff:
    """A row whose values could not be compared (wrong shape or dtype of the whole stage)."""
    return StageDiff(status, n_total, 0, 0, _NAN, -1, _NAN, float("inf"), _NAN, _NAN, _NO_STATS, _NO_STATS, tol, ())


def compare_rows(actual: np.ndarray, expected: np.ndarray, tol: Tol) -> StageDiff:
    """Compare a candidate row with the oracle row (module docstring: definitions and statuses)."""
    if actual.shape != expected.shape:
        return not_compared("shape", expected.size, tol)
    if actual.dtype != np.float32:
        return not_compared("dtype", expected.size, tol)
    a = actual.astype(np.float64).ravel()
    e = expected.astype(np.float64).ravel()
    d = np.abs(a - e)
    rank = np.where(np.isnan(d), np.inf, d)  # a NaN difference is the worst kind
    index = int(np.argmax(rank)) if d.size else 0
    max_abs = float(d[index]) if d.size else 0.0
    e_max = float(np.abs(e).max(initial=0.0))
    max_rel = _ratio(max_abs, e_max)
    finite = bool(np.isfinite(a).all() and np.isfinite(e).all())
    budget = min(_ratio(max_rel, tol.rtol), _ratio(max_abs, tol.atol)) if finite else float("inf")
    limit = max(tol.atol, tol.rtol * e_max)
    n_mismatch = int(np.count_nonzero(~(d < limit) & (d != 0)))  # NaN counts as a mismatch
    n_poison = int(np.count_nonzero(is_poison(actual)))
    status = _status(n_poison, a, e, finite, budget)
    return StageDiff(status, int(a.size), n_mismatch, n_poison, max_abs, index, max_rel, budget,
                     _ratio(float(np.linalg.norm(a - e)), float(np.linalg.norm(e))),
                     _cosine(a, e), _stats(e), _stats(a), tol, _worst(rank, a, e))


def compare_chunk(actual: np.ndarray, expected: np.ndarray, tol: Tol) -> list[StageDiff]:
    """compare_rows for each row of [rows, width] float32 arrays, vectorised over the rows.

    Same statuses and metrics; rows that are not `ok` are handed to compare_rows for their statistics and worst
    elements, so a failing row reads the same whichever function compared it."""
    if actual.shape != expected.shape or actual.dtype != np.float32 or actual.ndim != 2:
        return [compare_rows(a, e, tol) for a, e in zip(actual, expected)]
    d = np.subtract(actual, expected, dtype=np.float64)  # (rows, width) float64 differences
    np.abs(d, out=d)
    index = d.argmax(axis=1)  # a NaN difference counts as the largest
    max_abs = d[np.arange(len(d)), index]
    e_max = np.maximum(expected.max(axis=1), -expected.min(axis=1)).astype(np.float64)
    max_rel = _ratios(max_abs, e_max)
    budget = np.minimum(_ratios(max_rel, tol.rtol), _ratios(max_abs, tol.atol))
    aa, ee = (np.einsum("ij,ij->i", x, x, dtype=np.float64) for x in (actual, expected))
    dd = np.einsum("ij,ij->i", d, d)
    # A NaN/Inf on either side (poison included) makes max_abs non-finite; an all-zero row is unwritten.
    ok = np.isfinite(max_abs) & np.isfinite(e_max) & (budget < 1) & ~((aa == 0) & (ee > 0))
    rel_l2 = _ratios(np.sqrt(dd), np.sqrt(ee))
    cosine = _cosines(aa, ee, dd)
    width = expected.shape[1]
    return [StageDiff("ok", width, 0, 0, float(max_abs[i]), int(index[i]), float(max_rel[i]), float(budget[i]),
                      float(rel_l2[i]), float(cosine[i]), None, None, tol, ())
            if ok[i] else compare_rows(actual[i], expected[i], tol) for i in range(len(d))]


def _ratios(values: np.ndarray, limits: np.ndarray | float) -> np.ndarray:
    """_ratio elementwise: 0 where the value is 0, inf where only the limit is 0."""
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.where(values == 0, 0.0, values / limits)
    return np.where((values != 0) & (np.asarray(limits) == 0), np.inf, out)


def _cosines(aa: np.ndarray, ee: np.ndarray, dd: np.ndarray) -> np.ndarray:
    """_cosine per row from |a|², |e|² and |a−e|² (a·e = (|a|² + |e|² − |a−e|²) / 2)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        cos = (aa + ee - dd) / 2 / np.sqrt(aa * ee)
    return np.where((aa == 0) & (ee == 0), 1.0, np.where((aa == 0) | (ee == 0), np.nan, cos))


def _status(n_poison: int, a: np.ndarray, e: np.ndarray, finite: bool, budget: float) -> str:
    if n_poison:
        return "unwritten"
    if not a.any() and e.any():  # a zero-initialised buffer that was never written
        return "unwritten"
    if not finite:
        return "nonfinite"
    return "ok" if budget < 1 else "values"


def _ratio(value: float, limit: float) -> float:
    if value == 0:
        return 0.0
    if limit == 0:
        return float("inf")
    return value / limit


def _cosine(a: np.ndarray, e: np.ndarray) -> float:
    norm_a, norm_e = float(np.linalg.norm(a)), float(np.linalg.norm(e))
    if norm_a == 0 and norm_e == 0:
        return 1.0
    if norm_a == 0 or norm_e == 0 or not np.isfinite(norm_a * norm_e):
        return _NAN
    return float(np.dot(a, e) / (norm_a * norm_e))


def _stats(x: np.ndarray) -> RowStats:
    finite = x[np.isfinite(x)]
    if not finite.size:
        return RowStats(_NAN, _NAN, _NAN, int(x.size))
    return RowStats(float(finite.mean()), float(finite.std()), float(np.abs(finite).max()),
                    int(x.size - finite.size))


def _worst(rank: np.ndarray, a: np.ndarray, e: np.ndarray) -> tuple[tuple[int, float, float], ...]:
    k = min(WORST_K, rank.size)
    top = np.argpartition(-rank, k - 1)[:k] if k else np.array([], dtype=int)
    top = top[np.lexsort((top, -rank[top]))]  # largest difference first, ties by index
    return tuple((int(i), float(e[i]), float(a[i])) for i in top)
