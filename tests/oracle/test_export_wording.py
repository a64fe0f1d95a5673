"""export's wording: one step is "1 step" (not "1 steps"), and a T=1 export warns, even with -q, that a diff
against it can at best be inconclusive; a T=2 export of distinct rows does not."""

from click.testing import CliRunner

from oracle.cli import cli
from tests.helpers import TINY


def _export(tmp_path, tokens: str):
    result = CliRunner().invoke(cli, ["export", str(TINY), "--out", str(tmp_path / f"{len(tokens)}.h5"), "--tokens",
                                      tokens, "--hidden-seed", "0", "-q"])
    assert result.exit_code == 0, result.output
    return result


def test_a_one_step_export_says_1_step_and_warns_that_a_diff_is_inconclusive(tmp_path):
    result = _export(tmp_path, "5")
    assert result.stdout.strip().endswith("1 step x 12 stages") and "1 steps" not in result.output
    assert "T=1" in result.stderr and "can at best be inconclusive" in result.stderr


def test_twin_two_distinct_steps_are_plural_and_carry_no_such_warning(tmp_path):
    result = _export(tmp_path, "5,17")
    assert result.stdout.strip().endswith("2 steps x 12 stages")
    assert "inconclusive" not in result.stderr
