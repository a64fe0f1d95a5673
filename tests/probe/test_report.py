"""What the diff shows: the JSON report, the terminal table, -v side by side, the PNG heatmap, the summary line."""

import json

import numpy as np
import pytest

from oracle.stages import STAGE_NAMES
from probe.diff import diff_traces
from probe.report import coverage_text, render_text, summary_line
from tests.helpers import TINY_REF
from tests.probe.tracekit import (copy_stages, diff_cli, last_line, perturbed_from, ref_data,  # noqa: F401
                                  synthetic, write_h5)


def test_json_report_fields(tmp_path, ref_data):
    inputs, stages = ref_data
    path = write_h5(tmp_path / "c.h5", inputs, perturbed_from(stages, "ah", lambda r: r * 1.01))
    diff_cli(TINY_REF, path, "--json", tmp_path / "r.json")
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["verdict"] == "diverged" and report["exit_code"] == 1
    assert report["first_divergence"] == {"depth": 1, "stage": "ah", "token": 0,
                                          "budget_used": report["first_divergence"]["budget_used"]}
    assert len(report["rows"]) == 11 * 8 and report["summary"].startswith("DIVERGED |")
    row = next(r for r in report["rows"] if (r["stage"], r["token"]) == ("ah", 3))
    assert row["status"] == "values" and row["evidential"] is True
    assert row["budget_used"] == pytest.approx(min(row["max_rel"] / 1e-4, row["max_abs"] / 1e-5))
    assert row["budget_used"] > 1 and row["n_mismatch"] > 0
    for key in ("max_abs", "max_abs_index", "max_rel", "rel_l2", "cosine", "n_mismatch", "expected_stats",
                "actual_stats", "worst"):
        assert key in row
    t0_attn = next(r for r in report["rows"] if (r["stage"], r["token"]) == ("attn", 0))
    assert t0_attn["evidential"] is False
    # Full detail (statistics, worst elements) for each stage's first divergent row and its worst row only.
    detailed = [r for r in report["rows"] if r["detailed"]]
    assert {r["stage"] for r in detailed} == set(STAGE_NAMES)
    assert ("ah", 0) in {(r["stage"], r["token"]) for r in detailed}
    assert all(r["expected_stats"] and r["worst"] for r in detailed)
    assert all(r["expected_stats"] is None and r["worst"] == [] for r in report["rows"] if not r["detailed"])
    assert report["tolerances"]["fc"] == {"rtol": 1e-4, "atol": 1e-5, "why": report["tolerances"]["fc"]["why"]}
    assert any("absolute positions are not evidenced" in note for note in report["evidence_notes"])


def test_json_of_a_pass_has_no_first_divergence(tmp_path):
    diff_cli(TINY_REF, TINY_REF, "--json", tmp_path / "r.json")
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["verdict"] == "pass" and report["first_divergence"] is None and report["issues"] == []


def test_the_streamed_json_file_holds_report_json(tmp_path, ref_data):
    """write_json writes row by row (flat memory); the file parses to exactly report_json's document."""
    from probe.report import report_json, write_json

    inputs, stages = ref_data
    report = diff_traces(TINY_REF, write_h5(tmp_path / "c.h5", inputs, perturbed_from(stages, "mlp", lambda r: r + 1)))
    write_json(report, tmp_path / "r.json")
    assert json.loads((tmp_path / "r.json").read_text()) == report_json(report)


def test_nonfinite_values_are_strict_json(tmp_path, ref_data):
    inputs, stages = ref_data
    cand = copy_stages(stages)
    cand["out"][1, 1] = np.nan
    diff_cli(TINY_REF, write_h5(tmp_path / "c.h5", inputs, cand), "--json", tmp_path / "r.json")
    text = (tmp_path / "r.json").read_text()
    assert "NaN" not in text.replace('"nan"', "") and json.loads(text)["first_divergence"]["budget_used"] == "inf"


def test_plot_writes_a_png(tmp_path, ref_data):
    inputs, stages = ref_data
    cand = copy_stages(stages)
    cand["fc"][5:] += 1
    cand["mlp"][2] = 0  # unwritten
    result = diff_cli(TINY_REF, write_h5(tmp_path / "c.h5", inputs, cand), "--plot", tmp_path / "h.png")
    assert result.exit_code == 2
    assert (tmp_path / "h.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_verbose_shows_the_worst_elements_side_by_side(tmp_path, ref_data):
    inputs, stages = ref_data
    cand = copy_stages(stages)
    cand["res1"][4, 17] += 0.5
    path = write_h5(tmp_path / "c.h5", inputs, cand)
    quiet, loud = diff_cli(TINY_REF, path), diff_cli(TINY_REF, path, "-v")
    assert "worst elements" not in quiet.output and "worst elements" in loud.output
    line = next(s for s in loud.output.splitlines() if s.split()[:1] == ["17"])
    index, oracle, candidate, gap = line.split()
    assert float(oracle) == np.float32(stages["res1"][4, 17]) and float(candidate) == cand["res1"][4, 17]
    assert "first divergent stage: res1 at token 4" in last_line(loud)


def test_verbose_shows_a_stage_worst_valid_row_even_after_unwritten_rows(tmp_path, ref_data):
    """Unwritten rows (budget inf) come first in stage fc; its worst valid row (token 6) still has full detail."""
    from probe.poison import poison

    inputs, stages = ref_data
    cand = copy_stages(stages)
    cand["fc"][0:2] = poison((2, 64))
    cand["fc"][6, 3] += 0.25
    loud = diff_cli(TINY_REF, write_h5(tmp_path / "c.h5", inputs, cand), "-v")
    assert loud.exit_code == 2
    block = loud.output.split("fc token 6: values")[1].split("\n\n")[0]
    assert "worst elements" in block and block.splitlines()[2].split()[0] == "3"


def test_table_has_one_row_per_token_and_one_column_per_stage(tmp_path, ref_data):
    inputs, stages = ref_data
    cand = copy_stages(stages)
    cand["fc"][5] += 1
    result = diff_cli(TINY_REF, write_h5(tmp_path / "c.h5", inputs, cand))
    lines = result.output.splitlines()
    header = next(line for line in lines if line.startswith("token "))
    assert header.split()[1:] == list(STAGE_NAMES)
    t5 = next(line for line in lines if line.startswith("t5 ")).split()
    assert t5[4].endswith("!") and t5[1] == "0"
    table = [line for line in lines if line.startswith(("token ", "max ")) or line[:2] in {f"t{d}" for d in range(10)}]
    assert len(table) == 10 and all(len(line) <= 84 for line in table)


def test_long_traces_show_an_elided_table(tmp_path):
    inputs, stages = synthetic(100, 8)
    stages = {name: rows.copy() for name, rows in stages.items()}
    stages["out"][60] += 1
    path = write_h5(tmp_path / "long.h5", inputs, stages)
    cand = dict(stages)
    cand["out"] = stages["out"].copy()
    cand["out"][70] += 1
    text = render_text(diff_traces(path, write_h5(tmp_path / "cand.h5", inputs, cand)))
    assert "tokens 16-69 not shown" in text and "\nt70 " in text and "\nmax " in text


def test_coverage_text_is_derived_from_the_registry():
    assert coverage_text(tuple(STAGE_NAMES)) == "11 stages"
    assert coverage_text(tuple(s for s in STAGE_NAMES if s not in ("mh", "mlp"))) == \
        "9/11 stages, not captured: mh, mlp"


def test_summary_line_is_the_last_line(tmp_path):
    report = diff_traces(TINY_REF, TINY_REF)
    result = diff_cli(TINY_REF, TINY_REF)
    assert last_line(result) == summary_line(report)
