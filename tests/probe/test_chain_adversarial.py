"""Adversarial candidates (issue 24): each tries to make a chain depth it never computed pass, and must end invalid,
inconclusive or diverged (the issue's exit codes), never PASS about that depth.

Already covered elsewhere, not repeated here: a depth's rows copied from depth 1 in a dump
(test_chain_diff.py test_depth_one_rows_copied_into_depth_two_diverge), rows past the reference's bridge positions
and a bridge input out of order (test_rows_past_the_reference_bridges_are_bad_input,
test_candidate_bridge_input_out_of_order_is_bad_input), a raw depth the reference lacks
(test_depth_the_reference_lacks_is_bad_input), chains against a reference without them
(test_chain_against_reference_without_chain_is_bad_input), a Python draft_step that skips depth 3 and a C library
that exports mtp2_draft_step but writes nothing (test_run_chain.py). Here: the forms those miss.
"""

import textwrap

import h5py
import numpy as np
import pytest

from probe.cli import cli
from tests.helpers import FIXTURES, TINY, run_cli
from tests.probe.tracekit import diff_cli, last_line, write_chain_h5, write_chain_raw

CHEATS = textwrap.dedent('''
    import os

    import h5py
    import numpy as np
    from numpy_step import NumpyHead


    class CopiesTheReference(NumpyHead):
        """Computes depth 1 itself; for a chain depth it reads the reference's own rows from the trace file."""

        def draft_step(self, depth, token, pos, embed_row, out, trace):
            bridge = self.bridges - 1
            with h5py.File(os.environ["CHEAT_REFERENCE"]) as f:
                stages = f[f"chain/d{depth}/stages"]
                out[:] = stages["out"][bridge]
                for name, row in trace.items():
                    row[:] = stages[name][bridge]


    class DepthOneAgain(NumpyHead):
        """Every depth of bridge i's chain: the bridge step's own rows again (a loop that never ran)."""

        def forward(self, pos, embed_row, hidden, out, trace):
            super().forward(pos, embed_row, hidden, out, trace)
            self.last = {name: np.array(row) for name, row in trace.items()} | {"out": np.array(out)}

        def draft_step(self, depth, token, pos, embed_row, out, trace):
            out[:] = self.last["out"]
            for name, row in trace.items():
                row[:] = self.last[name]


    class ClaimsButNeverDrafts(NumpyHead):
        """Has draft_step, so it says it runs the loop, and writes nothing at any depth."""

        def draft_step(self, depth, token, pos, embed_row, out, trace):
            pass


    def make(cls):
        return lambda config, weights: cls(config, weights)


    copies, depth_one_again, never_drafts = make(CopiesTheReference), make(DepthOneAgain), make(ClaimsButNeverDrafts)
''')


@pytest.fixture
def cheats(tmp_path, monkeypatch, chained):
    (tmp_path / "chain_cheats.py").write_text(CHEATS)
    monkeypatch.syspath_prepend(str(FIXTURES / "candidates"))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("CHEAT_REFERENCE", str(chained[0]))


def _run(ref, spec):
    return run_cli(cli, ["run", ref, "--impl", spec, "--checkpoint", TINY, "-q"])


def _own_arithmetic(stages):
    """Depth 1 as an engine's own arithmetic leaves it: every float value one ulp away from the reference's."""
    return {n: np.nextafter(r, np.inf).astype(r.dtype) if r.dtype == np.float32 else r for n, r in stages.items()}


# --- rows copied from the reference: the depth was never computed --------------------------------------------

def test_driven_candidate_copying_the_reference_depths_is_not_a_pass(chained, cheats):
    result = _run(chained[0], "python:chain_cheats:copies")
    assert result.exit_code == 3, result.output
    assert "depth(s) 2, 3, 4 not counted as passed" in last_line(result)
    assert "copied, not computed" in last_line(result)


@pytest.mark.parametrize("form", ["raw", "h5"])
def test_dump_with_reference_depths_copied_is_not_a_pass(chained, tmp_path, form):
    ref, stages, depths, inputs = chained
    own = _own_arithmetic(stages)
    cand = (write_chain_raw(tmp_path / "c", own, depths) if form == "raw"
            else write_chain_h5(tmp_path / "c.h5", inputs, own, depths))
    result = diff_cli(ref, cand)
    assert result.exit_code == 3, result.output
    assert "depth(s) 2, 3, 4 not counted as passed" in last_line(result)


def test_only_the_copied_depth_is_named(chained, tmp_path):
    """Depths 2 and 4 nudged like depth 1 (computed), depth 3 the reference's bits: depth 3 alone is named."""
    ref, stages, depths, _ = chained
    mixed = {j: (_own_arithmetic(part) if j != 3 else part) for j, part in depths.items()}
    result = diff_cli(ref, write_chain_raw(tmp_path / "c", _own_arithmetic(stages), mixed))
    assert result.exit_code == 3, result.output
    assert "depth(s) 3 not counted as passed" in last_line(result)


def test_twin_a_candidate_off_in_the_last_bits_at_every_depth_passes(chained, tmp_path):
    """The twin: the same rows one ulp off at every depth, as an engine's own arithmetic leaves them, pass."""
    ref, stages, depths, _ = chained
    own = {j: _own_arithmetic(part) for j, part in depths.items()}
    result = diff_cli(ref, write_chain_raw(tmp_path / "c", _own_arithmetic(stages), own))
    assert result.exit_code == 0, result.output
    assert last_line(result).startswith("PASSED | 12 stages x 10 tokens within tolerance at depths 1-4")


# --- a depth equal to depth 1, depths claimed and never written -------------------------------------------------

def test_driven_depths_equal_to_depth_one_diverge_where_the_token_changes(chained, cheats):
    result = _run(chained[0], "python:chain_cheats:depth_one_again")
    assert result.exit_code == 1, result.output
    # depth 2 of bridge 0 feeds x_2 (token 3), depth 1 fed x_1 (17): e, the first stage, already differs
    assert "first divergent stage: e at depth 2 bridge 0" in last_line(result)


def test_driven_candidate_that_claims_the_loop_and_never_drafts_is_invalid(chained, cheats):
    result = _run(chained[0], "python:chain_cheats:never_drafts")
    assert result.exit_code == 2, result.output
    assert last_line(result).startswith("INVALID | depth 2: unwritten rows")
    assert "depth 3: unwritten rows" in last_line(result) and "depth 4: unwritten rows" in last_line(result)
    assert "depth 2 is captured but none of its rows was written" in result.output  # and what to do
    assert "exports no draft step" in result.output


def test_c_library_that_drafts_and_never_writes_is_told_what_to_do(chained, tmp_path):
    from probe.adapters.cabi import build_library

    library = build_library(FIXTURES / "candidates" / "mtp_step_v2.c", tmp_path, ("MTP_MUTANT_DRAFT_NO_WRITE",))
    result = _run(chained[0], f"c:{library}")
    assert result.exit_code == 2 and last_line(result).startswith("INVALID | depth 2: unwritten rows"), result.output
    assert "none of its rows was written" in result.output and "mtp2_draft_step" in result.output


def test_twin_a_depth_written_in_part_keeps_the_row_offset_advice(chained, tmp_path):
    """Only a depth with no row written at all gets the never-written message; a depth with one row left unwritten
    keeps the advice to check where the engine writes its rows."""
    from probe.poison import poison

    ref, stages, depths, _ = chained
    part = {j: {n: r.copy() for n, r in rows.items()} for j, rows in depths.items()}
    part[2]["attn"][3] = poison(part[2]["attn"].shape[1])
    result = diff_cli(ref, write_chain_raw(tmp_path / "c", stages, part))
    assert result.exit_code == 2 and last_line(result).startswith("INVALID | depth 2: unwritten rows"), result.output
    assert "Check the row offset" in result.output and "none of its rows was written" not in result.output


@pytest.mark.parametrize("form", ["raw", "h5"])
def test_dump_with_depth_folders_but_no_rows_is_invalid(chained, tmp_path, form):
    """Depth 1 only, but the dump claims depths 2..4 (empty d{j} folders / groups): bad input, never a pass."""
    ref, stages, _, inputs = chained
    if form == "raw":
        cand = write_chain_raw(tmp_path / "c", stages, {})
        for j in (2, 3, 4):
            (cand / f"d{j}").mkdir()
    else:
        cand = write_chain_h5(tmp_path / "c.h5", inputs, stages, {})
        with h5py.File(cand, "a") as f:
            for j in (2, 3, 4):
                f.create_group(f"chain/d{j}/stages")
    result = diff_cli(ref, cand)
    assert result.exit_code == 2, result.output
    assert last_line(result).startswith("INVALID | depth 2: no stage captured")
    assert "captures no stage; capture at least" in result.output  # what to do


# --- bad input in the HDF5 form: a depth the reference lacks, rows past its bridges ------------------------------

def test_h5_depth_the_reference_lacks_is_bad_input(chained, tmp_path):
    ref, stages, depths, inputs = chained
    cand = write_chain_h5(tmp_path / "c.h5", inputs, stages, depths | {5: {n: r[:6] for n, r in depths[4].items()}})
    result = diff_cli(ref, cand)
    assert result.exit_code == 2, result.output
    assert "captures chain depth 5, which the reference" in result.output and "--chain 5" in result.output


def test_h5_rows_for_bridges_the_reference_lacks_are_bad_input(chained, tmp_path):
    ref, stages, depths, inputs = chained
    long = {j: dict(part) for j, part in depths.items()}
    long[4] = {n: np.concatenate([r, r[:3]]) for n, r in depths[4].items()}  # 10 rows where n_4 = 7
    result = diff_cli(ref, write_chain_h5(tmp_path / "c.h5", inputs, stages, long))
    assert result.exit_code == 2, result.output
    assert "refer to bridge positions the reference lacks" in result.output and "Write row r" in result.output


def test_twin_a_stage_exact_at_every_depth_is_no_sign_of_copying(chained, tmp_path):
    """An engine whose `e` is bit-exact everywhere (its norm in the oracle's order) and whose other stages are its
    own: capturing only `e` and `out` at depth 2, with `e` exact there as at depth 1, is not flagged as copied."""
    ref, stages, depths, _ = chained
    own = _own_arithmetic(stages) | {"e": stages["e"]}  # e exact at depth 1, the rest off in the last bits
    part = {j: {"e": rows["e"], "out": _own_arithmetic(rows)["out"]} for j, rows in depths.items()}
    result = diff_cli(ref, write_chain_raw(tmp_path / "c", own, part))
    assert "copied, not computed" not in result.output, result.output
    only_e = {j: {"e": rows["e"]} for j, rows in depths.items()}  # e alone, exact at every depth: not a copy either
    result = diff_cli(ref, write_chain_raw(tmp_path / "d", own, only_e))
    assert "copied, not computed" not in result.output, result.output


# --- a wrongly typed index set at a chain depth ----------------------------------------------------------------

@pytest.mark.parametrize("ids_dtype", [np.float32, np.int64], ids=["float32_ids", "int64_ids"])
def test_a_chain_depth_with_topk_ids_written_as_float32_is_a_wrong_shape(tmp_path, ids_dtype):
    """d2/topk_ids.bin holding float32 (half the bytes int64 needs) is reported as a wrong shape (exit 2), as at
    depth 1; it was read to align topk_weights and crashed (exit 4). Twin: the same dump with int64 ids passes."""
    from oracle.cli import cli as oracle_cli

    ref = tmp_path / "moe.h5"
    exported = run_cli(oracle_cli, ["export", FIXTURES / "qwen3_5_moe_tiny", "--out", ref, "--tokens",
                                    "17,42,3,255,100,7,511,64", "--hidden-seed", "0", "--chain", "2", "-q"])
    assert exported.exit_code == 0, exported.output
    dump = tmp_path / "dump"
    with h5py.File(ref) as f:
        stages = {n: f["stages"][n][()] for n in f["stages"]}
        depth2 = {n: f["chain/d2/stages"][n][()] for n in f["chain/d2/stages"]}
    depth2["topk_ids"] = depth2["topk_ids"].astype(ids_dtype)
    dump.mkdir()
    for folder, part in ((dump, stages), (dump / "d2", depth2)):
        folder.mkdir(exist_ok=True)
        for name, rows in part.items():
            rows.tofile(folder / f"{name}.bin")  # what an engine's dump writes: the rows' bytes as they are
    result = diff_cli(ref, dump)
    if ids_dtype is np.int64:
        assert result.exit_code == 0, result.output
    else:
        assert result.exit_code == 2, result.output
        assert "depth 2: wrong shape: topk_ids" in last_line(result)
