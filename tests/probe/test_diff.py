"""`mtp-probe diff` end to end: localisation for every stage, verdicts, self-checks and evidence.

Every check has a twin in which the probe must fail: no false green.
"""

import json

import numpy as np
import pytest

from oracle.stages import STAGE_NAMES
from probe.diff import diff_traces
from probe.poison import poison
from tests.helpers import TINY_REF
from tests.probe.tracekit import (copy_stages, diff_cli, last_line, perturbed_from, ref_data, ref_t1,  # noqa: F401
                                  synthetic, write_h5)


@pytest.mark.parametrize("stage", STAGE_NAMES)
def test_a_perturbation_from_stage_k_on_is_localised_to_k(tmp_path, ref_data, stage):
    inputs, stages = ref_data
    cand = write_h5(tmp_path / "c.h5", inputs, perturbed_from(stages, stage, lambda r: r * (1 + 1e-2)))
    result = diff_cli(TINY_REF, cand, "--json", tmp_path / "r.json")
    assert result.exit_code == 1
    assert last_line(result).startswith(f"DIVERGED | first divergent stage: {stage} at token 0 | budget 100x")
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["first_divergence"]["stage"] == stage and report["first_divergence"]["token"] == 0
    assert {row["token"]: row["stage"] for row in report["first_divergence_per_token"]} == {t: stage for t in range(8)}


@pytest.mark.parametrize("stage", STAGE_NAMES)
def test_a_sub_tolerance_perturbation_from_stage_k_on_passes(tmp_path, ref_data, stage):
    inputs, stages = ref_data
    cand_stages = perturbed_from(stages, stage, lambda r: r + 1e-6 * np.abs(r).max())  # max_rel ~1e-6
    assert not np.array_equal(cand_stages[stage], stages[stage])
    result = diff_cli(TINY_REF, write_h5(tmp_path / "c.h5", inputs, cand_stages))
    assert result.exit_code == 0
    assert last_line(result).startswith("PASSED | 11 stages x 8 tokens within tolerance | ref=")


def test_the_earliest_token_wins_over_an_earlier_stage(tmp_path, ref_data):
    inputs, stages = ref_data
    cand = copy_stages(stages)
    cand["fc"][5:] += 1.0  # an early stage, late token
    for name in ("attn", "res1", "out"):
        cand[name][2:] += 0.5  # a later stage, earlier token: the causal origin
    path = write_h5(tmp_path / "c.h5", inputs, cand)
    for extra in ((), ("--fail-fast",)):
        result = diff_cli(TINY_REF, path, *extra)
        assert result.exit_code == 1
        assert "first divergent stage: attn at token 2" in last_line(result)
    report = diff_traces(TINY_REF, path)
    assert report.first_per_token == {2: "attn", 3: "attn", 4: "attn", 5: "fc", 6: "fc", 7: "fc"}


@pytest.mark.parametrize("fill", ["poison", "zeros"])
def test_row_offset_bug_is_invalid_and_names_every_unwritten_row(tmp_path, ref_data, fill):
    inputs, stages = ref_data
    cand = {}
    for name, rows in stages.items():
        buf = poison(rows.shape) if fill == "poison" else np.zeros_like(rows)
        buf[0] = rows[-1]  # every step wrote to row 0; the last step's values stayed
        cand[name] = buf
    result = diff_cli(TINY_REF, write_h5(tmp_path / "c.h5", inputs, cand), "--json", tmp_path / "r.json")
    assert result.exit_code == 2
    assert last_line(result).startswith("INVALID | unwritten rows: e at token(s) 1-7, h at token(s) 1-7, fc_in at token(s) 1-7 and 8 more |")
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["verdict"] == "invalid"
    named = {(i["where"], t) for i in report["issues"] if i["kind"] == "unwritten" for t in i["tokens"]}
    assert named == {(s, t) for s in STAGE_NAMES for t in range(1, 8)}
    assert ("poison pattern 0x7FDEAD00" if fill == "poison" else "all zeros") in result.output
    rows = {(r["stage"], r["token"]): r for r in report["rows"]}
    assert rows[("fc", 3)]["status"] == "unwritten" and rows[("fc", 3)]["evidential"] is False


def test_computed_nan_diverges_but_a_surviving_poison_is_invalid(tmp_path, ref_data):
    inputs, stages = ref_data
    computed, left = copy_stages(stages), copy_stages(stages)
    computed["mlp"][2, 5] = np.float32("nan")
    left["mlp"][2, 5] = poison(1)[0]
    result = diff_cli(TINY_REF, write_h5(tmp_path / "nan.h5", inputs, computed))
    assert result.exit_code == 1 and "first divergent stage: mlp at token 2 | budget inf" in last_line(result)
    assert "NaN!" in result.output
    result = diff_cli(TINY_REF, write_h5(tmp_path / "poison.h5", inputs, left))
    assert result.exit_code == 2 and "unwritten rows: mlp at token(s) 2" in last_line(result)


def test_t1_all_matching_is_inconclusive_and_t8_passes(ref_t1):
    result = diff_cli(ref_t1, ref_t1)
    assert result.exit_code == 3
    assert last_line(result).startswith("INCONCLUSIVE | all compared rows within tolerance, but attn compared "
                                        "only at t=0")
    assert "q/k path, attention pattern: NOT evidenced" in result.output
    assert diff_cli(TINY_REF, TINY_REF).exit_code == 0


@pytest.mark.parametrize("drop", [("attn",), ("out",), ("attn", "res1")])
def test_without_attn_or_out_the_best_verdict_is_inconclusive(tmp_path, ref_data, drop):
    inputs, stages = ref_data
    result = diff_cli(TINY_REF, write_h5(tmp_path / "c.h5", inputs, copy_stages(stages, drop)))
    assert result.exit_code == 3 and f"not captured: {drop[0]}" in last_line(result)


def test_attn_missing_still_diverges_when_something_differs(tmp_path, ref_data):
    inputs, stages = ref_data
    cand = perturbed_from(copy_stages(stages, ("attn",)), "mlp", lambda r: r + 0.1)
    assert diff_cli(TINY_REF, write_h5(tmp_path / "c.h5", inputs, cand)).exit_code == 1


def test_every_report_states_what_a_trace_cannot_evidence():
    result = diff_cli(TINY_REF, TINY_REF)
    assert "absolute positions are not evidenced" in result.output
    assert ("q/k path, attention pattern (softmax(q·k), not uniform weights): evidenced by 7 attn row(s) at t=1-7"
            in result.output)
    assert "q/k path, RoPE: evidenced" in result.output and "q/k path, KV append: evidenced" in result.output
    assert "the candidate is the reference file itself" in result.output.splitlines()[-1]
    assert "0~" in result.output  # t=0 attention cells are marked not evidential


def test_stage_tolerance_override(tmp_path, ref_data):
    inputs, stages = ref_data
    cand = copy_stages(stages)
    cand["fc"] *= np.float32(1 + 1e-3)  # only fc itself: a capture-side rounding difference
    path = write_h5(tmp_path / "c.h5", inputs, cand)
    assert diff_cli(TINY_REF, path).exit_code == 1
    loose = diff_cli(TINY_REF, path, "--stage-tol", "fc=1e-2,1e-3")
    assert loose.exit_code == 0 and "--stage-tol fc=1e-2,1e-3" in loose.output
    assert diff_cli(TINY_REF, path, "--rtol", "1e-2", "--atol", "1e-3").exit_code == 0
    assert diff_cli(TINY_REF, path, "--stage-tol", "ah=1e-2,1e-3").exit_code == 1


def test_fail_fast_stops_after_the_first_divergent_chunk(tmp_path):
    
    inputs, stages = synthetic(640, 1024)  # reads of 4 x 128 rows (READ_CHUNKS): two reads
    ref = write_h5(tmp_path / "ref.h5", inputs, stages)
    cand = write_h5(tmp_path / "c.h5", inputs, perturbed_from(stages, "h", lambda r: r + 1))
    full, fast = diff_traces(ref, cand), diff_traces(ref, cand, fail_fast=True)
    assert full.compared_tokens == 640 and fast.compared_tokens == 512
    assert (fast.first.stage, fast.first.token) == (full.first.stage, full.first.token) == ("h", 0)
    assert fast.verdict.name == "diverged" and len(fast.cells) == 11 * 512
    result = diff_cli(ref, cand, "--fail-fast")
    assert result.exit_code == 1 and "stopped after 512 of 640 tokens" in result.output
