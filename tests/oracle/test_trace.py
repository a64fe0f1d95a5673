"""The mtp-trace/1 file: round trip, row-range reads, schema errors, and atomic writes."""

import h5py
import numpy as np
import pytest

import oracle.trace as trace_mod
from oracle.errors import OutputError, TraceFormatError
from oracle.stages import STAGE_BY_NAME, STAGE_NAMES
from oracle.trace import TraceInputs, inputs_digest, read_trace, write_trace
from tests.helpers import TINY_REF


def synthetic(t=5, d=8, seed=0):
    rng = np.random.default_rng(seed)
    inputs = TraceInputs(token_ids=np.arange(t, dtype=np.int64) + 3, positions=np.arange(t, dtype=np.int64),
                         hidden=rng.standard_normal((t, d), dtype=np.float32),
                         embed=rng.standard_normal((t, d), dtype=np.float32))
    stages = {s.name: rng.standard_normal((t, s.width(d)), dtype=np.float32) for s in STAGE_BY_NAME.values()}
    return inputs, stages


def test_round_trip_by_name_and_row_range(tmp_path):
    inputs, stages = synthetic()
    path = tmp_path / "t.h5"
    write_trace(path, inputs, stages, {"family": "qwen3_5", "config": {"hidden_size": 8}})
    with read_trace(path) as tr:
        assert (tr.num_tokens, tr.hidden_size, tr.stages) == (5, 8, STAGE_NAMES)
        assert tr.attrs["schema"] == "mtp-trace/1" and tr.attrs["config"] == {"hidden_size": 8}
        assert tr.attrs["inputs_digest"] == inputs_digest(inputs)
        np.testing.assert_array_equal(tr.stage_rows("fc_in", 1, 3), stages["fc_in"][1:3])
        back = tr.inputs()
    for name in ("token_ids", "positions", "hidden", "embed"):
        np.testing.assert_array_equal(getattr(back, name), getattr(inputs, name))


def test_stage_datasets_are_chunked_by_token_rows(tmp_path):
    inputs, stages = synthetic(t=300, d=1024)
    write_trace(tmp_path / "t.h5", inputs, stages, {})
    with h5py.File(tmp_path / "t.h5") as f:
        assert f["stages/fc_in"].chunks == (128, 2048) and f["stages/e"].chunks == (256, 1024)


def test_inputs_digest_changes_with_any_input():
    inputs, _ = synthetic()
    changed = TraceInputs(inputs.token_ids, inputs.positions + 1, inputs.hidden, inputs.embed)
    assert inputs_digest(inputs) != inputs_digest(changed)


def test_a_candidate_may_omit_stages(tmp_path):
    inputs, stages = synthetic()
    write_trace(tmp_path / "t.h5", inputs, {k: v for k, v in stages.items() if k not in ("mh", "out")}, {})
    with read_trace(tmp_path / "t.h5") as tr:
        assert "mh" not in tr.stages and "out" not in tr.stages and len(tr.stages) == 9


def test_wrong_schema_names_both_versions_and_how_to_regenerate(tmp_path):
    path = tmp_path / "old.h5"
    path.write_bytes(TINY_REF.read_bytes())
    with h5py.File(path, "r+") as f:
        f.attrs["schema"] = "mtp-trace/0"
    with pytest.raises(TraceFormatError, match=r"schema mtp-trace/0, this tool reads mtp-trace/1\. "
                                               r"Regenerate with: mtp-oracle export"):
        read_trace(path)


@pytest.mark.parametrize("damage", ["truncated", "not_hdf5", "no_schema"])
def test_unreadable_traces_are_format_errors(tmp_path, damage):
    path = tmp_path / "bad.h5"
    if damage == "truncated":
        path.write_bytes(TINY_REF.read_bytes()[: TINY_REF.stat().st_size // 2])
    elif damage == "not_hdf5":
        path.write_text("hello")
    else:
        with h5py.File(path, "w") as f:
            f.create_dataset("x", data=[1])
    with pytest.raises(TraceFormatError, match="not a readable HDF5|not an mtp trace"):
        with read_trace(path) as tr:
            tr.stage_rows("out")


def test_unknown_stage_dataset_is_rejected_with_the_valid_names(tmp_path):
    path = tmp_path / "t.h5"
    path.write_bytes(TINY_REF.read_bytes())
    with h5py.File(path, "r+") as f:
        f["stages/attn_out"] = f["stages/attn"][()]
    with pytest.raises(TraceFormatError, match="unknown stage datasets \\['attn_out'\\]; valid names are e, h"):
        read_trace(path)


def test_interrupted_write_leaves_nothing_and_keeps_the_old_file(tmp_path, monkeypatch):
    inputs, stages = synthetic()
    path = tmp_path / "t.h5"
    path.write_bytes(b"previous contents")
    calls = []

    def interrupted(f, stage, values, inputs, dims):
        calls.append(stage.name)
        if len(calls) == 3:
            raise KeyboardInterrupt
        real_write_stage(f, stage, values, inputs, dims)

    real_write_stage = trace_mod._write_stage
    monkeypatch.setattr(trace_mod, "_write_stage", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_trace(path, inputs, stages, {})
    assert path.read_bytes() == b"previous contents"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.h5"]


def test_unwritable_destinations(tmp_path):
    inputs, stages = synthetic()
    with pytest.raises(OutputError, match="does not exist"):
        write_trace(tmp_path / "missing" / "t.h5", inputs, stages, {})
    with pytest.raises(OutputError, match="is a directory"):
        write_trace(tmp_path, inputs, stages, {})
