"""probe.testing.assert_trace_close and the pytest plugin (probe/pytest_plugin.py): every verdict but pass raises,
with the probe's summary line and first divergent row; the README's example test runs as written."""

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from oracle.trace import read_trace
from probe.adapters.trace_file import open_candidate
from probe.errors import AdapterError, ToleranceError
from probe.poison import poison
from probe.testing import assert_trace_close, reference_inputs
from tests.helpers import FIXTURES, ROOT, TINY_REF
from tests.probe.tracekit import copy_stages, ref_data, ref_t1, write_h5, write_raw  # noqa: F401 (fixtures)

D = 64


def concat_swapped(stages):
    """What an engine that concatenates [h | e] (instead of [e | h]) captures: fc_in's halves swapped, and every
    stage from fc on computed from it (fc = W @ [h | e])."""
    from oracle.checkpoint import Checkpoint

    out = copy_stages(stages)
    out["fc_in"] = np.concatenate([stages["fc_in"][:, D:], stages["fc_in"][:, :D]], axis=1)
    fc = Checkpoint(FIXTURES / "qwen3_5_tiny").read("mtp.fc.weight").astype(np.float64)
    out["fc"] = (out["fc_in"].astype(np.float64) @ fc.T).astype(np.float32)
    return out


# --- pass: every candidate form -------------------------------------------------------------------------------


def test_pass_returns_the_report_for_arrays_paths_and_open_traces(ref_data, tmp_path):
    inputs, stages = ref_data
    assert assert_trace_close(TINY_REF, copy_stages(stages)).verdict.name == "pass"
    assert assert_trace_close(str(TINY_REF), write_h5(tmp_path / "c.h5", inputs, stages)).verdict.name == "pass"
    assert assert_trace_close(TINY_REF, write_raw(tmp_path / "raw", stages, inputs)).verdict.name == "pass"
    with open_candidate(tmp_path / "c.h5", inputs.num_tokens, D) as source:
        assert assert_trace_close(TINY_REF, source).verdict.name == "pass"
    with read_trace(tmp_path / "c.h5") as reader:
        assert assert_trace_close(TINY_REF, reader).verdict.name == "pass"


def test_reference_inputs_are_the_references(ref_data):
    got = reference_inputs(TINY_REF)
    assert np.array_equal(got.token_ids, ref_data[0].token_ids) and np.array_equal(got.hidden, ref_data[0].hidden)


# --- twins: every other verdict raises --------------------------------------------------------------------------


def test_twin_concat_swapped_candidate_raises_with_summary_and_first_row(ref_data):
    with pytest.raises(AssertionError) as caught:
        assert_trace_close(TINY_REF, concat_swapped(ref_data[1]))
    lines = str(caught.value).splitlines()
    assert lines[0].startswith("DIVERGED | first divergent stage: fc_in at token 0 | budget ")
    assert lines[1].startswith("FAILED | stage 3/11 'fc_in' token 0 | width 128")
    assert "same statistics, different values: suspect layout or permutation" in str(caught.value)
    assert type(caught.value) is AssertionError and caught.value.report.verdict.name == "diverged"


def test_twin_one_unwritten_row_is_invalid_and_raises(ref_data):
    stages = copy_stages(ref_data[1])
    stages["attn"][5] = poison(D)
    with pytest.raises(AssertionError, match=r"(?s)^INVALID \| unwritten rows: attn at token\(s\) 5.*0x7FDEAD00"):
        assert_trace_close(TINY_REF, stages)


def test_twin_float64_arrays_are_invalid_not_cast(ref_data):
    stages = {name: rows.astype(np.float64) for name, rows in ref_data[1].items()}
    with pytest.raises(AssertionError, match=r"^INVALID \| wrong dtype"):
        assert_trace_close(TINY_REF, stages)


def test_twin_missing_attention_is_inconclusive_and_raises(ref_data):
    with pytest.raises(AssertionError, match=r"^INCONCLUSIVE \| .*not captured: attn"):
        assert_trace_close(TINY_REF, copy_stages(ref_data[1], drop=("attn",)))


def test_twin_t1_reference_is_inconclusive_even_for_its_own_stages(ref_t1):
    with pytest.raises(AssertionError, match=r"^INCONCLUSIVE \| .*compared only at t=0"):
        assert_trace_close(ref_t1, ref_t1)


# --- tolerances ---------------------------------------------------------------------------------------------


def test_tolerances_loosen_like_the_cli_and_default_catches_the_same_error(ref_data):
    stages = copy_stages(ref_data[1])
    stages["out"] = stages["out"] * np.float32(1 + 1e-3)  # 1e-3 relative: over the float32 rtol 1e-4
    with pytest.raises(AssertionError, match="first divergent stage: out at token 0"):
        assert_trace_close(TINY_REF, stages)
    assert assert_trace_close(TINY_REF, stages, rtol=1e-2, atol=1e-5).verdict.name == "pass"
    assert assert_trace_close(TINY_REF, stages, stage_tol={"out": (2e-3, 0)}).verdict.name == "pass"
    assert assert_trace_close(TINY_REF, stages, profile="bfloat16").verdict.name == "pass"


def test_bad_arguments_are_errors_not_verdicts(ref_data):
    with pytest.raises(ToleranceError, match="both rtol and atol"):
        assert_trace_close(TINY_REF, ref_data[1], rtol=1e-3)
    with pytest.raises(ToleranceError, match="unknown stage 'fcin'"):
        assert_trace_close(TINY_REF, ref_data[1], stage_tol={"fcin": (1, 1)})
    with pytest.raises(AdapterError, match=r"unknown stage names \['logits'\]"):
        assert_trace_close(TINY_REF, {**ref_data[1], "logits": ref_data[1]["out"]})
    with pytest.raises(TypeError, match="must be a path"):
        assert_trace_close(TINY_REF, [ref_data[1]["out"]])


# --- the plugin: light import, the README example, the fixture ----------------------------------------------


def test_plugin_import_is_light():
    """pytest loads the plugin in every run: its import must not pull numpy, h5py, torch or transformers."""
    code = ("import sys, probe.pytest_plugin; heavy = [m for m in ('numpy', 'h5py', 'torch', 'transformers') "
            "if m in sys.modules]; print(heavy); sys.exit(bool(heavy))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _readme_example() -> tuple[str, str]:
    """The toml and python blocks of README.md's pytest section, as written there."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## In an engine's own test suite", 1)[1].split("\n## ", 1)[0]
    toml = re.search(r"```toml\n(.*?)```", section, re.S).group(1)
    python = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    return toml, python


MY_ENGINE = f'''
"""Stand-in for an engine's Python binding: the numpy candidate stepped over the inputs; SWAP_CONCAT=1 makes it
concatenate [h | e] instead of [e | h] (fc = W @ [h | e])."""
import os, sys
import numpy as np
sys.path.insert(0, {str(FIXTURES / "candidates")!r})
import numpy_step
from oracle.checkpoint import Checkpoint
from oracle.stages import STAGE_BY_NAME


def mtp_head_stages(token_ids, positions, hidden):
    ckpt = Checkpoint({str(FIXTURES / "qwen3_5_tiny")!r})
    head = numpy_step.make_head(ckpt.config, ckpt.read_head().tensors)
    embed = ckpt.embedding_rows(np.asarray(token_ids))
    T, D = hidden.shape
    if os.environ.get("SWAP_CONCAT") == "1":
        W = head.w["fc.weight"]
        head.w["fc.weight"] = np.concatenate([W[:, D:], W[:, :D]], axis=1)  # W @ [e | h] with halves swapped
    stages = {{n: np.empty((T, s.width(D)), np.float32) for n, s in STAGE_BY_NAME.items()}}
    for t in range(T):
        head.step(int(positions[t]), embed[t], hidden[t], stages["out"][t], {{n: stages[n][t] for n in head.capture}})
    if os.environ.get("SWAP_CONCAT") == "1":
        stages["fc_in"] = np.concatenate([stages["fc_in"][:, D:], stages["fc_in"][:, :D]], axis=1)  # [h | e]
    return stages
'''


def _entry_point_installed(cwd: Path) -> bool:
    """Whether pytest, started in `cwd`, loads the plugin by itself (False in a venv installed before the entry point
    existed: then the tests name it with -p). Asked from `cwd`: a build's mtp_probe.egg-info in the checkout would
    shadow the installed metadata here."""
    code = "from importlib.metadata import entry_points; print([e.value for e in entry_points(group='pytest11')])"
    proc = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, check=True)
    return "probe.pytest_plugin" in proc.stdout


def _pytest_project(tmp_path: Path, files: dict[str, str], env: dict | None = None) -> subprocess.CompletedProcess:
    """Run pytest in a fresh project at tmp_path (fixtures/ linked in), as a user's engine repository would."""
    (tmp_path / "fixtures").symlink_to(FIXTURES)
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    plugin = [] if _entry_point_installed(tmp_path) else ["-p", "probe.pytest_plugin"]
    isolated = ["-p", "no:cacheprovider", f"--basetemp={tmp_path / 'basetemp'}"]  # leave the outer run's tmp alone
    return subprocess.run([sys.executable, "-m", "pytest", "-q", *isolated, *plugin],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(tmp_path), **(env or {})})


@pytest.mark.slow
def test_readme_example_runs_as_written_and_passes(tmp_path):
    toml, test = _readme_example()
    proc = _pytest_project(tmp_path, {"pyproject.toml": "[tool.pytest.ini_options]\n" + toml.split("\n", 1)[1],
                                      "my_engine.py": MY_ENGINE, "tests/test_mtp_head.py": test})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 passed" in proc.stdout


@pytest.mark.slow
def test_twin_readme_example_fails_on_a_concat_swapped_engine(tmp_path):
    toml, test = _readme_example()
    proc = _pytest_project(tmp_path, {"pyproject.toml": "[tool.pytest.ini_options]\n" + toml.split("\n", 1)[1],
                                      "my_engine.py": MY_ENGINE, "tests/test_mtp_head.py": test},
                           env={"SWAP_CONCAT": "1"})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "AssertionError: DIVERGED | first divergent stage: fc_in at token 0" in proc.stdout
    assert "FAILED | stage 3/12 'fc_in' token 0" in proc.stdout and "1 failed" in proc.stdout


@pytest.mark.slow
def test_overridden_spec_exports_once_per_session(tmp_path):
    conftest = textwrap.dedent(f"""
        import pytest
        from probe.testing import ReferenceSpec

        @pytest.fixture(scope="session")
        def mtp_reference_spec():
            return ReferenceSpec({str(FIXTURES / "qwen3_5_tiny")!r}, (17, 42, 3), hidden_seed=0)
        """)
    tests = textwrap.dedent("""
        from probe.testing import assert_trace_close, reference_inputs
        seen = []

        def test_first(mtp_reference):
            seen.append(mtp_reference)
            assert reference_inputs(mtp_reference).token_ids.tolist() == [17, 42, 3]

        def test_second(mtp_reference, tmp_path_factory):
            assert seen == [mtp_reference]  # the same file: exported once for the session
            assert len(list(tmp_path_factory.getbasetemp().glob("mtp-reference[0-9]*"))) == 1
            assert_trace_close(mtp_reference, mtp_reference)
        """)
    proc = _pytest_project(tmp_path, {"conftest.py": conftest, "test_once.py": tests})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2 passed" in proc.stdout


def test_twin_unconfigured_fixture_errors_with_what_to_set(tmp_path):
    proc = _pytest_project(tmp_path, {"test_x.py": "def test_x(mtp_reference):\n    pass\n"})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "1 error" in proc.stdout
    assert "set the ini options mtp_probe_checkpoint and mtp_probe_tokens" in proc.stdout
