"""What a comparison can prove, and the verdict rule (invalid > diverged > inconclusive > pass).

Evidence is measured, never assumed. Attention's output at step t is Σ_j p_j v_j over the visible keys: q, k,
q_norm, k_norm and RoPE only move the weights p. The oracle records, per token, `attn` recomputed with uniform
weights over the visible keys (`/evidence/attn_uniform`, oracle/attention_evidence.py). Where that row passes the
diff's own tolerance rule against the real `attn` row, a candidate with a broken q/k path can produce the same row,
so `attn` and every stage after it (which see q/k only through `attn`) are not evidence of that path there: they
are `qk_blind`. That is always so at t=0 (one key: softmax ≡ 1) and at every t when the value rows coincide
(repeated token and hidden). A reference without the record is blind everywhere: at best `inconclusive`.

A row that failed a self-check (unwritten, wrong shape or dtype) is never evidence of anything.
"""

from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from oracle.stages import STAGE_BY_NAME, STAGE_NAMES, stage_index

from probe.compare import DIVERGENT_STATUSES, INVALID_STATUSES, Cell, StageRows

NOT_EVIDENCE = INVALID_STATUSES | {"tie"}  # a failed self-check, or a row excused by a routing near-tie

ATTENTION = STAGE_BY_NAME["attn"].name
HEAD_OUTPUT = STAGE_NAMES[-1]
REQUIRED_FOR_PASS = (ATTENTION, HEAD_OUTPUT)
# Stages that see q, k, q_norm, k_norm and RoPE only through the attention weights.
QK_DEPENDENT = STAGE_NAMES[stage_index(ATTENTION):]
EXIT_CODES = {"pass": 0, "diverged": 1, "invalid": 2, "inconclusive": 3}

QK_NOTE = (f"an {ATTENTION} row witnesses q, k, q_norm, k_norm and RoPE only where uniform attention weights would "
           f"have failed the tolerance there (measured by the oracle: /evidence/attn_uniform); elsewhere, t=0 "
           f"always, {', '.join(QK_DEPENDENT)} are marked not evidential (~)")
POSITION_NOTE = ("absolute positions are not evidenced by a self-contained trace: RoPE scores depend only on "
                 "relative positions, so a candidate that runs every step at a uniform offset p+k matches it "
                 "to rounding")
NO_RECORD = ("the reference records no attention-sensitivity evidence (/evidence/attn_uniform; it was exported by "
             "an older oracle), so no attn row can be counted as evidence of q, k, q_norm, k_norm or RoPE: "
             "re-export the reference with this version of mtp-oracle")


@dataclass(frozen=True)
class Verdict:
    name: str  # pass | diverged | invalid | inconclusive
    reasons: tuple[str, ...]

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.name]


@dataclass(frozen=True)
class QkSensitivity:
    """Per reference token: whether its attn row depends on the attention weights beyond the tolerance."""

    sensitive: np.ndarray  # bool [T]
    recorded: bool  # False: the reference holds no /evidence/attn_uniform (every row counts as blind)
    dependent: tuple[str, ...] = QK_DEPENDENT  # stages that see q/k only through attention (the family's rule)
    window: int | None = None  # a sliding-window head's W (evidence_rules "window"): only T > W evidences it

    def blind(self, stage: str, start: int, stop: int) -> np.ndarray:
        """Rows start..stop of `stage` that cannot witness the q/k path."""
        if stage not in self.dependent:
            return np.zeros(stop - start, dtype=bool)
        return ~self.sensitive[start:stop]


def evidential_rows(rows: StageRows) -> np.ndarray:
    """Rows of `rows` that count as evidence: a valid comparison that could witness everything feeding the stage."""
    return ~rows.has_status(NOT_EVIDENCE) & ~rows.qk_blind


def cell_at(rows: StageRows, token: int) -> Cell:
    """Row `token` of `rows` as a Cell."""
    diff = rows.diff(token)
    evidential = diff.status not in NOT_EVIDENCE and not bool(rows.qk_blind[token - rows.start])
    return Cell(rows.stage, token, diff, evidential)


def qk_evidence_tokens(rows: Iterable[StageRows]) -> list[int]:
    """Tokens whose attn comparison witnesses the q/k path (valid and sensitive)."""
    for r in rows:
        if r.stage == ATTENTION:
            return r.tokens[evidential_rows(r)].tolist()
    return []


def qk_evidenced(rows: Iterable[StageRows]) -> bool:
    """True when some attention comparison witnesses the q/k path."""
    return bool(qk_evidence_tokens(rows))


def decide(rows: Iterable[StageRows], problems: Sequence[str], captured: Sequence[str],
           qk: QkSensitivity | None = None) -> Verdict:
    """The verdict from self-check problems, the compared rows of each stage and the captured stages."""
    rows = list(rows)
    if problems:
        return Verdict("invalid", tuple(problems))
    divergent = sum(int(r.has_status(DIVERGENT_STATUSES).sum()) for r in rows)
    if divergent:
        return Verdict("diverged", (f"{divergent} (stage, token) comparisons out of tolerance",))
    reasons = inconclusive_reasons(rows, captured, qk)
    return Verdict("inconclusive", reasons) if reasons else Verdict("pass", ())


def inconclusive_reasons(rows: Sequence[StageRows], captured: Sequence[str],
                         qk: QkSensitivity | None = None) -> tuple[str, ...]:
    """Why an all-within-tolerance comparison still proves too little to pass (empty when it proves enough)."""
    reasons = []
    missing = [name for name in REQUIRED_FOR_PASS if name not in captured]
    if missing:
        reasons.append(f"not captured: {', '.join(missing)} (pass needs {' and '.join(REQUIRED_FOR_PASS)} compared)")
    if ATTENTION in captured and (not qk_evidenced(rows) or (qk is not None and not qk.recorded)):
        reasons.append(_no_qk_reason(rows, qk))
    if ATTENTION in captured and qk is not None and qk.window is not None and len(qk.sensitive) <= qk.window:
        reasons.append(window_reason(qk.window, len(qk.sensitive)))
    tie = tie_reason(rows)
    if tie:
        reasons.append(tie)
    return tuple(reasons)


def tie_reason(rows: Sequence[StageRows]) -> str | None:
    """Why rows excused by a routing near-tie keep a comparison from passing: they differ and were not judged.

    A flip at a near-tie is rounding, not a wiring bug (so not a divergence), but the candidate's rows after the
    router at that token were then computed from other experts and checked against nothing; a pass must not count
    them (the red team passed garbage there). None when no row was excused."""
    excused = {r.stage: r.tokens[r.has_status({"tie"})].tolist() for r in rows}
    excused = {stage: tokens for stage, tokens in excused.items() if tokens}
    if not excused:
        return None
    tokens = sorted({t for ts in excused.values() for t in ts})
    shown = ", ".join(map(str, tokens[:12])) + (f" and {len(tokens) - 12} more" if len(tokens) > 12 else "")
    count = sum(len(ts) for ts in excused.values())
    if set(excused) == {"draft"}:  # a draft flip within the margin the out error explains (probe/drafts.py)
        return (f"draft near-ties at row(s) {shown}: the candidate's draft token differs where the reference's own "
                f"top-2 margin is within what its out error can move (draft_margin <= 2 * row_norm_max * "
                f"||out error||), so those draft rows were not judged either way")
    return (f"routing near-ties at token(s) {shown}: the candidate chose other experts within rounding there, so "
            f"{count} (stage, token) rows after the router ({', '.join(excused)}) differ and were not compared; "
            f"the rest is within tolerance. Compare at inputs without near-ties (other tokens or hidden rows), or "
            f"capture the candidate's own topk_ids so only the rows a flip explains are excused")


def window_reason(window: int, num_tokens: int) -> str:
    """Why a sliding-window head's trace with T <= W cannot evidence the window."""
    return (f"the sliding window (W={window}) is not evidenced: T={num_tokens} <= W, so no step drops a key (only "
            f"steps t >= W do) and a candidate with full causal attention, or another window, gives the same rows; "
            f"compare a reference with T > {window}")


def _no_qk_reason(rows: Sequence[StageRows], qk: QkSensitivity | None) -> str:
    if qk is not None and not qk.recorded:
        return NO_RECORD
    num_tokens = max((r.start + len(r) for r in rows), default=0)
    if num_tokens <= 1:
        return (f"{ATTENTION} compared only at t=0, where it sees one key (softmax ≡ 1): q, k, q_norm, k_norm and "
                f"RoPE are not evidenced; compare a trace with T >= 2")
    return (f"no {ATTENTION} row depends on the attention weights beyond the tolerance (uniform weights give the "
            f"same rows: repeated tokens and hidden?), so q, k, q_norm, k_norm and RoPE are not evidenced; "
            f"export the reference with distinct tokens and hidden rows")
