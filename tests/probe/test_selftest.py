"""`mtp-probe selftest` is part of the suite: every mutant caught and localised, every correct candidate passing
— and a selftest whose expectation is not met exits non-zero."""

import dataclasses

import numpy as np
import pytest

import probe.selftest as selftest
from probe.cli import cli
from tests.helpers import TINY, run_cli


def test_selftest_passes_on_the_bundled_fixture():
    result = run_cli(cli, ["selftest"])
    assert result.exit_code == 0, result.output
    last = result.output.strip().splitlines()[-1]
    assert last.startswith("SELFTEST PASSED | ") and " not" not in last
    rows = [line for line in result.output.splitlines() if line.startswith(("NO_QK_NORM", "POS_PLUS_ONE"))]
    assert any("diverged     attn@1" in r and "match" in r for r in rows)  # matches at t=0, caught at t=1
    assert any(r.startswith("POS_PLUS_ONE") and " 8  pass" in r for r in rows)
    cases = selftest.LOOP_CASES + selftest.LAYERED_CASES
    loop = {line.split("  ")[0]: line.split() for line in result.output.splitlines()
            if line.startswith(tuple(c.name for c in cases))}
    assert len(loop) == len(cases)
    assert all(fields[-1] == "ok" for fields in loop.values()), loop
    for impl in ("C", "python"):
        assert loop[f"recycle_prenorm ({impl})"][2:4] == ["diverged", "h@d2:0"]
        assert loop[f"chain_kv_kept ({impl})"][2:4] == ["diverged", "attn@d1:1"]
    assert loop["C draft loop"][3:5] == ["pass", "-"] and loop["C draft loop"][-3] == "1-4"
    assert loop["C draft loop, 3 layers"][-3] == "1-3"  # the 3-layer head: every depth on its own layer
    for impl in ("C", "python"):
        assert loop[f"layer0_reused ({impl})"][2:4] == ["diverged", "ah@d2:0"]
    # --explain's DIAGNOSIS (the diagnosis column): each variant's mutants named as it, correct loops as none
    for case in cases:
        assert loop[case.name][-2] == (case.variant or "none"), (case.name, loop[case.name])


def test_selftest_fails_when_a_mutant_is_not_caught_as_expected(monkeypatch):
    by_name = {c.name: c for c in selftest.CASES}
    wrong = dataclasses.replace(by_name["ROPE_GPTJ"], expect=("diverged", "attn@0"))  # it really shows at t=1
    monkeypatch.setattr(selftest, "CASES", (by_name["C reference"], wrong))
    monkeypatch.setattr(selftest, "LOOP_CASES", ())
    monkeypatch.setattr(selftest, "LAYERED_CASES", ())
    result = run_cli(cli, ["selftest"])
    assert result.exit_code == 1
    assert result.output.strip().splitlines()[-1].startswith("SELFTEST FAILED | 3/4 runs as expected, 1 not")


# --- the draft loop's cases (issue 24) -------------------------------------------------------------------------

LOOP_BY_NAME = {c.name: c for c in selftest.LOOP_CASES}
VARIANTS = ("recycle_prenorm", "recycle_main_hidden", "position_frozen", "chain_kv_kept", "draft_embed_tokens",
            "layer0_reused")


def test_every_loop_variant_has_a_c_and_a_python_mutant():
    for variant in VARIANTS:
        cases = [c for c in selftest.LOOP_CASES + selftest.LAYERED_CASES if c.variant == variant]
        assert {c.impl.split(":")[0] for c in cases} == {"c", "python"}, variant
        assert len({c.expect for c in cases}) == 1  # both caught at the same place
    correct = [c for c in selftest.LOOP_CASES if not c.variant and c.expect[0] == "pass"]
    assert {c.profile for c in correct} == {"float32", "bfloat16"}


@pytest.fixture(scope="module")
def chain_export(tmp_path_factory):
    """The selftest's chained reference, exported once for this module's loop runs."""
    out = tmp_path_factory.mktemp("selftest-chain") / "chain.h5"
    return selftest.chained_reference(selftest.BUNDLED_REFERENCE, selftest.BUNDLED_CHECKPOINT, out)


@pytest.fixture
def loop_run(chain_export, tmp_path, monkeypatch):
    """run_loop_cases over `cases` on the module's chained reference: {case name: LoopRow}."""
    monkeypatch.setattr(selftest, "chained_reference", lambda reference, checkpoint, out: chain_export)

    def run(*cases):
        monkeypatch.setattr(selftest, "LOOP_CASES", cases)
        rows = selftest.run_loop_cases(selftest.BUNDLED_REFERENCE, selftest.BUNDLED_CHECKPOINT, tmp_path, tmp_path)
        return {r.case.name: r for r in rows}
    return run


def test_embed_draft_expectation_is_where_the_two_matrices_disagree(chain_export):
    """Worked out independently: argmax over out . embed_tokens vs out . lm_head, from the checkpoint's own bytes."""
    import h5py

    from oracle.checkpoint import Checkpoint
    from tests.probe.chain_reference import _tensor

    ckpt = Checkpoint(TINY)
    lm_head, embed = (_tensor(ckpt, n).astype(np.float64) for n in
                      ("lm_head.weight", "model.language_model.embed_tokens.weight"))
    with h5py.File(chain_export) as f:
        out = f["stages/out"][()].astype(np.float64)
    differ = np.flatnonzero((out @ embed.T).argmax(axis=1) != (out @ lm_head.T).argmax(axis=1))
    assert len(differ)  # the variant is visible on this reference at depth 1
    assert selftest.embed_draft_first(chain_export, TINY) == f"draft@d1:{differ[0]}"


def test_a_loop_variant_caught_elsewhere_fails_the_selftest(loop_run):
    wrong = dataclasses.replace(LOOP_BY_NAME["recycle_prenorm (C)"], expect=("diverged", "h@d3:0"))
    rows = loop_run(LOOP_BY_NAME["C draft loop"], wrong)
    assert rows["C draft loop"].ok is True
    assert rows[wrong.name].ok is False and rows[wrong.name].first == "h@d2:0"  # where it really starts


def test_a_pass_without_the_draft_captured_fails_and_the_embed_draft_goes_unseen(loop_run, monkeypatch):
    """Twin of the correct candidates' pass: without their draft tables they capture no draft, so the pass does not
    cover every stage (FAIL), and draft_embed_tokens cannot be caught (FAIL), never reported as expected."""
    monkeypatch.setattr(selftest, "DRAFT_TABLES_ENV", "MTP_SELFTEST_NO_SUCH_TABLES")
    rows = loop_run(LOOP_BY_NAME["python draft loop"], LOOP_BY_NAME["draft_embed_tokens (python)"])
    assert rows["python draft loop"].verdict == "pass" and rows["python draft loop"].ok is False
    assert "not captured: d1 draft" in rows["python draft loop"].note
    assert rows["draft_embed_tokens (python)"].verdict == "pass" and rows["draft_embed_tokens (python)"].ok is False


def test_draft_embed_tokens_must_diverge_at_the_draft_stage_only(loop_run):
    """A candidate that diverges elsewhere too cannot stand for draft_embed_tokens, even where its first divergence
    is the expected one."""
    impostor = selftest.LoopCase("impostor", "python:numpy_loop_mutants:recycle_prenorm", "draft_embed_tokens",
                                 ("diverged", "h@d2:0"))
    row = loop_run(impostor)["impostor"]
    assert row.first == "h@d2:0" and row.ok is False and "diverged too" in row.note
    real = loop_run(LOOP_BY_NAME["draft_embed_tokens (python)"])["draft_embed_tokens (python)"]
    assert real.ok is True and real.first.startswith("draft@d1:")


def test_the_loop_cases_leave_the_environment_as_they_found_it(loop_run):
    import os
    import sys

    before_env, before_path = os.environ.get(selftest.DRAFT_TABLES_ENV), list(sys.path)
    loop_run(LOOP_BY_NAME["C without mtp2_draft_step"])
    assert os.environ.get(selftest.DRAFT_TABLES_ENV) == before_env and sys.path == before_path


def test_a_bf16_engine_passes_at_every_depth_under_the_bf16_profile_only(loop_run):
    """The numpy head storing every stage in bfloat16 passes depths 1-4 (draft included) under the bfloat16 profile;
    its twin, the same run under float32's tolerance, diverges at the first stage it rounds."""
    rows = loop_run(LOOP_BY_NAME["python bfloat16, bf16 profile"], LOOP_BY_NAME["python bfloat16"])
    bf16, f32 = rows["python bfloat16, bf16 profile"], rows["python bfloat16"]
    assert (bf16.verdict, bf16.depths, bf16.ok) == ("pass", "1-4", True), bf16
    assert (f32.verdict, f32.first, f32.ok) == ("diverged", "e@d1:0", True), f32


def test_a_loop_case_diagnosed_as_another_variant_or_a_correct_loop_diagnosed_fails(loop_run):
    """The diagnosis check can fail: recycle_prenorm's mutant is caught where recycle_main_hidden's is (h@d2:0),
    so only --explain's DIAGNOSIS tells them apart; labelled recycle_main_hidden, or as a correct loop, it fails."""
    mutant = "python:numpy_loop_mutants:recycle_prenorm"
    mislabelled = selftest.LoopCase("mislabelled", mutant, "recycle_main_hidden", ("diverged", "h@d2:0"))
    unlabelled = selftest.LoopCase("unlabelled", mutant, "", ("diverged", "h@d2:0"))
    rows = loop_run(mislabelled, unlabelled, LOOP_BY_NAME["recycle_prenorm (python)"], LOOP_BY_NAME["C draft loop"])
    for name in ("mislabelled", "unlabelled"):
        assert (rows[name].verdict, rows[name].first) == ("diverged", "h@d2:0")  # as expected, but for the diagnosis
        assert rows[name].ok is False and rows[name].diagnosis == "recycle_prenorm", rows[name]
    assert "not recycle_main_hidden" in rows["mislabelled"].note
    assert "for a correct loop" in rows["unlabelled"].note
    right = rows["recycle_prenorm (python)"]
    assert (right.ok, right.diagnosis) == (True, "recycle_prenorm"), right
    assert (rows["C draft loop"].ok, rows["C draft loop"].diagnosis) == (True, "none")


def test_an_explain_that_does_not_run_fails_every_loop_case_never_passes_it(loop_run, monkeypatch):
    monkeypatch.setattr(selftest, "EXPLAIN_CHILD", "import sys; print('broken', file=sys.stderr); sys.exit(4)")
    rows = loop_run(LOOP_BY_NAME["C draft loop"], LOOP_BY_NAME["recycle_prenorm (C)"])
    for row in rows.values():
        assert row.ok is False and row.diagnosis == "error" and "exit 4): broken" in row.note, row
    table = selftest.render_table(list(rows.values()))
    assert table.splitlines()[-1].startswith("SELFTEST FAILED | 0/2 runs as expected, 2 not")


def test_without_transformers_the_loop_cases_and_their_diagnosis_are_skipped(monkeypatch, tmp_path):
    """No oracle (no transformers): neither the chained reference nor --explain can run: skipped, never passed."""
    real = selftest.importlib.util.find_spec
    monkeypatch.setattr(selftest.importlib.util, "find_spec", lambda name: None if name == "transformers"
                        else real(name))
    rows = selftest.run_loop_cases(selftest.BUNDLED_REFERENCE, selftest.BUNDLED_CHECKPOINT, tmp_path, tmp_path)
    assert len(rows) == len(selftest.LOOP_CASES)
    assert all(r.ok is None and r.diagnosis == "skipped" and "skipped" in r.note for r in rows)
    table = selftest.render_table(rows).splitlines()
    assert table[-1].endswith(f"0/{len(rows)} runs as expected, {len(rows)} skipped")
    shown = [line for line in table if line.startswith(tuple(c.name for c in selftest.LOOP_CASES))]
    assert len(shown) == len(rows) and all("skipped" in line and " ok" not in line for line in shown)


def test_the_layered_cases_run_on_a_three_layer_head_and_skip_with_a_reason_elsewhere(tmp_path):
    """The 3-layer fixture is what LAYERED_CASES check (a one-layer head would make layer0_reused right); a
    reference whose hidden does not fit it skips them, said, never passed."""
    from oracle.checkpoint import Checkpoint
    from tests.probe.tracekit import synthetic, write_h5

    ckpt = Checkpoint(selftest.BUNDLED_LAYERED)
    assert ckpt.family.layer_count(ckpt.config) == selftest.LAYERED_DEPTHS == 3
    inputs, stages = synthetic(4, 32)
    other = write_h5(tmp_path / "d32.h5", inputs, stages)
    rows = selftest.run_layered_cases(other, tmp_path, tmp_path / "layered")
    assert len(rows) == len(selftest.LAYERED_CASES)
    assert all(r.ok is None and "32 wide" in r.note for r in rows), rows
