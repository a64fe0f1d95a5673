"""What a comparison can prove, and the verdict rule (invalid > diverged > inconclusive > pass).

Evidence is measured, never assumed. Attention's output at step t is Σ_j p_j v_j over the visible keys: q, k,
q_norm, k_norm and RoPE only move the weights p. The oracle records, per token, `attn` recomputed with uniform
weights over the visible keys (`/evidence/attn_uniform`, oracle/attention_evidence.py). Where that row passes the
diff's own tolerance rule against the real `attn` row, a candidate with a broken q/k path can produce the same row,
so `attn` and every stage after it (which see q/k only through `attn`) are not evidence of that path there: they
are `qk_blind`. That is always so at t=0 (one key: softmax ≡ 1) and at every t when the value rows coincide
(repeated token and hidden). A reference without the record is blind everywhere: at best `inconclusive`.

That measures the attention weights as a whole, never one part of the q/k path: in a saturated head (a query's
own key wins by a huge margin, or a sink takes almost all the mass) uniform weights move every row while RoPE
removed or the KV append skipped move none. So the oracle also records, per q/k-path part its family has (RoPE,
q_norm, k_norm, the KV append, the sliding window, the sink), how far each of the part's wrong variants moves every
attn row (`/evidence/qk_<part>`, oracle/qk_parts.py), and the probe judges those distances with the attn
tolerance: a compared attn row evidences a variant only where that variant would fail there. "The q/k path is
evidenced" (needed to pass) means: the attention pattern at some compared attn row (t >= 1 in practice), AND each
variant of every part the reference measured at some compared attn row; else the verdict is inconclusive, naming
the parts and variants not evidenced. A reference without the part records (an older oracle) keeps the first
condition only, and every report says its parts were not measured (never that they are evidenced).

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

QK_NOTE = (f"an {ATTENTION} row witnesses the attention pattern (softmax(q·k)) only where uniform attention "
           f"weights would have failed the tolerance there (measured by the oracle: /evidence/attn_uniform); "
           f"elsewhere, t=0 always, {', '.join(QK_DEPENDENT)} are marked not evidential (~). It witnesses a part "
           f"of the q/k path (RoPE, q_norm, k_norm, KV append, window, sink) only where that part's own wrong "
           f"variants would have failed there (/evidence/qk_<part>)")
PART_NAMES = {"rope": "RoPE", "q_norm": "q_norm", "k_norm": "k_norm", "kv_append": "KV append",
              "window": "sliding window", "sink": "attention sink"}
NOT_MEASURED = ("q/k path parts (RoPE, q_norm, k_norm, KV append, window, sink) not measured: the reference "
                "records no /evidence/qk_<part> (it was exported by an older oracle), so none of them is claimed "
                "evidenced; re-export it with this version of mtp-oracle to measure them")
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
    # {part: {variant: bool [T]}}: where the variant's attn row would FAIL the tolerance (/evidence/qk_<part>);
    # None when the reference predates the part records (the parts are "not measured")
    parts: dict[str, dict[str, np.ndarray]] | None = None

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


def part_evidence(rows: Iterable[StageRows], qk: QkSensitivity | None) -> dict[str, dict[str, list[int]]]:
    """{part: {variant: tokens}}: the compared, valid attn rows where each variant of each measured part would have
    failed the tolerance ({} when the parts were not measured or attn was not compared)."""
    if qk is None or not qk.parts:
        return {}
    attn = next((r for r in rows if r.stage == ATTENTION), None)
    if attn is None:
        return {part: {v: [] for v in variants} for part, variants in qk.parts.items()}
    valid = ~attn.has_status(NOT_EVIDENCE)
    return {part: {v: attn.tokens[valid & caught[attn.start:attn.start + len(attn)]].tolist()
                   for v, caught in variants.items()} for part, variants in qk.parts.items()}


def parts_not_evidenced(rows: Iterable[StageRows], qk: QkSensitivity | None) -> dict[str, list[str]]:
    """{part: [variants no compared attn row catches]} for the measured parts that are not evidenced."""
    found = part_evidence(rows, qk)
    return {part: [v for v, tokens in variants.items() if not tokens]
            for part, variants in found.items() if not all(variants.values())}


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
    # Parts are named only where the attention pattern is evidenced: otherwise the reason above says why no
    # part can be (T=1, repeated inputs), and "a saturated attention hides them" would point the wrong way.
    missing_parts = parts_not_evidenced(rows, qk) if ATTENTION in captured and qk_evidenced(rows) else {}
    if missing_parts:
        reasons.append(parts_reason(missing_parts))
    window_measured = qk is not None and qk.parts is not None and "window" in qk.parts
    if (ATTENTION in captured and qk is not None and qk.window is not None and not window_measured
            and len(qk.sensitive) <= qk.window):
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


def parts_reason(missing: dict[str, list[str]]) -> str:
    """Why an all-within-tolerance comparison cannot pass while parts of the q/k path are not evidenced."""
    named = "; ".join(f"{PART_NAMES.get(p, p)} ({', '.join(v)})" for p, v in missing.items())
    return (f"q/k path parts not evidenced: {named}: no compared {ATTENTION} row would have failed the tolerance "
            f"had the candidate made that mistake (measured by the oracle: /evidence/qk_<part>; a saturated "
            f"attention, where one key or the sink takes almost all the weight, hides them), so a candidate with "
            f"it gives the same rows; compare a reference whose inputs move them (other tokens, hidden rows, more "
            f"steps)")


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
