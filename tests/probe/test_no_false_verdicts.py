"""Issue 10: each cause of a wrong verdict found by adversarial candidates, as a test with its twin.

1. attention that cannot depend on q/k (repeated token and hidden) is no q/k evidence;
2. every recorded input is checked on its own;
3. a crashing candidate is INVALID (exit 2), never "diverged" (exit 1);
4. an all-zero row a poisoned candidate computed is compared, not called unwritten;
5. a reference whose inputs were edited after export is refused;
6. `run` refuses a checkpoint whose head config differs from the reference's;
and the report's claims are measured: the candidate is the reference; rows shifted by one token.
"""

import json
import shutil

import h5py
import numpy as np
import pytest

from oracle.cli import main as oracle_main
from oracle.trace import TraceInputs, write_trace
from probe.cli import cli
from tests.helpers import TINY, TINY_REF, run_cli
from tests.probe.tracekit import copy_stages, load_trace, write_raw

PY = "python:tests.probe.lie_candidates:"


def last_line(result) -> str:
    return result.output.rstrip("\n").splitlines()[-1]


def export(out, *args) -> None:
    oracle_main(["export", str(TINY), "--out", str(out), *map(str, args), "-q"], standalone_mode=False)


@pytest.fixture(scope="module")
def degenerate_ref(tmp_path_factory):
    """T=6 steps of one token with one hidden row repeated: every attention row equals its uniform mean."""
    d = tmp_path_factory.mktemp("degenerate")
    np.save(d / "h.npy", np.repeat(np.random.default_rng(0).standard_normal((1, 64), dtype=np.float32), 6, axis=0))
    export(d / "ref.h5", "--tokens", "5,5,5,5,5,5", "--hidden", d / "h.npy")
    return d / "ref.h5"


def test_degenerate_attention_is_not_q_k_evidence_and_a_q_k_bug_cannot_pass(degenerate_ref):
    result = run_cli(cli, ["run", degenerate_ref, "--impl", PY + "no_qk_norm", "--checkpoint", TINY])
    assert result.exit_code == 3, result.output
    assert last_line(result).startswith("INCONCLUSIVE |") and "no attn row depends on the attention" in result.output
    assert "q/k path, attention pattern: NOT evidenced" in result.output and "0 of 6 reference tokens" in result.output


def test_twin_the_same_q_k_bug_diverges_at_attention_on_distinct_inputs():
    result = run_cli(cli, ["run", TINY_REF, "--impl", PY + "no_qk_norm", "--checkpoint", TINY])
    assert result.exit_code == 1 and "first divergent stage: attn at token 1" in last_line(result)


def test_export_warns_when_its_inputs_cannot_evidence_q_k(tmp_path):
    np.save(tmp_path / "h.npy", np.ones((3, 64), np.float32))
    warned = run_cli(__import__("oracle.cli", fromlist=["cli"]).cli,
                     ["export", TINY, "--out", tmp_path / "a.h5", "--tokens", "5,5,5", "--hidden", tmp_path / "h.npy"])
    assert warned.exit_code == 0 and "cannot evidence q, k" in warned.output
    twin = run_cli(__import__("oracle.cli", fromlist=["cli"]).cli,
                   ["export", TINY, "--out", tmp_path / "b.h5", "--tokens", "5,6,7", "--hidden-seed", "0"])
    assert twin.exit_code == 0 and "cannot evidence" not in twin.output


def test_a_reference_without_the_sensitivity_record_is_at_best_inconclusive(tmp_path):
    old = tmp_path / "old.h5"
    shutil.copy(TINY_REF, old)
    with h5py.File(old, "a") as f:  # as an older oracle wrote it: no evidence, no digest of it
        del f["evidence"]
        del f.attrs["evidence_digest"]
    result = run_cli(cli, ["diff", old, TINY_REF])
    assert result.exit_code == 3 and "re-export the reference" in last_line(result)


def test_each_recorded_input_is_checked_on_its_own(tmp_path):
    inputs, stages = load_trace(TINY_REF)
    moved = TraceInputs(inputs.token_ids, inputs.positions + 1, inputs.hidden, inputs.embed)
    path = tmp_path / "c.h5"
    write_trace(path, moved, copy_stages(stages), {"producer": "test"})
    with h5py.File(path, "a") as f:
        del f["inputs/hidden"]  # an incomplete /inputs group: positions must still be checked
    result = run_cli(cli, ["diff", TINY_REF, path])
    assert result.exit_code == 2 and "inputs differ: inputs/positions" in last_line(result)
    assert "not recorded (not verified): hidden" in result.output
    twin = tmp_path / "twin.h5"
    write_trace(twin, inputs, copy_stages(stages), {"producer": "test"})
    with h5py.File(twin, "a") as f:
        del f["inputs/hidden"]
    ok = run_cli(cli, ["diff", TINY_REF, twin])
    assert ok.exit_code == 0 and "identical to the reference: token_ids, positions" in ok.output


@pytest.mark.parametrize("factory, words", [
    ("raises_at_step_3", "INVALID | candidate raised ValueError at step 3: kv cache full"),
    ("raises_in_factory", "INVALID | candidate raised RuntimeError in raises_in_factory(): weights not found"),
])
def test_a_crashing_python_candidate_is_invalid_with_its_own_frame(factory, words):
    result = run_cli(cli, ["run", TINY_REF, "--impl", PY + factory, "--checkpoint", TINY])
    assert result.exit_code == 2, result.output
    assert words in result.output and "lie_candidates.py" in result.output  # the candidate's frame is shown
    assert "probe/adapters/python.py" not in result.output and "Traceback" not in result.output


@pytest.mark.parametrize("factory, words", [
    ("exits_at_step_3", "INVALID | candidate called sys.exit(0) at step 3"),
    ("exits_in_factory", "INVALID | candidate called sys.exit(0) in exits_in_factory()"),
])
def test_a_python_candidate_that_exits_is_invalid_not_a_silent_success(factory, words):
    """Red team: sys.exit(0) inside a Python candidate ended the probe with exit 0 and no verdict."""
    result = run_cli(cli, ["run", TINY_REF, "--impl", PY + factory, "--checkpoint", TINY])
    assert result.exit_code == 2 and words in result.output, result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize("factory, words", [
    ("cancelled_at_step_3", "INVALID | candidate raised CancelledError at step 3: engine loop shut down"),
    ("generator_exit_in_factory", "INVALID | candidate raised GeneratorExit in generator_exit_in_factory(): closed"),
    ("capture_raises", "INVALID | candidate raised RuntimeError reading its capture list: capture list not ready"),
    ("step_property_raises", "INVALID | candidate raised RuntimeError reading its step attribute: step kernel"),
    ("capture_is_none", "INVALID | python:tests.probe.lie_candidates:capture_is_none: capture must list stage names"),
    ("capture_is_a_number", "INVALID | python:tests.probe.lie_candidates:capture_is_a_number: capture must list stage names"),
])
def test_a_python_candidates_own_faults_are_invalid_not_diverged_or_a_probe_bug(factory, words):
    """Red team: a BaseException that is not an Exception (asyncio.CancelledError, GeneratorExit) ended the probe
    with exit 1 ("diverged") and a bare traceback; a capture/step attribute that raises or has the wrong type was
    "a bug in mtp-probe" (exit 4). All are the candidate's: INVALID, exit 2, no traceback of the probe's."""
    result = run_cli(cli, ["run", TINY_REF, "--impl", PY + factory, "--checkpoint", TINY])
    assert result.exit_code == 2 and words in result.output, result.output
    assert "Traceback" not in result.output and "bug in mtp-probe" not in result.output


def test_a_cancelled_candidate_exits_2_from_the_real_command():
    """The same as a process (the exit code CI reads): 2 with the INVALID line, never 1."""
    import subprocess
    import sys

    from tests.helpers import ROOT

    probe = [sys.executable, "-c", "from probe.cli import main; main()", "run", str(TINY_REF), "--checkpoint", str(TINY)]
    proc = subprocess.run(probe + ["--impl", PY + "cancelled_at_step_3"], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stdout.splitlines()[-1].startswith("INVALID | candidate raised CancelledError at step 3")
    # twin: an honest candidate from the same module, run the same way, passes
    ok = subprocess.run(probe + ["--impl", PY + "captures_through_a_generator"], capture_output=True, text=True,
                        cwd=ROOT)
    assert ok.returncode == 0, ok.stdout + ok.stderr


def test_a_capture_list_given_as_a_generator_is_read_once():
    """Red team: a generator `capture` was consumed by the check, so attn counted as not captured. Twin-free by
    construction: the same stages listed as a tuple give the same rows."""
    result = run_cli(cli, ["run", TINY_REF, "--impl", PY + "captures_through_a_generator", "--checkpoint", TINY])
    assert "not captured: attn" not in result.output and result.exit_code == 0, result.output


def test_a_c_candidate_that_exits_0_mid_run_is_invalid(tmp_path):
    from probe.adapters.cabi import build_library

    source = tmp_path / "quitter.c"
    original = (TINY.parent / "candidates" / "mtp_step.c").read_text()
    source.write_text("#include <stdlib.h>\n" + original.replace("int mtp_step(", "static int real_step(", 1) +
                      "\nint mtp_step(void *c, int pos, const float *e, const float *h, float *o, const mtp_trace *t)"
                      " { if (pos == 2) exit(0); return real_step(c, pos, e, h, o, t); }\n")
    lib = build_library(source, tmp_path)
    result = run_cli(cli, ["run", TINY_REF, "--impl", f"c:{lib}", "--checkpoint", TINY])
    assert result.exit_code == 2 and result.stdout.splitlines()[-1].startswith("INVALID |"), result.output
    assert "exited with status 0" in result.output and "step 2" in result.output


def test_a_computed_zero_row_is_compared_when_the_buffers_were_poisoned():
    result = run_cli(cli, ["run", TINY_REF, "--impl", PY + "zero_o_proj", "--checkpoint", TINY])
    assert result.exit_code == 1, result.output
    assert "first divergent stage: attn at token 0" in last_line(result)
    assert "every compared row written: the buffers were poison-filled" in result.output


def test_twin_a_zero_row_in_an_unpoisoned_dump_is_unwritten_and_said_to_be_indistinguishable(tmp_path):
    inputs, stages = load_trace(TINY_REF)
    cand = copy_stages(stages)
    cand["attn"][:] = 0
    result = run_cli(cli, ["diff", TINY_REF, write_raw(tmp_path / "raw", cand)])
    assert result.exit_code == 2 and "unwritten rows: attn" in last_line(result)


def test_a_zero_row_whose_reference_is_zero_is_never_claimed_written(tmp_path):
    inputs, stages = load_trace(TINY_REF)
    ref_stages = copy_stages(stages)
    ref_stages["mlp"][2] = 0  # a reference row that is itself all zeros
    ref = tmp_path / "ref.h5"
    write_trace(ref, inputs, ref_stages, {"producer": "test"},
                evidence={"attn_uniform": load_uniform(TINY_REF)})
    result = run_cli(cli, ["diff", ref, write_raw(tmp_path / "raw", copy_stages(ref_stages))])
    assert result.exit_code == 0, result.output
    assert "1 row(s) are all zeros on both sides, so whether they were written cannot be verified" in result.output


def load_uniform(path):
    with h5py.File(path, "r") as f:
        return f["evidence/attn_uniform"][()]


def test_a_reference_whose_inputs_were_edited_after_export_is_refused(tmp_path):
    edited = tmp_path / "edited.h5"
    shutil.copy(TINY_REF, edited)
    with h5py.File(edited, "a") as f:
        f["inputs/hidden"][2, 0] += 1.0
    result = run_cli(cli, ["diff", edited, TINY_REF])
    assert result.exit_code == 2 and "reference trace inconsistent" in result.output
    assert last_line(result).startswith(("INVALID |", "Error:"))
    twin = tmp_path / "copy.h5"
    shutil.copy(TINY_REF, twin)
    assert run_cli(cli, ["diff", twin, TINY_REF]).exit_code == 0


def test_a_candidate_trace_with_a_stale_digest_is_invalid(tmp_path):
    cand = tmp_path / "cand.h5"
    shutil.copy(TINY_REF, cand)
    with h5py.File(cand, "a") as f:
        f["inputs/embed"][0, 0] += 1.0  # embed is not compared as an input, but the digest covers it
    result = run_cli(cli, ["diff", TINY_REF, cand])
    assert result.exit_code == 2 and "inconsistent trace" in last_line(result)


def test_run_refuses_a_checkpoint_whose_head_config_differs_from_the_references(tmp_path):
    other = tmp_path / "ckpt"
    shutil.copytree(TINY, other)
    config = json.loads((other / "config.json").read_text())
    text = config.get("text_config", config)
    rope = text.setdefault("rope_parameters", {})
    rope["partial_rotary_factor"] = 0.5
    (other / "config.json").write_text(json.dumps(config))
    result = run_cli(cli, ["run", TINY_REF, "--impl", "torch", "--checkpoint", other])
    assert result.exit_code == 2 and "partial_rotary_factor" in result.output
    assert run_cli(cli, ["run", TINY_REF, "--impl", "torch", "--checkpoint", TINY]).exit_code == 0


def test_rows_shifted_by_one_token_are_named(tmp_path):
    result = run_cli(cli, ["run", TINY_REF, "--impl", PY + "shifted_rows", "--checkpoint", TINY])
    assert result.exit_code == 1 and "rows shifted by one token" in last_line(result), result.output
    twin = run_cli(cli, ["run", TINY_REF, "--impl", PY + "no_qk_norm", "--checkpoint", TINY])
    assert "rows shifted" not in twin.output


def test_the_candidate_being_the_reference_is_said(tmp_path):
    same = run_cli(cli, ["diff", TINY_REF, TINY_REF])
    assert "the candidate is the reference file itself" in last_line(same)
    copy = tmp_path / "copy.h5"
    shutil.copy(TINY_REF, copy)
    assert "written by the oracle" in last_line(run_cli(cli, ["diff", TINY_REF, copy]))
    inputs, stages = load_trace(TINY_REF)
    write_trace(tmp_path / "engine.h5", inputs, copy_stages(stages), {"producer": "my engine"})
    assert "note:" not in last_line(run_cli(cli, ["diff", TINY_REF, tmp_path / "engine.h5"]))


def test_run_does_not_claim_determinism_it_did_not_measure():
    result = run_cli(cli, ["run", TINY_REF, "--impl", "torch", "--checkpoint", TINY])
    assert result.exit_code == 0 and "deterministic" not in result.output


def test_a_reference_whose_evidence_was_edited_is_refused(tmp_path, degenerate_ref):
    """Edited evidence could turn blind rows into q/k evidence (a false pass): it is covered by evidence_digest."""
    forged = tmp_path / "forged.h5"
    shutil.copy(degenerate_ref, forged)
    with h5py.File(forged, "a") as f:
        f["evidence/attn_uniform"][1:] += 1.0  # claims every attn row at t >= 1 depends on the weights
    result = run_cli(cli, ["run", forged, "--impl", PY + "no_qk_norm", "--checkpoint", TINY])
    assert result.exit_code == 2 and "evidence" in result.output and "do not match" in result.output
    rules = tmp_path / "rules.h5"
    shutil.copy(degenerate_ref, rules)
    with h5py.File(rules, "a") as f:
        f.attrs["evidence_rules"] = json.dumps({"qk_dependent": [], "absolute_positions": "not evidenced"})
    assert run_cli(cli, ["diff", rules, degenerate_ref]).exit_code == 2
    unsigned = tmp_path / "unsigned.h5"
    shutil.copy(TINY_REF, unsigned)
    with h5py.File(unsigned, "a") as f:
        del f.attrs["evidence_digest"]  # evidence no digest covers is not trusted: at best inconclusive
    assert run_cli(cli, ["diff", unsigned, TINY_REF]).exit_code == 3
    assert run_cli(cli, ["diff", TINY_REF, TINY_REF]).exit_code == 0  # twin: the untouched reference


def test_a_reference_damaged_after_export_is_refused_not_blamed_on_the_candidate(tmp_path):
    """Red team: one edited attn value in the reference made a correct candidate DIVERGED (exit 1). The trace's
    stage_checksums are verified as the diff reads the rows: the damaged reference is INVALID, naming the stage.
    Twin: the same reference undamaged passes the same candidate."""
    from oracle.cli import cli as oracle_cli

    ref = tmp_path / "ref.h5"
    inputs = ["--tokens", "17,42,3,255,100,7,511,64", "--hidden-seed", "0", "-q"]
    assert run_cli(oracle_cli, ["export", TINY, "--out", ref, *inputs]).exit_code == 0
    cand = tmp_path / "cand.h5"
    shutil.copy(TINY_REF, cand)  # the same head and inputs, exported earlier: a correct candidate
    assert run_cli(cli, ["diff", ref, cand]).exit_code == 0
    with h5py.File(ref, "a") as f:
        f["stages/attn"][3, 5] *= np.float32(1.0001)
    result = run_cli(cli, ["diff", ref, cand])
    assert result.exit_code == 2 and "stage attn do not match the trace's stage_checksums" in last_line(result)
    # dropping the edited stage's checksum from the record does not let the edit through (red team)
    with h5py.File(ref, "a") as f:
        recorded = json.loads(f.attrs["stage_checksums"])
        del recorded["attn"]
        f.attrs["stage_checksums"] = json.dumps(recorded)
    result = run_cli(cli, ["diff", ref, cand])
    assert result.exit_code == 2 and "list no checksum for stage attn" in last_line(result), result.output


def test_fail_fast_still_refuses_a_reference_damaged_after_export(tmp_path, monkeypatch):
    """Red team: --fail-fast stopped at the first divergent chunk and skipped the checksums, so a reference edited in
    that chunk blamed a correct candidate (DIVERGED, exit 1; exit 2 without --fail-fast). The reference's other rows
    are now read (the candidate's are not) and verified. Reads of 2 tokens make the tiny trace several chunks."""
    from oracle.cli import cli as oracle_cli

    monkeypatch.setattr("probe.diff.read_rows", lambda widths, num_tokens, names: 2)
    ref = tmp_path / "ref.h5"
    inputs = ["--tokens", "17,42,3,255,100,7,511,64", "--hidden-seed", "0", "-q"]
    assert run_cli(oracle_cli, ["export", TINY, "--out", ref, *inputs]).exit_code == 0
    cand = tmp_path / "cand.h5"
    shutil.copy(TINY_REF, cand)  # a correct candidate
    with h5py.File(ref, "a") as f:
        f["stages/e"][0, 0] += np.float32(1.0)
    result = run_cli(cli, ["diff", ref, cand, "--fail-fast"])
    assert result.exit_code == 2 and "stage e do not match the trace's stage_checksums" in last_line(result), \
        result.output
    # twin: an intact reference and a candidate wrong from token 0 still stop early as DIVERGED
    assert run_cli(oracle_cli, ["export", TINY, "--out", tmp_path / "ok.h5", *inputs]).exit_code == 0
    wrong = tmp_path / "wrong.h5"
    shutil.copy(TINY_REF, wrong)
    with h5py.File(wrong, "a") as f:
        f["stages/e"][0, 0] += np.float32(1.0)
    stopped = run_cli(cli, ["diff", tmp_path / "ok.h5", wrong, "--fail-fast"])
    assert stopped.exit_code == 1 and "first divergent stage: e at token 0" in stopped.output, stopped.output


@pytest.mark.parametrize("chunks, fill", [((2, 64), np.nan), ((8, 16), 0.0)], ids=["row_chunks_nan", "col_chunks_0"])
def test_rows_in_chunks_the_candidate_never_wrote_are_unwritten_not_computed(tmp_path, chunks, fill):
    """Red team: an HDF5 candidate whose attn chunks for tokens 6-7 were never written read as the dataset's fill
    value, and a NaN fill was a computed divergence (exit 1). HDF5 knows those chunks were never allocated: the rows
    are unwritten (invalid, exit 2). Twin: the same layout with every chunk written passes."""
    inputs, stages = load_trace(TINY_REF)

    def candidate(path, write_all):
        shutil.copy(TINY_REF, path)
        with h5py.File(path, "r+") as f:
            values, attrs = f["stages/attn"][()], dict(f["stages/attn"].attrs)
            del f["stages/attn"]
            ds = f.create_dataset("stages/attn", shape=values.shape, dtype="f4", chunks=chunks, fillvalue=fill)
            if write_all:
                ds[...] = values
            elif chunks[0] == 2:
                ds[0:6] = values[0:6]  # the chunks of tokens 6-7 never written
            else:
                ds[:, :48] = values[:, :48]  # one column chunk of every row never written
            for key, value in attrs.items():
                ds.attrs[key] = value
        return path

    result = run_cli(cli, ["diff", TINY_REF, candidate(tmp_path / "holes.h5", write_all=False)])
    tokens = "6-7" if chunks[0] == 2 else "0-7"
    assert result.exit_code == 2 and f"unwritten rows: attn at token(s) {tokens}" in last_line(result), result.output
    assert run_cli(cli, ["diff", TINY_REF, candidate(tmp_path / "whole.h5", write_all=True)]).exit_code == 0


def test_an_index_set_in_unwritten_chunks_is_unwritten(tmp_path):
    """The same for topk_ids stored as uint (any integer dtype is accepted): its unwritten rows read as -1."""
    from oracle.cli import cli as oracle_cli

    ref = tmp_path / "moe_ref.h5"
    moe = TINY.parent / "qwen3_5_moe_tiny"
    assert run_cli(oracle_cli, ["export", moe, "--out", ref, "--tokens", "17,42,3,255,100,7,511,64",
                                "--hidden-seed", "0", "-q"]).exit_code == 0
    cand = tmp_path / "cand.h5"
    shutil.copy(ref, cand)
    with h5py.File(cand, "r+") as f:
        ids, attrs = f["stages/topk_ids"][()], dict(f["stages/topk_ids"].attrs)
        del f["stages/topk_ids"]
        ds = f.create_dataset("stages/topk_ids", shape=ids.shape, dtype="u2", chunks=(4, ids.shape[1]))
        ds[4:8] = ids[4:8]  # tokens 0-3 never written (they read as 0: expert 0 k times)
        for key, value in attrs.items():
            ds.attrs[key] = value
    result = run_cli(cli, ["diff", ref, cand])
    assert result.exit_code == 2 and "unwritten rows: topk_ids at token(s) 0-3" in last_line(result), result.output
