"""`mtp-probe selftest` is part of the suite: every mutant caught and localised, every correct candidate passing
— and a selftest whose expectation is not met exits non-zero."""

import dataclasses

import probe.selftest as selftest
from probe.cli import cli
from tests.helpers import run_cli


def test_selftest_passes_on_the_bundled_fixture():
    result = run_cli(cli, ["selftest"])
    assert result.exit_code == 0, result.output
    last = result.output.strip().splitlines()[-1]
    assert last.startswith("SELFTEST PASSED | ") and " not" not in last
    rows = [line for line in result.output.splitlines() if line.startswith(("NO_QK_NORM", "POS_PLUS_ONE"))]
    assert any("diverged     attn@1" in r and "match" in r for r in rows)  # matches at t=0, caught at t=1
    assert any(r.startswith("POS_PLUS_ONE") and " 8  pass" in r for r in rows)


def test_selftest_fails_when_a_mutant_is_not_caught_as_expected(monkeypatch):
    by_name = {c.name: c for c in selftest.CASES}
    wrong = dataclasses.replace(by_name["ROPE_GPTJ"], expect=("diverged", "attn@0"))  # it really shows at t=1
    monkeypatch.setattr(selftest, "CASES", (by_name["C reference"], wrong))
    result = run_cli(cli, ["selftest"])
    assert result.exit_code == 1
    assert result.output.strip().splitlines()[-1].startswith("SELFTEST FAILED | 3/4 runs as expected, 1 not")
