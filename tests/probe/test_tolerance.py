"""Tolerances: the default, per-stage overrides with a reason, and loud errors for bad values."""

import pytest

from oracle.stages import STAGE_NAMES
from probe.errors import ToleranceError
from probe.tolerance import DEFAULT, Tol, stage_tol_from_text, tol_table


def test_default_matches_the_design():
    assert (DEFAULT.rtol, DEFAULT.atol) == (1e-4, 1e-5)
    table = tol_table()
    assert table.for_stages(STAGE_NAMES) == {name: DEFAULT for name in STAGE_NAMES}
    assert table["router_logits"] == DEFAULT  # any family's stage gets the base


def test_override_applies_to_one_stage_and_records_why():
    table = tol_table(Tol(1e-3, 1e-4, "--rtol/--atol"), ["fc=1e-2, 1e-3"])
    assert (table["fc"].rtol, table["fc"].atol) == (1e-2, 1e-3) and "fc=1e-2" in table["fc"].why
    assert table["attn"] == Tol(1e-3, 1e-4, "--rtol/--atol")


def test_unknown_stage_lists_the_valid_names():
    with pytest.raises(ToleranceError, match="unknown stage 'fcc'.*e, h, fc_in, fc, ah, attn"):
        stage_tol_from_text("fcc=1e-3,1e-4")


@pytest.mark.parametrize("text", ["fc=1e-3", "fc", "fc=a,b", "fc=1e-3,1e-4,1"])
def test_both_numbers_required(text):
    with pytest.raises(ToleranceError, match="STAGE=RTOL,ATOL"):
        stage_tol_from_text(text)


@pytest.mark.parametrize("rtol, atol", [(-1e-3, 1e-4), (float("nan"), 1e-4), (1e-3, float("inf"))])
def test_tolerances_must_be_finite_and_non_negative(rtol, atol):
    with pytest.raises(ToleranceError, match="finite number >= 0"):
        Tol(rtol, atol, "test")


def test_a_stage_given_twice_is_an_error():
    with pytest.raises(ToleranceError, match="more than once"):
        tol_table(DEFAULT, ["fc=1e-3,1e-4", "fc=1e-2,1e-4"])


@pytest.mark.parametrize("args", [["--rtol", "10", "--atol", "10"], ["--rtol", "1", "--atol", "0"],
                                  ["--stage-tol", "mlp=1.5,1e-5"]])
def test_an_rtol_of_100_percent_or_more_on_the_command_line_is_refused(args):
    """Red team: --rtol 10 passed a candidate whose mlp was x -3 (PASSED, exit 0); a measured profile giving such an
    rtol was already refused. Twin: the largest rtol below 1 is accepted."""
    from probe.cli import cli
    from tests.helpers import TINY_REF, run_cli

    result = run_cli(cli, ["diff", TINY_REF, TINY_REF, *args])
    assert result.exit_code == 2 and "checks nothing" in result.output, result.output
    loose = run_cli(cli, ["diff", TINY_REF, TINY_REF, "--rtol", "0.99", "--atol", "1e-5"])
    assert loose.exit_code in (0, 3) and "checks nothing" not in loose.output, loose.output  # (3: attn rows blind)
