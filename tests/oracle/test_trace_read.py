"""Row reads of a trace: plainly stored datasets are read straight from the file (os.preadv), everything else by
h5py, and both routes give exactly what h5py gives, whatever layout another tool wrote."""

import os

import h5py
import numpy as np
import pytest

from oracle.errors import TraceFormatError
from oracle.trace import SCHEMA, read_trace

T, D = 7, 16
VALUES = np.random.default_rng(0).standard_normal((T, D)).astype(np.float32)


def write(path, **dataset_options):
    """A minimal mtp-trace/1 file whose one stage `e` is stored with `dataset_options`; returns what h5py reads."""
    data = dataset_options.pop("data", VALUES)
    with h5py.File(path, "w") as f:
        f.attrs.update(schema=SCHEMA, num_tokens=T, hidden_size=D)
        f.create_dataset("stages/e", data=data, **dataset_options)
    with h5py.File(path, "r") as f:
        return f["stages/e"][()]


LAYOUTS = {  # name: (dataset options, route)
    "chunked by rows": (dict(chunks=(3, D)), "direct"),  # the last chunk is partly past T
    "one chunk": (dict(chunks=(T, D)), "direct"),
    "contiguous": ({}, "direct"),
    "gzip": (dict(chunks=(3, D), compression="gzip"), "h5py"),
    "shuffle and checksum": (dict(chunks=(3, D), shuffle=True, fletcher32=True), "h5py"),
    "chunks split across a row": (dict(chunks=(3, D // 2)), "h5py"),
    "big-endian": (dict(data=VALUES.astype(">f4"), chunks=(3, D)), "h5py"),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layout_reads_what_h5py_reads(tmp_path, layout):
    options, route = LAYOUTS[layout]
    truth = write(tmp_path / "t.h5", **dict(options))
    with read_trace(tmp_path / "t.h5") as tr:
        assert tr.read_route("stages/e") == route
        for start in range(T + 1):
            for stop in range(start, T + 1):
                np.testing.assert_array_equal(tr.stage_rows("e", start, stop), truth[start:stop])
                out = np.full((stop - start, D), np.nan, dtype=np.float32)
                assert tr.stage_rows("e", start, stop, out=out) is out
                np.testing.assert_array_equal(out, truth[start:stop])
        np.testing.assert_array_equal(tr.stage_rows("e"), truth)


def test_chunks_stored_out_of_order_are_found_by_their_row(tmp_path):
    """Chunks written last-first lie in the file in reverse order; each row range still reads its own rows."""
    with h5py.File(tmp_path / "t.h5", "w") as f:
        f.attrs.update(schema=SCHEMA, num_tokens=T, hidden_size=D)
        ds = f.create_dataset("stages/e", shape=(T, D), dtype=np.float32, chunks=(2, D))
        for start in reversed(range(0, T, 2)):
            ds[start:start + 2] = VALUES[start:start + 2]
    with read_trace(tmp_path / "t.h5") as tr:
        assert tr.read_route("stages/e") == "direct"
        for start in range(T):
            np.testing.assert_array_equal(tr.stage_rows("e", start, T), VALUES[start:])


def test_a_chunk_never_written_reads_as_the_fill_value_through_h5py(tmp_path):
    """Only HDF5 knows an unwritten chunk's fill value, so such a dataset is read by h5py."""
    with h5py.File(tmp_path / "t.h5", "w") as f:
        f.attrs.update(schema=SCHEMA, num_tokens=T, hidden_size=D)
        ds = f.create_dataset("stages/e", shape=(T, D), dtype=np.float32, chunks=(2, D), fillvalue=-7.0)
        ds[0:2] = VALUES[0:2]
    with read_trace(tmp_path / "t.h5") as tr:
        assert tr.read_route("stages/e") == "h5py"
        rows = tr.stage_rows("e", 0, T)
    np.testing.assert_array_equal(rows[:2], VALUES[:2])
    assert (rows[2:] == -7.0).all()


def test_a_contiguous_dataset_never_written_reads_as_the_fill_value(tmp_path):
    with h5py.File(tmp_path / "t.h5", "w") as f:
        f.attrs.update(schema=SCHEMA, num_tokens=T, hidden_size=D)
        f.create_dataset("stages/e", shape=(T, D), dtype=np.float32, fillvalue=3.0)  # no storage allocated
    with read_trace(tmp_path / "t.h5") as tr:
        assert tr.read_route("stages/e") == "h5py" and (tr.stage_rows("e", 2, 5) == 3.0).all()


def test_a_file_cut_short_while_open_is_reported_not_read_as_zeros(tmp_path):
    write(tmp_path / "t.h5", chunks=(3, D))
    with read_trace(tmp_path / "t.h5") as tr:
        np.testing.assert_array_equal(tr.stage_rows("e", 0, 3), VALUES[:3])  # the layout is known now
        first, _, offset = tr._layouts["stages/e"].extents[-1]
        os.truncate(tmp_path / "t.h5", offset + (T - first) * D * 4 - 8)  # into the last row's bytes
        with pytest.raises(TraceFormatError, match="truncated"):
            tr.stage_rows("e", 0, T)


def test_out_must_fit_the_rows(tmp_path):
    write(tmp_path / "t.h5", chunks=(3, D))
    with read_trace(tmp_path / "t.h5") as tr, pytest.raises(ValueError, match="C-contiguous"):
        tr.stage_rows("e", 0, 3, out=np.empty((2, D), dtype=np.float32))


@pytest.mark.parametrize("block_bytes", [4 << 20, 100, 1])
def test_digests_hashed_a_block_of_rows_at_a_time_equal_the_whole_arrays(block_bytes, monkeypatch, tmp_path):
    """The reader hashes /inputs and /evidence a few rows at a time (memory flat in T: whole [T, D] arrays copied
    to bytes were most of the diff's peak), with the value the writer computed over whole arrays; at 1 byte every
    row is its own block."""
    import shutil

    import oracle.trace as trace
    from oracle.trace import evidence_digest, inputs_digest
    from tests.helpers import TINY_REF

    monkeypatch.setattr(trace, "HASH_BLOCK_BYTES", block_bytes)
    with read_trace(TINY_REF) as reader:
        assert reader.inputs_digest() == inputs_digest(reader.inputs()) == reader.attrs["inputs_digest"]
        assert reader.evidence_verified() is True
        whole = {n: reader.evidence_rows(n) for n in reader.evidence_names()}
        assert evidence_digest(reader.attrs.get("evidence_rules"), whole) == reader.attrs["evidence_digest"]
    edited = shutil.copy(TINY_REF, tmp_path / "edited.h5")  # twin: one element of the last row changed
    with h5py.File(edited, "r+") as f:
        f["inputs/hidden"][-1, -1] += 1
        f["evidence/attn_uniform"][-1, -1] += 1
    with read_trace(edited) as reader:
        assert reader.inputs_digest() != reader.attrs["inputs_digest"]
        assert reader.evidence_verified() is False
