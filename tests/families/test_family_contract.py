"""The family contract: every family in the registry, on a tiny checkpoint of its own, must

1. export with the CLI, writing exactly its stage list (with docs and kinds) and evidence, the q/k-path parts its
   head has measured from its own variants (each caught somewhere on these distinct inputs; a candidate whose attn
   is a variant's diverges);
2. agree with the official transformers decoder layer stepping through its KV cache (the transcribed tail);
3. agree between its stepwise and batched runs;
4. load strictly: a missing or an extra head tensor is an error naming it;
5. localise a perturbation of each stage's computation at that very stage.

A new family adds a tiny-checkpoint writer to WRITERS; the first test fails until it does.
"""

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.torch import load_file, save_file

from oracle.checkpoint import Checkpoint
from oracle.cli import cli as oracle_cli
from oracle.errors import CheckpointError
from oracle.families.registry import FAMILIES, head_module
from oracle.qk_parts import BASELINE
from oracle.trace import read_trace
from probe.diff import diff_traces
from tests.helpers import load_script, run_cli
from tests.probe.tracekit import load_trace, write_raw

FIXTURES = load_script("make_fixtures")
TOKENS = "5,17,3,99,200,7,42,5"


def _qwen3_5(path: Path) -> Path:
    return FIXTURES.write_checkpoint(path)


WRITERS = {
    "qwen3_5": _qwen3_5,
    "qwen3_5_moe": lambda path: FIXTURES.write_moe_checkpoint(path, "qwen3_5_moe", "fused", main_model=False),
    "qwen3_next": lambda path: FIXTURES.write_moe_checkpoint(path, "qwen3_next", "per_expert", main_model=False),
    "deepseek_v3": lambda path: FIXTURES.write_mtp_layer_checkpoint(path, "deepseek_v3"),
    "glm4_moe": lambda path: FIXTURES.write_mtp_layer_checkpoint(path, "glm4_moe"),
    "deepseek_v4": lambda path: FIXTURES.write_deepseek_v4_checkpoint(path),
    "step3p7": lambda path: FIXTURES.write_mtp_model_checkpoint(path, "step3p7"),
    "inkling": lambda path: FIXTURES.write_mtp_model_checkpoint(path, "inkling"),
    "mimo_v2_flash": lambda path: FIXTURES.write_mimo_v2_flash_checkpoint(path),
}
FAMILY_NAMES = sorted(FAMILIES)


def test_every_registered_family_has_a_tiny_checkpoint_writer():
    assert sorted(WRITERS) == FAMILY_NAMES


@pytest.fixture(scope="module", params=FAMILY_NAMES)
def family(request, tmp_path_factory):
    """(name, checkpoint dir, batched trace, stepwise trace) of one family."""
    name = request.param
    if name not in WRITERS:
        pytest.skip(f"no tiny-checkpoint writer for {name} (test_every_registered_family_has... fails)")
    root = tmp_path_factory.mktemp(name)
    ckpt = WRITERS[name](root / "ckpt")
    traces = {}
    for mode in ("batched", "stepwise"):
        out = root / f"{mode}.h5"
        result = run_cli(oracle_cli, ["export", ckpt, "--out", out, "--tokens", TOKENS, "--hidden-seed", "0",
                                      "--mode", mode, "-q"])
        assert result.exit_code == 0, result.output
        traces[mode] = out
    return name, ckpt, traces["batched"], traces["stepwise"]


def test_export_writes_the_familys_stage_list_with_docs_and_evidence(family):
    name, ckpt, batched, _ = family
    spec = FAMILIES[name]
    cfg = Checkpoint(ckpt).config
    with read_trace(batched) as trace:
        assert trace.attrs["family"] == name
        assert trace.stages == spec.stages(cfg).names
        assert all(s.doc for s in trace.stage_list)
        assert {s.name: s.kind for s in trace.stage_list} == {s.name: s.kind for s in spec.stages(cfg)}
        assert trace.has_evidence("attn_uniform")
        assert trace.attrs["evidence_rules"]["qk_dependent"][0] == spec.qk_dependent_from


QK_PARTS = {  # the q/k-path parts each family's head has (oracle/families/*.py qk_part_variants)
    "qwen3_5": {"rope", "q_norm", "k_norm", "kv_append"}, "qwen3_5_moe": {"rope", "q_norm", "k_norm", "kv_append"},
    "qwen3_next": {"rope", "q_norm", "k_norm", "kv_append"}, "deepseek_v3": {"rope", "kv_append"},
    "glm4_moe": {"rope", "q_norm", "k_norm", "kv_append"},
    "deepseek_v4": {"rope", "q_norm", "k_norm", "kv_append", "window", "sink"},
    "step3p7": {"rope", "q_norm", "k_norm", "kv_append"},  # its fixture's layer 0 is full attention
    "inkling": {"q_norm", "k_norm", "kv_append"},  # no rotary (relative position logits): rope is never claimed
    "mimo_v2_flash": {"rope", "kv_append", "window", "sink"},  # every MTP layer: sliding window with sinks, no q/k norms
}


def test_export_measures_each_qk_part_from_the_familys_own_variants(family):
    """The record equals each variant's attn rows (the official module re-run) against the real ones, and every
    variant moves some row of these distinct inputs: a diff of the reference with itself evidences every part."""
    name, ckpt, batched, _ = family
    inputs, stages = load_trace(batched)
    checkpoint = Checkpoint(ckpt)
    impl = head_module(checkpoint.family)
    head, rotary = impl.build_head(checkpoint.config, impl.torch_weights(checkpoint.read_head(widen=False)))
    variants = impl.qk_part_variants(head, rotary, inputs, stages["ah"])
    for base in [v for v in variants if v.part == BASELINE]:  # the pass without a variant is the real one
        np.testing.assert_allclose(base.rows(), stages["attn"], rtol=1e-5, atol=1e-6 * np.abs(stages["attn"]).max())
    variants = [v for v in variants if v.part != BASELINE]
    with read_trace(batched) as trace:
        parts = trace.attrs["evidence_rules"]["qk_parts"]
        records = {p: trace.evidence_rows(f"qk_{p}") for p in parts}
    assert set(parts) == QK_PARTS[name]
    assert [(v.part, v.name) for v in variants] == [(p, n) for p in dict.fromkeys(v.part for v in variants)
                                                     for n in parts[p]]
    columns = {p: 0 for p in parts}
    for v in variants:
        rows = v.rows()
        distance = np.abs(rows.astype(np.float64) - stages["attn"]).max(axis=1)
        np.testing.assert_allclose(records[v.part][:, columns[v.part]], distance, rtol=1e-6, atol=1e-12,
                                   err_msg=f"{v.part} {v.name}")
        assert (distance > 1e-3 * np.abs(stages["attn"]).max()).any(), f"{v.part} {v.name} moves no row"
        columns[v.part] += 1
    report = diff_traces(batched, batched)
    assert report.verdict.name == "pass", report.verdict.reasons
    assert set(report.qk.parts) == QK_PARTS[name]


def test_twin_a_candidate_whose_attn_is_a_variants_diverges(family, tmp_path):
    """RoPE absent (q_norm absent where the head has no rotary: Inkling): a candidate computing attn that way
    diverges at attn."""
    name, ckpt, batched, _ = family
    inputs, stages = load_trace(batched)
    checkpoint = Checkpoint(ckpt)
    impl = head_module(checkpoint.family)
    head, rotary = impl.build_head(checkpoint.config, impl.torch_weights(checkpoint.read_head(widen=False)))
    variants = {(v.part, v.name): v for v in impl.qk_part_variants(head, rotary, inputs, stages["ah"])}
    variant = variants.get(("rope", "absent")) or variants[("q_norm", "absent")]
    cand = write_raw(tmp_path / "cand", {"attn": variant.rows(), "out": stages["out"]})
    report = diff_traces(batched, cand)
    assert report.verdict.name == "diverged" and report.first.stage == "attn"


def test_the_transcribed_tail_equals_the_official_decoder_layer_stepping_through_its_cache(family):
    name, ckpt, batched, _ = family
    inputs, stages = load_trace(batched)
    checkpoint = Checkpoint(ckpt)
    impl = head_module(checkpoint.family)
    head, rotary = impl.build_head(checkpoint.config, impl.torch_weights(checkpoint.read_head(widen=False)))
    layer_in, layer_out = FAMILIES[name].layer_input, FAMILIES[name].layer_output  # Qwen: fc -> res2
    official = impl.official_layer_stepwise(head, rotary, inputs, stages[layer_in])
    np.testing.assert_allclose(official, stages[layer_out], rtol=0, atol=1e-5 * np.abs(stages[layer_out]).max())
    # twin: the comparison sees a wiring change in the tail (a dropped residual)
    assert np.abs(official - (stages[layer_out] - stages[layer_in])).max() > 1e-3


def test_stepwise_and_batched_runs_agree(family):
    _, _, batched, stepwise = family
    _, a = load_trace(batched)
    _, b = load_trace(stepwise)
    assert a.keys() == b.keys()
    for stage in a:
        if a[stage].dtype.kind == "i":
            np.testing.assert_array_equal(np.sort(a[stage], axis=1), np.sort(b[stage], axis=1), err_msg=stage)
        else:
            scale = max(np.abs(a[stage]).max(), 1e-30)
            assert np.abs(a[stage] - b[stage]).max() <= 1e-5 * scale, stage


def _rewrite(ckpt: Path, out: Path, change) -> Path:
    out.mkdir()
    (out / "config.json").write_text((ckpt / "config.json").read_text())
    tensors = load_file(ckpt / "model.safetensors")
    change(tensors)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


def test_loading_is_strict_missing_and_extra_head_tensors_are_errors(family, tmp_path):
    name, ckpt, _, _ = family
    layer = getattr(Checkpoint(ckpt).config, "num_hidden_layers", None)  # DeepSeek/GLM: model.layers.{N}.
    prefix = FAMILIES[name].head_prefix.format(num_hidden_layers=layer)
    head = sorted(n for n in load_file(ckpt / "model.safetensors") if n.startswith(prefix))
    victim = head[len(head) // 2]
    missing = _rewrite(ckpt, tmp_path / "missing", lambda t: t.pop(victim))
    result = run_cli(oracle_cli, ["export", missing, "--out", tmp_path / "m.h5", "--tokens", "5,6", "--hidden-seed", "0"])
    assert result.exit_code == 2 and victim in result.output, result.output
    extra = _rewrite(ckpt, tmp_path / "extra", lambda t: t.__setitem__(head[0] + ".extra", t[head[0]].clone()))
    result = run_cli(oracle_cli, ["export", extra, "--out", tmp_path / "x.h5", "--tokens", "5,6", "--hidden-seed", "0"])
    assert result.exit_code == 2 and ".extra" in result.output, result.output
    checkpoint = Checkpoint(ckpt)
    impl = head_module(checkpoint.family)
    weights = impl.torch_weights(checkpoint.read_head(widen=False))
    weights.pop(victim)
    with pytest.raises((CheckpointError, ValueError)):
        impl.build_head(checkpoint.config, weights)


def test_a_perturbation_of_each_stage_is_first_seen_at_that_stage(family, tmp_path):
    name, ckpt, batched, _ = family
    inputs, stages = load_trace(batched)
    with read_trace(batched) as trace:
        order = trace.stages
    for k, stage in enumerate(order):
        cand = {}
        for later in order:
            rows = stages[later].copy()
            if order.index(later) >= k:
                if later == "draft":  # a wrong draft token
                    rows = (rows + 1) % Checkpoint(ckpt).config.vocab_size
                elif rows.dtype.kind == "i":  # a wrong expert: an id the reference did not select
                    experts = stages["router_logits"].shape[1]
                    for row in rows:
                        row[0] = next(e for e in range(experts) if e not in row)
                else:
                    rows = (rows + 0.01 * np.abs(rows).max() + 0.01).astype(np.float32)
            cand[later] = rows
        path = tmp_path / f"{stage}.h5"
        _write_like(batched, path, inputs, cand)
        report = diff_traces(batched, path)
        assert report.first is not None and report.first.stage == stage, (stage, report.first)


def _write_like(ref: Path, path: Path, inputs, stages) -> None:
    from oracle.trace import write_trace

    with read_trace(ref) as trace:
        write_trace(path, inputs, stages, {"producer": "contract test"}, stage_list=trace.stage_list, dims=trace.dims)


def test_the_registry_refuses_an_unknown_family_listing_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(CheckpointError, match="not a supported MTP family. Supported: .*qwen3_5"):
        Checkpoint(tmp_path)


FUSED = {"qwen3_5", "qwen3_5_moe", "qwen3_next", "step3p7"}  # families whose variant passes run SDPA


def test_variant_passes_through_sdpa_equal_the_eager_ones(family, monkeypatch):
    """The variant passes' SDPA (oracle/qk_parts.py fused_attention) computes what the official eager attention
    does, within float32 rounding, for every variant of every family that uses it; the others never call it."""
    import contextlib

    import oracle.families.qwen3_5_stem as stem
    import oracle.qk_parts as qk_parts

    name, ckpt, batched, _ = family
    inputs, stages = load_trace(batched)
    checkpoint = Checkpoint(ckpt)
    impl = head_module(checkpoint.family)
    head, rotary = impl.build_head(checkpoint.config, impl.torch_weights(checkpoint.read_head(widen=False)))
    fused_calls = []
    real = qk_parts.fused_attention

    def counted(attention, mask):
        fused_calls.append(mask is not None)
        return real(attention, mask)

    monkeypatch.setattr(qk_parts, "fused_attention", counted)
    monkeypatch.setattr(stem, "fused_attention", counted)
    fused = [v.rows() for v in impl.qk_part_variants(head, rotary, inputs, stages["ah"])]
    assert any(fused_calls) == (name in FUSED), fused_calls
    eager_only = lambda attention, mask: contextlib.nullcontext()  # noqa: E731 - the twin: no SDPA anywhere
    monkeypatch.setattr(qk_parts, "fused_attention", eager_only)
    monkeypatch.setattr(stem, "fused_attention", eager_only)
    eager = [v.rows() for v in impl.qk_part_variants(head, rotary, inputs, stages["ah"])]
    scale = np.abs(stages["attn"]).max()
    for a, b in zip(fused, eager):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * scale)
