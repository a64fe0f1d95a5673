"""An error about a file that is not a usable trace suggests an export, and the suggested --out is a fresh path
beside it: never the file itself (it may be the user's weights) nor any other existing file."""

import re

import h5py
import pytest

from oracle.cli import cli
from oracle.trace import export_hint
from tests.helpers import TINY, run_cli


def _suggested_out(output: str) -> str:
    return re.search(r"mtp-oracle export CHECKPOINT --out (\S+)", output).group(1)


@pytest.mark.parametrize("name", ["model.safetensors", "ref.h5"])
def test_inspect_of_a_non_hdf5_file_never_suggests_writing_over_it(tmp_path, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    (tmp_path / name).write_bytes(b"not hdf5 at all")
    result = run_cli(cli, ["inspect", name])
    assert result.exit_code == 2
    out = _suggested_out(result.output)
    assert out != name and not (tmp_path / out).exists()
    assert out == ("ref.h5" if name != "ref.h5" else "ref-2.h5")


def test_a_wrong_schema_suggests_a_fresh_path_too(tmp_path):
    path = tmp_path / "ref.h5"
    with h5py.File(path, "w") as f:
        f.attrs["schema"] = "mtp-trace/0"
    (tmp_path / "ref-2.h5").write_bytes(b"")  # taken as well
    result = run_cli(cli, ["inspect", path])
    assert result.exit_code == 2 and _suggested_out(result.output) == str(tmp_path / "ref-3.h5")


def test_export_hint_skips_the_path_and_existing_files(tmp_path):
    (tmp_path / "ref.h5").write_bytes(b"")
    assert export_hint(tmp_path / "weights.bin").endswith(f"--out {tmp_path / 'ref-2.h5'}")
    assert export_hint(tmp_path / "other.h5").endswith(f"--out {tmp_path / 'ref-2.h5'}")


def test_a_shard_given_as_a_trace_never_gets_a_hint_into_its_checkpoint_folder(tmp_path):
    """Issue 28: `mtp-probe diff CKPT/model.safetensors …` suggested `--out CKPT/ref.h5`, a trace among the weights."""
    import shutil

    ckpt = tmp_path / "ckpt"
    shutil.copytree(TINY, ckpt)
    hint = export_hint(ckpt / "model.safetensors")
    assert hint.endswith(f"--out {tmp_path / 'ref.h5'}")
    assert export_hint(tmp_path / "plain" / "x.h5").endswith(f"--out {tmp_path / 'plain' / 'ref.h5'}")  # twin
