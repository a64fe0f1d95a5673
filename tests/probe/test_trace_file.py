"""Trace sources (HDF5 file, raw directory) and bounded memory: reads never exceed one chunk of rows."""

import subprocess
import sys

import numpy as np
import pytest

from oracle.errors import TraceFormatError
from oracle.stages import STAGE_BY_NAME, STAGE_NAMES
from oracle.trace import rows_per_chunk
from probe.adapters import trace_file
from probe.adapters.trace_file import open_candidate, open_reference
from probe.diff import diff_sources, read_rows
from probe.tolerance import tol_table
from tests.helpers import ROOT, TINY_REF
from tests.probe.tracekit import ref_data, synthetic, write_h5, write_raw  # noqa: F401


class RecordingSource:
    """Wraps a TraceSource and records every row range asked for."""

    def __init__(self, source):
        self._source = source
        self.requests: list[tuple[str, int, int]] = []

    def __getattr__(self, name):
        return getattr(self._source, name)

    def stage_rows(self, name, start, stop, out=None):
        self.requests.append((name, start, stop))
        return self._source.stage_rows(name, start, stop, out)

    def input_rows(self, name, start, stop):
        self.requests.append((f"inputs/{name}", start, stop))
        return self._source.input_rows(name, start, stop)


def _assert_bounded(requests, tokens, hidden):
    widths = {n: STAGE_BY_NAME[n].width(hidden) for n in STAGE_NAMES} | {"inputs/hidden": hidden}
    for name, start, stop in requests:
        bound = read_rows(hidden, tokens, STAGE_NAMES) if name in widths and name in STAGE_NAMES else \
            rows_per_chunk(widths.get(name, 1), tokens)
        assert stop - start <= bound, (name, start, stop)
    for name in STAGE_NAMES:  # every row was read, in more than one request
        # (set: the reference's attn is read twice, once more to measure which rows evidence q/k)
        ranges = sorted({(a, b) for n, a, b in requests if n == name})
        assert len(ranges) > 1 and ranges[0][0] == 0 and ranges[-1][1] == tokens
        assert all(b == c for (_, b), (c, _) in zip(ranges, ranges[1:]))


def test_diff_reads_both_traces_one_chunk_at_a_time(tmp_path, monkeypatch):
    tokens, hidden = 1200, 1024  # fc_in is 2048 wide: 128 rows per chunk, reads of 512 rows: three per stage
    inputs, stages = synthetic(tokens, hidden)
    path = write_h5(tmp_path / "big.h5", inputs, stages)
    raw = write_raw(tmp_path / "raw", stages, inputs)
    fromfile_counts = []
    real_fromfile = np.fromfile
    monkeypatch.setattr(trace_file.np, "fromfile",
                        lambda *a, **k: fromfile_counts.append(k["count"]) or real_fromfile(*a, **k))
    for cand_path in (path, raw):
        with open_reference(path) as ref_source, open_candidate(cand_path, tokens, hidden) as cand_source:
            ref, cand = RecordingSource(ref_source), RecordingSource(cand_source)
            report = diff_sources(ref, cand, tol_table())
        assert report.verdict.name == "pass" and len(report.cells) == 11 * tokens
        _assert_bounded(ref.requests, tokens, hidden)
        _assert_bounded(cand.requests, tokens, hidden)
    assert fromfile_counts and max(fromfile_counts) <= 512 * 2048  # raw files: row ranges, never whole files


def test_the_bound_check_catches_a_whole_file_read():
    with pytest.raises(AssertionError):
        _assert_bounded([(n, 0, 1200) for n in STAGE_NAMES], 1200, 1024)


def test_raw_rows_are_read_at_their_offset(tmp_path, ref_data):
    inputs, stages = ref_data
    raw = write_raw(tmp_path / "raw", stages, inputs)
    with open_candidate(raw, 8, 64) as source:
        assert source.stages == tuple(STAGE_NAMES) and source.kind == "raw dir"
        assert np.array_equal(source.stage_rows("fc_in", 3, 6), stages["fc_in"][3:6])
        out = np.full((3, 128), np.nan, dtype=np.float32)
        assert source.stage_rows("fc_in", 3, 6, out) is out and np.array_equal(out, stages["fc_in"][3:6])
        assert np.array_equal(source.input_rows("hidden", 5, 8), inputs.hidden[5:8])
        assert source.recorded_inputs == ("token_ids", "positions", "hidden")
        (raw / "fc_in.bin").write_bytes((raw / "fc_in.bin").read_bytes()[:-8])  # cut while open: not zeros
        with pytest.raises(TraceFormatError, match="ends before row 7"):
            source.stage_rows("fc_in", 6, 8, np.empty((2, 128), dtype=np.float32))


def test_hdf5_source_matches_the_reference_reader(ref_data):
    inputs, stages = ref_data
    with open_reference(TINY_REF) as source:
        assert source.stages == tuple(STAGE_NAMES) and (source.num_tokens, source.hidden_size) == (8, 64)
        assert np.array_equal(source.stage_rows("attn", 2, 5), stages["attn"][2:5])
        assert np.array_equal(source.input_rows("token_ids", 0, 8), inputs.token_ids)


def test_probe_imports_neither_torch_transformers_nor_matplotlib():
    code = ("import probe.cli, probe.diff, probe.report, sys; "
            "bad = [m for m in ('transformers', 'torch', 'matplotlib') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def test_an_hdf5_chunk_never_written_is_reported_unwritten(tmp_path, ref_data):
    """A candidate whose engine never wrote the last rows' chunk reads as zeros (HDF5's fill value, through h5py),
    which the probe reports as unwritten rows, not as values; twin: the same rows written pass."""
    import h5py

    from tests.probe.tracekit import diff_cli, last_line

    inputs, stages = ref_data
    for written in (4, 8):
        path = write_h5(tmp_path / f"c{written}.h5", inputs, stages)
        with h5py.File(path, "a") as f:
            del f["stages/fc"]
            f.create_dataset("stages/fc", shape=(8, 64), dtype=np.float32, chunks=(2, 64))[:written] = \
                stages["fc"][:written]
        result = diff_cli(TINY_REF, path)
        if written == 4:
            assert result.exit_code == 2 and "INVALID | unwritten rows: fc at token(s) 4-7" in last_line(result)
        else:
            assert result.exit_code == 0, last_line(result)
