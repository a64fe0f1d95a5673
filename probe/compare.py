"""Comparing a candidate's (stage, token) rows with the oracle's: pure data in, a `StageDiff` (one row) or
`StageRows` (a block of rows, as columns) out.

The rule that decides a row, its per-row sums and their compiled kernel are one object, `RULE` (probe/rule.py):
max_rel < rtol or max_abs < atol, max_rel = max|a-e| / max|e| (a = candidate row, e = oracle row). Every metric
here derives from its sums (a and e widened to float64, i over the row):

    budget_used = min(max_rel / rtol, max_abs / atol)    1 = at the limit; pass ⇔ budget_used < 1
    n_mismatch  = elements with |a_i - e_i| >= max(atol, rtol * max|e|) and > 0: those that alone fail the row,
                  so a row fails iff n_mismatch > 0
    rel_l2      = ||a - e|| / ||e||,   cosine = a·e / (||a|| ||e||)

`compare_block` judges a block of consecutive rows of one stage and returns columns (`StageRows`); only rows chosen
for full detail get the statistics and worst elements, from `compare_rows`, which judges its one row through the
same sums. A diff over thousands of tokens therefore builds no Python object per row.

A NaN or Inf on either side never passes. Status, checked in this order: `shape`, `dtype` (the candidate row
must be float32), `unwritten` (an element still holds the poison pattern, or the row is all zeros where the
reference row is not), `nonfinite` (a NaN/Inf the candidate computed), `values` (out of tolerance), `ok`.
The all-zero rule applies only to sources that were not filled with poison before the candidate wrote them (trace
files and raw dumps): where the probe poisoned the buffers itself (the C and Python adapters), an all-zero row is
a value the candidate computed and is compared like any other (`zero_is_unwritten=False`).
"""

from dataclasses import dataclass, replace
from functools import cache

import numpy as np

from probe.poison import is_poison
from probe.rule import RULE, ratios
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
class DiffSpread:
    """How |a - e| spreads over a detailed row's elements (Polygraphy-style): its mean and median beside the max,
    and a histogram by decade: `histogram` is ((lo, hi, count), ...) for lo <= |a-e| < hi, lo = 0 for exact
    matches (hi = 0 then). Non-finite differences are left out (the row's status counts them)."""

    mean: float
    median: float
    histogram: tuple[tuple[float, float, int], ...]


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
    expected_stats: RowStats | None  # None: a row whose full detail was not kept (StageRows.diff)
    actual_stats: RowStats | None
    tol: Tol
    worst: tuple[tuple[int, float, float], ...]  # (index, oracle, candidate), largest |difference| first
    # a [T, hc·D] stage's row per stream s (elements s·D .. s·D+D-1): (max|a-e|, max|e|, max|a|); () otherwise
    per_stream: tuple[tuple[float, float, float], ...] = ()
    spread: DiffSpread | None = None  # detailed rows only (compare_rows)

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


def compare_rows(actual: np.ndarray, expected: np.ndarray, tol: Tol, zero_is_unwritten: bool = True) -> StageDiff:
    """Compare a candidate row with the oracle row (module docstring: definitions and statuses): the verdict and
    metrics from RULE's sums, as for a block, plus the row's statistics and worst elements."""
    if actual.shape != expected.shape:
        return not_compared("shape", expected.size, tol)
    if actual.dtype != np.float32:
        return not_compared("dtype", expected.size, tol)
    a, e = actual.reshape(1, -1), expected.reshape(1, -1)
    sums = RULE.sums(a, e, tol) if e.dtype == np.float32 else RULE.specification(a, e, tol)  # the kernel reads f32
    judged = rows_from_sums("", 0, a.shape[1], sums, tol, zero_is_unwritten=zero_is_unwritten)
    a64, e64 = a[0].astype(np.float64), e[0].astype(np.float64)
    d = np.abs(a64 - e64)
    rank = np.where(np.isnan(d), np.inf, d)  # a NaN difference is the worst kind, as in RULE
    return replace(judged.diff(0), expected_stats=_stats(e64), actual_stats=_stats(a64), worst=_worst(rank, a64, e64),
                   spread=diff_spread(d))


# `tie`: a row that differs only because the reference's own top-k selection was a near-tie at that token (a
# routing flip within rounding), or a row downstream of such a flip: not a divergence, not evidence.
STATUSES = ("ok", "values", "nonfinite", "unwritten", "shape", "dtype", "tie")  # StageRows.status holds indices
_CODE = {name: code for code, name in enumerate(STATUSES)}


@cache
def _status_table(names: frozenset[str]) -> np.ndarray:
    """Indexed by a status code: whether that status is one of `names`."""
    return np.array([name in names for name in STATUSES])


@dataclass(frozen=True, eq=False)
class StageRows:
    """One stage's comparison for consecutive token rows start, start+1, …: one column entry per row.

    The columns hold what StageDiff holds for every row; `detail` maps a token to its full StageDiff (statistics
    and worst elements), kept only for the rows that need it (the diff chooses them)."""

    stage: str
    start: int
    width: int
    tol: Tol
    status: np.ndarray  # int8 index into STATUSES
    n_mismatch: np.ndarray
    n_poison: np.ndarray
    max_abs: np.ndarray
    max_abs_index: np.ndarray
    max_rel: np.ndarray
    budget_used: np.ndarray
    rel_l2: np.ndarray
    cosine: np.ndarray
    qk_blind: np.ndarray  # bool: this row cannot witness q, k, q_norm, k_norm or RoPE (probe/evidence.py)
    both_zero: np.ndarray  # bool: candidate and reference rows are all zeros (written-ness unverifiable unpoisoned)
    detail: dict[int, StageDiff]
    zero_is_unwritten: bool = True  # the source was not poison-filled: an all-zero row counts as unwritten

    def __len__(self) -> int:
        return len(self.status)

    @property
    def tokens(self) -> np.ndarray:
        return np.arange(self.start, self.start + len(self))

    def has_status(self, names) -> np.ndarray:
        """Boolean mask of the rows whose status is one of `names`."""
        return _status_table(frozenset(names))[self.status]

    def diff(self, token: int) -> StageDiff:
        """Row `token` as a StageDiff: its full detail when kept, else the columns (no statistics, no worst)."""
        if token in self.detail:
            return self.detail[token]
        i = token - self.start
        if not 0 <= i < len(self):
            raise IndexError(f"stage {self.stage}: token {token} is outside rows {self.start}.."
                             f"{self.start + len(self) - 1}")
        return StageDiff(STATUSES[self.status[i]], self.width, int(self.n_mismatch[i]), int(self.n_poison[i]),
                         float(self.max_abs[i]), int(self.max_abs_index[i]), float(self.max_rel[i]),
                         float(self.budget_used[i]), float(self.rel_l2[i]), float(self.cosine[i]), None, None,
                         self.tol, ())

    def add_detail(self, token: int, actual: np.ndarray, expected: np.ndarray) -> None:
        """Keep row `token`'s full detail (compare_rows of its candidate and oracle rows)."""
        self.detail[token] = compare_rows(actual, expected, self.tol, self.zero_is_unwritten)


def most_severe(rows: StageRows, valid_only: bool = False) -> tuple[int, tuple[int, float]] | None:
    """(row index, severity) of the most severe row: invalid first, then computed NaN/Inf, then the largest budget
    (the first row on ties); `valid_only` skips invalid rows. None when no row qualifies."""
    invalid = rows.has_status(INVALID_STATUSES)
    rank = np.where(invalid, 2, np.where(rows.has_status({"nonfinite"}), 1, 0))
    candidates = np.flatnonzero(~invalid) if valid_only else np.arange(len(rows))
    if not candidates.size:
        return None
    i = int(candidates[np.lexsort((-rows.budget_used[candidates], -rank[candidates]))[0]])
    return i, (int(rank[i]), float(rows.budget_used[i]))


def compare_block(stage: str, start: int, actual: np.ndarray, expected: np.ndarray, tol: Tol,
                  zero_is_unwritten: bool = True) -> StageRows:
    """compare_rows for each row of two float32 [rows, width] arrays (token `start` first), as columns.

    Same statuses and metrics as compare_rows; the oracle side must be finite (the diff checks `oracle_finite`)."""
    if actual.shape != expected.shape or actual.ndim != 2 or actual.dtype != np.float32:
        raise ValueError(f"compare_block needs two float32 arrays of one [rows, width] shape, got {actual.dtype} "
                         f"{actual.shape} and {expected.dtype} {expected.shape}")
    return rows_from_sums(stage, start, expected.shape[1], RULE.sums(actual, expected, tol), tol,
                          zero_is_unwritten=zero_is_unwritten)


def oracle_finite(sums: np.ndarray) -> np.ndarray:
    """Rows whose oracle side is finite (sum of squares finite: float32 squares cannot overflow a double)."""
    return np.isfinite(sums["ee"])


def rows_from_sums(stage: str, start: int, width: int, sums: np.ndarray, tol: Tol,
                   qk_blind: np.ndarray | None = None, zero_is_unwritten: bool = True) -> StageRows:
    """The StageRows columns from probe/rowdiff.py's per-row sums (compare_rows' definitions, vectorised);
    `qk_blind` marks the rows that cannot witness the q/k path (default: none)."""
    aa, ee = sums["aa"], sums["ee"]
    judged = RULE.judge(sums, tol)
    unwritten = sums["n_poison"] > 0  # poison left
    if zero_is_unwritten:
        unwritten = unwritten | ((aa == 0) & (ee != 0))  # an all-zero row where the reference is not
    status = np.where(unwritten, _CODE["unwritten"], np.where(~judged.finite, _CODE["nonfinite"],
                                                               np.where(judged.passes, _CODE["ok"], _CODE["values"])))
    return StageRows(stage, start, width, tol, status.astype(np.int8), sums["n_mismatch"].copy(),
                     sums["n_poison"].copy(), sums["max_abs"].copy(), sums["index"].copy(), judged.max_rel,
                     judged.budget_used, ratios(np.sqrt(sums["dd"]), np.sqrt(ee)), _cosines(aa, ee, sums["ae"]),
                     np.zeros(len(aa), dtype=bool) if qk_blind is None else np.asarray(qk_blind, dtype=bool),
                     (aa == 0) & (ee == 0), {}, zero_is_unwritten)


def compare_index_sets(stage: str, start: int, actual: np.ndarray, expected: np.ndarray, tol: Tol,
                       near_tie: np.ndarray | None = None, flippable: np.ndarray | None = None,
                       zero_is_unwritten: bool = False) -> StageRows:
    """Rows of an index-set stage (e.g. topk_ids, int64 [rows, k]): a row is ok when both rows hold the same set.

    n_mismatch counts the reference's ids the candidate lacks; max_abs is that count too (budget inf when > 0).
    A differing row where `near_tie` is set (the reference's own selection margin is within the tolerance of its
    router logits) is `tie`, not `values`: a routing flip at a near-tie is rounding, not wiring. Where `flippable`
    ([rows, E] bool: experts whose own flip distance is within the tolerance, /evidence/topk_flip) is given, only
    a difference confined to those experts is a tie; any other expert in or out is `values`. A negative id is
    an unwritten row (the C and Python adapters fill index buffers with -1); so is, where `zero_is_unwritten` (files
    nothing says were pre-filled), a row of k >= 2 zeros: no top-k selects one expert twice, and it is what a
    zero-initialised, never-written dump holds (it had been reported as a computed divergence, exit 1)."""
    rows = len(expected)
    exp_sorted, act_sorted = np.sort(expected, axis=1), np.sort(actual, axis=1)
    same = (exp_sorted == act_sorted).all(axis=1)
    missing = np.array([len(set(e.tolist()) - set(a.tolist())) for e, a in zip(expected, actual)], dtype=np.int64)
    unwritten = (actual < 0).any(axis=1)
    if zero_is_unwritten and actual.shape[1] >= 2:
        unwritten |= (actual == 0).all(axis=1)
    tie = ~same & (near_tie if near_tie is not None else np.zeros(rows, dtype=bool))
    if flippable is not None:
        tie &= np.array([_only_flippable(a, e, f) for a, e, f in zip(actual, expected, flippable)], dtype=bool)
    status = np.where(unwritten, _CODE["unwritten"],
                      np.where(same, _CODE["ok"], np.where(tie, _CODE["tie"], _CODE["values"])))
    zero = np.zeros(rows)
    budget = np.where(same, 0.0, np.inf)
    return StageRows(stage, start, expected.shape[1], tol, status.astype(np.int8), missing,
                     np.zeros(rows, dtype=np.int64), missing.astype(float), np.full(rows, -1), np.where(same, 0.0, 1.0),
                     budget, zero, np.ones(rows), np.zeros(rows, dtype=bool), np.zeros(rows, dtype=bool), {},
                     zero_is_unwritten=False)


def _only_flippable(actual: np.ndarray, expected: np.ndarray, flippable: np.ndarray) -> bool:
    """Whether every expert in one set and not the other could flip by rounding (ids out of range cannot)."""
    disputed = set(actual.tolist()) ^ set(expected.tolist())
    return all(0 <= e < len(flippable) and bool(flippable[e]) for e in disputed)


def mark_ties(rows: StageRows, tokens: np.ndarray) -> None:
    """Rows of `rows` at `tokens` (bool per row) that diverge become `tie` (downstream of a near-tie flip)."""
    divergent = rows.has_status(DIVERGENT_STATUSES) & tokens
    rows.status[divergent] = _CODE["tie"]


def not_compared_rows(stage: str, num_rows: int, width: int, status: str, tol: Tol) -> StageRows:
    """Rows of a stage whose layout (shape or dtype) could not be compared at all."""
    nan, zero = np.full(num_rows, _NAN), np.zeros(num_rows, dtype=np.int64)
    return StageRows(stage, 0, width, tol, np.full(num_rows, _CODE[status], dtype=np.int8), zero, zero, nan,
                     np.full(num_rows, -1), nan, np.full(num_rows, np.inf), nan, nan, np.ones(num_rows, dtype=bool),
                     np.zeros(num_rows, dtype=bool), {})


def join_rows(parts: list[StageRows]) -> StageRows:
    """Consecutive blocks of one stage as one StageRows."""
    first = parts[0]
    columns = {f: np.concatenate([getattr(p, f) for p in parts]) for f in _COLUMNS}
    return StageRows(first.stage, first.start, first.width, first.tol, **columns,
                     detail={t: d for p in parts for t, d in p.detail.items()},
                     zero_is_unwritten=first.zero_is_unwritten)


_COLUMNS = ("status", "n_mismatch", "n_poison", "max_abs", "max_abs_index", "max_rel", "budget_used", "rel_l2",
            "cosine", "qk_blind", "both_zero")


def _cosines(aa: np.ndarray, ee: np.ndarray, ae: np.ndarray) -> np.ndarray:
    """a·e / (|a| |e|) per row from |a|², |e|² and a·e: 1 for two zero rows, NaN for one or a non-finite norm."""
    norms = np.sqrt(aa) * np.sqrt(ee)
    with np.errstate(divide="ignore", invalid="ignore"):
        cos = ae / norms
    return np.where((aa == 0) & (ee == 0), 1.0, np.where((aa == 0) | (ee == 0) | ~np.isfinite(norms), np.nan, cos))


def _stats(x: np.ndarray) -> RowStats:
    finite = x[np.isfinite(x)]
    if not finite.size:
        return RowStats(_NAN, _NAN, _NAN, int(x.size))
    return RowStats(float(finite.mean()), float(finite.std()), float(np.abs(finite).max()),
                    int(x.size - finite.size))


HISTOGRAM_DECADES = 8  # at most this many decade bins; smaller differences are pooled into the lowest


def diff_spread(d: np.ndarray) -> DiffSpread | None:
    """Mean, median and decade histogram of the finite |a - e| of one row (None when none is finite)."""
    d = d[np.isfinite(d)]
    if not d.size:
        return None
    zero, nonzero = int((d == 0).sum()), d[d > 0]
    bins = [(0.0, 0.0, zero)] if zero else []
    if nonzero.size:
        top = int(np.floor(np.log10(nonzero.max()))) + 1
        low = max(int(np.floor(np.log10(nonzero.min()))), top - HISTOGRAM_DECADES)
        edges = [10.0 ** k for k in range(low, top + 1)]
        counts = np.histogram(np.clip(nonzero, edges[0], None), bins=edges)[0]  # pooled below the lowest edge
        bins += [(0.0 if k == 0 and nonzero.min() < edges[0] else edges[k], edges[k + 1], int(c))
                 for k, c in enumerate(counts)]
    return DiffSpread(float(d.mean()), float(np.median(d)), tuple(bins))


def stream_detail(actual: np.ndarray, expected: np.ndarray, streams: int) -> tuple[tuple[float, float, float], ...]:
    """Per stream of a [hc·D] row (hyper-connection heads: hc streams of D, stream-major): (max|a-e|, max|e|,
    max|a|), so a report can say which stream diverged (e.g. the e term added to stream 0 only)."""
    a = actual.astype(np.float64).reshape(streams, -1)
    e = expected.astype(np.float64).reshape(streams, -1)
    return tuple((float(np.abs(x - y).max()), float(np.abs(y).max()), float(np.abs(x).max())) for x, y in zip(a, e))


def _worst(rank: np.ndarray, a: np.ndarray, e: np.ndarray) -> tuple[tuple[int, float, float], ...]:
    k = min(WORST_K, rank.size)
    top = np.argpartition(-rank, k - 1)[:k] if k else np.array([], dtype=int)
    top = top[np.lexsort((top, -rank[top]))]  # largest difference first, ties by index
    return tuple((int(i), float(e[i]), float(a[i])) for i in top)


# topk_weights follow each side's own topk_ids order; topk_ids compare as sets (an engine may list its top-k in any
# order). So a topk_weights row is compared in the expected side's id order wherever both rows select the same
# experts: one rule for the diff and for --explain (probe/explain.py), never sorted weights (which would pass a
# candidate that gives expert a the weight of expert b).
ALIGNED_BY_IDS, INDEX_STAGE = "topk_weights", "topk_ids"


def in_expected_id_order(weights: np.ndarray, ids: np.ndarray | None, expected_ids: np.ndarray | None) -> np.ndarray:
    """`weights` ([rows, k], in `ids`' order) reordered into `expected_ids`' order in each row where both select
    the same k distinct experts; other rows (sets differ: topk_ids reports them), and every row when either side's
    ids are unknown or of another shape, stay as they are."""
    if ids is None or expected_ids is None:
        return weights
    ids, expected_ids = np.asarray(ids, dtype=np.int64), np.asarray(expected_ids, dtype=np.int64)
    if ids.shape != expected_ids.shape or ids.shape != np.shape(weights):
        return weights  # a layout the self-checks report
    out = np.array(weights, copy=True)
    for row, (mine, theirs) in enumerate(zip(ids, expected_ids)):
        if not np.array_equal(mine, theirs) and np.array_equal(np.sort(mine), np.sort(theirs)) and \
                len(set(mine.tolist())) == len(mine):
            where = {int(e): j for j, e in enumerate(mine)}
            out[row] = weights[row, [where[int(e)] for e in theirs]]
    return out


def compare_stage_rows(stage: str, actual: np.ndarray, expected: np.ndarray, tol: Tol, index_set: bool,
                       ids: tuple[np.ndarray | None, np.ndarray | None] | None = None) -> StageRows:
    """Rows of one stage compared as the diff compares them, for callers holding whole arrays (--explain, the
    observer check): index sets as sets, float rows by RULE on float32 (topk_weights in the expected side's id order
    when `ids` = (actual's topk_ids, expected's topk_ids) are given). Nothing counts as unwritten but poison."""
    a, e = np.asarray(actual), np.asarray(expected)
    if index_set:
        return compare_index_sets(stage, 0, a.astype(np.int64).reshape(len(a), -1),
                                  e.astype(np.int64).reshape(len(e), -1), tol)
    if stage == ALIGNED_BY_IDS and ids is not None:
        a = in_expected_id_order(a, *ids)
    a = np.ascontiguousarray(a, dtype=np.float32).reshape(len(a), -1)
    e = np.ascontiguousarray(e, dtype=np.float32).reshape(len(e), -1)
    return rows_from_sums(stage, 0, e.shape[1], RULE.sums(a, e, tol), tol, zero_is_unwritten=False)
