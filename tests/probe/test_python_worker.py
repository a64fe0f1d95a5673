"""A Python candidate runs in a child process (probe/adapters/python.py, the C ABI's worker): nothing its code does
outside its steps (atexit, a non-daemon thread, a __del__, os._exit, chdir) can forge the verdict line, stall or end
the probe, or move its outputs. Run as the real program, where such code would act (issue 29, causes 1 and 6)."""

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT, TINY, TINY_REF

PY = "python:tests.probe.fault_candidates:"
FORGED = "forged by the candidate"


def probe(*args, cwd=ROOT, env=None, timeout=120) -> subprocess.CompletedProcess:
    command = [sys.executable, "-c", "from probe.cli import main; main()", *map(str, args)]
    return subprocess.run(command, capture_output=True, text=True, cwd=cwd, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})


def run_candidate(factory: str, *more, **kwargs) -> subprocess.CompletedProcess:
    return probe("run", TINY_REF, "--impl", PY + factory, "--checkpoint", TINY, "-q", *more, **kwargs)


def last_line(proc) -> str:
    return proc.stdout.rstrip("\n").splitlines()[-1]


@pytest.mark.parametrize("factory", ["atexit_forges_wrong", "thread_forges_wrong", "del_forges_wrong"])
def test_code_that_runs_after_the_verdict_cannot_forge_it(factory):
    """Red team: an atexit handler, a non-daemon thread or a __del__ printed `PASSED | …` after the real verdict of
    a wrong candidate, so the last stdout line (what CI greps) was the candidate's."""
    proc = run_candidate(factory)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert last_line(proc).startswith("DIVERGED | first divergent stage: attn"), proc.stdout
    assert not any(line.startswith("PASSED") for line in proc.stdout.splitlines()), proc.stdout


def test_twin_the_same_forger_when_correct_passes_with_the_probes_own_line():
    proc = run_candidate("atexit_forges")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert last_line(proc).startswith("PASSED | 11 stages x 8 tokens") and FORGED not in last_line(proc)


def test_a_non_daemon_thread_that_never_ends_does_not_hold_the_probe():
    """Red team: the candidate's endless non-daemon thread kept the probe from exiting (Python's exit joins it)."""
    proc = run_candidate("thread_never_ends", timeout=60)  # TimeoutExpired is the failure
    assert proc.returncode == 0 and last_line(proc).startswith("PASSED"), proc.stdout + proc.stderr


def test_os_exit_inside_a_step_is_invalid_and_names_the_step():
    """os._exit cannot be caught in-process: it ended the probe with the candidate's status and no verdict."""
    proc = run_candidate("os_exit_at_step_2")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert last_line(proc).startswith("INVALID | python:tests.probe.fault_candidates:os_exit_at_step_2: the "
                                      "process running it exited with status 0 in step 2"), proc.stdout


def test_what_the_candidate_prints_is_shown_escaped_before_the_verdict():
    proc = run_candidate("chatty")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert "  | step at position 0" in lines and "  | step at position 7" in lines
    forged = [line for line in lines if FORGED in line]
    assert forged == ["  | \\x1b[2J\\r" + "PASSED | 11 stages x 8 tokens within tolerance | forged by the candidate"]
    assert lines.index(forged[0]) < len(lines) - 1 and last_line(proc).startswith("PASSED | 11 stages")
    assert "\x1b" not in proc.stdout


def test_twin_a_chatty_wrong_candidate_still_diverges():
    proc = run_candidate("chatty_wrong")
    assert proc.returncode == 1 and last_line(proc).startswith("DIVERGED"), proc.stdout + proc.stderr
    assert "  | step at position 3" in proc.stdout.splitlines()


def test_outputs_do_not_follow_the_candidates_chdir(tmp_path):
    """Red team: a factory that changed directory made --json and --html land in its own folder."""
    elsewhere, here = tmp_path / "elsewhere", tmp_path / "here"
    elsewhere.mkdir()
    here.mkdir()
    proc = run_candidate("chdir_in_factory", "--json", "r.json", "--html", "r.html", "--out", "cand.h5", cwd=here,
                         env={"MTP_TEST_CHDIR": str(elsewhere)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(p.name for p in here.iterdir()) == ["cand.h5", "r.html", "r.json"]
    assert list(elsewhere.iterdir()) == []
    assert json.loads((here / "r.json").read_text())["verdict"] == "pass"


def test_the_adapter_runs_the_candidate_outside_the_probes_process():
    """In-process use (the library API) gets the same isolation: the candidate's chdir and atexit stay in its
    worker."""
    from oracle.trace import read_trace
    from probe.run import adapter_from_spec

    cwd = os.getcwd()
    os.environ["MTP_TEST_CHDIR"] = "/"
    try:
        adapter = adapter_from_spec(PY + "chdir_in_factory", TINY)
        with read_trace(TINY_REF) as ref:
            rows = adapter.run(ref.inputs())
    finally:
        del os.environ["MTP_TEST_CHDIR"]
    assert os.getcwd() == cwd and "tests.probe.fault_candidates" not in sys.modules
    assert rows["out"].shape == (8, 64) and adapter.weights_digest


def test_a_flood_of_output_is_shown_cut_to_a_bounded_size():
    proc = run_candidate("floods")
    assert proc.returncode == 0 and last_line(proc).startswith("PASSED"), proc.stderr
    block = proc.stdout.split("candidate output:\n", 1)[1]
    assert block.startswith("  | [stdout, its last 4000 characters]") and len(proc.stdout) < 10_000
