"""Which comparisons are evidence, the verdict precedence, and first-divergence localisation."""

import numpy as np

from oracle.stages import STAGE_NAMES
from probe.compare import Cell, compare_rows
from probe.evidence import QK_BLIND_AT_T0, decide, is_evidential
from probe.localize import first_divergence, first_divergence_per_token
from probe.tolerance import DEFAULT

OK = compare_rows(np.ones(2, np.float32), np.ones(2, np.float32), DEFAULT)
BAD = compare_rows(np.full(2, 2, np.float32), np.ones(2, np.float32), DEFAULT)
NAN = compare_rows(np.array([np.nan, 1], np.float32), np.ones(2, np.float32), DEFAULT)
UNWRITTEN = compare_rows(np.zeros(2, np.float32), np.ones(2, np.float32), DEFAULT)


def grid(tokens: int, stages=STAGE_NAMES, bad: dict | None = None) -> list[Cell]:
    bad = bad or {}
    return [Cell(s, t, bad.get((s, t), OK), is_evidential(s, t, bad.get((s, t), OK)))
            for s in stages for t in range(tokens)]


def test_attention_and_downstream_at_t0_are_not_evidential():
    assert QK_BLIND_AT_T0 == ("attn", "res1", "mh", "mlp", "res2", "out")
    assert not any(is_evidential(s, 0, OK) for s in QK_BLIND_AT_T0)
    assert all(is_evidential(s, 0, OK) for s in ("e", "h", "fc_in", "fc", "ah"))
    assert all(is_evidential(s, 1, OK) for s in STAGE_NAMES)
    assert not is_evidential("fc", 3, UNWRITTEN)


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
    diverged = grid(1, stages, {("fc", 0): BAD})
    assert decide(diverged, [], stages).name == "diverged"
    assert decide(diverged, ["unwritten rows"], stages).name == "invalid"
    assert decide(grid(4, bad={("mlp", 2): NAN}), [], STAGE_NAMES).exit_code == 1


def test_first_divergence_is_the_earliest_token_then_the_first_stage():
    cells = grid(8, bad={("fc", 5): BAD, ("out", 5): BAD, ("attn", 1): BAD, ("mlp", 1): NAN, ("res2", 1): BAD})
    first = first_divergence(cells)
    assert (first.stage, first.token) == ("attn", 1)
    assert first_divergence_per_token(cells) == {1: "attn", 5: "fc"}
    assert first_divergence(grid(3)) is None
    assert first_divergence(grid(3, bad={("fc", 0): UNWRITTEN})) is None  # unwritten is invalid, not a divergence
