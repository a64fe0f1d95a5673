"""Each part of the q/k path (RoPE, q_norm, k_norm, the KV append, the window, the sink) is evidenced only where
its own wrong variants move an attn row past tolerance (oracle/qk_parts.py, probe/evidence.py).

A saturated head (each query's own key wins by a huge margin) makes uniform attention weights fail every row, so
the attention weights look evidenced, while RoPE removed moves no row: a candidate without RoPE must then be
inconclusive, naming RoPE, never PASS. Twins: on the normal fixture every part is evidenced, a correct candidate
passes and the same RoPE-less candidate diverges; a reference exported before the part records passes as before but
says its parts were not measured."""

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from oracle.export import HiddenSource, export_trace
from oracle.trace import read_trace
from probe.adapters.cabi import CAbiAdapter, build_library
from probe.cli import cli as probe_cli
from probe.evidence import NOT_MEASURED, decide
from probe.report import qk_lines, report_json
from probe.run import run_and_diff
from probe.tolerance import tol_table
from tests.helpers import FIXTURES, ROOT, TINY, TINY_REF, run_cli

SOURCE = ROOT / "fixtures" / "candidates" / "mtp_step.c"
LEGACY_REF = FIXTURES / "legacy" / "qwen3_5_tiny_ref_before_qk_parts.h5"
TOKENS = np.array([17, 42, 3, 255, 100, 7, 511, 64], dtype=np.int64)
QWEN_PARTS = {"rope": ["absent", "all_dims", "interleaved"], "q_norm": ["absent", "w_not_1_plus_w"],
              "k_norm": ["absent", "w_not_1_plus_w"], "kv_append": ["own_key_missing", "only_own_key"]}


def saturated_checkpoint(out: Path) -> Path:
    """The tiny Qwen3.5 checkpoint with each query head's q rows equal to its KV head's k rows and q_norm = k_norm
    = 7 ((1+w): x8): q_t·k_t exceeds every other score by hundreds, so each step attends only to its own key."""
    shutil.copytree(TINY, out)
    tensors = load_file(out / "model.safetensors")
    a = "mtp.layers.0.self_attn."
    q, k = tensors[a + "q_proj.weight"].clone(), tensors[a + "k_proj.weight"]
    hd, heads, kv = 32, 4, 2
    for h in range(heads):
        g = h // (heads // kv)
        q[h * 2 * hd: h * 2 * hd + hd] = k[g * hd:(g + 1) * hd]
    tensors[a + "q_proj.weight"] = q
    for norm in ("q_norm", "k_norm"):
        tensors[a + f"{norm}.weight"] = torch.full_like(tensors[a + f"{norm}.weight"], 7.0)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def saturated(tmp_path_factory):
    root = tmp_path_factory.mktemp("saturated")
    ckpt = saturated_checkpoint(root / "ckpt")
    warnings = []
    ref = export_trace(ckpt, root / "ref.h5", TOKENS, HiddenSource(seed=0), warn=warnings.append)
    assert any("wrong variants of the q/k path: rope (absent, all_dims, interleaved)" in w for w in warnings), warnings
    return ckpt, ref


def test_twin_the_normal_fixture_exports_without_a_q_k_warning(tmp_path):
    warnings = []
    export_trace(TINY, tmp_path / "ref.h5", TOKENS, HiddenSource(seed=0), warn=warnings.append)
    assert not [w for w in warnings if "q/k" in w], warnings


@pytest.fixture(scope="module")
def libs(tmp_path_factory):
    out = tmp_path_factory.mktemp("qk-libs")
    return {m: build_library(SOURCE, out, (f"MTP_MUTANT_{m}",) if m != "REF" else ())
            for m in ("REF", "NO_ROPE", "NO_KV_APPEND")}


def run(ref: Path, ckpt: Path, lib: Path):
    return run_and_diff(ref, CAbiAdapter(lib, ckpt), tol_table()).report


def test_the_reference_records_each_qwen_part_with_its_variants():
    with read_trace(TINY_REF) as trace:
        assert trace.attrs["evidence_rules"]["qk_parts"] == QWEN_PARTS
        for part, variants in QWEN_PARTS.items():
            rows = trace.evidence_rows(f"qk_{part}")
            assert rows.dtype == np.float32 and rows.shape == (8, len(variants))
            assert (rows[0] == 0).all()  # t = 0 attends to one key: softmax ≡ 1 whatever q, k, RoPE or the norms
            assert (rows[1:] > 0).all(), part  # every variant moves every t >= 1 row of the normal fixture


def test_saturated_head_a_candidate_without_rope_is_inconclusive_naming_rope(saturated, libs):
    ckpt, ref = saturated
    report = run(ref, ckpt, libs["NO_ROPE"])
    assert report.verdict.name == "inconclusive", report.verdict
    reason = next(r for r in report.verdict.reasons if r.startswith("q/k path parts not evidenced"))
    assert "RoPE (absent, all_dims, interleaved)" in reason
    # today's rule alone (the attention weights, /evidence/attn_uniform) would have passed it: uniform weights
    # fail every t >= 1 row of a saturated head
    assert decide(report.rows.values(), [], report.captured, dataclasses.replace(report.qk, parts=None)).name == "pass"
    lines = qk_lines(report)
    assert lines[0].startswith("q/k path, attention pattern (softmax(q·k), not uniform weights): evidenced")
    rope = next(line for line in lines if line.startswith("q/k path, RoPE"))
    assert rope.startswith("q/k path, RoPE: NOT evidenced") and "absent at 0" in rope
    assert not any(line.startswith("q/k path, RoPE: evidenced") for line in lines)
    parts = report_json(report)["qk_evidence"]["parts"]
    assert parts["rope"]["evidenced"] is False and parts["kv_append"]["variants"]["own_key_missing"]


def test_saturated_head_a_cache_that_never_grows_is_inconclusive_naming_the_kv_append(saturated, libs):
    """Each step attends to its own key only, so a cache that is never appended to gives the same rows; the
    other KV-append variant (the current key missing) is caught there, but the part needs both."""
    ckpt, ref = saturated
    report = run(ref, ckpt, libs["NO_KV_APPEND"])
    assert report.verdict.name == "inconclusive"
    reason = next(r for r in report.verdict.reasons if r.startswith("q/k path parts not evidenced"))
    assert "KV append (only_own_key)" in reason
    assert report.qk.parts["kv_append"]["own_key_missing"][1:].all()


def test_twin_saturated_head_the_correct_candidate_is_inconclusive_not_pass(saturated, libs):
    ckpt, ref = saturated
    report = run(ref, ckpt, libs["REF"])
    assert report.verdict.name == "inconclusive"
    assert any("RoPE" in r for r in report.verdict.reasons)


def test_twin_normal_fixture_every_part_is_evidenced_and_the_correct_candidate_passes(libs):
    report = run(TINY_REF, TINY, libs["REF"])
    assert report.verdict.name == "pass", report.verdict.reasons
    lines = qk_lines(report)
    assert len(lines) == 1 + len(QWEN_PARTS)
    assert all(": evidenced" in line for line in lines), lines
    parts = report_json(report)["qk_evidence"]["parts"]
    assert {p: v["evidenced"] for p, v in parts.items()} == {p: True for p in QWEN_PARTS}


@pytest.mark.parametrize("mutant", ["NO_ROPE", "NO_KV_APPEND"])
def test_twin_normal_fixture_a_candidate_with_the_variant_diverges(libs, mutant):
    assert run(TINY_REF, TINY, libs[mutant]).verdict.name == "diverged"


def test_an_old_reference_passes_as_before_but_says_its_parts_were_not_measured(libs, tmp_path):
    report = run(LEGACY_REF, TINY, libs["REF"])
    assert report.verdict.name == "pass"
    assert qk_lines(report)[1:] == [NOT_MEASURED]
    out = tmp_path / "r.json"
    result = run_cli(probe_cli, ["diff", LEGACY_REF, TINY_REF, "--json", out])
    assert "not measured" in result.output and "RoPE: evidenced" not in result.output
    qk = json.loads(out.read_text())["qk_evidence"]
    assert qk["parts_measured"] is False and qk["parts"] == {}


@pytest.mark.parametrize("rtol", [1e-4, 0.2, 0.9])
def test_the_candidates_own_attn_tolerance_judges_the_recorded_distances(libs, rtol):
    """caught = max_abs / max|attn row| >= rtol and max_abs >= atol, computed here from the file itself."""
    report = run_and_diff(TINY_REF, CAbiAdapter(libs["REF"], TINY), tol_table(overrides=[f"attn={rtol},1e-5"])).report
    with read_trace(TINY_REF) as trace:
        e_max = np.abs(trace.stage_rows("attn").astype(np.float64)).max(axis=1)
        for part, variants in QWEN_PARTS.items():
            d = trace.evidence_rows(f"qk_{part}").astype(np.float64)
            for v, name in enumerate(variants):
                expected = (d[:, v] / e_max >= rtol) & (d[:, v] >= 1e-5)
                np.testing.assert_array_equal(report.qk.parts[part][name], expected, err_msg=f"{part} {name}")
    evidenced = all(caught.any() for variants in report.qk.parts.values() for caught in variants.values())
    assert report.verdict.name == ("pass" if evidenced else "inconclusive")
    if rtol == 0.9:  # a loose tolerance lets some variants through everywhere: not evidenced, never pass
        assert not evidenced


def test_a_sink_that_takes_almost_all_the_mass_evidences_only_the_sink(tmp_path):
    """DeepSeek-V4 with sink logits of 30: every key's weight is ~e^-29, so attn rows are ~1e-13 and no variant of
    RoPE, the norms, the KV append or the window moves one past the atol; uniform weights (each key 1/(n+1)) and
    the sink removed do. The reference compared with itself is inconclusive naming those parts (today's rule,
    attention weights only, passed it); twin: the normal V4 fixture evidences them all (family contract test)."""
    from tests.helpers import load_script

    ckpt = load_script("make_fixtures").write_deepseek_v4_checkpoint(tmp_path / "ckpt")
    tensors = load_file(ckpt / "model.safetensors")
    tensors["mtp.0.attn.attn_sink"] = torch.full_like(tensors["mtp.0.attn.attn_sink"], 30.0)
    save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})
    ref = export_trace(ckpt, tmp_path / "ref.h5", np.array([5, 17, 3, 99, 4, 250, 5, 511, 0, 64]),
                       HiddenSource(seed=3))
    from probe.diff import diff_traces

    report = diff_traces(ref, ref)
    assert report.verdict.name == "inconclusive"
    reason = next(r for r in report.verdict.reasons if r.startswith("q/k path parts not evidenced"))
    for part in ("RoPE", "q_norm", "k_norm", "KV append", "sliding window"):
        assert part in reason, part
    assert "attention sink" not in reason and report.qk.parts["sink"]["absent"].all()
    assert decide(report.rows.values(), [], report.captured, dataclasses.replace(report.qk, parts=None)).name == "pass"
    text = "\n".join(qk_lines(report))
    assert "q/k path, attention sink: evidenced" in text and "q/k path, sliding window: NOT evidenced" in text


def test_the_report_and_explain_state_the_q_k_path_part_by_part_without_contradiction(saturated, libs):
    """`run --explain` on the saturated head: one statement per q/k part ("q/k path, <part>: evidenced / NOT
    evidenced"), tensor coverage worded as values ("k_norm: values ..."), and never a blanket "q/k path evidenced"
    beside a tensor of that path "not evidenced"."""
    import re

    from probe.cli import cli

    ckpt, ref = saturated
    result = run_cli(cli, ["run", ref, "--impl", f"c:{libs['NO_ROPE']}", "--checkpoint", ckpt, "--explain"])
    assert result.exit_code == 3, result.output
    text = result.output
    assert re.search(r"q/k path, RoPE: NOT evidenced", text)
    assert not re.search(r"q/k (path )?(is )?evidenced", text), text
    assert not re.search(r"q/k path, RoPE: evidenced", text)
    for line in text.splitlines():
        if re.search(r"\b(k_proj|q_norm|k_norm)\b[^:]*: .*evidenced", line) and "q/k path," not in line:
            assert "values" in line, line  # a tensor's 1% error, never a claim about the part
