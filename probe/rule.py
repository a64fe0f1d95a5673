"""The tolerance rule: the one definition of when a candidate's (stage, token) row matches the oracle's row.

    pass  ⇔  max_rel < rtol  or  max_abs < atol,     max_abs = max_i |a_i - e_i|,  max_rel = max_abs / max_i |e_i|

(a = candidate row, e = oracle row, both widened to float64; a zero tolerance means exact equality; a NaN or Inf
on either side never passes.) `RULE` holds the rule and nothing else restates it:

- `RULE.text`: the description every report quotes (text, JSON, HTML);
- `RULE.specification(a, e, tol)`: the per-row sums the verdict is made from, in plain numpy: the definition;
- `RULE.sums(a, e, tol)`: the same sums from the compiled kernel (probe/_rowdiff.c, loaded by probe/rowdiff.py
  and tested equal to the specification in tests/probe/test_rowdiff.py); the specification runs where the kernel
  is not built;
- `RULE.judge(sums, tol)`: max_rel, budget_used and the verdict of each row, from those sums.

Every float comparison calls these: the diff's blocks, the rows shown in full detail (probe/compare.py), the probe's
check of the reference's `attn_uniform` evidence, the rows-shifted finding, and the export's warning that its
inputs cannot evidence q/k (oracle/attention_evidence.py). Index-set stages are compared as sets instead
(probe/compare.py `compare_index_sets`).

Sums, per row (fields of `ROW_SUMS`), with d_i = |a_i - e_i|:
    max_abs, index   the largest d_i and its first index; a NaN d_i ranks above every number
    e_max            max_i |e_i|
    aa, ee, dd, ae   sums of a_i², e_i², (a_i - e_i)², a_i·e_i
    n_mismatch       elements with d_i >= max(atol, rtol·e_max) or NaN, and d_i != 0: those that alone fail the row
    n_poison         elements of a that still hold the poison pattern (probe/poison.py)
A row whose oracle side holds NaN/Inf is refused by the diff before a verdict is read (e_max is unspecified there).
"""

from dataclasses import dataclass

import numpy as np

from probe import rowdiff
from probe.poison import is_poison
from probe.rowdiff import ROW_SUMS
from probe.tolerance import Tol


@dataclass(frozen=True)
class Judgement:
    """The rule's verdict on a block of rows, one entry per row."""

    max_rel: np.ndarray
    budget_used: np.ndarray  # min(max_rel / rtol, max_abs / atol): 1 = at the limit; inf where not finite
    finite: np.ndarray  # both rows finite (sums of squares finite: float32 squares cannot overflow a double)
    passes: np.ndarray  # finite and budget_used < 1


class RowRule:
    """max_rel < rtol or max_abs < atol, per row (module docstring)."""

    text = "pass iff max_rel < rtol or max_abs < atol, max_rel = max|a-e| / max|e| per (stage, token) row"
    fields = ROW_SUMS

    def specification(self, actual: np.ndarray, expected: np.ndarray, tol: Tol) -> np.ndarray:
        """ROW_SUMS of each row of two [rows, width] arrays, in plain numpy: the definition the kernel must equal."""
        a, e = actual.astype(np.float64), expected.astype(np.float64)
        signed = a - e
        d = np.abs(signed)
        rank = np.where(np.isnan(d), np.inf, d)
        rows = np.arange(len(d))
        out = np.empty(len(d), dtype=ROW_SUMS)
        out["index"] = rank.argmax(axis=1) if d.shape[1] else 0
        out["max_abs"] = d[rows, out["index"]] if d.shape[1] else 0.0
        out["e_max"] = np.abs(e).max(axis=1, initial=0.0)
        for field, x, y in (("aa", a, a), ("ee", e, e), ("dd", signed, signed), ("ae", a, e)):
            out[field] = np.einsum("ij,ij->i", x, y)
        limit = np.maximum(tol.atol, tol.rtol * out["e_max"])
        out["n_mismatch"] = np.count_nonzero(~(d < limit[:, None]) & (d != 0), axis=1)  # a NaN counts
        out["n_poison"] = np.count_nonzero(is_poison(actual), axis=1)
        return out

    def sums(self, actual: np.ndarray, expected: np.ndarray, tol: Tol) -> np.ndarray:
        """ROW_SUMS of each row of two float32 [rows, width] arrays of one shape: the kernel where built."""
        found = rowdiff.kernel_sums(actual, expected, tol)
        return self.specification(actual, expected, tol) if found is None else found

    def judge(self, sums: np.ndarray, tol: Tol) -> Judgement:
        """The verdict of each row from its sums."""
        finite = np.isfinite(sums["aa"]) & np.isfinite(sums["ee"])
        max_rel = ratios(sums["max_abs"], sums["e_max"])
        budget = np.where(finite, np.minimum(ratios(max_rel, tol.rtol), ratios(sums["max_abs"], tol.atol)), np.inf)
        return Judgement(max_rel, budget, finite, finite & (budget < 1))

    def passes_at(self, max_abs: np.ndarray, e_max: np.ndarray, tol: Tol) -> np.ndarray:
        """Per row, from its max_abs and max|e| alone (all the rule reads of a finite row): whether it passes.
        The probe judges the oracle's recorded q/k-part variant distances (/evidence/qk_<part>) with it."""
        max_abs, e_max = np.asarray(max_abs, dtype=np.float64), np.asarray(e_max, dtype=np.float64)
        budget = np.minimum(ratios(ratios(max_abs, e_max), tol.rtol), ratios(max_abs, tol.atol))
        return np.isfinite(max_abs) & (budget < 1)

    def passes(self, actual: np.ndarray, expected: np.ndarray, tol: Tol) -> np.ndarray:
        """Per row of two float32 [rows, width] arrays: whether the rule passes it."""
        return self.judge(self.sums(actual, expected, tol), tol).passes


RULE = RowRule()


def ratios(values: np.ndarray, limits: np.ndarray | float) -> np.ndarray:
    """values / limits elementwise: 0 where the value is 0 (even over a zero limit), inf where only the limit is 0."""
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.where(values == 0, 0.0, values / limits)
    return np.where((values != 0) & (np.asarray(limits) == 0), np.inf, out)
