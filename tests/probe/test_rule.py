"""The tolerance rule is one object (probe/rule.py RULE): every comparison path decides through it, and the
reports quote its own text."""

import numpy as np
import pytest

from oracle.attention_evidence import qk_blind_tokens
from probe import explain
from probe.compare import compare_block, compare_rows
from probe.rule import RULE, RowRule
from probe.tolerance import DEFAULT, Tol
from tests.probe.test_rowdiff import rows_of_every_kind


def rows_at_the_limits(tol: Tol) -> tuple[np.ndarray, np.ndarray]:
    """Rows with max_rel just below, at and just above rtol, and max_abs just below and above atol."""
    expected = np.tile(np.float32([1.0, -2.0, 0.5, 0.0]), (6, 1))
    actual = expected.copy()
    for row, rel in enumerate((0.5, 0.999, 1.001, 2.0)):
        actual[row, 1] += np.float32(2.0 * tol.rtol * rel)  # max|e| = 2
    expected[4:] *= np.float32(1e-3)  # tiny rows: only atol can pass them
    actual[4:] = expected[4:]
    actual[4, 0] += np.float32(0.5 * tol.atol)
    actual[5, 0] += np.float32(3.0 * tol.atol)
    return actual, expected


def every_path(actual: np.ndarray, expected: np.ndarray, tol: Tol) -> dict[str, list[bool]]:
    """Whether each comparison path passes each row."""
    return {"RULE": RULE.passes(actual, expected, tol).tolist(),
            "compare_rows": [bool(compare_rows(a, e, tol, zero_is_unwritten=False).status == "ok")
                             for a, e in zip(actual, expected)],
            "compare_block": compare_block("attn", 0, actual, expected, tol, zero_is_unwritten=False)
                             .has_status({"ok"}).tolist(),
            "explain": explain._verdicts("attn", actual, expected, tol, {})[1].tolist()}


@pytest.mark.parametrize("tol", [DEFAULT, Tol(5e-2, 1e-3, "bf16")], ids=str)
def test_every_path_decides_as_the_rule(tol):
    actual, expected = rows_at_the_limits(tol)
    paths = every_path(actual, expected, tol)
    assert paths["RULE"] == [True, True, False, False, True, False]
    assert all(verdicts == paths["RULE"] for verdicts in paths.values()), paths


def test_every_path_agrees_on_every_kind_of_row():
    actual, expected = rows_of_every_kind(300)
    finite_reference = np.isfinite(expected).all(axis=1)
    actual, expected = actual[finite_reference], expected[finite_reference]
    paths = every_path(actual, expected, DEFAULT)
    poisoned = ~np.isfinite(actual).all(axis=1) | (actual == 0).all(axis=1)
    assert paths["compare_rows"] == paths["compare_block"]
    assert [v for v, p in zip(paths["RULE"], poisoned) if not p] == \
        [v for v, p in zip(paths["explain"], poisoned) if not p]


def test_the_paths_go_through_the_one_object(monkeypatch):
    """Twin: a different rule installed on the object changes every path's verdict, so none restates the rule."""
    actual, expected = rows_at_the_limits(DEFAULT)
    honest = every_path(actual, expected, DEFAULT)
    original = RowRule.judge

    def stricter(self, sums, tol):
        return original(self, sums, Tol(tol.rtol / 4, tol.atol / 4, "stricter"))

    monkeypatch.setattr(RowRule, "judge", stricter)
    changed = every_path(actual, expected, DEFAULT)
    assert all(changed[path] != honest[path] for path in honest), (honest, changed)


def test_the_exports_restatement_equals_the_rule():
    """The oracle never imports the probe, so its q/k warning restates the rule with the default tolerance: held
    equal here, on rows at the limits and rows of every kind (NaN, Inf, zeros)."""
    from oracle import attention_evidence

    assert (attention_evidence.WARN_RTOL, attention_evidence.WARN_ATOL) == (DEFAULT.rtol, DEFAULT.atol)
    for actual, expected in (rows_at_the_limits(DEFAULT), rows_of_every_kind(300), rows_of_every_kind(7, seed=3)):
        assert qk_blind_tokens(expected, actual).tolist() == RULE.passes(actual, expected, DEFAULT).tolist()


def test_the_reports_quote_the_rules_own_text(tmp_path):
    import json

    from click.testing import CliRunner

    from probe.cli import cli
    from tests.helpers import TINY_REF

    import html

    result = CliRunner().invoke(cli, ["diff", str(TINY_REF), str(TINY_REF), "--json", str(tmp_path / "r.json"),
                                      "--html", str(tmp_path / "r.html")])
    assert result.exit_code == 0, result.output
    assert f"tolerance  {RULE.text}" in result.stdout
    assert json.loads((tmp_path / "r.json").read_text())["rule"] == RULE.text
    assert html.escape(RULE.text) in (tmp_path / "r.html").read_text()
