"""Draft near-ties: when a differing `draft` row (the head's argmax token, an index set [rows, 1]) is rounding.

The oracle records, per row, the reference's own top-1 minus top-2 draft logit (/evidence/draft_margin, exact
float32 logits) and, as its attribute `row_norm_max`, the largest L2 norm of a row of the draft projection. A
candidate whose `out` row is off by d (L2) moves every logit by at most row_norm_max * d, so the top two can swap
only if draft_margin <= 2 * row_norm_max * d. d is measured from the candidate's own `out` row where it captured
one (the diff's per-row sums: sqrt(dd)); without a captured out, d is the most a row within the out tolerance can
be off: sqrt(D) * max(atol, rtol * max|e|). A flip inside that bound is `tie` (a near-tie: inconclusive, never a
pass, as for routing); outside it, or without a verified draft_margin record, a flip is a divergence.
"""

import math

import numpy as np

from probe.compare import INVALID_STATUSES, StageRows
from probe.errors import ReferenceTraceError

DRAFT_STAGE, HEAD_OUT = "draft", "out"


class DraftTies:
    """The draft stage's near-tie rows of one depth, from the reference's margin and the candidate's out rows."""

    def __init__(self, ref, margin: np.ndarray | None, row_norm_max: float, out_tol):
        self.ref, self.margin, self.row_norm_max, self.out_tol = ref, margin, row_norm_max, out_tol
        self.out_l2 = None if margin is None else np.full(len(margin), np.nan)  # measured ||Δout||_2 per row

    @staticmethod
    def of(ref, cand, tols) -> "DraftTies":
        if DRAFT_STAGE not in ref.stages or not ref.has_evidence("draft_margin"):
            return DraftTies(ref, None, 0.0, None)
        total = ref.num_tokens
        margin = np.asarray(ref.evidence_rows("draft_margin", 0, total), dtype=np.float64)
        norm = ref.evidence_attr("draft_margin", "row_norm_max") if hasattr(ref, "evidence_attr") else None
        norm = float(np.asarray(norm).reshape(-1)[0]) if norm is not None and np.size(norm) == 1 else None
        if margin.shape != (total, 1) or not np.isfinite(margin).all() or (margin < 0).any() or norm is None \
                or not math.isfinite(norm) or norm < 0:
            raise ReferenceTraceError(f"reference {ref.path}: its draft_margin evidence is {margin.dtype} "
                                      f"{margin.shape} with row_norm_max {norm}; the schema says float32 [rows, 1] "
                                      f"of finite margins >= 0 and a finite row_norm_max >= 0. Regenerate it with "
                                      f"mtp-oracle export.")
        return DraftTies(ref, margin[:, 0], norm, tols[HEAD_OUT])

    def saw(self, name: str, start: int, sums: np.ndarray, block: StageRows) -> None:
        """Keep ||Δout||_2 of each validly compared candidate `out` row (the diff's sums: dd = Σ (a - e)²)."""
        if self.margin is None or name != HEAD_OUT:
            return
        valid = ~block.has_status(INVALID_STATUSES)
        self.out_l2[start:start + len(sums)] = np.where(valid, np.sqrt(sums["dd"]), np.nan)

    def near_tie(self, start: int, stop: int) -> np.ndarray | None:
        """Rows start..stop where a draft flip is explainable by the out error: margin <= 2 * row_norm_max * d."""
        if self.margin is None:
            return None
        d = self.out_l2[start:stop].copy()
        unmeasured = np.isnan(d)
        if unmeasured.any():  # no captured (valid) out row: the most a row within the out tolerance can be off
            d[unmeasured] = self._tolerance_bound(start, stop)[unmeasured]
        return self.margin[start:stop] <= 2 * self.row_norm_max * d

    def _tolerance_bound(self, start: int, stop: int) -> np.ndarray:
        expected = np.asarray(self.ref.stage_rows(HEAD_OUT, start, stop), dtype=np.float64)
        tol = self.out_tol
        largest = np.maximum(tol.atol, tol.rtol * np.abs(expected).max(axis=1))  # the max|a-e| a passing row may have
        return math.sqrt(expected.shape[1]) * largest
