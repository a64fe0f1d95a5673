"""Interrupts, one mechanism for every command (issue 29, cause 3): SIGINT or SIGTERM at any point leaves the previous
outputs byte for byte, nothing beside them or in TMPDIR, no process running, no traceback, and exit 128 + signal.

Each command is run once to its end first (the twin: its outputs do change, nothing is left, so the checks can
fail), then interrupted at fractions of that duration. `python -m tests.signal_trials` sweeps many more points."""

import signal

import pytest

from tests import signal_trials as trials
from tests.helpers import TINY, TINY_REF, run_cli

FRACTIONS = ((signal.SIGINT, 0.1), (signal.SIGTERM, 0.5), (signal.SIGINT, 0.85))


@pytest.fixture(scope="module")
def forking_library(tmp_path_factory):
    return trials.build_forking_library(tmp_path_factory.mktemp("forking"))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["export", "accept", "inputs", "noise", "diff", "selftest", "run_python", "run_c"])
def test_an_interrupt_at_any_point_leaves_the_previous_outputs_and_nothing_else(name, forking_library, tmp_path):
    command = trials.commands(forking_library)[name]
    marker = trials.FORK_PIDFILE if name == "run_c" else None
    whole = trials.run_trial(command, signal.SIGINT, 600, tmp_path / "whole", marker)  # never signalled
    duration = whole.elapsed
    assert whole.status in (0, 1) and whole.problems == [], whole
    folder = tmp_path / "whole" / "out"
    assert all((folder / n).read_bytes() != trials.PREVIOUS for n in command.outputs)  # the twin: they do change
    interrupted = []
    for signum, fraction in FRACTIONS:
        trial = trials.run_trial(command, signum, fraction * duration, tmp_path / f"t{fraction}", marker)
        assert trial.problems == [], trial
        interrupted.append(trial.interrupted)
    assert sum(interrupted) >= 2, f"too few trials were interrupted before {name} ended: {interrupted}"


def test_a_forking_librarys_child_does_not_outlive_a_run(forking_library, tmp_path):
    """Red team: a C library that forks kept its child running after the run (and after Ctrl-C): the worker leads
    its own process group, killed whole."""
    command = trials.commands(forking_library)["run_c"]
    trial = trials.run_trial(command, signal.SIGINT, 600, tmp_path, trials.FORK_PIDFILE)
    assert trial.status == 0 and trial.problems == [], trial
    assert (tmp_path / "child.pid").read_text().split(), "the library did not fork: the test would prove nothing"


def test_twin_the_survivor_check_sees_a_child_left_running(forking_library, tmp_path):
    """The check itself: a forked child nobody kills is reported."""
    import subprocess

    child = subprocess.Popen(["sleep", "30"])
    (tmp_path / "child.pid").write_text(f"{child.pid}\n")
    try:
        assert trials._survivors(-1, tmp_path / "child.pid") == [f"still running after the command ended: forked "
                                                                  f"child {child.pid}"]
    finally:
        child.kill()
        child.wait()


def _interrupting(what):
    def fail(*args, **kwargs):
        raise what

    return fail


def test_an_interrupt_after_one_report_was_written_keeps_the_previous_reports(tmp_path, monkeypatch):
    """Red team: the --json report was put in place, then a Ctrl-C while --plot was drawn exited 130 with it
    replaced. A command's outputs are put in place together, when it ends."""
    import probe.plot

    report, plot = tmp_path / "r.json", tmp_path / "r.png"
    report.write_bytes(trials.PREVIOUS)
    plot.write_bytes(trials.PREVIOUS)
    monkeypatch.setattr(probe.plot, "write_heatmap", _interrupting(KeyboardInterrupt))
    from probe.cli import cli

    result = run_cli(cli, ["diff", TINY_REF, TINY_REF, "--json", report, "--plot", plot])
    assert result.exit_code == 130, result.output
    assert report.read_bytes() == trials.PREVIOUS and plot.read_bytes() == trials.PREVIOUS
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json", "r.png"]


def test_twin_a_report_that_fails_does_not_cost_the_others(tmp_path, monkeypatch):
    """An error (not an interrupt) ends the command as before: the reports that were written are put in place."""
    import probe.plot
    from oracle.errors import OutputError

    report, plot = tmp_path / "r.json", tmp_path / "r.png"
    report.write_bytes(trials.PREVIOUS)
    monkeypatch.setattr(probe.plot, "write_heatmap", _interrupting(OutputError("no space left on the plot")))
    from probe.cli import cli

    result = run_cli(cli, ["diff", TINY_REF, TINY_REF, "--json", report, "--plot", plot])
    assert result.exit_code == 2 and "no space left on the plot" in result.output, result.output
    assert report.read_bytes() != trials.PREVIOUS and b'"verdict": "pass"' in report.read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]


def test_export_reads_its_own_trace_before_it_is_put_in_place(tmp_path):
    """export counts the stages of the trace it wrote, which is still under its temporary name then."""
    from oracle.cli import cli

    out = tmp_path / "ref.h5"
    result = run_cli(cli, ["export", TINY, "--tokens", "17,42,3", "--hidden-seed", "0", "--out", out, "-q"])  # 11 stages + the draft (issue 24)
    assert result.exit_code == 0 and f"wrote {out}: 3 steps x 12 stages" in result.output, result.output
    assert [p.name for p in tmp_path.iterdir()] == ["ref.h5"]


def test_an_interrupt_between_the_writability_trial_files_creation_and_removal_removes_it(tmp_path, monkeypatch):
    """Red team: a SIGTERM right after check_writable created its trial file `.NAME.tmp-PID` left it beside --out.
    Here the CLIs' handler (remove_pending, then the end of the program) runs at that very point."""
    import os

    import oracle.output as output

    real_close, seen = os.close, []

    def close_then_interrupt(fd):
        real_close(fd)
        monkeypatch.setattr(output.os, "close", real_close)
        seen.append(sorted(p.name for p in tmp_path.iterdir()))
        output.remove_pending()
        raise KeyboardInterrupt

    monkeypatch.setattr(output.os, "close", close_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        output.check_writable(tmp_path / "out.h5")
    assert seen == [[f".out.h5.tmp-{os.getpid()}"]]  # it did exist then: the check below could fail
    assert list(tmp_path.iterdir()) == []


def test_a_scratch_directory_is_removed_when_a_signal_lands_while_it_is_made(monkeypatch):
    """The race CI's signal trial hit (a SIGTERM between mkdtemp and the registration left mtp-probe-html-* in
    TMPDIR): the signal is held until the directory is registered, then delivered, and the directory removed.
    Twin: without a signal the block runs in the directory, which is gone afterwards."""
    import tempfile
    from pathlib import Path

    from oracle import output

    with output.scratch_directory("mtp-test-") as path:
        assert path.is_dir() and path in output._PENDING
    assert not path.exists() and path not in output._PENDING
    made, real = [], tempfile.mkdtemp

    def mkdtemp_then_signal(**kwargs):
        made.append(real(**kwargs))
        signal.raise_signal(signal.SIGINT)  # held: delivered once the directory is registered
        return made[-1]

    monkeypatch.setattr(tempfile, "mkdtemp", mkdtemp_then_signal)
    with pytest.raises(KeyboardInterrupt):
        with output.scratch_directory("mtp-test-"):
            pytest.fail("the block ran although the interrupt came first")
    assert made and not Path(made[0]).exists() and Path(made[0]) not in output._PENDING
