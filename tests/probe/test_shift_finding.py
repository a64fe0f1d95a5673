"""The "rows shifted by one token" finding is a measurement (issue 29): every row must match the shifted reference
AND, where the shifted and unshifted reference rows differ, the unshifted rows must fail. On a trace whose rows
repeat, a candidate wrong at one row matches the shifted reference everywhere, yet nothing shows a shift."""

import pytest

from oracle.cli import cli as oracle_cli
from oracle.trace import write_trace
from probe.adapters.trace_file import open_candidate, open_reference
from probe.findings import _shift_finding
from probe.tolerance import tol_table
from tests.helpers import TINY, run_cli
from tests.probe.tracekit import copy_stages, diff_cli, last_line, load_trace


def export(tmp_path, tokens: str):
    out = tmp_path / f"ref_{tokens.replace(',', '_')}.h5"
    result = run_cli(oracle_cli, ["export", TINY, "--out", out, "--tokens", tokens, "--hidden-seed", "0", "-q"])
    assert result.exit_code == 0, result.output
    return out


def candidate(tmp_path, ref, change):
    inputs, stages = load_trace(ref)
    stages = copy_stages(stages)
    change(stages)
    path = tmp_path / "cand.h5"
    stages.pop("draft", None)  # an engine that captures the head's stages, not its draft
    write_trace(path, inputs, stages, {"producer": "my engine"})
    return path


def finding(ref, cand, stage="e"):
    with open_reference(ref) as r, open_candidate(cand, r) as c:
        return _shift_finding(r, c, stage, tol_table()[stage])


@pytest.mark.parametrize("tokens, wrong_row", [("5,5,5,5,5,5,5,5", 0), ("5,5,5,5,5,5,5,17", 7),
                                               ("5,5,5,5,5,5,5,17", 0)])
def test_a_wrong_row_on_a_trace_whose_rows_repeat_is_no_shift(tmp_path, tokens, wrong_row):
    ref = export(tmp_path, tokens)

    def one_row_wrong(stages):
        stages["e"][wrong_row] = stages["e"][-1 - wrong_row] if tokens.endswith("17") else -stages["e"][wrong_row]

    cand = candidate(tmp_path, ref, one_row_wrong)
    result = diff_cli(ref, cand)
    assert result.exit_code == 1 and "first divergent stage: e" in last_line(result), result.output
    assert "rows shifted" not in result.output
    assert finding(ref, cand) is None


def test_twin_truly_shifted_rows_are_named_on_a_trace_that_can_tell(tmp_path):
    ref = export(tmp_path, "5,17,3,99,200,7,42,11")

    def shifted(stages):
        for name in stages:
            stages[name][:-1] = stages[name][1:].copy()  # row t holds step t+1's values

    cand = candidate(tmp_path, ref, shifted)
    said = finding(ref, cand)
    assert said and said.startswith("rows shifted by one token: at stage e the candidate's row t holds step t+1's")
    assert "rows shifted by one token" in last_line(diff_cli(ref, cand))


def test_twin_shifted_rows_on_a_trace_of_two_alternating_tokens_are_named(tmp_path):
    """Rows repeat with period 2: a shift by one still changes every row, so it is evidenced."""
    ref = export(tmp_path, "5,17,5,17,5,17,5,17")

    def shifted(stages):
        for name in stages:
            stages[name][1:] = stages[name][:-1].copy()  # row t holds step t-1's values

    said = finding(ref, candidate(tmp_path, ref, shifted))
    assert said and "row t holds step t-1's values" in said
