"""What a comparison can prove, and the verdict rule (invalid > diverged > inconclusive > pass).

At t=0 the head's attention sees one key, so softmax ≡ 1 and `attn` = o_proj(v · sigmoid(gate)) whatever q, k,
q_norm, k_norm and RoPE compute; every stage from `attn` on differs from the oracle only through what it receives,
so none of them witnesses that path at t=0. Only `attn` compared at some t >= 1 evidences it. A row that failed a
self-check (unwritten, wrong shape or dtype) is never evidence of anything.
"""

from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from oracle.stages import STAGE_BY_NAME, STAGE_NAMES, stage_index

from probe.compare import DIVERGENT_STATUSES, INVALID_STATUSES, Cell, StageDiff, StageRows

ATTENTION = STAGE_BY_NAME["attn"].name
HEAD_OUTPUT = STAGE_NAMES[-1]
REQUIRED_FOR_PASS = (ATTENTION, HEAD_OUTPUT)
QK_BLIND_AT_T0 = STAGE_NAMES[stage_index(ATTENTION):]
EXIT_CODES = {"pass": 0, "diverged": 1, "invalid": 2, "inconclusive": 3}

QK_NOTE = (f"at t=0 attention sees one key (softmax ≡ 1): {', '.join(QK_BLIND_AT_T0)} there cannot witness "
           f"q, k, q_norm, k_norm or RoPE (marked not evidential)")
POSITION_NOTE = ("absolute positions are not evidenced by a self-contained trace: RoPE scores depend only on "
                 "relative positions, so a candidate that runs every step at a uniform offset p+k matches it "
                 "to rounding")


@dataclass(frozen=True)
class Verdict:
    name: str  # pass | diverged | invalid | inconclusive
    reasons: tuple[str, ...]

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.name]


def is_evidential(stage: str, token: int, diff: StageDiff) -> bool:
    """Whether this comparison could fail for every computation that feeds the stage."""
    if diff.status in INVALID_STATUSES:
        return False
    return not (token == 0 and stage in QK_BLIND_AT_T0)


def evidential_rows(rows: StageRows) -> np.ndarray:
    """is_evidential for every row of `rows`, as a boolean mask."""
    mask = ~rows.has_status(INVALID_STATUSES)
    return mask & (rows.tokens != 0) if rows.stage in QK_BLIND_AT_T0 else mask


def cell_at(rows: StageRows, token: int) -> Cell:
    """Row `token` of `rows` as a Cell."""
    diff = rows.diff(token)
    return Cell(rows.stage, token, diff, is_evidential(rows.stage, token, diff))


def qk_evidenced(rows: Iterable[StageRows]) -> bool:
    """True when some attention comparison at t >= 1 was made (the q/k/RoPE path is witnessed)."""
    return any(r.stage == ATTENTION and evidential_rows(r).any() for r in rows)


def decide(rows: Iterable[StageRows], problems: Sequence[str], captured: Sequence[str]) -> Verdict:
    """The verdict from self-check problems, the compared rows of each stage and the captured stages."""
    rows = list(rows)
    if problems:
        return Verdict("invalid", tuple(problems))
    divergent = sum(int(r.has_status(DIVERGENT_STATUSES).sum()) for r in rows)
    if divergent:
        return Verdict("diverged", (f"{divergent} (stage, token) comparisons out of tolerance",))
    reasons = inconclusive_reasons(rows, captured)
    return Verdict("inconclusive", reasons) if reasons else Verdict("pass", ())


def inconclusive_reasons(rows: Sequence[StageRows], captured: Sequence[str]) -> tuple[str, ...]:
    """Why an all-within-tolerance comparison still proves too little to pass (empty when it proves enough)."""
    reasons = []
    missing = [name for name in REQUIRED_FOR_PASS if name not in captured]
    if missing:
        reasons.append(f"not captured: {', '.join(missing)} (pass needs {' and '.join(REQUIRED_FOR_PASS)} compared)")
    if ATTENTION in captured and not qk_evidenced(rows):
        reasons.append(f"{ATTENTION} compared only at t=0, where it sees one key (softmax ≡ 1): q, k, q_norm, "
                       f"k_norm and RoPE are not evidenced; compare a trace with T >= 2")
    return tuple(reasons)
