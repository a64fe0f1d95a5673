"""The draft loop's diff (issue 24): chain depths read, compared per depth, and judged together.

References: a real depth-1 export of the tiny Qwen3.5 fixture plus depths 2..4 computed with the oracle's own head
(tests/probe/chain_reference.py), written per the chain schema with h5py (tests/probe/tracekit.py add_chain).
Every check has a twin the probe must fail or decline.
"""

import json
import shutil

import h5py
import numpy as np
import pytest

from oracle.trace import _put, evidence_digest
from probe.testing import assert_trace_close
from tests.helpers import TINY_REF
from tests.probe.chain_reference import compute_chain
from tests.probe.tracekit import (add_chain, diff_cli, last_line, load_trace, write_chain_h5, write_chain_raw,
                                  write_raw)

K = 4  # depths 1..4 of T = 10 bridge positions: n_j = 10, 9, 8, 7


def copies(depths):
    return {j: {n: r.copy() for n, r in part.items()} for j, part in depths.items()}


def edit_reference(src, dst, edit, redigest_evidence=False):
    """A copy of the reference with `edit(h5py.File)` applied (evidence_digest recomputed if asked)."""
    shutil.copy(src, dst)
    with h5py.File(dst, "a") as f:
        edit(f)
        if redigest_evidence:
            evidence = {n: f[f"evidence/{n}"][()] for n in f["evidence"]}
            for j in range(2, K + 1):
                evidence |= {f"d{j}/{n}": f[f"chain/d{j}/evidence/{n}"][()] for n in f[f"chain/d{j}/evidence"]}
            _put(f.attrs, "evidence_digest", evidence_digest(json.loads(f.attrs["evidence_rules"]), evidence))
    return dst


# --- a correct candidate passes at every depth; the same with depths missing does not ---------------------------

@pytest.mark.parametrize("form", ["raw", "h5"])
def test_correct_chain_passes_at_every_depth(chained, tmp_path, form):
    ref, stages, depths, inputs = chained
    cand = (write_chain_raw(tmp_path / "c", stages, depths) if form == "raw"
            else write_chain_h5(tmp_path / "c.h5", inputs, stages, depths))
    result = diff_cli(ref, cand, "--json", tmp_path / "r.json")
    assert result.exit_code == 0, result.output
    assert last_line(result).startswith("PASSED | 12 stages x 10 tokens within tolerance at depths 1-4")
    report = json.loads((tmp_path / "r.json").read_text())
    assert [d["depth"] for d in report["depths"]] == [1, 2, 3, 4]
    assert {r["depth"] for r in report["rows"]} == {1, 2, 3, 4}
    assert len([r for r in report["rows"] if r["depth"] == 3]) == 12 * 8  # n_3 = T - 3 + 1 bridge rows
    assert report["depths"][2]["recycle_evidence"]["prenorm"]["evidencing_rows"]  # measured, not assumed


def test_no_chain_captured_is_inconclusive_never_pass(chained, tmp_path):
    ref, stages, _, _ = chained
    result = diff_cli(ref, write_raw(tmp_path / "c", stages))
    assert result.exit_code == 3, result.output
    assert "the draft loop was not checked" in last_line(result) and "captures none" in last_line(result)


def test_some_depths_missing_is_inconclusive(chained, tmp_path):
    ref, stages, depths, _ = chained
    result = diff_cli(ref, write_chain_raw(tmp_path / "c", stages, {2: depths[2]}))
    assert result.exit_code == 3, result.output
    assert "depth(s) 3, 4 of the reference's 2..4 not captured" in last_line(result)


def test_reference_without_chain_judges_depth_one_and_notes_it(tmp_path):
    _, stages = load_trace(TINY_REF)
    result = diff_cli(TINY_REF, write_raw(tmp_path / "c", stages))
    assert result.exit_code == 0, result.output  # old traces read unchanged: judged on depth 1 as before
    assert "the draft loop was not checked: the reference records the bridge step only" in result.output


def test_chain_against_reference_without_chain_is_bad_input(tmp_path):
    _, stages = load_trace(TINY_REF)
    cand = write_chain_raw(tmp_path / "c", stages, {2: {n: r[:7] for n, r in stages.items()}})
    result = diff_cli(TINY_REF, cand)
    assert result.exit_code == 2 and "records the bridge step only" in result.output


# --- adversarial twins: wrong at one depth, copied depths, a wrong draft matrix -------------------------------

def test_wrong_at_depth_three_bridge_five_names_it(chained, tmp_path):
    ref, stages, depths, _ = chained
    bad = copies(depths)
    for name in ("res1", "mh", "mlp", "res2", "out"):
        bad[3][name][5] += 0.25
    result = diff_cli(ref, write_chain_raw(tmp_path / "c", stages, bad), "--json", tmp_path / "r.json")
    assert result.exit_code == 1, result.output
    assert "first divergent stage: res1 at depth 3 bridge 5" in last_line(result)
    report = json.loads((tmp_path / "r.json").read_text())
    assert {k: report["first_divergence"][k] for k in ("depth", "stage", "token")} == \
        {"depth": 3, "stage": "res1", "token": 5}
    assert [d["verdict"] for d in report["depths"]] == ["pass", "pass", "diverged", "pass"]


def test_depth_one_rows_copied_into_depth_two_diverge(chained, tmp_path):
    ref, stages, depths, _ = chained
    bad = copies(depths)
    bad[2] = {n: stages[n][:9].copy() for n in bad[2]}  # a loop that never ran: the bridge step's rows again
    result = diff_cli(ref, write_chain_raw(tmp_path / "c", stages, bad))
    assert result.exit_code == 1, result.output
    assert "at depth 2 bridge 0" in last_line(result)


def test_recycling_prenorm_caught_at_depth_two_h(chained, tmp_path):
    """An engine-shaped bug: the loop recycles res2 (the pre-norm residual) instead of out, same head otherwise."""
    ref, stages, _, inputs = chained
    wrong = compute_chain(inputs, stages["out"], K, recycle="res2")
    bad = {j: wrong.depths[j]["stages"] for j in wrong.depths}
    result = diff_cli(ref, write_chain_raw(tmp_path / "c", stages, bad))
    assert result.exit_code == 1, result.output
    assert "first divergent stage: h at depth 2 bridge 0" in last_line(result)


def test_frozen_chain_position_caught_at_depth_two_attn(chained, tmp_path):
    ref, stages, _, inputs = chained
    wrong = compute_chain(inputs, stages["out"], K, freeze_position=True)
    bad = {j: wrong.depths[j]["stages"] for j in wrong.depths}
    result = diff_cli(ref, write_chain_raw(tmp_path / "c", stages, bad))
    assert result.exit_code == 1, result.output
    assert "first divergent stage: attn at depth 2 bridge 0" in last_line(result)  # 2 keys: bridge 0 and itself


def test_draft_through_embed_tokens_diverges_at_draft(chained, tmp_path):
    """Every float stage matches; the draft is argmax(out @ embed_tokens^T) instead of lm_head."""
    from tests.probe.chain_reference import _tensor

    ref, stages, depths, _ = chained
    from oracle.checkpoint import Checkpoint
    from tests.helpers import TINY

    embed = _tensor(Checkpoint(TINY), "model.language_model.embed_tokens.weight").astype(np.float64)
    wrong = lambda out: (out.astype(np.float64) @ embed.T).argmax(axis=1)[:, None].astype(np.int64)  # noqa: E731
    cand_stages = {**stages, "draft": wrong(stages["out"])}
    bad = {j: {**part, "draft": wrong(part["out"])} for j, part in copies(depths).items()}
    assert (cand_stages["draft"] != stages["draft"]).any()
    result = diff_cli(ref, write_chain_raw(tmp_path / "c", cand_stages, bad))
    assert result.exit_code == 1, result.output
    assert "first divergent stage: draft at token" in last_line(result)


# --- draft near-ties: inconclusive, never a pass; a flip the out error cannot explain diverges ----------------

def _flip(rows, at):
    flipped = rows.copy()
    flipped[at, 0] = (flipped[at, 0] + 1) % 512
    return flipped


def test_draft_flip_explained_by_out_error_is_a_near_tie(chained, tmp_path):
    ref, stages, depths, _ = chained
    bad = copies(depths)
    bad[2]["out"][4] *= 1.2  # within a loose out tolerance, but enough to move the top two logits
    bad[2]["draft"] = _flip(bad[2]["draft"], 4)
    cand = write_chain_raw(tmp_path / "c", stages, bad)
    result = diff_cli(ref, cand, "--stage-tol", "out=0.5,1")
    assert result.exit_code == 3, result.output  # a near-tie: not judged, so not a pass
    assert "depth 2: draft near-ties at row(s) 4" in last_line(result)
    twin = copies(depths)
    twin[2]["draft"] = _flip(twin[2]["draft"], 4)  # the same flip with out exact: rounding cannot explain it
    result = diff_cli(ref, write_chain_raw(tmp_path / "t", stages, twin), "--stage-tol", "out=0.5,1")
    assert result.exit_code == 1 and "draft at depth 2 bridge 4" in last_line(result), result.output


def test_draft_flip_without_captured_out_uses_the_tolerance_bound(chained, tmp_path):
    ref, stages, depths, _ = chained
    bad = copies(depths)
    bad[2]["draft"] = _flip(bad[2]["draft"], 4)
    del bad[2]["out"]
    loose = diff_cli(ref, write_chain_raw(tmp_path / "c", stages, bad), "--stage-tol", "out=0.5,1")
    assert loose.exit_code == 3, loose.output  # a passing out may be off enough to flip it
    tight = diff_cli(ref, write_chain_raw(tmp_path / "t", stages, bad))
    assert tight.exit_code == 1, tight.output  # within 1e-4 of out the margin cannot be crossed


# --- bad input: rows past the reference's bridges, depths it lacks, truncated depths ----------------------------

def test_truncated_depth_rows_are_invalid(chained, tmp_path):
    ref, stages, depths, _ = chained
    bad = copies(depths)
    bad[3] = {n: r[:-1] for n, r in bad[3].items()}
    result = diff_cli(ref, write_chain_raw(tmp_path / "c", stages, bad))
    assert result.exit_code == 2 and last_line(result).startswith("INVALID | depth 3: wrong shape: e"), result.output


def test_rows_past_the_reference_bridges_are_bad_input(chained, tmp_path):
    ref, stages, depths, _ = chained
    bad = copies(depths)
    bad[3]["out"] = np.concatenate([bad[3]["out"], bad[3]["out"][:1]])  # 9 rows where n_3 = 8
    result = diff_cli(ref, write_chain_raw(tmp_path / "c", stages, bad))
    assert result.exit_code == 2 and "refer to bridge positions the reference lacks" in result.output


def test_depth_the_reference_lacks_is_bad_input(chained, tmp_path):
    ref, stages, depths, _ = chained
    bad = copies(depths) | {5: {n: r[:6] for n, r in depths[4].items()}}
    result = diff_cli(ref, write_chain_raw(tmp_path / "c", stages, bad))
    assert result.exit_code == 2 and "captures chain depth 5, which the reference" in result.output


def test_candidate_bridge_input_out_of_order_is_bad_input(chained, tmp_path):
    ref, stages, depths, inputs = chained
    cand = write_chain_h5(tmp_path / "c.h5", inputs, stages, depths)
    with h5py.File(cand, "a") as f:
        f["chain/d2/inputs/bridge"] = np.arange(9)[::-1].copy()
    result = diff_cli(ref, cand)
    assert result.exit_code == 2 and "bridge order" in result.output


# --- the reference's chain is verified before anything is blamed on the candidate -----------------------------

def test_edited_chain_stage_refused(chained, tmp_path):
    ref, stages, depths, _ = chained

    def edit(f):
        f["chain/d2/stages/out"][3] += 1.0

    result = diff_cli(edit_reference(ref, tmp_path / "e.h5", edit), write_chain_raw(tmp_path / "c", stages, depths))
    assert result.exit_code == 2 and "stage_checksums" in result.output


def test_edited_chain_input_refused(chained, tmp_path):
    ref, stages, depths, _ = chained

    def edit(f):
        f["chain/d3/inputs/token_ids"][0] += 1

    result = diff_cli(edit_reference(ref, tmp_path / "e.h5", edit), write_chain_raw(tmp_path / "c", stages, depths))
    assert result.exit_code == 2 and "chain_digest" in result.output


def test_chain_evidence_edited_after_export_is_refused(chained, tmp_path):
    ref, stages, depths, _ = chained

    def edit(f):  # evidence that would make a blind row count: the digest no longer matches
        f["chain/d2/evidence/attn_uniform"][1] += 1.0

    result = diff_cli(edit_reference(ref, tmp_path / "e.h5", edit), write_chain_raw(tmp_path / "c", stages, depths))
    assert result.exit_code == 2 and "evidence_digest" in result.output, result.output


def test_chain_evidence_outside_the_digest_is_not_trusted(chained, tmp_path):
    """A writer whose evidence_digest covers depth 1's evidence only: the chain's evidence counts for nothing."""
    ref, stages, depths, _ = chained

    def edit(f):
        evidence = {n: f[f"evidence/{n}"][()] for n in f["evidence"]}
        _put(f.attrs, "evidence_digest", evidence_digest(json.loads(f.attrs["evidence_rules"]), evidence))

    result = diff_cli(edit_reference(ref, tmp_path / "e.h5", edit), write_chain_raw(tmp_path / "c", stages, depths))
    assert result.exit_code == 3, result.output
    assert "depth 2: the reference records no attention-sensitivity evidence" in last_line(result)


# --- evidence is measured per depth -----------------------------------------------------------------------------

def test_recycle_alternative_equal_to_h_is_not_evidential(chained, tmp_path):
    ref, stages, depths, _ = chained

    def edit(f):
        f["chain/d2/evidence/h_if_prenorm"][...] = f["chain/d2/stages/h"][()]

    edited = edit_reference(ref, tmp_path / "e.h5", edit, redigest_evidence=True)
    result = diff_cli(edited, write_chain_raw(tmp_path / "c", stages, depths), "--json", tmp_path / "r.json")
    assert result.exit_code == 3, result.output
    assert "depth 2: no h row evidences the recycle choice against prenorm" in last_line(result)
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["depths"][1]["recycle_evidence"]["prenorm"]["not_evidential_rows"] == list(range(9))
    assert report["depths"][2]["recycle_evidence"]["prenorm"]["not_evidential_rows"] == []


def test_h_not_captured_at_a_depth_does_not_evidence_the_recycle(chained, tmp_path):
    ref, stages, depths, _ = chained
    cand = copies(depths)
    del cand[2]["h"]
    result = diff_cli(ref, write_chain_raw(tmp_path / "c", stages, cand))
    assert result.exit_code == 3 and "depth 2: h not captured" in last_line(result), result.output


def test_attention_evidence_is_per_depth(chained, tmp_path):
    ref, stages, depths, _ = chained

    def edit(f):  # depth 3's attention made insensitive: uniform weights would give the same rows
        f["chain/d3/evidence/attn_uniform"][...] = f["chain/d3/stages/attn"][()]

    edited = edit_reference(ref, tmp_path / "e.h5", edit, redigest_evidence=True)
    result = diff_cli(edited, write_chain_raw(tmp_path / "c", stages, depths))
    assert result.exit_code == 3, result.output
    assert "depth 3: no attn row depends on the attention weights" in last_line(result)


# --- assert_trace_close takes per-depth stages ------------------------------------------------------------------

def test_assert_trace_close_per_depth(chained):
    ref, stages, depths, _ = chained
    report = assert_trace_close(ref, {**stages, **{f"d{j}": part for j, part in depths.items()}})
    assert report.chain.compared_depths == (1, 2, 3, 4)
    bad = copies(depths)
    bad[4]["out"][2] += 1.0
    with pytest.raises(AssertionError, match="at depth 4 bridge 2"):
        assert_trace_close(ref, {**stages, **{f"d{j}": part for j, part in bad.items()}})
    with pytest.raises(AssertionError, match="the draft loop was not checked"):
        assert_trace_close(ref, stages)


def test_fail_fast_skips_the_chain_after_a_depth_one_divergence(chained, tmp_path):
    ref, stages, depths, _ = chained
    bad = dict(stages, out=stages["out"] + 1)
    result = diff_cli(ref, write_chain_raw(tmp_path / "c", bad, depths), "--fail-fast")
    assert result.exit_code == 1 and "at token 0" in last_line(result), result.output


# --- renderings: one bad depth stays visible at T in the thousands ------------------------------------------------

@pytest.fixture(scope="module")
def long_chain(tmp_path_factory):
    from tests.probe.tracekit import synthetic, synthetic_chain, write_h5

    folder = tmp_path_factory.mktemp("long")
    inputs, stages = synthetic(3000, 8)
    ref = write_h5(folder / "ref.h5", inputs, stages)
    chain = synthetic_chain(stages, 3)
    add_chain(ref, chain)
    depths = {j: chain.depths[j]["stages"] for j in chain.depths}
    return ref, {**stages, "draft": chain.depth1["draft"]}, depths


def _diff(ref, cand):
    from probe.diff import diff_traces

    return diff_traces(ref, cand)


def test_heatmap_shows_one_bad_depth_among_thousands_of_rows(long_chain, tmp_path):
    from probe.plot import heatmap_figure

    ref, stages, depths = long_chain
    bad = copies(depths)
    bad[3]["out"][1700] += 1.0  # one row of one stage of one depth, among 3 x 3000 x 12
    report = _diff(ref, write_chain_raw(tmp_path / "c", stages, bad))
    assert report.first_at[0] == 3 and report.first_at[1].token == 1700
    fig = heatmap_figure(report)
    overview = [ax for ax in fig.axes if ax.get_title().startswith("depth 3: all 2998 rows")]
    assert len(overview) == 1
    budgets = overview[0].collections[0].get_array()
    assert budgets.max() > 1  # the pooled column holding bridge 1700 shows the failure
    zoom = [ax for ax in fig.axes if ax.get_title().startswith("depth 3, rows")]
    assert zoom and zoom[0].get_xlim()[0] <= 1700 <= zoom[0].get_xlim()[1]
    assert "first divergence: out at depth 3 bridge 1700" in fig._suptitle.get_text()
    twin = heatmap_figure(_diff(ref, write_chain_raw(tmp_path / "t", stages, depths)))  # the same, correct
    calm = [ax for ax in twin.axes if ax.get_title().startswith("depth 3: all")][0].collections[0].get_array()
    assert calm.max() < 1


def test_html_has_a_depth_table(long_chain, tmp_path):
    from probe.html_report import render_html

    ref, stages, depths = long_chain
    bad = copies(depths)
    bad[2]["h"][10] += 1.0
    page = render_html(_diff(ref, write_chain_raw(tmp_path / "c", stages, bad)))
    assert '<section id="depths">' in page and "first divergence: stage h at depth 2 bridge position 10" in page
    assert "<td>2</td><td class=\"num\">2999</td><td class=\"bad\">DIVERGED</td>" in page
    calm = render_html(_diff(ref, write_chain_raw(tmp_path / "t", stages, depths)))
    assert "DIVERGED" not in calm and '<section id="depths">' in calm


def test_explain_checks_the_loop_variants_on_a_chain_divergence_no_variant_explains(chained, tmp_path):
    """A depth-3 error no loop variant makes: no variant is named, and the line says which depth diverged and what
    was checked there (tests/probe/test_explain_loop.py: the loop variants named on engine-shaped candidates)."""
    ref, stages, depths, _ = chained
    bad = copies(depths)
    bad[3]["out"][5] += 0.5
    result = diff_cli(ref, write_chain_raw(tmp_path / "c", stages, bad), "--explain")
    assert result.exit_code == 1, result.output
    assert ("DIAGNOSIS | no known variant reproduces the candidate: depth 3 of the draft loop diverges; the loop "
            "variants were checked at every captured depth") in result.output  # never "nothing to diagnose"


def test_fail_fast_stops_at_the_first_failing_depth(chained, tmp_path):
    ref, stages, depths, _ = chained
    bad = copies(depths)
    bad[2]["out"][1] += 1.0
    result = diff_cli(ref, write_chain_raw(tmp_path / "c", stages, bad), "--fail-fast")
    assert result.exit_code == 1 and "out at depth 2 bridge 1" in last_line(result), result.output
    assert "--fail-fast: depth 2 failed, so depth(s) 3, 4 were not compared" in result.output
    full = diff_cli(ref, write_chain_raw(tmp_path / "t", stages, bad))  # the twin without it compares them all
    assert "were not compared" not in full.output and "depths compared: 1-4 of 1-4" in last_line(full)


# --- the real oracle's chains (mtp-oracle export --chain K, chain-oracle's half of issue 24) -----------------------

def test_real_export_agrees_with_the_independent_chain(tmp_path):
    """The oracle's own --chain export against tests/probe/chain_reference.py's step-by-step computation (two
    implementations of the loop's semantics): a pass at every depth; the twin recycling res2 diverges at depth 2 h.
    Skipped (not passed) where this oracle has no --chain yet."""
    pytest.importorskip("oracle.draft_loop", reason="this oracle cannot export chains yet (issue 24, oracle half)")
    from oracle.cli import main

    from tests.helpers import TINY
    from tests.probe.chain_reference import TOKENS

    ref = tmp_path / "ref.h5"
    main(["export", str(TINY), "--out", str(ref), "--tokens", ",".join(map(str, TOKENS)), "--hidden-seed", "0",
          "--chain", "4", "-q"], standalone_mode=False)
    inputs, stages = load_trace(ref)
    mine = compute_chain(inputs, stages["out"], 4)
    result = diff_cli(ref, write_chain_raw(tmp_path / "c", stages, {j: p["stages"] for j, p in mine.depths.items()}))
    assert result.exit_code == 0 and "at depths 1-4" in last_line(result), result.output
    wrong = compute_chain(inputs, stages["out"], 4, recycle="res2")
    result = diff_cli(ref, write_chain_raw(tmp_path / "w", stages, {j: p["stages"] for j, p in wrong.depths.items()}))
    assert result.exit_code == 1 and "h at depth 2 bridge 0" in last_line(result), result.output
