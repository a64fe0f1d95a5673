"""Issue 28 ("as a user meets it, round 2"): the waits say what loads, --main-model on a head-only checkpoint is
refused before anything loads, and the messages a new user met read right. Each behaviour has its twin."""

import subprocess
import sys

from oracle.cli import cli as oracle_cli
from probe.cli import cli as probe_cli
from tests.helpers import FIXTURES, ROOT, TINY, TINY_REF, run_cli

HEAD_ONLY = FIXTURES / "qwen3_next_tiny_fused"


def test_main_model_on_a_head_only_checkpoint_is_refused_before_torch_loads(tmp_path):
    """In a fresh process: the message names the checkpoint, says it holds no main model and suggests --hidden /
    --hidden-seed; torch was never imported (the refusal comes before the slow part)."""
    code = ("import sys\nfrom oracle.cli import main\n"
            "try:\n    main(sys.argv[1:])\nexcept SystemExit as e:\n"
            "    print('torch loaded' if 'torch' in sys.modules else 'torch not loaded', file=sys.stderr)\n"
            "    raise\n")
    for command in (["export", str(HEAD_ONLY), "--out", str(tmp_path / "r.h5"), "--tokens", "1,2,3", "--main-model",
                     "--first-token", "4"],
                    ["accept", str(HEAD_ONLY), "--tokens", "1,2,3,4,5,6,7", "--main-model", "--k", "2"]):
        proc = subprocess.run([sys.executable, "-c", code, *command], capture_output=True, text=True, cwd=ROOT,
                              timeout=120)
        assert proc.returncode == 2, proc.stderr
        assert "holds no main model" in proc.stderr and "--hidden FILE" in proc.stderr
        assert "--hidden-seed N" in proc.stderr and "torch not loaded" in proc.stderr
        assert "missing" not in proc.stderr.lower()  # not torch's missing-keys list
    assert not (tmp_path / "r.h5").exists()


def test_main_model_on_a_checkpoint_with_only_the_heads_shared_main_tensors_is_refused(tmp_path):
    """DeepSeek/GLM fixtures hold layer 0's few tensors the head shares, not the main model: named layer by layer."""
    for name in ("deepseek_v3_tiny", "glm4_moe_tiny", "deepseek_v4_tiny"):
        result = run_cli(oracle_cli, ["export", FIXTURES / name, "--out", tmp_path / "r.h5", "--tokens", "1,2,3",
                                      "--main-model", "--first-token", "4"])
        assert result.exit_code == 2 and "holds no complete main model" in result.output, result.output
        assert "layer(s) 1 have no tensors" in result.output and "--hidden-seed N" in result.output


def test_clipped_cuts_after_a_whole_item_and_says_how_much_is_left():
    from oracle.text import clipped

    keys = ", ".join(f'"layers.{i}.self_attn.q_proj.weight"' for i in range(60))
    short = clipped(keys, 200)
    assert short.endswith("more characters)") and short.split(" … ")[0].endswith('weight"')
    assert clipped("a, b", 200) == "a, b"  # twin: short text untouched


def test_twin_main_model_on_a_whole_checkpoint_runs(tmp_path):
    result = run_cli(oracle_cli, ["export", TINY, "--out", tmp_path / "r.h5", "--tokens", "5,17,3", "--main-model",
                                  "--first-token", "9"])
    assert result.exit_code == 0, result.output
    assert "holds no main model" not in result.output and "loading torch and transformers" in result.output


def test_explain_says_it_loads_torch_and_q_silences_it(tmp_path):
    args = ["diff", TINY_REF, TINY_REF, "--explain", "--checkpoint", TINY]
    loud, quiet = run_cli(probe_cli, args), run_cli(probe_cli, [*args, "-q"])
    assert loud.exit_code == quiet.exit_code == 0, loud.output
    assert "--explain: loading torch and transformers" in loud.output
    assert "loading torch" not in quiet.output  # twin


def test_accept_says_it_loads_torch(tmp_path):
    result = run_cli(oracle_cli, ["accept", FIXTURES / "qwen3_5_trained", "--tokens", "1,2,3,4,5,6,7,8",
                                  "--hidden-seed", "0", "--target", "text", "--k", "2"])
    assert result.exit_code == 0, result.output
    assert result.output.index("loading torch and transformers") < result.output.index("ACCEPT |")
    quiet = run_cli(oracle_cli, ["accept", FIXTURES / "qwen3_5_trained", "--tokens", "1,2,3,4,5,6,7,8",
                                 "--hidden-seed", "0", "--target", "text", "--k", "2", "-q"])
    assert quiet.exit_code == 0 and "loading torch" not in quiet.output


# --- every family runs from the README, on a fixture make_fixtures.py writes -------------------------------------

def readme_family_exports() -> list[list[str]]:
    """The `mtp-oracle export fixtures/…` lines of the README's every-family block, as argument lists."""
    import re
    import shlex

    readme = (ROOT / "README.md").read_text()
    block = re.search(r"Every family, on its tiny fixture.*?```bash\n(.*?)```", readme, re.S).group(1)
    return [shlex.split(line)[1:] for line in block.splitlines() if line.startswith("mtp-oracle export ")]


def test_the_readme_shows_an_export_for_every_registered_family():
    from oracle.families.registry import FAMILIES
    from oracle.checkpoint import Checkpoint

    shown = {Checkpoint(ROOT / args[1]).family.name for args in readme_family_exports()}
    assert shown == set(FAMILIES)  # twin by construction: a family without its line fails this


def test_each_readme_family_export_runs_as_written(tmp_path, monkeypatch):
    import os

    from oracle.trace import read_trace

    os.symlink(ROOT / "fixtures", tmp_path / "fixtures")
    monkeypatch.chdir(tmp_path)
    for args in readme_family_exports():
        result = run_cli(oracle_cli, [*args, "-q"])
        assert result.exit_code == 0, (args, result.output)
        out = tmp_path / args[args.index("--out") + 1]
        with read_trace(out) as trace:
            assert trace.attrs["family"] == out.stem and trace.num_tokens == 8


def test_the_family_fixtures_are_what_make_fixtures_writes(tmp_path):
    from tests.helpers import load_script

    make = load_script("make_fixtures")
    make.write_family_fixtures(tmp_path)
    for name in make.FAMILY_FIXTURES:
        for file in ("config.json", "model.safetensors"):
            assert (tmp_path / name / file).read_bytes() == (FIXTURES / name / file).read_bytes(), (name, file)
        assert sum(f.stat().st_size for f in (FIXTURES / name).iterdir()) < 600_000  # tiny: a few hundred KB


# --- the `shape` attribute in ASCII (what h5ls / h5dump print), old symbols still read ---------------------------

def test_new_traces_write_ascii_shape_symbols_and_old_ones_still_read(tmp_path):
    import h5py

    from oracle.trace import read_trace

    out = tmp_path / "new.h5"
    result = run_cli(oracle_cli, ["export", TINY, "--out", out, "--tokens", "17,42,3,255,100,7,511,64",
                                  "--hidden-seed", "0", "-q"])
    assert result.exit_code == 0, result.output
    with h5py.File(out) as new, h5py.File(TINY_REF) as old:
        text = lambda v: v.decode("utf-8") if isinstance(v, bytes) else str(v)  # noqa: E731
        written = {n: text(new["stages"][n].attrs["shape"]) for n in new["stages"]}
        assert all(v.isascii() for v in written.values()) and written["fc_in"] == "Tx2D" and written["draft"] == "Tx1"
        assert text(old["stages"]["fc_in"].attrs["shape"]) == "T×2D"  # the stored fixture predates the change
    with read_trace(TINY_REF) as old_trace, read_trace(out) as new_trace:
        # old symbols read as the new ones; the stored fixture also predates the draft stage (issue 24)
        assert old_trace.stage_list == tuple(s for s in new_trace.stage_list if s.name != "draft")
    diffed = run_cli(probe_cli, ["diff", out, TINY_REF, "-q"])  # the old trace lacks only the draft: not captured
    assert diffed.exit_code == 0 and diffed.output.splitlines()[-1].startswith("PASSED"), diffed.output


def test_twin_an_unknown_shape_symbol_is_still_refused(tmp_path):
    import shutil

    import h5py

    from oracle.errors import TraceFormatError
    from oracle.trace import read_trace

    bad = tmp_path / "bad.h5"
    shutil.copy(TINY_REF, bad)
    with h5py.File(bad, "r+") as f:
        f["stages"]["fc"].attrs["shape"] = "T×Q"
    import pytest

    with pytest.raises(TraceFormatError, match="shape"), read_trace(bad) as trace:
        trace.stage_list


# --- messages (issue 28, point 8) --------------------------------------------------------------------------------

def _module(tmp_path, name: str, source: str, monkeypatch):
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))


def test_an_import_error_inside_a_found_candidate_module_says_so_not_pythonpath(tmp_path, monkeypatch):
    _module(tmp_path, "cand_bad_import", "import no_such_dependency_xyz\n", monkeypatch)
    result = run_cli(probe_cli, ["run", TINY_REF, "--impl", "python:cand_bad_import:make_head", "--checkpoint", TINY])
    assert result.exit_code == 2, result.output
    assert "cand_bad_import was found" in result.output and "no_such_dependency_xyz" in result.output
    assert "PYTHONPATH" not in result.output


def test_twin_a_module_not_found_asks_about_pythonpath_and_a_missing_factory_is_named(tmp_path, monkeypatch):
    result = run_cli(probe_cli, ["run", TINY_REF, "--impl", "python:cand_nowhere_xyz:make_head", "--checkpoint", TINY])
    assert result.exit_code == 2 and "Is the module on PYTHONPATH" in result.output, result.output
    _module(tmp_path, "cand_no_factory", "def other():\n    pass\n", monkeypatch)
    result = run_cli(probe_cli, ["run", TINY_REF, "--impl", "python:cand_no_factory:make_head", "--checkpoint", TINY])
    assert result.exit_code == 2 and "has no make_head" in result.output and "PYTHONPATH" not in result.output


def test_a_raw_dump_without_inputs_json_never_claims_inputs_as_recorded(tmp_path):
    from tests.probe.tracekit import load_trace, write_raw

    inputs, stages = load_trace(TINY_REF)
    bare = run_cli(probe_cli, ["diff", TINY_REF, write_raw(tmp_path / "bare", stages)])
    assert bare.exit_code == 0, bare.output
    assert "inputs not recorded, so not checked" in bare.output and "inputs as recorded" not in bare.output
    recorded = run_cli(probe_cli, ["diff", TINY_REF, write_raw(tmp_path / "with", stages, inputs)])  # twin
    assert recorded.exit_code == 0 and "inputs as recorded" in recorded.output
    assert "inputs not recorded" not in recorded.output


def test_the_weights_audit_says_a_transposed_tensors_max_rel_is_after_transposing_back(tmp_path):
    import numpy as np
    from safetensors.numpy import save_file

    from oracle.checkpoint import Checkpoint

    tensors = {n: np.ascontiguousarray(v, dtype=np.float32) for n, v in Checkpoint(TINY).read_head().tensors.items()}
    fc = "mtp.fc.weight"
    tensors[fc] = np.ascontiguousarray(tensors[fc].T)
    save_file(tensors, tmp_path / "dump.safetensors")
    result = run_cli(probe_cli, ["weights", TINY, tmp_path / "dump.safetensors"])
    assert result.exit_code == 1, result.output
    line = next(line for line in result.output.splitlines() if fc in line)
    assert line.split()[0] == "transposed" and "once transposed back (wrong as stored)" in line
    ok = run_cli(probe_cli, ["weights", TINY, tmp_path / "dump.safetensors", "-v"])  # twin: ok rows say no such thing
    assert all("transposed back" not in l for l in ok.output.splitlines() if l.split()[:1] == ["ok"])


def test_a_probe_error_is_printed_once_where_stdout_and_stderr_meet():
    """`INVALID | X` on stdout and `Error: X` on stderr read as one message twice in a terminal (2>&1 here)."""
    cmd = [sys.executable, "-m", "probe.cli", "diff", str(TINY_REF), str(ROOT / "README.md")]
    cmd = [sys.executable, "-c", "import sys; from probe.cli import main; main(sys.argv[1:])", *cmd[3:]]
    merged = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, timeout=120)
    assert merged.returncode == 2 and merged.stdout.count("is not a readable HDF5 file") == 1, merged.stdout
    assert merged.stdout.splitlines()[-1].startswith("INVALID | ")
    # twin: separate destinations each get the message (a log of stderr alone still says what went wrong)
    apart = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert apart.returncode == 2 and apart.stdout.startswith("INVALID | ") and apart.stderr.startswith("Error: ")


# --- small things (issue 28, point 9) -------------------------------------------------------------------------

def test_plot_writes_the_format_its_extension_names_and_says_where(tmp_path):
    jpg, svg, js = tmp_path / "h.jpg", tmp_path / "h.svg", tmp_path / "r.json"
    result = run_cli(probe_cli, ["diff", TINY_REF, TINY_REF, "--plot", jpg, "--json", js, "-q"])
    assert result.exit_code == 0, result.output
    assert jpg.read_bytes()[:3] == b"\xff\xd8\xff"  # JPEG, not PNG bytes under a .jpg name
    assert f"wrote --json {js}, --plot {jpg}" in result.output
    assert result.output.splitlines()[-1].startswith("PASSED |")  # the summary stays last
    assert run_cli(probe_cli, ["diff", TINY_REF, TINY_REF, "--plot", svg, "-q"]).exit_code == 0
    assert b"<svg" in svg.read_bytes()[:500]


def test_twin_an_extension_it_cannot_write_is_refused_before_the_work(tmp_path):
    gif = tmp_path / "h.gif"
    result = run_cli(probe_cli, ["diff", TINY_REF, TINY_REF, "--plot", gif])
    assert result.exit_code == 2 and "a .gif picture cannot be written" in result.output, result.output
    assert "PASSED" not in result.output and not gif.exists()
    accept = run_cli(oracle_cli, ["accept", FIXTURES / "qwen3_5_trained", "--tokens", "1,2,3,4,5,6", "--hidden-seed",
                                  "0", "--target", "text", "--plot", gif])
    assert accept.exit_code == 2 and "a .gif picture cannot be written" in accept.output and not gif.exists()
    plain = run_cli(probe_cli, ["diff", TINY_REF, TINY_REF, "-q"])
    assert "wrote" not in plain.output  # no outputs asked for: no such line


def test_both_clis_have_version():
    from importlib.metadata import version

    for cli, name in ((probe_cli, "mtp-probe"), (oracle_cli, "mtp-oracle")):
        result = run_cli(cli, ["--version"])
        assert result.exit_code == 0 and result.output.strip() == f"{name} {version('mtp-probe')}"


def test_skip_reasons_show_under_q(tmp_path):
    (tmp_path / "test_skips.py").write_text("import pytest\n\n\n@pytest.mark.skip(reason='needs a thing')\n"
                                            "def test_x():\n    pass\n")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-c", str(ROOT / "pyproject.toml"),
                           "--rootdir", str(tmp_path), "-p", "no:cacheprovider", str(tmp_path / "test_skips.py")],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert "SKIPPED [1]" in proc.stdout and "needs a thing" in proc.stdout, proc.stdout


# --- the detailed row: its rule in its own words, and how |a-e| spreads (issue 28, point 10) -----------------------

def _one_row_candidate(tmp_path, change):
    import numpy as np

    from tests.probe.tracekit import copy_stages, load_trace, write_raw

    inputs, stages = load_trace(TINY_REF)
    cand = copy_stages(stages)
    change(cand["fc"])
    return write_raw(tmp_path / "cand", cand, inputs), np


def test_the_detailed_row_states_its_rule_and_the_spread_of_the_differences(tmp_path):
    import json

    def outlier(fc):
        fc[3, 10] += 1.0  # one element wrong, the rest exact

    cand, np = _one_row_candidate(tmp_path, outlier)
    js, page = tmp_path / "r.json", tmp_path / "r.html"
    result = run_cli(probe_cli, ["diff", TINY_REF, cand, "--json", js, "--html", page])
    assert result.exit_code == 1, result.output
    assert "greatest relative difference" not in result.output and "greatest absolute" not in result.output
    assert "rule, per row (not per element as in torch.testing.assert_close): pass iff max_rel < rtol" in result.output
    assert "max_rel = max|a-e| / max|e| = " in result.output
    row = next(r for r in json.loads(js.read_text())["rows"] if r["stage"] == "fc" and r["token"] == 3)
    spread = row["abs_diff"]
    assert spread["median"] == 0 and spread["mean"] > 0 and sum(b["count"] for b in spread["histogram"]) == 64
    assert spread["histogram"][0] == {"lo": 0.0, "hi": 0.0, "count": 63}  # the exact elements
    assert "|a-e| per element: mean" in result.output and "|a-e| histogram (elements per decade):" in result.output
    assert "|a-e| histogram" in page.read_text()


def test_twin_a_row_wrong_everywhere_has_a_median_near_its_mean(tmp_path):
    import json

    def everywhere(fc):
        fc[3] *= 1.01

    cand, np = _one_row_candidate(tmp_path, everywhere)
    js = tmp_path / "r.json"
    assert run_cli(probe_cli, ["diff", TINY_REF, cand, "--json", js]).exit_code == 1
    row = next(r for r in json.loads(js.read_text())["rows"] if r["stage"] == "fc" and r["token"] == 3)
    spread = row["abs_diff"]
    assert spread["median"] > 0.3 * spread["mean"] and all(b["hi"] != 0 for b in spread["histogram"])
    undetailed = next(r for r in json.loads(js.read_text())["rows"] if not r["detailed"])
    assert "abs_diff" not in undetailed  # only detailed rows carry it
