"""A DeepSeek-V4 head driven from C (issue 29): fixtures/candidates/mtp_step_v4.c under C ABI v2, gcc-compiled and
run through ctypes in the worker, on a V4 reference whose hidden rows are the hc residual streams [T, hc·D] while
the embedding rows are [T, D]. The adapter had compared D with hc·D and refused every V4 run (INVALID); now the
correct candidate passes, and its mutants diverge at the stage of their mistake."""

import subprocess

import numpy as np
import pytest

from oracle.cli import cli as oracle_cli
from oracle.trace import TraceInputs, read_trace
from probe.adapters.cabi import CAbiAdapter, build_library
from probe.cli import cli as probe_cli
from probe.errors import AdapterError
from probe.run import run_and_diff
from probe.tolerance import tol_table
from tests.helpers import ROOT, load_script, run_cli

SOURCE = ROOT / "fixtures" / "candidates" / "mtp_step_v4.c"
TOKENS = "5,17,3,99,4,250,5,511,0,64"  # T = 10 > the tiny window W = 4: the window is exercised


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    root = tmp_path_factory.mktemp("cabi-v4")
    ckpt = load_script("make_fixtures").write_deepseek_v4_checkpoint(root / "v4")
    ref = root / "v4.h5"
    result = run_cli(oracle_cli, ["export", ckpt, "--out", ref, "--tokens", TOKENS, "--hidden-seed", "0", "-q"])
    assert result.exit_code == 0, result.output
    libs = {m: build_library(SOURCE, root, (f"MTP_MUTANT_{m}",) if m else ()) for m in
            ("", "HIDDEN_D_WIDE", "E_FIRST_STREAM_ONLY")}
    return ckpt, ref, libs


def test_the_reference_has_hidden_rows_hc_times_d_wide(v4):
    _, ref, _ = v4
    with read_trace(ref) as r:
        inputs = r.inputs()
    assert inputs.hidden.shape[1] == 3 * inputs.embed.shape[1]  # hc = 3


def test_the_v4_c_candidate_passes_on_a_v4_reference(v4):
    ckpt, ref, libs = v4
    result = run_and_diff(ref, CAbiAdapter(libs[""], ckpt), tol_table())
    report = result.report
    assert not report.issues, report.issues
    assert report.verdict.name == "pass", (report.verdict, report.first)
    assert set(report.captured) == set(report.stage_names) - {"draft"}  # every head stage, out included (no draft)
    cli = run_cli(probe_cli, ["run", ref, "--impl", f"c:{libs['']}", "--checkpoint", ckpt])
    assert cli.exit_code == 0 and cli.output.rstrip().splitlines()[-1].startswith("PASSED |"), cli.output


@pytest.mark.parametrize("mutant, stage", [("HIDDEN_D_WIDE", "h"), ("E_FIRST_STREAM_ONLY", "x_in")])
def test_twin_its_mutants_diverge_at_their_stage(v4, mutant, stage):
    ckpt, ref, libs = v4
    report = run_and_diff(ref, CAbiAdapter(libs[mutant], ckpt), tol_table()).report
    assert report.verdict.name == "diverged" and report.first.stage == stage, report.first


def test_twin_inputs_of_the_wrong_width_are_still_refused(v4):
    """The check now compares each input with its own width: a hidden of D (not hc·D) columns is refused."""
    ckpt, ref, libs = v4
    with read_trace(ref) as r:
        inputs = r.inputs()
    narrow = TraceInputs(inputs.token_ids, inputs.positions, np.ascontiguousarray(inputs.hidden[:, :64]), inputs.embed)
    with pytest.raises(AdapterError, match="hidden rows of 64 but .* takes 192"):
        CAbiAdapter(libs[""], ckpt).run(narrow)
    wide_embed = TraceInputs(inputs.token_ids, inputs.positions, inputs.hidden, np.ascontiguousarray(inputs.hidden))
    with pytest.raises(AdapterError, match="embedding rows of 192 but .* takes 64"):
        CAbiAdapter(libs[""], ckpt).run(wide_embed)


def test_the_v4_candidate_compiles_warning_free(tmp_path):
    cmd = ["gcc", "-std=c11", "-O2", "-Wall", "-Wextra", "-Werror", "-pedantic", "-shared", "-fPIC",
           f"-I{SOURCE.parent}", str(SOURCE), "-o", str(tmp_path / "x.so"), "-lm"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
