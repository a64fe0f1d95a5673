"""Which comparisons are evidence, the verdict precedence, and first-divergence localisation."""

import numpy as np

from oracle.stages import STAGE_NAMES
from probe.compare import StageRows, compare_rows, rows_from_sums
from probe.evidence import QK_DEPENDENT, QkSensitivity, cell_at, decide, evidential_rows
from probe.rule import RULE
from probe.localize import first_divergence, first_divergence_per_token
from probe.tolerance import DEFAULT

ROWS = {"ok": [1, 1], "bad": [2, 1], "nan": [np.nan, 1], "unwritten": [0, 0]}  # candidate rows against [1, 1]
OK, BAD, NAN, UNWRITTEN = (compare_rows(np.array(ROWS[k], np.float32), np.ones(2, np.float32), DEFAULT) for k in ROWS)


def grid(tokens: int, stages=STAGE_NAMES, bad: dict | None = None, qk: QkSensitivity | None = None) -> list[StageRows]:
    """Compared rows of `stages` x `tokens`, all ok but the (stage, token) -> kind in `bad`; attention sensitive
    at every t >= 1 unless `qk` says otherwise."""
    bad = bad or {}
    qk = qk or QkSensitivity(np.arange(tokens) > 0, recorded=True)
    out = []
    for stage in stages:
        actual = np.array([ROWS[bad.get((stage, t), "ok")] for t in range(tokens)], np.float32)
        expected = np.ones((tokens, 2), np.float32)
        out.append(rows_from_sums(stage, 0, 2, RULE.sums(actual, expected, DEFAULT), DEFAULT,
                                  qk.blind(stage, 0, tokens)))
    return out


def test_rows_after_attention_are_evidence_only_where_the_reference_attention_is_sensitive():
    assert QK_DEPENDENT == ("attn", "res1", "mh", "mlp", "res2", "out")
    qk = QkSensitivity(np.array([False, True, False, True]), recorded=True)
    rows = {r.stage: evidential_rows(r).tolist() for r in grid(4, bad={("fc", 2): "unwritten"}, qk=qk)}
    assert rows["attn"] == rows["out"] == [False, True, False, True]
    assert rows["e"] == [True] * 4 and rows["fc"] == [True, True, False, True]
    attn = next(r for r in grid(4, qk=qk) if r.stage == "attn")
    assert [cell_at(attn, t).evidential for t in range(4)] == [False, True, False, True]


def test_no_sensitive_attention_row_is_inconclusive_even_at_many_tokens():
    blind = QkSensitivity(np.zeros(6, dtype=bool), recorded=True)
    verdict = decide(grid(6, qk=blind), [], STAGE_NAMES, blind)
    assert verdict.name == "inconclusive" and "depends on the attention weights" in verdict.reasons[0]
    twin = QkSensitivity(np.arange(6) == 4, recorded=True)  # one sensitive row is enough
    assert decide(grid(6, qk=twin), [], STAGE_NAMES, twin).name == "pass"


def test_a_reference_without_the_sensitivity_record_cannot_pass():
    unrecorded = QkSensitivity(np.zeros(5, dtype=bool), recorded=False)
    verdict = decide(grid(5, qk=unrecorded), [], STAGE_NAMES, unrecorded)
    assert verdict.name == "inconclusive" and "re-export" in verdict.reasons[0]


def test_pass_needs_attention_at_a_later_token():
    assert decide(grid(2), [], STAGE_NAMES).name == "pass"
    t1 = decide(grid(1), [], STAGE_NAMES)
    assert t1.name == "inconclusive" and t1.exit_code == 3 and "only at t=0" in t1.reasons[0]


def test_pass_needs_attn_and_out_captured():
    for missing in ("attn", "out"):
        stages = tuple(s for s in STAGE_NAMES if s != missing)
        verdict = decide(grid(4, stages), [], stages)
        assert verdict.name == "inconclusive" and missing in verdict.reasons[0]
    stages = tuple(s for s in STAGE_NAMES if s not in ("mh", "mlp"))
    assert decide(grid(4, stages), [], stages).name == "pass"


def test_precedence_invalid_over_diverged_over_inconclusive():
    stages = tuple(s for s in STAGE_NAMES if s != "out")
    diverged = grid(1, stages, {("fc", 0): "bad"})
    assert decide(diverged, [], stages).name == "diverged"
    assert decide(diverged, ["unwritten rows"], stages).name == "invalid"
    assert decide(grid(4, bad={("mlp", 2): "nan"}), [], STAGE_NAMES).exit_code == 1


def test_first_divergence_is_the_earliest_token_then_the_first_stage():
    cells = grid(8, bad={("fc", 5): "bad", ("out", 5): "bad", ("attn", 1): "bad", ("mlp", 1): "nan",
                         ("res2", 1): "bad"})
    first = first_divergence(cells)
    assert (first.stage, first.token) == ("attn", 1)
    assert first_divergence_per_token(cells) == {1: "attn", 5: "fc"}
    assert first_divergence(grid(3)) is None
    assert first_divergence(grid(3, bad={("fc", 0): "unwritten"})) is None  # unwritten is invalid, not a divergence
