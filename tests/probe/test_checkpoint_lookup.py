"""A reference run from another directory: export records the checkpoint's absolute path, and `run` finds a moved
checkpoint by its head digest beside the reference or under the current directory, or says what to pass."""

import json
import shutil

import h5py
import pytest

from oracle.cli import cli as oracle_cli
from oracle.trace import read_trace
from probe.cli import cli
from probe.errors import ProbeError
from probe.run import checkpoint_for
from tests.helpers import TINY, TINY_REF, run_cli


def _recording(ref, checkpoint: str):
    """`ref` with its provenance's checkpoint path replaced (a trace exported elsewhere)."""
    with h5py.File(ref, "r+") as f:
        provenance = json.loads(f.attrs["provenance"])
        f.attrs["provenance"] = json.dumps(provenance | {"checkpoint": checkpoint}, sort_keys=True)
    return ref


def test_export_records_the_absolute_checkpoint_path(tmp_path, monkeypatch):
    shutil.copytree(TINY, tmp_path / "ckpt")
    monkeypatch.chdir(tmp_path)
    result = run_cli(oracle_cli, ["export", "ckpt", "--out", "ref.h5", "--tokens", "5,17,3", "--hidden-seed", "0"])
    assert result.exit_code == 0, result.output
    with read_trace(tmp_path / "ref.h5") as ref:
        assert ref.attrs["provenance"]["checkpoint"] == str((tmp_path / "ckpt").resolve())


def test_a_moved_checkpoint_is_found_by_digest_not_by_config(tmp_path, monkeypatch, make_fixtures):
    ref = _recording(shutil.copy(TINY_REF, tmp_path / "ref.h5"), "/nowhere/moved/qwen3_5_tiny")
    make_fixtures.write_checkpoint(tmp_path / "a_decoy", seed=7)  # same config, other weights; looked at first
    shutil.copytree(TINY, tmp_path / "weights")
    monkeypatch.chdir(tmp_path / "a_decoy")
    notes = []
    assert checkpoint_for(ref, None, log=notes.append) == tmp_path / "weights"
    assert "records /nowhere/moved/qwen3_5_tiny" in notes[0]


def test_without_a_matching_checkpoint_it_says_what_to_pass(tmp_path, monkeypatch, make_fixtures):
    ref = _recording(shutil.copy(TINY_REF, tmp_path / "ref.h5"), "/nowhere/moved/qwen3_5_tiny")
    make_fixtures.write_checkpoint(tmp_path / "a_decoy", seed=7)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ProbeError, match=r"no checkpoint with its head digest .* Pass --checkpoint DIR"):
        checkpoint_for(ref, None)


def test_a_relative_recorded_path_resolves_from_the_references_folder(tmp_path, monkeypatch):
    (tmp_path / "fixtures").mkdir()
    shutil.copytree(TINY, tmp_path / "fixtures" / "qwen3_5_tiny")
    ref = _recording(shutil.copy(TINY_REF, tmp_path / "fixtures" / "ref.h5"), "fixtures/qwen3_5_tiny")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    result = run_cli(cli, ["run", ref, "--impl", "torch", "-q"])
    assert result.exit_code == 0, result.output
    assert f"using checkpoint {tmp_path / 'fixtures' / 'qwen3_5_tiny'}" in result.output


def test_the_message_states_the_search_depth_and_a_checkpoint_one_level_deeper_is_not_found(tmp_path, monkeypatch):
    """The search looks 2 levels down (the message says so): a copy 2 levels down is found, one 4 levels down is not."""
    ref = _recording(shutil.copy(TINY_REF, tmp_path / "ref.h5"), "/nowhere/moved/qwen3_5_tiny")
    monkeypatch.chdir(tmp_path)
    shutil.copytree(TINY, tmp_path / "a" / "b" / "c" / "weights")  # 4 levels below: out of reach
    with pytest.raises(ProbeError, match=r"up to 2 levels below the reference's folder or the current directory"):
        checkpoint_for(ref, None)
    shutil.copytree(TINY, tmp_path / "x" / "weights")  # twin: 2 levels below, found
    assert checkpoint_for(ref, None, log=lambda msg: None) == tmp_path / "x" / "weights"
