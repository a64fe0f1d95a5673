"""Progress on stderr: a tqdm bar (count, rate, ETA) on a terminal, one final timing line per loop otherwise,
nothing with -q, and nothing from library calls unless the caller turns reporting on."""

import io
import re
import sys

import pytest

from oracle import progress
from oracle.cli import cli as oracle_cli
from oracle.export import HiddenSource, export_trace
from oracle.progress import Progress, reporting, timing_line, tracked
from probe.cli import cli as probe_cli
from tests.helpers import ROOT, TINY, TINY_REF, run_cli

CANDIDATES = ROOT / "fixtures" / "candidates"


def test_timing_line_wording():
    assert timing_line("export", 1, 1, "step", 0.5) == "export: 1 step in 0.50 s (2 steps/s)"
    assert timing_line("diff", 3, 8, "row", 2.0) == "diff: 3/8 rows in 2.00 s (1.5 rows/s)"


def test_a_terminal_gets_a_bar_with_count_rate_and_eta(monkeypatch):
    fake = io.StringIO()
    monkeypatch.setattr(sys, "stderr", fake)
    monkeypatch.setattr(progress, "_is_terminal", lambda: True)
    with reporting():
        for _ in tracked(range(4), "export (stepwise)", 4):
            pass
    shown = fake.getvalue()
    assert "export (stepwise)" in shown and "4/4" in shown and "step/s" in shown
    assert re.search(r"\d+/4 \[\d\d:\d\d<\d\d:\d\d", shown)  # elapsed<remaining: the ETA


def test_twin_not_a_terminal_gets_one_line_and_quiet_or_library_gets_nothing(capsys):
    with reporting():
        with Progress("export (batched)", 8) as bar:
            bar.update(8)
    assert re.fullmatch(r"export \(batched\): 8 steps in \d+\.\d\d s \(.*steps/s\)\n", capsys.readouterr().err)
    with reporting(enabled=False):
        with Progress("x", 2) as bar:
            bar.update(2)
    with Progress("library", 2) as bar:  # no reporting block: a library call
        bar.update(2)
    assert capsys.readouterr().err == ""


def test_a_loop_that_raises_prints_no_timing_line(capsys):
    with reporting(), pytest.raises(ValueError):
        with Progress("run", 8) as bar:
            raise ValueError("candidate crashed")
    assert capsys.readouterr().err == ""


def test_library_export_is_silent(tmp_path, capsys):
    export_trace(TINY, tmp_path / "ref.h5", [5, 17, 3], HiddenSource(seed=0))
    assert capsys.readouterr().err == ""


def test_export_cli_prints_a_final_timing_line_and_is_quiet_with_q(tmp_path):
    args = ["export", TINY, "--tokens", "5,17,3", "--hidden-seed", "0", "--mode", "stepwise"]
    loud = run_cli(oracle_cli, [*args, "--out", tmp_path / "a.h5"])
    assert loud.exit_code == 0 and re.search(r"^export \(stepwise\): 3 steps in \d", loud.stderr, re.M)
    assert "\r" not in loud.stderr  # no bar redrawn into a log file
    quiet = run_cli(oracle_cli, [*args, "--out", tmp_path / "b.h5", "-q"])
    assert quiet.exit_code == 0 and quiet.stderr == ""


def test_run_reports_the_candidates_steps_for_python_and_c(tmp_path, monkeypatch):
    from probe.adapters.cabi import build_library

    monkeypatch.syspath_prepend(str(CANDIDATES))
    result = run_cli(probe_cli, ["run", TINY_REF, "--impl", "python:numpy_step:make_head"])
    assert result.exit_code == 0 and "candidate python:numpy_step:make_head: 8 steps in" in result.stderr
    lib = build_library(CANDIDATES / "mtp_step.c", tmp_path)
    result = run_cli(probe_cli, ["run", TINY_REF, "--impl", f"c:{lib}"])
    assert result.exit_code == 0 and "candidate c:mtp_step.so: 8 steps in" in result.stderr
    quiet = run_cli(probe_cli, ["run", TINY_REF, "--impl", f"c:{lib}", "-q"])
    assert quiet.exit_code == 0 and "steps in" not in quiet.stderr


def test_the_c_workers_steps_are_read_from_its_progress_file(tmp_path):
    from probe.adapters.cabi import _steps_done

    path = tmp_path / "progress.txt"
    assert _steps_done(path, 8) == 0
    path.write_text("load\t0.0\ncreate\t0.1\nstep 0\t0.2\nstep 1\t0.3\nstep 2\t0.4\n")
    assert _steps_done(path, 8) == 2
    path.write_text(path.read_text() + "destroy\t0.5\n")
    assert _steps_done(path, 8) == 8


def test_on_a_terminal_run_of_a_c_library_ends_with_a_full_bar(tmp_path, monkeypatch):
    from probe.adapters.cabi import build_library

    monkeypatch.setattr(progress, "_is_terminal", lambda: True)
    lib = build_library(CANDIDATES / "mtp_step.c", tmp_path)
    result = run_cli(probe_cli, ["run", TINY_REF, "--impl", f"c:{lib}"])
    assert result.exit_code == 0 and re.search(r"candidate c:mtp_step\.so: 100%.*8/8", result.stderr)


def test_diff_reports_the_rows_it_compared(tmp_path):
    result = run_cli(probe_cli, ["diff", TINY_REF, TINY_REF])
    assert result.exit_code == 0 and re.search(r"^diff: 88 rows in \d", result.stderr, re.M)  # 11 stages x 8 tokens
    assert "rows in" not in run_cli(probe_cli, ["diff", TINY_REF, TINY_REF, "-q"]).stderr


def test_a_tracked_loop_left_early_closes_without_a_timing_line(capsys):
    with reporting():
        for i in tracked(range(8), "diff", 8):
            if i == 3:
                break
        assert capsys.readouterr().err == ""
        assert list(tracked(range(2), "diff", 2)) == [0, 1]
    assert capsys.readouterr().err.startswith("diff: 2 steps in")


# --- heartbeat: a sign of life in a log while a loop runs long -------------------------------------------------

def _slow_loop(seconds: float, desc: str = "export (stepwise)", steps: int = 4):
    import time

    with reporting():
        with Progress(desc, steps) as bar:
            for _ in range(steps):
                time.sleep(seconds / steps)
                bar.update()


def test_not_a_terminal_gets_a_heartbeat_line_while_a_long_loop_runs(capsys, monkeypatch):
    monkeypatch.setattr(progress, "HEARTBEAT_S", 0.05)
    _slow_loop(0.4)
    lines = capsys.readouterr().err.splitlines()
    beats = [line for line in lines if line.endswith("still running")]
    assert len(beats) >= 3 and all(re.fullmatch(r"export \(stepwise\): \d/4 steps after \d+ s, still running", b)
                                   for b in beats)
    assert re.fullmatch(r"export \(stepwise\): 4 steps in .*", lines[-1])  # the timing line comes last


def test_twin_no_heartbeat_on_a_terminal_with_q_or_in_a_short_loop(capsys, monkeypatch):
    monkeypatch.setattr(progress, "HEARTBEAT_S", 0.05)
    with reporting(enabled=False):
        with Progress("quiet", 2) as bar:
            import time
            time.sleep(0.2)
            bar.update(2)
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(progress, "HEARTBEAT_S", 5.0)
    _slow_loop(0.1)
    assert "still running" not in capsys.readouterr().err  # shorter than the interval: only the timing line
    monkeypatch.setattr(progress, "HEARTBEAT_S", 0.05)
    fake = io.StringIO()
    monkeypatch.setattr(sys, "stderr", fake)
    monkeypatch.setattr(progress, "_is_terminal", lambda: True)
    _slow_loop(0.3)
    assert "still running" not in fake.getvalue()  # the bar is the sign of life there


def test_a_stepwise_export_in_a_log_has_heartbeats_and_says_what_it_loads(tmp_path, monkeypatch):
    monkeypatch.setattr(progress, "HEARTBEAT_S", 0.001)
    result = run_cli(oracle_cli, ["export", TINY, "--out", tmp_path / "r.h5", "--tokens", "5,17,3,4,9,11",
                                  "--hidden-seed", "0", "--mode", "stepwise"])
    assert result.exit_code == 0, result.output
    assert "still running" in result.output
    assert "loading torch and transformers" in result.output
