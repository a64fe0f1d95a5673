"""Which comparisons are evidence, the verdict precedence, and first-divergence localisation."""

import numpy as np

from oracle.stages import STAGE_NAMES
from probe.compare import StageRows, compare_block, compare_rows
from probe.evidence import QK_BLIND_AT_T0, decide, evidential_rows, is_evidential
from probe.localize import first_divergence, first_divergence_per_token
from probe.tolerance import DEFAULT

ROWS = {"ok": [1, 1], "bad": [2, 1], "nan": [np.nan, 1], "unwritten": [0, 0]}  # candidate rows against [1, 1]
OK, BAD, NAN, UNWRITTEN = (compare_rows(np.array(ROWS[k], np.float32), np.ones(2, np.float32), DEFAULT) for k in ROWS)


def grid(tokens: int, stages=STAGE_NAMES, bad: dict | None = None) -> list[StageRows]:
    """Compared rows of `stages` x `tokens`, all ok but the (stage, token) -> kind in `bad`."""
    bad = bad or {}
    out = []
    for stage in stages:
        actual = np.array([ROWS[bad.get((stage, t), "ok")] for t in range(tokens)], np.float32)
        out.append(compare_block(stage, 0, actual, np.ones((tokens, 2), np.float32), DEFAULT))
    return out


def test_attention_and_downstream_at_t0_are_not_evidential():
    assert QK_BLIND_AT_T0 == ("attn", "res1", "mh", "mlp", "res2", "out")
    assert not any(is_evidential(s, 0, OK) for s in QK_BLIND_AT_T0)
    assert all(is_evidential(s, 0, OK) for s in ("e", "h", "fc_in", "fc", "ah"))
    assert all(is_evidential(s, 1, OK) for s in STAGE_NAMES)
    assert not is_evidential("fc", 3, UNWRITTEN)
    rows = {r.stage: evidential_rows(r).tolist() for r in grid(3, bad={("fc", 2): "unwritten"})}
    assert rows["attn"] == rows["out"] == [False, True, True]
    assert rows["e"] == [True, True, True] and rows["fc"] == [True, True, False]


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
