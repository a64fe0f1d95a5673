"""A candidate and a reference that disagree on the position-0 embedding mask (issue 29): where `e` differs at
exactly the steps at absolute position 0, the message names the convention (--mask-pos0-embedding), both ways,
instead of "never written, check the row offset". Twin: zero rows elsewhere are still unwritten rows."""

import pytest

from oracle.cli import cli as oracle_cli
from probe.adapters.trace_file import open_reference
from probe.diff import diff_sources
from probe.run import ArraySource
from probe.tolerance import tol_table
from tests.helpers import load_script, run_cli
from tests.probe.tracekit import diff_cli, last_line, load_trace, write_raw

FIXTURES = load_script("make_fixtures")
STEM = ("e", "h", "fc_in", "fc")  # what the raw dumps capture


@pytest.fixture(scope="module")
def refs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pos0")
    ckpt = FIXTURES.write_mtp_layer_checkpoint(root / "ckpt", "deepseek_v3")
    out = {}
    for name, extra in (("plain", ()), ("masked", ("--mask-pos0-embedding",))):
        out[name] = root / f"{name}.h5"
        result = run_cli(oracle_cli, ["export", ckpt, "--out", out[name], "--tokens", "5,17,3,99,200,7",
                                      "--hidden-seed", "0", "-q", *extra])
        assert result.exit_code == 0, result.output
    return out


def raw_dump(tmp_path, ref, change=None):
    inputs, stages = load_trace(ref)
    stages = {n: stages[n].copy() for n in STEM}
    if change:
        change(stages)
    return write_raw(tmp_path / "dump", stages, inputs)


def test_a_dump_that_masks_position_0_against_an_unmasked_reference_names_the_flag(tmp_path, refs):
    result = diff_cli(refs["plain"], raw_dump(tmp_path, refs["masked"]))
    assert result.exit_code == 2
    assert "position-0 embedding mask differs: e at token(s) 0" in last_line(result)
    assert "--mask-pos0-embedding" in result.output and "Check the row offset" not in result.output


def test_the_reverse_an_unmasked_dump_against_a_masked_reference_names_the_flag(tmp_path, refs):
    result = diff_cli(refs["masked"], raw_dump(tmp_path, refs["plain"]))
    assert result.exit_code == 1 and "first divergent stage: e" in last_line(result)
    assert "exported with --mask-pos0-embedding and the candidate does not mask" in result.output


def test_a_driven_candidate_that_masks_against_an_unmasked_reference_names_the_flag(refs):
    """Poison-filled buffers (the C and Python adapters): a zero row is a computed value, compared (DIVERGED)."""
    inputs, stages = load_trace(refs["masked"])
    with open_reference(refs["plain"]) as ref:
        report = diff_sources(ref, ArraySource("engine", inputs, {n: stages[n] for n in STEM}), tol_table())
    assert report.verdict.name == "diverged"
    assert any("the candidate masks the position-0 embedding" in f for f in report.findings)


def test_twin_zero_rows_that_are_not_the_position_0_steps_are_still_unwritten(tmp_path, refs):
    def zero_rows_1_and_2(stages):
        stages["e"][1:3] = 0.0

    result = diff_cli(refs["plain"], raw_dump(tmp_path, refs["plain"], zero_rows_1_and_2))
    assert result.exit_code == 2 and "unwritten rows: e at token(s) 1-2" in last_line(result)
    assert "Check the row offset" in result.output and "--mask-pos0-embedding" not in result.output


def test_twin_a_dump_that_masks_position_0_and_also_zeroes_another_row_is_unwritten(tmp_path, refs):
    def also_row_3(stages):
        stages["e"][3] = 0.0

    result = diff_cli(refs["plain"], raw_dump(tmp_path, refs["masked"], also_row_3))
    assert result.exit_code == 2 and "unwritten rows" in last_line(result)
    assert "mask differs" not in last_line(result)


def test_twin_matching_conventions_pass_the_stem(tmp_path, refs):
    for name in ("plain", "masked"):
        result = diff_cli(refs[name], raw_dump(tmp_path / name, refs[name]))
        assert result.exit_code == 3 and last_line(result).startswith("INCONCLUSIVE | all compared rows within"), \
            result.output  # the stem matches; attn and out were not captured
        assert "position-0 embedding" not in result.output
