"""`mtp-probe run --impl c:LIB --checkpoint DIR` starts the library's worker before the probe's own imports and
checks (probe/adapters/cabi_process.py): the worker reads the reference's inputs itself, its results are bit for bit
those of a worker started after the checks, a worker that read other inputs is refused, a failing check kills it,
and the worker process never imports torch or transformers, nor runs numpy's BLAS threads into the library."""

import os
import re
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest

from oracle.trace import read_trace
from probe.adapters import cabi, cabi_process
from probe.adapters.cabi import CAbiAdapter, build_library
from probe.adapters.cabi_process import early_worker, worker_env
from probe.cli import cli
from probe.errors import ProbeError
from probe.selftest import first_step_reference
from tests.helpers import ROOT, TINY, TINY_REF, run_cli

CANDIDATES = ROOT / "fixtures" / "candidates"

# A v2 library that writes its pid and what it sees of OPENBLAS_NUM_THREADS into $MTP2_RECORD, then (with -DSLOW)
# sleeps in mtp2_create: long enough that only a kill ends it within the test.
SLOW_SOURCE = r"""
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
#include "mtp_probe_v2.h"
static int ctx;
int mtp2_abi_version(void) { return MTP2_ABI_VERSION; }
void *mtp2_create(const mtp2_config *cfg, const mtp2_tensor *w, int n, char *err, size_t err_len) {
    (void)cfg, (void)w, (void)n, (void)err, (void)err_len;
    FILE *f = fopen(getenv("MTP2_RECORD"), "w");
    const char *blas = getenv("OPENBLAS_NUM_THREADS");
    fprintf(f, "%d %s\n", (int)getpid(), blas ? blas : "(unset)");
    fclose(f);
#ifdef SLOW
    sleep(60);
#endif
    return &ctx;
}
int mtp2_step(void *c, int64_t pos, const float *e, const float *h, float *out, const mtp2_stage *st, int n) {
    (void)c, (void)pos, (void)e, (void)h, (void)out, (void)st, (void)n;
    return MTP2_OK;
}
void mtp2_destroy(void *c) { (void)c; }
"""


@pytest.fixture(scope="module")
def libs(tmp_path_factory):
    out = tmp_path_factory.mktemp("early")
    source = out / "slow_v2.c"
    source.write_text(SLOW_SOURCE)
    return {"v2": build_library(CANDIDATES / "mtp_step_v2.c", out), "slow": build_library(source, out, ("SLOW",)),
            "quick": build_library(source, out)}


@pytest.fixture
def started(monkeypatch):
    """The worker commands started during the test."""
    commands = []
    real = cabi_process.start_worker

    def recorded(command, work):
        commands.append(command)
        return real(command, work)

    monkeypatch.setattr(cabi_process, "start_worker", recorded)  # early_worker's
    monkeypatch.setattr(cabi, "start_worker", recorded)  # CAbiAdapter's
    return commands


def stage_rows(path):
    with read_trace(path) as trace:
        return {name: trace.stage_rows(name) for name in trace.stages}


def test_early_worker_runs_on_the_reference_and_matches_a_late_start_bit_for_bit(libs, started, tmp_path,
                                                                                 monkeypatch):
    early = run_cli(cli, ["run", TINY_REF, "--impl", f"c:{libs['v2']}", "--checkpoint", TINY,
                          "--out", tmp_path / "early.h5"])
    assert early.exit_code == 0 and "PASSED" in early.output, early.output
    assert len(started) == 1 and started[0][-1] == str(TINY_REF)  # started early: told to read the reference
    monkeypatch.chdir(ROOT)  # no --checkpoint: the recorded one, known only after reading the reference
    late = run_cli(cli, ["run", TINY_REF, "--impl", f"c:{libs['v2']}", "--out", tmp_path / "late.h5"])
    assert late.exit_code == 0, late.output
    assert started[1][-1] != str(TINY_REF)  # started after the checks, on the inputs the probe wrote
    a, b = stage_rows(tmp_path / "early.h5"), stage_rows(tmp_path / "late.h5")
    assert a.keys() == b.keys() and all(np.array_equal(a[n], b[n]) for n in a)


def test_a_worker_that_read_other_inputs_is_refused(libs, tmp_path):
    """Twin of the above: the probe checks the early worker read what the probe itself read."""
    other = first_step_reference(TINY_REF, tmp_path / "t1.h5")  # other inputs (one step)
    with read_trace(TINY_REF) as ref:
        inputs = ref.inputs()
    with early_worker(libs["v2"], TINY, other) as early:
        with pytest.raises(ProbeError, match="the reference changed while the candidate ran"):
            CAbiAdapter(libs["v2"], TINY, {}, early).run(inputs)
    with early_worker(libs["v2"], TINY, TINY_REF) as early:  # the same reference: accepted
        assert "out" in CAbiAdapter(libs["v2"], TINY, {}, early).run(inputs)


def test_no_early_start_without_a_library_file_or_a_safetensors_checkpoint(libs, tmp_path):
    """A GGUF checkpoint is dequantized into a cache on first use: the probe's checks and an early worker would both
    write it, so its worker starts after the checks (as without --checkpoint)."""
    gguf_dir = tmp_path / "gguf"
    gguf_dir.mkdir()
    (gguf_dir / "head.gguf").write_bytes(b"GGUF")
    with early_worker(libs["v2"], gguf_dir, TINY_REF) as early:
        assert early is None
    with early_worker(tmp_path / "missing.so", TINY, TINY_REF) as early:
        assert early is None
    with early_worker(libs["v2"], TINY, TINY_REF) as early:  # twin: both present
        assert early is not None and early.proc.wait(timeout=60) == 0


def test_leaving_the_block_kills_a_running_early_worker_and_removes_its_folder(libs, tmp_path, monkeypatch):
    record = tmp_path / "record.txt"
    monkeypatch.setenv("MTP2_RECORD", str(record))
    with pytest.raises(RuntimeError, match="a check failed"):
        with early_worker(libs["slow"], TINY, TINY_REF) as early:
            deadline = time.monotonic() + 30
            # the library is in its 60 s mtp2_create once it has written its pid (fopen creates the file first)
            while not (record.is_file() and record.read_text().endswith("\n")) and time.monotonic() < deadline:
                time.sleep(0.02)
            pid, work = int(record.read_text().split()[0]), early.work
            os.kill(pid, 0)  # alive until the block is left
            raise RuntimeError("a check failed")
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # killed and reaped
    assert not work.exists()


def test_a_check_failing_after_the_early_start_ends_the_command_at_once(libs, tmp_path, monkeypatch):
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setenv("MTP2_RECORD", str(tmp_path / "record.txt"))
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    start = time.monotonic()
    result = run_cli(cli, ["run", TINY_REF, "--impl", f"c:{libs['slow']}", "--checkpoint", TINY,
                           "--stage-tol", "topk_ids=1e-3,1e-5"])  # a stage this reference lacks: refused
    assert result.exit_code == 2 and "'topk_ids' is not a stage of the reference" in result.output, result.output
    assert time.monotonic() - start < 30  # not the 60 s the library sleeps
    assert list(scratch.iterdir()) == []  # the worker's folder removed


def imported_modules(argv: list[str], **kwargs) -> set[str]:
    """Every module a Python process imports (python -X importtime), from its stderr."""
    proc = subprocess.run([sys.executable, "-X", "importtime", *argv], capture_output=True, text=True, **kwargs)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return {m.group(1) for m in re.finditer(r"^import time:\s+\d+ \|\s+\d+ \|\s*(\S+)$", proc.stderr, re.M)}


def test_the_worker_process_imports_neither_torch_nor_transformers(libs, tmp_path):
    modules = imported_modules(["-m", "probe.adapters.cabi_worker", str(libs["v2"]), str(TINY), str(tmp_path),
                                str(TINY_REF)], env=worker_env(), cwd=tmp_path)
    assert (tmp_path / "captured.json").is_file() and "h5py" in modules  # it ran, reading the reference
    assert not {m.split(".")[0] for m in modules} & {"torch", "transformers"}


def test_the_import_scan_sees_an_import():
    """Twin: the scan above finds what a process imports."""
    assert "json" in imported_modules(["-c", "import json"]) and "torch" not in imported_modules(["-c", "pass"])


@pytest.mark.parametrize("setting", [None, "3"])
def test_the_library_sees_the_users_blas_setting(libs, tmp_path, monkeypatch, setting):
    """numpy is imported with one BLAS thread in the worker; the library under test sees the user's setting."""
    record = tmp_path / "record.txt"
    monkeypatch.setenv("MTP2_RECORD", str(record))
    if setting is None:
        monkeypatch.delenv("OPENBLAS_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OPENBLAS_NUM_THREADS", setting)
    with read_trace(TINY_REF) as ref:
        CAbiAdapter(libs["quick"], TINY).run(ref.inputs())
    assert record.read_text().split()[1] == (setting or "(unset)")


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_an_interrupted_run_kills_the_worker_stuck_in_the_library(libs, tmp_path, signum):
    """Red team: Ctrl-C (or SIGTERM) on `mtp-probe run --impl c:` ended the probe (exit 130/143) but left the worker
    running: stuck in the library's own code, it never returns to Python to act on a signal (a GPU library would
    keep the GPU). The interrupt handler now kills it. The library sleeps 60 s in mtp2_create."""
    record = tmp_path / "record.txt"
    env = dict(os.environ, MTP2_RECORD=str(record))
    probe = subprocess.Popen([sys.executable, "-c", "from probe.cli import main; main()", "run", str(TINY_REF),
                              "--impl", f"c:{libs['slow']}", "--checkpoint", str(TINY), "-q"], cwd=ROOT, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not record.is_file() and time.monotonic() < deadline:
        time.sleep(0.05)
    pid = int(record.read_text().split()[0])
    time.sleep(0.5)  # the probe is past its imports and checks, waiting for the worker
    try:
        probe.send_signal(signum)
        _, err = probe.communicate(timeout=30)
        assert probe.returncode == 128 + signum, err
        gone_by = time.monotonic() + 10
        while time.monotonic() < gone_by:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # twin of the leak: before the fix it was still sleeping here
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_a_library_whose_constructor_changes_directory_still_finds_a_relative_checkpoint(tmp_path):
    """Red team: the worker resolved its paths after dlopen, so a library constructor calling chdir("/") turned a
    relative --checkpoint into "not a directory" (exit 2). Twin: the same library run on absolute paths passed."""
    source = tmp_path / "chdir_v2.c"
    source.write_text('#include <unistd.h>\n#include "mtp_step_v2.c"\n'
                      '__attribute__((constructor)) static void wander(void) { if (chdir("/")) {} }\n')
    lib = build_library(source, tmp_path)
    relative = os.path.relpath(TINY, ROOT)
    for checkpoint in (relative, str(TINY)):
        proc = subprocess.run([sys.executable, "-c", "from probe.cli import main; main()", "run",
                               os.path.relpath(TINY_REF, ROOT), "--impl", f"c:{lib}", "--checkpoint", checkpoint, "-q"],
                              cwd=ROOT, capture_output=True, text=True)
        assert proc.returncode == 0, (checkpoint, proc.stdout[-800:], proc.stderr[-800:])
