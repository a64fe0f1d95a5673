"""`mtp-probe run`: an implementation driven on the reference's inputs, with the diff's verdicts and exit codes."""

import json

import pytest

from oracle.trace import read_trace
from probe.cli import cli
from probe.selftest import first_step_reference
from tests.helpers import ROOT, TINY, TINY_REF, TINY_SHARDED, run_cli

CANDIDATES = ROOT / "fixtures" / "candidates"


def last_line(result) -> str:
    return result.output.strip().splitlines()[-1]


@pytest.mark.parametrize("impl", ["torch", "torch:cpu:float32", "python:numpy_step:make_head"])
def test_correct_candidates_pass(impl, monkeypatch):
    monkeypatch.syspath_prepend(str(CANDIDATES))
    result = run_cli(cli, ["run", TINY_REF, "--impl", impl])
    assert result.exit_code == 0, result.output
    assert last_line(result).startswith("PASSED | 11 stages x 8 tokens within tolerance")


def test_c_candidate_from_a_built_library_and_the_sharded_checkpoint(tmp_path):
    from probe.adapters.cabi import build_library

    lib = build_library(CANDIDATES / "mtp_step.c", tmp_path)
    result = run_cli(cli, ["run", TINY_REF, "--impl", f"c:{lib}", "--checkpoint", TINY_SHARDED])
    assert result.exit_code == 0 and last_line(result).startswith("PASSED"), result.output


def test_bfloat16_fails_float32_tolerance_and_passes_the_bf16_profile():
    strict = run_cli(cli, ["run", TINY_REF, "--impl", "torch:cpu:bfloat16"])
    assert strict.exit_code == 1 and last_line(strict).startswith("DIVERGED | first divergent stage: e at token 0")
    loose = run_cli(cli, ["run", TINY_REF, "--impl", "torch:cpu:bfloat16", "--profile", "bfloat16"])
    assert loose.exit_code == 0 and "bfloat16 profile" in loose.output


def test_out_writes_a_candidate_trace_that_diff_accepts(tmp_path):
    out = tmp_path / "cand.h5"
    result = run_cli(cli, ["run", TINY_REF, "--impl", "torch", "--out", out, "--json", tmp_path / "r.json"])
    assert result.exit_code == 0 and f"candidate trace written to {out}" in result.output
    with read_trace(out) as cand:
        assert cand.attrs["provenance"]["adapter"] == "torch:cpu:float32" and len(cand.stages) == 11
    again = run_cli(cli, ["diff", TINY_REF, out])
    assert again.exit_code == 0, again.output
    assert json.loads((tmp_path / "r.json").read_text())["verdict"] == "pass"


def test_one_step_reference_is_inconclusive_even_when_everything_matches(tmp_path):
    one = first_step_reference(TINY_REF, tmp_path / "t1.h5")
    result = run_cli(cli, ["run", one, "--impl", "torch", "--checkpoint", TINY])
    assert result.exit_code == 3 and last_line(result).startswith("INCONCLUSIVE"), result.output


def test_weights_other_than_the_references_are_refused(tmp_path, make_fixtures):
    other = make_fixtures.write_checkpoint(tmp_path / "other", seed=7)
    result = run_cli(cli, ["run", TINY_REF, "--impl", "torch", "--checkpoint", other])
    assert result.exit_code == 2 and "was exported from weights of digest" in result.output
    assert isinstance(result.exception, SystemExit)


def test_checkpoint_defaults_to_the_one_the_reference_records(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # the fixture records fixtures/qwen3_5_tiny, relative to the repository
    assert run_cli(cli, ["run", TINY_REF, "--impl", "torch"]).exit_code == 0
    monkeypatch.chdir(tmp_path)  # elsewhere, the recorded relative path is read from the reference's folders
    result = run_cli(cli, ["run", TINY_REF, "--impl", "torch"])
    assert result.exit_code == 0 and "using checkpoint" in result.output, result.output


@pytest.mark.parametrize("spec, message", [
    ("cuda:x", "unknown implementation"),
    ("c:/no/such/lib.so", "does not exist"),
    ("python:no_such_module:make", "cannot import no_such_module"),
    ("python:numpy_step", "expected python:MODULE:FACTORY"),
    ("torch:tpu", "device must be one of"),
])
def test_bad_impl_specs_exit_2(spec, message, monkeypatch):
    monkeypatch.syspath_prepend(str(CANDIDATES))
    result = run_cli(cli, ["run", TINY_REF, "--impl", spec, "--checkpoint", TINY])
    assert result.exit_code == 2 and message in result.output and isinstance(result.exception, SystemExit)


def test_python_candidate_with_the_row_offset_bug_is_invalid(tmp_path, monkeypatch):
    (tmp_path / "row0.py").write_text(
        "import numpy_step\n"
        "class Row0(numpy_step.NumpyHead):\n"
        "    def step(self, pos, embed_row, hidden, out, trace):\n"
        "        if not hasattr(self, 'first'): self.first = trace\n"
        "        super().step(pos, embed_row, hidden, out, self.first)\n"
        "def make(config, weights): return Row0(config, weights)\n")
    monkeypatch.syspath_prepend(str(CANDIDATES))
    monkeypatch.syspath_prepend(str(tmp_path))
    result = run_cli(cli, ["run", TINY_REF, "--impl", "python:row0:make", "--checkpoint", TINY])
    assert result.exit_code == 2 and last_line(result).startswith("INVALID | unwritten rows: e at token(s) 1-7")
