"""Round 5 red team, chained candidates (issue 24): the forms tests/probe/test_chain_adversarial.py does not try.
Each finding: the input, what happened, what it does now; each with its twin.

Tried and already right (kept here as regressions, so a later change cannot make them pass): depth-2 rows shifted by
one bridge position, a chain captured for only some bridges, depth 3's rows written as depth 2, a NaN at depth 3,
draft ids permuted / all one id / out of vocabulary at depth 2."""

import numpy as np
import pytest

from tests.probe.tracekit import diff_cli, last_line, write_chain_raw


def _own(stages):
    """Rows as an engine's own arithmetic leaves them: every float value one ulp off (not a copy of the reference)."""
    return {n: np.nextafter(r, np.inf).astype(r.dtype) if r.dtype == np.float32 else r.copy() for n, r in stages.items()}


@pytest.fixture
def own(chained):
    ref, stages, depths, _ = chained
    return ref, _own(stages), {j: _own(part) for j, part in depths.items()}


def _diff(tmp_path, ref, stages, depths):
    return diff_cli(ref, write_chain_raw(tmp_path / "c", stages, depths))


# --- Finding 2: a chain depth that captures fewer stages, in a PASS --------------------------------------------
# input: a raw dump whose d3/ lacks mlp.bin (or d2..d4 lack draft.bin), everything else right
# was: exit 0 `PASSED | 12 stages x 10 tokens within tolerance at depths 1-4`: read as every stage at every depth,
#      though depth 3's mlp (or the chain's drafts) was never compared (depth 1's own gaps were named, not these)
# now: still a pass (attn and out are compared at every depth), and the line names each depth's missing stages

@pytest.mark.parametrize("stage,depths_without", [("mlp", (3,)), ("draft", (2, 3, 4))])
def test_a_pass_names_the_stages_a_chain_depth_did_not_capture(tmp_path, own, stage, depths_without):
    ref, stages, depths = own
    part = {j: {n: r for n, r in rows.items() if not (n == stage and j in depths_without)} for j, rows in depths.items()}
    result = _diff(tmp_path, ref, stages, part)
    assert result.exit_code == 0, result.output
    line = last_line(result)
    for j in depths_without:
        assert f"depth {j} not captured: {stage}" in line, line
    assert all(f"depth {j} not captured" not in line for j in {2, 3, 4} - set(depths_without))


def test_twin_every_stage_at_every_depth_names_no_gap(tmp_path, own):
    ref, stages, depths = own
    result = _diff(tmp_path, ref, stages, depths)
    assert result.exit_code == 0, result.output
    assert "not captured" not in last_line(result)
    assert last_line(result).startswith("PASSED | 12 stages x 10 tokens within tolerance at depths 1-4 | ref=")


# --- regressions: tried, already caught ---------------------------------------------------------------------

def test_depth_two_rows_shifted_by_one_bridge_diverge_at_bridge_zero(tmp_path, own):
    ref, stages, depths = own
    shifted = dict(depths) | {2: {n: np.concatenate([r[1:], r[-1:]]) for n, r in depths[2].items()}}
    result = _diff(tmp_path, ref, stages, shifted)
    assert result.exit_code == 1 and "first divergent stage: e at depth 2 bridge 0" in last_line(result), \
        result.output


@pytest.mark.parametrize("cut", ["first", "last"], ids=["from_bridge_1", "to_bridge_6"])
def test_a_chain_captured_for_only_some_bridges_is_invalid(tmp_path, own, cut):
    ref, stages, depths = own
    short = dict(depths) | {2: {n: (r[1:] if cut == "first" else r[:-2]) for n, r in depths[2].items()}}
    result = _diff(tmp_path, ref, stages, short)
    assert result.exit_code == 2 and last_line(result).startswith("INVALID | depth 2: wrong shape"), result.output


def test_depth_three_rows_written_as_depth_two_are_invalid(tmp_path, own):
    ref, stages, depths = own
    result = _diff(tmp_path, ref, stages, {2: depths[3], 3: depths[4]})
    assert result.exit_code == 2 and "depth 2: wrong shape" in last_line(result), result.output


def test_a_nan_at_depth_three_diverges_there(tmp_path, own):
    ref, stages, depths = own
    bad = {n: r.copy() for n, r in depths[3].items()}
    bad["out"][2, 5] = np.nan
    result = _diff(tmp_path, ref, stages, dict(depths) | {3: bad})
    assert result.exit_code == 1 and "first divergent stage: out at depth 3 bridge 2" in last_line(result)


@pytest.mark.parametrize("how", ["reversed", "one_id", "out_of_vocab"])
def test_wrong_draft_ids_at_depth_two_diverge_at_the_draft(tmp_path, own, how):
    ref, stages, depths = own
    ids = depths[2]["draft"].copy()
    ids = ids[::-1].copy() if how == "reversed" else ids
    ids[:] = ids[0] if how == "one_id" else ids
    ids[0] = 10 ** 6 if how == "out_of_vocab" else ids[0]
    result = _diff(tmp_path, ref, stages, dict(depths) | {2: depths[2] | {"draft": ids}})
    assert result.exit_code == 1 and "first divergent stage: draft at depth 2" in last_line(result), result.output


# --- Finding 3: an HDF5 candidate that records another physical layer than the reference ran -------------------
# input: /chain/d3/inputs/layer = 1 at every bridge (the reference: layer 0), rows otherwise the engine's own
# was: exit 0 PASSED at depths 1-4: the candidate's own record of the layer it ran was never read (token_ids and
#      positions were), so a PASS certified a layer the candidate says it did not run
# now: exit 3, INCONCLUSIVE naming depth, bridge and both layers; a divergence (layer0_reused's rows) still wins

def _with_chain_inputs(tmp_path, ref, stages, depths, layer_at_3):
    import h5py

    from tests.probe.tracekit import _dataset, load_trace, write_chain_h5

    with h5py.File(ref) as f:
        inputs = {j: {n: f[f"chain/d{j}/inputs/{n}"][()] for n in f[f"chain/d{j}/inputs"]} for j in depths}
    trace_inputs = load_trace(ref)[0]
    cand = write_chain_h5(tmp_path / "c.h5", trace_inputs, stages, depths)
    with h5py.File(cand, "a") as f:
        for j, part in inputs.items():
            for name, rows in part.items():
                _dataset(f, f"chain/d{j}/inputs/{name}", layer_at_3(rows) if (j, name) == (3, "layer") else rows)
    return cand


def test_a_candidate_recording_another_layer_is_not_a_pass(tmp_path, own):
    ref, stages, depths = own
    result = diff_cli(ref, _with_chain_inputs(tmp_path, ref, stages, depths, lambda rows: rows + 1))
    assert result.exit_code == 3, result.output
    assert "depth 3: the candidate records layer 1 at bridge 0 (8 row(s)) where the reference ran layer 0" \
        in last_line(result), result.output


def test_a_wrongly_typed_layer_record_is_not_a_pass(tmp_path, own):
    ref, stages, depths = own
    result = diff_cli(ref, _with_chain_inputs(tmp_path, ref, stages, depths, lambda rows: rows.astype(np.float32)))
    assert result.exit_code == 3 and "not one integer layer index per bridge row" in last_line(result), result.output


def test_twin_the_reference_layers_recorded_pass(tmp_path, own):
    ref, stages, depths = own
    result = diff_cli(ref, _with_chain_inputs(tmp_path, ref, stages, depths, lambda rows: rows))
    assert result.exit_code == 0, result.output
    assert last_line(result).startswith("PASSED | 12 stages x 10 tokens within tolerance at depths 1-4 | ref=")


def test_twin_a_wrong_layer_that_diverges_stays_diverged(tmp_path, own):
    """A depth whose rows diverge keeps its DIVERGED verdict (and so its diagnosis) beside the layer record."""
    ref, stages, depths = own
    bad = {n: (r * 1.5 if n in ("out",) else r) for n, r in depths[3].items()}
    result = diff_cli(ref, _with_chain_inputs(tmp_path, ref, stages, dict(depths) | {3: bad}, lambda rows: rows + 1))
    assert result.exit_code == 1 and "first divergent stage: out at depth 3" in last_line(result), result.output
