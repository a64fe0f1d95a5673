"""Measured observations about a candidate that name a classic cause in words, beside the verdict.

- The candidate is the reference itself (the same file, or a trace the oracle wrote from the same weights and
  inputs): the comparison checks no implementation, and the report says so.
- The position-0 embedding mask the other way round: `e` diverges at exactly the steps at absolute position 0, zero
  in the candidate where the reference was exported without --mask-pos0-embedding, or not where it was exported
  with it (probe/selfcheck.py Pos0Convention names the convention instead of "never written").
- The candidate's rows equal the reference's rows shifted by one token (row t holds step t+1's values, or step
  t-1's): the classic harness bug of an off-by-one row offset or inputs fed one step ahead. Checked at the first
  divergent stage with the diff's own tolerance rule, so it is a measurement, not a guess: every row must match
  the shifted reference, AND at the rows where the shifted and unshifted reference differ (a trace whose rows
  repeat has few) the unshifted rows must fail, at two rows at least.
"""

import os
from pathlib import Path

import numpy as np

from probe.compare import DIVERGENT_STATUSES, Cell, rows_from_sums
from probe.rule import RULE
from probe.selfcheck import MASKED_STAGE, pos0_convention
from probe.tolerance import Tol

SHIFT_WINDOW = 256  # rows examined for a shift: enough to be sure, bounded whatever T


def candidate_findings(ref, cand, first: Cell | None, tols: dict[str, Tol],
                       rows: dict | None = None) -> tuple[str, ...]:
    findings = []
    convention = _pos0_mask_finding(ref, cand, rows or {})
    if convention:
        findings.append(convention)
    itself = _is_the_reference(ref, cand)
    if itself:
        findings.append(itself)
    if first is not None:
        shift = _shift_finding(ref, cand, first.stage, tols[first.stage])
        if shift:
            findings.append(shift)
    return tuple(findings)


def _pos0_mask_finding(ref, cand, rows: dict) -> str | None:
    """The position-0 embedding mask convention the other way round, named: `e` diverges at exactly the steps at
    absolute position 0, the candidate's rows zero where the reference is unmasked, or not where it masks."""
    pos0, e = pos0_convention(ref), rows.get(MASKED_STAGE)
    if pos0 is None or e is None or not pos0.tokens or MASKED_STAGE not in cand.stages:
        return None
    tokens = tuple(e.tokens[e.has_status(DIVERGENT_STATUSES)].tolist())
    if not tokens:
        return None
    zero = all(not np.asarray(cand.stage_rows(MASKED_STAGE, t, t + 1)).any() for t in tokens)
    return pos0.message(tokens) if pos0.explains(MASKED_STAGE, tokens, candidate_zero=zero) else None


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
        rows = slice(0, n - 1) if offset == 1 else slice(1, n)
        shifted = slice(1, n) if offset == 1 else slice(0, n - 1)
        telling = _shift_tells(actual[rows], expected[shifted], expected[rows], tol)
        if telling:
            first = 0 if offset == 1 else 1
            return (f"rows shifted by one token: at stage {stage} the candidate's {words} (tokens {first}-"
                    f"{first + n - 2} checked; at the {telling} of them where the reference's neighbouring rows "
                    f"differ, the shifted rows match and the unshifted ones fail); the harness writes each step one "
                    f"row off, or feeds the inputs one step {'ahead' if offset == 1 else 'behind'}")
    return None


MIN_TELLING_ROWS = 2  # rows where a shift and no shift predict different values: one could be a coincidence


def _shift_tells(actual: np.ndarray, shifted: np.ndarray, unshifted: np.ndarray, tol: Tol) -> int:
    """How many rows evidence the shift: every row matches the shifted reference, and at each row where the shifted
    and unshifted reference rows differ (only there can the two readings be told apart: a trace whose rows repeat
    has few or none) the unshifted comparison fails. 0 when the shift is not evidenced by at least
    MIN_TELLING_ROWS such rows."""
    if not _ok_rows(actual, shifted, tol).all():
        return 0
    telling = ~_ok_rows(unshifted, shifted, tol)
    if telling.sum() < MIN_TELLING_ROWS or _ok_rows(actual[telling], unshifted[telling], tol).any():
        return 0
    return int(telling.sum())


def _ok_rows(actual: np.ndarray, expected: np.ndarray, tol: Tol) -> np.ndarray:
    rows = rows_from_sums("shift", 0, expected.shape[1], RULE.sums(np.ascontiguousarray(actual),
                                                                  np.ascontiguousarray(expected), tol), tol,
                          zero_is_unwritten=False)
    return rows.has_status({"ok"})
