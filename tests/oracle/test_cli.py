"""mtp-oracle as a user runs it: export/inspect, the stored-trace drift check, and bad input -> exit 2."""

import json
import re
import shutil
import signal
import subprocess
import sys
import time

import h5py
import numpy as np
import pytest
from pathlib import Path

import oracle.trace as trace_mod
from oracle.cli import cli
from oracle.inputs import hidden_from_seed
from oracle.stages import STAGE_NAMES
from oracle.trace import read_trace
from tests.helpers import ROOT, TINY, TINY_REF, TINY_SHARDED, run_cli

TOKENS = "17,42,3,255,100,7,511,64"


def export(*args):
    return run_cli(cli, ["export", *args, "-q"])


def stages_of(path) -> dict[str, np.ndarray]:
    with read_trace(path) as tr:
        return {n: tr.stage_rows(n) for n in tr.stages}


def test_export_then_inspect(tmp_path):
    out = tmp_path / "ref.h5"
    result = export(TINY, "--out", out, "--tokens", TOKENS, "--hidden-seed", "0")
    assert result.exit_code == 0 and result.output.strip().endswith("8 steps x 12 stages")  # the spine and draft
    shown = run_cli(cli, ["inspect", out])
    assert shown.exit_code == 0
    assert "mtp-trace/1, family qwen3_5, T=8 tokens, D=64" in shown.output
    assert "token_ids          17,42,3,255,100,7,511,64" in shown.output
    assert shown.output.strip().splitlines()[-1].strip() == "12/12 stages"


def test_stored_reference_trace_regenerates(tmp_path, make_fixtures):
    """Silent oracle drift (a transformers upgrade, a wiring edit) must fail CI."""
    out = tmp_path / "regen.h5"
    result = run_cli(cli, make_fixtures.reference_export_args(TINY, out))
    assert result.exit_code == 0, result.output
    with read_trace(TINY_REF) as stored, read_trace(out) as fresh:
        for key in ("checkpoint_digest", "inputs_digest", "config"):
            assert fresh.attrs[key] == stored.attrs[key], key
        for name in STAGE_NAMES:
            expected, actual = stored.stage_rows(name), fresh.stage_rows(name)
            # float32 kernels may round differently on another CPU (<= ~1e-7 relative); real drift is >= 1e-3
            assert np.abs(actual - expected).max() <= 1e-6 * np.abs(expected).max(), name


def test_single_file_and_sharded_checkpoints_give_identical_traces(tmp_path):
    for ckpt, name in ((TINY, "a.h5"), (TINY_SHARDED, "b.h5")):
        assert export(ckpt, "--out", tmp_path / name, "--tokens", TOKENS, "--hidden-seed", "1").exit_code == 0
    a, b = stages_of(tmp_path / "a.h5"), stages_of(tmp_path / "b.h5")
    for name in STAGE_NAMES:
        np.testing.assert_array_equal(a[name], b[name])


def test_one_step_trace(tmp_path):
    assert export(TINY, "--out", tmp_path / "t1.h5", "--tokens", "5", "--hidden-seed", "0").exit_code == 0
    assert stages_of(tmp_path / "t1.h5")["out"].shape == (1, 64)


def test_hidden_file_formats_are_equivalent(tmp_path):
    hidden = hidden_from_seed(0, 8, 64)
    np.save(tmp_path / "h.npy", hidden)
    hidden.astype("<f4").tofile(tmp_path / "h.bin")
    with h5py.File(tmp_path / "h.h5", "w") as f:
        f["dumps/hfinal"] = hidden
    export(TINY, "--out", tmp_path / "seed.h5", "--tokens", TOKENS, "--hidden-seed", "0")
    expected = stages_of(tmp_path / "seed.h5")
    for spec in ("h.npy", "h.bin", "h.h5:/dumps/hfinal"):
        out = tmp_path / f"{spec[:4]}.trace.h5"
        result = export(TINY, "--out", out, "--tokens", TOKENS, "--hidden", tmp_path / spec)
        assert result.exit_code == 0, result.output
        for name in STAGE_NAMES:
            np.testing.assert_array_equal(stages_of(out)[name], expected[name])


def test_tokens_file_and_start_pos(tmp_path):
    (tmp_path / "ids.txt").write_text("17 42\n3\n")
    out = tmp_path / "t.h5"
    assert export(TINY, "--out", out, "--tokens-file", tmp_path / "ids.txt", "--hidden-seed", "0",
                  "--start-pos", "100").exit_code == 0
    with read_trace(out) as tr:
        assert tr.input_rows("token_ids").tolist() == [17, 42, 3]
        assert tr.input_rows("positions").tolist() == [100, 101, 102]


def test_main_model_hidden_path(tmp_path):
    from oracle.checkpoint import Checkpoint
    from oracle.families import qwen3_5

    out = tmp_path / "mm.h5"
    result = export(TINY_SHARDED, "--out", out, "--tokens", "5,17,3,9", "--main-model", "--first-token", "1")
    assert result.exit_code == 0, result.output
    model = qwen3_5.load_main_model(Checkpoint(TINY_SHARDED))
    expected = qwen3_5.main_model_hidden(model, np.array([1, 5, 17, 3]))
    with read_trace(out) as tr:
        np.testing.assert_array_equal(tr.input_rows("hidden"), expected)
        assert tr.attrs["provenance"]["hidden"] == {"kind": "main-model", "first_token": 1}


# --- bad input: exit 2, a message naming the culprit, no traceback, nothing at --out ---

def _damaged_checkpoint(tmp_path, damage: str):
    ckpt = shutil.copytree(TINY_SHARDED, tmp_path / "ckpt")
    index_path = ckpt / "model.safetensors.index.json"
    if damage == "missing_tensor":
        index = json.loads(index_path.read_text())
        del index["weight_map"]["mtp.fc.weight"]
        index_path.write_text(json.dumps(index))
    elif damage == "missing_shard":
        (ckpt / "model-00002-of-00003.safetensors").unlink()
    elif damage == "wrong_shape":
        cfg = json.loads((ckpt / "config.json").read_text())
        cfg["text_config"]["head_dim"] = 16
        (ckpt / "config.json").write_text(json.dumps(cfg))
    elif damage == "no_rope_theta":
        cfg = json.loads((ckpt / "config.json").read_text())
        del cfg["text_config"]["rope_parameters"]["rope_theta"]
        (ckpt / "config.json").write_text(json.dumps(cfg))
    return ckpt


def _bad_hidden(tmp_path, kind: str) -> str:
    hidden = hidden_from_seed(0, 8, 64)
    if kind == "wide":
        np.save(tmp_path / "h.npy", np.zeros((8, 65), np.float32))
    elif kind == "rows":
        np.save(tmp_path / "h.npy", hidden[:7])
    elif kind == "float64":
        np.save(tmp_path / "h.npy", hidden.astype(np.float64))
    elif kind == "nan":
        hidden[3, 5] = np.nan
        np.save(tmp_path / "h.npy", hidden)
    elif kind == "bin_size":
        hidden[:7].tofile(tmp_path / "h.bin")
        return str(tmp_path / "h.bin")
    elif kind == "h5_dataset":
        with h5py.File(tmp_path / "h.h5", "w") as f:
            f["hfinal"] = hidden
        return f"{tmp_path / 'h.h5'}:/missing"
    return str(tmp_path / "h.npy")


CHECKPOINT_CASES = {
    "missing_tensor": "tensor mtp.fc.weight is missing",
    "missing_shard": "shard model-00002-of-00003.safetensors is missing",
    "wrong_shape": r"mtp\.layers\.0\.self_attn\.\w+\.weight .*has shape .* but config.json implies",
    "no_rope_theta": "no rope_theta",
}
HIDDEN_CASES = {
    "wide": r"shape \[8, 65\]; the checkpoint's hidden_size is 64",
    "rows": "has 7 rows but 8 token ids were given",
    "float64": "is float64; the hidden must be float32",
    "nan": "row 3 holds NaN or Inf",
    "bin_size": "has 1792 bytes; T=8 tokens x D=64 float32 need 2048",
    "h5_dataset": "has no dataset /missing; its datasets are: /hfinal",
}


def assert_clean_exit_2(result, out, pattern):
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit) and "Traceback" not in result.output
    assert re.search(pattern, result.output), result.output
    assert not out.exists() and not list(out.parent.glob(f".{out.name}.tmp-*"))


@pytest.mark.parametrize("damage", sorted(CHECKPOINT_CASES))
def test_bad_checkpoint_exit_2(tmp_path, damage):
    out = tmp_path / "ref.h5"
    result = export(_damaged_checkpoint(tmp_path, damage), "--out", out, "--tokens", TOKENS, "--hidden-seed", "0")
    assert_clean_exit_2(result, out, CHECKPOINT_CASES[damage])


@pytest.mark.parametrize("kind", sorted(HIDDEN_CASES))
def test_bad_hidden_exit_2(tmp_path, kind):
    out = tmp_path / "ref.h5"
    result = export(TINY, "--out", out, "--tokens", TOKENS, "--hidden", _bad_hidden(tmp_path, kind))
    assert_clean_exit_2(result, out, HIDDEN_CASES[kind])


@pytest.mark.parametrize("args, pattern", [
    (["--tokens", "17,512", "--hidden-seed", "0"], "token id 512 at row 1 is out of range"),
    (["--tokens", "17,x", "--hidden-seed", "0"], "'x' is not an integer token id"),
    (["--tokens", "17", "--hidden-seed", "0", "--start-pos", "-1"], "--start-pos -1 is negative"),
    (["--tokens", "17", "--tokens-file", __file__, "--hidden-seed", "0"], "exactly one of --tokens, --tokens-file"),
    (["--tokens", "17"], "exactly one of --hidden, --hidden-seed, --main-model"),
    (["--tokens", "17", "--main-model"], "--main-model needs --first-token"),
    (["--tokens", "17", "--main-model", "--first-token", "1", "--start-pos", "3"], "cannot be combined with"),
])
def test_bad_options_exit_2(tmp_path, args, pattern):
    out = tmp_path / "ref.h5"
    assert_clean_exit_2(export(TINY, "--out", out, *args), out, pattern)


def test_output_in_a_missing_directory_exit_2(tmp_path):
    out = tmp_path / "no" / "such" / "dir" / "ref.h5"
    result = export(TINY, "--out", out, "--tokens", TOKENS, "--hidden-seed", "0")
    assert_clean_exit_2(result, out, "does not exist; create it first")


def test_output_the_filesystem_refuses_exit_2():
    """/proc accepts no new files, even from root (for whom directory permissions are no obstacle)."""
    out = Path("/proc/mtp_oracle_ref.h5")
    result = export(TINY, "--out", out, "--tokens", TOKENS, "--hidden-seed", "0")
    assert_clean_exit_2(result, out, "cannot write /proc/mtp_oracle_ref.h5")


def test_interrupted_write_leaves_no_file_and_keeps_an_existing_one(tmp_path, monkeypatch):
    out = tmp_path / "ref.h5"
    shutil.copy(TINY_REF, out)
    before = out.read_bytes()

    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(trace_mod, "_write_stage", interrupted)
    result = export(TINY, "--out", out, "--tokens", "1,2", "--hidden-seed", "0")
    assert result.exit_code != 0
    assert out.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["ref.h5"]


@pytest.mark.slow
def test_sigterm_during_export_leaves_nothing(tmp_path):
    out = tmp_path / "ref.h5"
    tokens = ",".join(["7"] * 3000)  # stepwise over 3000 steps: several seconds
    proc = subprocess.Popen([sys.executable, "-m", "oracle", "export", str(TINY), "--out", str(out),
                             "--tokens", tokens, "--hidden-seed", "0", "--mode", "stepwise"],
                            cwd=ROOT, stderr=subprocess.PIPE, text=True)
    for line in proc.stderr:
        if "running the head" in line:
            break
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    assert list(tmp_path.iterdir()) == []


def test_inspect_a_corrupt_trace_exit_2(tmp_path):
    damaged = bytearray(TINY_REF.read_bytes())
    for offset in range(4096, len(damaged), 2048):  # scribble over the metadata and data alike
        damaged[offset:offset + 16] = b"\xff" * 16
    path = tmp_path / "corrupt.h5"
    path.write_bytes(bytes(damaged))
    result = run_cli(cli, ["inspect", path])
    assert result.exit_code == 2 and "is corrupt or truncated" in result.output
    assert isinstance(result.exception, SystemExit)
