"""A CLI run as the program ends without Python's module teardown (over a second once torch is loaded), exactly as
its normal exit would otherwise: the same status, atexit handlers run, stdout and stderr flushed."""

import subprocess
import sys

from oracle.cli import cli
from tests.helpers import ROOT, TINY, TINY_REF, run_cli


def _as_program(tmp_path, *args) -> subprocess.CompletedProcess:
    code = (f"import atexit; atexit.register(lambda: open({str(tmp_path / 'atexit')!r}, 'w').write('ran')); "
            "from oracle.cli import main; main()")
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


def test_output_status_and_atexit_handlers_are_those_of_a_normal_exit(tmp_path):
    proc = _as_program(tmp_path, "inspect", TINY_REF)
    assert proc.returncode == 0 and proc.stdout == run_cli(cli, ["inspect", TINY_REF]).output
    assert (tmp_path / "atexit").read_text() == "ran"


def test_an_export_ends_with_its_trace_written_and_its_last_line(tmp_path):
    out = tmp_path / "ref.h5"
    proc = _as_program(tmp_path, "export", TINY, "--out", out, "--tokens", "17,42,3", "--hidden-seed", "0", "-q")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == f"wrote {out}: 3 steps x 12 stages" and out.is_file()
    assert (tmp_path / "atexit").read_text() == "ran"


def test_an_input_error_keeps_exit_2_and_its_message(tmp_path):
    proc = _as_program(tmp_path, "export", TINY, "--out", tmp_path / "ref.h5", "--tokens", "100000",
                       "--hidden-seed", "0")
    assert proc.returncode == 2 and proc.stderr.startswith("Error: token id 100000 at row 0 is out of range")
    assert (tmp_path / "atexit").read_text() == "ran" and not (tmp_path / "ref.h5").exists()


def test_a_thread_still_running_is_joined_as_by_python_exit(tmp_path):
    """The shortcut is taken only when no other non-daemon thread runs (Python's exit would join it)."""
    mark = tmp_path / "thread"
    code = ("import threading, time; threading.Thread(target=lambda: (time.sleep(1), "
            f"open({str(mark)!r}, 'w').write('done'))).start(); from oracle.cli import main; main()")
    proc = subprocess.run([sys.executable, "-c", code, "--help"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and mark.read_text() == "done"
