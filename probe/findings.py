"""Measured observations about a candidate that name a classic cause in words, beside the verdict.

- The candidate is the reference itself (the same file, or a trace the oracle wrote from the same weights and
  inputs): the comparison checks no implementation, and the report says so.
- The candidate's rows equal the reference's rows shifted by one token (row t holds step t+1's values, or step
  t-1's): the classic harness bug of an off-by-one row offset or inputs fed one step ahead. Checked at the first
  divergent stage with the diff's own tolerance rule, so it is a measurement, not a guess.
"""

import os
from pathlib import Path

import numpy as np

from probe.compare import Cell, rows_from_sums
from probe.rule import RULE
from probe.tolerance import Tol

SHIFT_WINDOW = 256  # rows examined for a shift: enough to be sure, bounded whatever T


def candidate_findings(ref, cand, first: Cell | None, tols: dict[str, Tol]) -> tuple[str, ...]:
    findings = []
    itself = _is_the_reference(ref, cand)
    if itself:
        findings.append(itself)
    if first is not None:
        shift = _shift_finding(ref, cand, first.stage, tols[first.stage])
        if shift:
            findings.append(shift)
    return tuple(findings)


def _is_the_reference(ref, cand) -> str | None:
    try:
        if Path(cand.path).is_file() and os.path.samefile(ref.path, cand.path):
            return "the candidate is the reference file itself: this comparison checks no implementation"
    except OSError:
        return None
    ref_attrs, cand_attrs = getattr(ref, "attrs", {}), getattr(cand, "attrs", {})
    same = all(cand_attrs.get(k) is not None and cand_attrs.get(k) == ref_attrs.get(k)
               for k in ("checkpoint_digest", "inputs_digest"))
    if same and str(cand_attrs.get("producer", "")).startswith("mtp-oracle"):
        return (f"the candidate was written by the oracle ({cand_attrs['producer']}) from the reference's own "
                f"weights and inputs: it is a reference trace, not an implementation under test")
    return None


def _shift_finding(ref, cand, stage: str, tol: Tol) -> str | None:
    n = min(ref.num_tokens, SHIFT_WINDOW)
    if n < 3 or stage not in cand.stages:
        return None
    # `stage` held a divergent row, so its layout passed the self-checks: [T, width] float32 on both sides.
    actual = np.array(cand.stage_rows(stage, 0, n), dtype=np.float32)
    expected = np.array(ref.stage_rows(stage, 0, n), dtype=np.float32)
    if actual.shape != expected.shape:
        return None
    for offset, words in ((1, "row t holds step t+1's values"), (-1, "row t holds step t-1's values")):
        a, e = (actual[:-1], expected[1:]) if offset == 1 else (actual[1:], expected[:-1])
        if _all_within(a, e, tol) and not _all_within(actual, expected, tol):
            rows = f"tokens {0 if offset == 1 else 1}-{n - 2 if offset == 1 else n - 1}"
            return (f"rows shifted by one token: at stage {stage} the candidate's {words} ({rows} checked); the "
                    f"harness writes each step one row off, or feeds the inputs one step "
                    f"{'ahead' if offset == 1 else 'behind'}")
    return None


def _all_within(actual: np.ndarray, expected: np.ndarray, tol: Tol) -> bool:
    rows = rows_from_sums("shift", 0, expected.shape[1], RULE.sums(actual, expected, tol), tol,
                          zero_is_unwritten=False)
    return bool(rows.has_status({"ok"}).all())
