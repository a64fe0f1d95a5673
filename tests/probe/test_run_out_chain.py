"""`mtp-probe run --out` records every depth the candidate computed (issue 24): depth 1 and /chain/d{j} in the
trace schema, so `mtp-probe diff REF OUT` compares them again and comes to the same verdict at the same (depth,
stage, bridge). Its twins: a candidate with a loop bug writes a trace whose diff diverges where the run did; a
candidate that captures no chain writes depth 1 only, and its diff is inconclusive as the run was. The torch
transcription is not a driven candidate (probe/adapters/torch_ref.py): on a chain reference it is inconclusive,
on the same head's bridge-only reference it passes."""

import json
import textwrap

import numpy as np
import pytest

from oracle.trace import read_trace
from probe.cli import cli
from tests.helpers import FIXTURES, TINY, run_cli
from tests.probe.tracekit import last_line

MUTANTS = textwrap.dedent('''
    from numpy_step import NumpyHead


    class FrozenPosition(NumpyHead):
        def step(self, pos, embed_row, hidden, out, trace):
            self.bridge_pos = pos
            super().step(pos, embed_row, hidden, out, trace)

        def draft_step(self, depth, token, pos, embed_row, out, trace):
            super().draft_step(depth, token, self.bridge_pos, embed_row, out, trace)


    class NoLoop(NumpyHead):
        draft_step = None


    def frozen(config, weights):
        return FrozenPosition(config, weights)


    def no_loop(config, weights):
        return NoLoop(config, weights)
''')


@pytest.fixture
def candidates(tmp_path, monkeypatch):
    (tmp_path / "out_mutants.py").write_text(MUTANTS)
    monkeypatch.syspath_prepend(str(FIXTURES / "candidates"))
    monkeypatch.syspath_prepend(str(tmp_path))


def _run_out(ref, spec, out):
    return run_cli(cli, ["run", ref, "--impl", spec, "--checkpoint", TINY, "--out", out, "-q"])


def test_out_records_every_depth_and_diff_passes_them_again(chained, candidates, tmp_path):
    ref, _, ref_depths, _ = chained
    out = tmp_path / "cand.h5"
    ran = _run_out(ref, "python:numpy_step:make_head", out)
    assert ran.exit_code == 0, ran.output
    with read_trace(out) as cand:
        record = json.loads(cand.attrs["chain"])
        assert record["depths"] == 4 and cand.attrs["provenance"]["adapter"].startswith("python:")
    import h5py

    with h5py.File(out) as f:
        assert sorted(f["chain"]) == ["d2", "d3", "d4"]
        for j in (2, 3, 4):
            assert set(f[f"chain/d{j}/stages"]) == set(f["stages"])  # every stage it captured, at every depth
            assert set(f["stages"]) == set(ref_depths[j]) - {"draft"}  # the numpy head takes no draft
            assert len(f[f"chain/d{j}/stages/out"]) == 10 - j + 1
            assert np.isnan(f[f"chain/d{j}/inputs/recycled"][()]).all()  # the engine's own: never claimed
    again = run_cli(cli, ["diff", ref, out, "-q"])
    assert again.exit_code == 0, again.output
    assert last_line(again).startswith("PASSED | 11 stages x 10 tokens within tolerance at depths 1-4"), again.output


def test_a_loop_bug_written_by_out_diverges_again_where_the_run_did(chained, candidates, tmp_path):
    ref, out = chained[0], tmp_path / "frozen.h5"
    ran = _run_out(ref, "python:out_mutants:frozen", out)
    assert ran.exit_code == 1 and "first divergent stage: attn at depth 2 bridge 0" in last_line(ran), ran.output
    again = run_cli(cli, ["diff", ref, out, "-q"])
    assert again.exit_code == 1, again.output
    assert "first divergent stage: attn at depth 2 bridge 0" in last_line(again)


def test_a_candidate_without_a_loop_writes_depth_one_only_and_stays_inconclusive(chained, candidates, tmp_path):
    ref, out = chained[0], tmp_path / "noloop.h5"
    ran = _run_out(ref, "python:out_mutants:no_loop", out)
    assert ran.exit_code == 3 and "the draft loop was not checked" in last_line(ran), ran.output
    with read_trace(out) as cand:
        assert "chain" not in cand.attrs
    again = run_cli(cli, ["diff", ref, out, "-q"])
    assert again.exit_code == 3 and "the draft loop was not checked" in last_line(again), again.output


def test_out_over_the_reference_is_refused_and_the_reference_is_untouched(chained, candidates):
    ref = chained[0]
    before = ref.read_bytes()
    ran = _run_out(ref, "python:numpy_step:make_head", ref)
    assert ran.exit_code == 2, ran.output
    assert ref.read_bytes() == before


def test_a_failed_write_leaves_no_file_and_no_half_trace(chained, candidates, tmp_path, monkeypatch):
    import oracle.trace as trace

    out, real = tmp_path / "half.h5", trace._write_chain_depth

    def full_disk_at_depth_four(f, depth, *args):  # depth 1 and 2..3 are in the file when the disk fills up
        if depth == 4:
            raise OSError(28, "No space left on device")
        real(f, depth, *args)

    monkeypatch.setattr(trace, "_write_chain_depth", full_disk_at_depth_four)
    ran = _run_out(chained[0], "python:numpy_step:make_head", out)
    assert ran.exit_code != 0 and "No space left" in ran.output, ran.output
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == ["out_mutants.py"]


def test_torch_captures_no_chain_so_a_chain_reference_is_inconclusive(chained, tmp_path):
    ref, out = chained[0], tmp_path / "torch.h5"
    ran = run_cli(cli, ["run", ref, "--impl", "torch", "--checkpoint", TINY, "--out", out, "-q"])
    assert ran.exit_code == 3, ran.output
    assert last_line(ran).startswith("INCONCLUSIVE") and "the draft loop was not checked" in last_line(ran)
    with read_trace(out) as cand:
        assert "chain" not in cand.attrs and len(cand.stages) == 11  # depth 1, as it computed


def test_torch_on_the_same_heads_bridge_only_reference_passes(tmp_path):
    """Twin: the torch transcription is right at depth 1, so the inconclusive verdict above is the loop's alone."""
    from tests.probe.chain_reference import export_depth1

    ref = export_depth1(tmp_path / "bridge.h5")
    ran = run_cli(cli, ["run", ref, "--impl", "torch", "--checkpoint", TINY, "-q"])
    assert ran.exit_code == 0 and last_line(ran).startswith("PASSED | 11 stages x 10 tokens"), ran.output
