"""`mtp-oracle inputs REF --out-dir D`: the reference's step inputs as raw files, read back and used in a diff."""

import json
import shutil

import numpy as np

from oracle.cli import cli
from oracle.trace import read_trace
from probe.cli import cli as probe_cli
from tests.helpers import TINY_REF, run_cli


def _ref_inputs():
    with read_trace(TINY_REF) as reader:
        return reader.inputs()


def test_writes_inputs_bit_for_bit_into_a_new_directory(tmp_path):
    out = tmp_path / "nested" / "inputs"
    result = run_cli(cli, ["inputs", TINY_REF, "--out-dir", out])
    assert result.exit_code == 0, result.output
    assert "inputs.json" in result.output and "hidden.bin" in result.output
    ref = _ref_inputs()
    ids = json.loads((out / "inputs.json").read_text())
    assert ids == {"token_ids": ref.token_ids.tolist(), "positions": ref.positions.tolist()}
    for name in ("hidden", "embed"):
        raw = np.fromfile(out / f"{name}.bin", dtype="<f4").reshape(ref.num_tokens, ref.hidden_size)
        assert raw.view(np.uint32).tobytes() == getattr(ref, name).astype("<f4").view(np.uint32).tobytes()
    assert sorted(p.name for p in out.iterdir()) == ["embed.bin", "hidden.bin", "inputs.json"]  # no temporaries


def _dump_with_inputs(tmp_path, inputs_dir, hidden_change=None):
    """An engine's dump directory: the reference's stages as <stage>.bin plus the inputs it was handed."""
    dump = tmp_path / "dump"
    dump.mkdir()
    with read_trace(TINY_REF) as reader:
        for name in reader.stages:
            reader.stage_rows(name).astype("<f4").tofile(dump / f"{name}.bin")
    shutil.copy(inputs_dir / "inputs.json", dump)
    hidden = np.fromfile(inputs_dir / "hidden.bin", dtype="<f4")
    if hidden_change is not None:
        hidden = hidden_change(hidden.copy())
    hidden.tofile(dump / "hidden.bin")
    return dump


def test_a_dump_fed_these_inputs_is_checked_and_passes(tmp_path):
    assert run_cli(cli, ["inputs", TINY_REF, "--out-dir", tmp_path / "in"]).exit_code == 0
    result = run_cli(probe_cli, ["diff", TINY_REF, _dump_with_inputs(tmp_path, tmp_path / "in")])
    assert result.exit_code == 0, result.output
    assert "identical to the reference: token_ids, positions, hidden" in result.output


def test_twin_a_dump_that_consumed_another_hidden_is_invalid(tmp_path):
    assert run_cli(cli, ["inputs", TINY_REF, "--out-dir", tmp_path / "in"]).exit_code == 0

    def nudge(hidden):
        hidden[70] = np.nextafter(hidden[70], np.float32(np.inf))  # one element of row 1, one ulp
        return hidden

    result = run_cli(probe_cli, ["diff", TINY_REF, _dump_with_inputs(tmp_path, tmp_path / "in", nudge)])
    assert result.exit_code == 2, result.output
    assert result.output.strip().splitlines()[-1].startswith("INVALID | inputs differ")


def test_refuses_to_write_over_the_reference(tmp_path):
    ref = tmp_path / "hidden.bin"  # an HDF5 reference that happens to carry an input file's name
    shutil.copy(TINY_REF, ref)
    before = ref.read_bytes()
    result = run_cli(cli, ["inputs", ref, "--out-dir", tmp_path])
    assert result.exit_code == 2
    assert "is the reference trace itself" in result.output and "Traceback" not in result.output
    assert ref.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hidden.bin"]  # nothing else written either


def test_out_dir_that_is_a_file_is_an_error(tmp_path):
    target = tmp_path / "taken"
    target.write_text("x")
    result = run_cli(cli, ["inputs", TINY_REF, "--out-dir", target])
    assert result.exit_code == 2
    assert "is a file" in result.output and target.read_text() == "x"


def test_help_has_examples():
    result = run_cli(cli, ["inputs", "--help"])
    assert result.exit_code == 0 and "mtp-oracle inputs ref.h5 --out-dir" in result.output


def test_the_message_gives_the_shapes_written_hc_times_d_for_deepseek_v4(tmp_path):
    """DeepSeek-V4's hidden is its hc residual streams, [T, hc·D]: the message says so, with the measured sizes
    (it had printed [T, D]). Twin: a dense head's hidden is [T, D]."""
    from tests.helpers import load_script

    ckpt = load_script("make_fixtures").write_deepseek_v4_checkpoint(tmp_path / "v4")
    ref = tmp_path / "v4.h5"
    assert run_cli(cli, ["export", ckpt, "--out", ref, "--tokens", "5,17,3", "--hidden-seed", "0", "-q"]).exit_code == 0
    with read_trace(ref) as reader:
        t, d, width = reader.num_tokens, reader.hidden_size, reader.input_shape("hidden")[1]
    assert width > d
    result = run_cli(cli, ["inputs", ref, "--out-dir", tmp_path / "in"])
    assert result.exit_code == 0, result.output
    assert f"hidden.bin [T, hc·D] = [{t}, {width}], embed.bin [T, D] = [{t}, {d}]" in result.output
    assert (tmp_path / "in" / "hidden.bin").stat().st_size == t * width * 4
    dense = run_cli(cli, ["inputs", TINY_REF, "--out-dir", tmp_path / "dense"])
    ref_inputs = _ref_inputs()
    assert f"hidden.bin [T, D] = [{ref_inputs.num_tokens}, {ref_inputs.hidden_size}]" in dense.output
