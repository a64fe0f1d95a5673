"""The q/k-path part records at every chain depth (issue 29, finished): `export --chain K` measures each part's
wrong variants on the chain's own depth-j attn rows (/chain/d{j}/evidence/qk_<part>, oracle/qk_parts.py
chain_part_records), and the probe judges each depth with its own records (never depth 1's).

The saturated head (tests/probe/test_qk_parts.py: each query's own key wins by hundreds of logits) hides RoPE at
depth 2 as at depth 1: a correct candidate's depth 2 must then say "RoPE: NOT evidenced" and be inconclusive, where
before it borrowed nothing and said the parts were not measured. Twins: on the normal fixture depth 2 evidences
every part and passes; a reference without depth records says "not measured at depth 2"; the stacked pass the
records come from reproduces the loop's own attn rows at every depth (no variant), so a record is of the loop."""

import shutil

import h5py
import numpy as np
import pytest
import torch

from oracle.export import ChainOptions, HiddenSource, export_trace
from probe.diff import diff_traces
from probe.report import depth_not_measured, depth_qk_lines
from tests.helpers import TINY
from tests.probe.test_qk_parts import QWEN_PARTS, TOKENS, saturated_checkpoint


@pytest.fixture(scope="module")
def normal(tmp_path_factory):
    root = tmp_path_factory.mktemp("depths-normal")
    return export_trace(TINY, root / "ref.h5", TOKENS, HiddenSource(seed=0), chain=ChainOptions(3))


@pytest.fixture(scope="module")
def saturated(tmp_path_factory):
    root = tmp_path_factory.mktemp("depths-saturated")
    ckpt = saturated_checkpoint(root / "ckpt")
    return export_trace(ckpt, root / "ref.h5", TOKENS, HiddenSource(seed=0), chain=ChainOptions(3))


def _as_candidate(ref, tmp_path):
    """The reference's own rows as a candidate trace file: correct at every depth."""
    return shutil.copy(ref, tmp_path / "cand.h5")


def _depth(report, j):
    return next(d for d in report.chain.depths if d.depth == j).report


def test_every_depth_records_its_own_parts_with_depth_1s_variants(normal):
    with h5py.File(normal) as f:
        for j in (2, 3):
            n = len(TOKENS) - j + 1
            for part, names in QWEN_PARTS.items():
                rows = f[f"chain/d{j}/evidence/qk_{part}"][:]
                assert rows.shape == (n, len(names)) and rows.dtype == np.float32, (j, part)
                assert (rows > 0).any(), (j, part)
        # measured on the depth's own rows, not copied from depth 1's
        assert not np.array_equal(f["chain/d2/evidence/qk_rope"][:], f["evidence/qk_rope"][:7])


def test_the_stacked_pass_without_a_variant_gives_the_loops_own_attn_rows(normal):
    """chain_part_records' rows (bridge, then each depth's chain entries) under the loop's mask, no variant: the
    official attention module reproduces the recorded attn rows of depths 1..3 (within float32 rounding)."""
    from oracle.checkpoint import Checkpoint
    from oracle.draft_loop import key_positions
    from oracle.families.registry import head_module
    from oracle.qk_parts import stacked_mask

    ckpt = Checkpoint(TINY)
    impl = head_module(ckpt.family)
    head, rotary = impl.build_head(ckpt.config, impl.torch_weights(ckpt.read_head(widen=False, digest=False)))
    with h5py.File(normal) as f:
        positions = f["inputs/positions"][:]
        ah = [f["stages/ah"][:]] + [f[f"chain/d{j}/stages/ah"][:] for j in (2, 3)]
        attn = [f["stages/attn"][:]] + [f[f"chain/d{j}/stages/attn"][:] for j in (2, 3)]
        embed = np.concatenate([f["inputs/embed"][:]] + [f[f"chain/d{j}/inputs/embed"][:] for j in (2, 3)])
    counts = (len(ah[1]), len(ah[2]))
    keys = key_positions(0, torch.from_numpy(positions), counts)
    mask = stacked_mask(len(positions), counts)
    attention = head.layers[0].self_attn
    with torch.inference_mode():
        rope = rotary(torch.from_numpy(embed)[None], keys[None])
        rows = attention(torch.from_numpy(np.concatenate(ah))[None], position_embeddings=rope,
                         attention_mask=mask)[0][0].numpy()
    np.testing.assert_allclose(rows, np.concatenate(attn), rtol=1e-5, atol=1e-6)
    # twin: the bridge's plain causal mask over the same rows (chains seeing each other) gives other rows
    from oracle.families.torch_parts import causal_mask

    with torch.inference_mode():
        wrong = attention(torch.from_numpy(np.concatenate(ah))[None], position_embeddings=rope,
                          attention_mask=causal_mask(len(keys)))[0][0].numpy()
    assert not np.allclose(wrong[len(positions):], np.concatenate(attn[1:]), rtol=1e-4, atol=1e-5)


def test_saturated_head_depth_2_is_judged_by_its_own_records_rope_not_evidenced(saturated, tmp_path):
    report = diff_traces(saturated, _as_candidate(saturated, tmp_path))
    depth2 = _depth(report, 2)
    assert depth2.verdict.name == "inconclusive", depth2.verdict
    lines = depth_qk_lines(depth2)
    rope = next(line for line in lines if "RoPE" in line)
    assert rope.startswith("depth 2: q/k path, RoPE: NOT evidenced"), lines
    assert report.verdict.name == "inconclusive"
    assert any("depth 2" in r and "RoPE" in r for r in report.verdict.reasons), report.verdict.reasons


def test_twin_normal_fixture_depth_2_evidences_every_part_and_passes(normal, tmp_path):
    report = diff_traces(normal, _as_candidate(normal, tmp_path))
    for j in (2, 3):
        depth = _depth(report, j)
        assert depth.verdict.name == "pass", (j, depth.verdict)
        lines = depth_qk_lines(depth)
        assert len(lines) == len(QWEN_PARTS) and all(": evidenced:" in line for line in lines), lines
    assert report.verdict.name == "pass"


def test_twin_a_reference_without_depth_records_says_not_measured_at_that_depth(normal, tmp_path):
    """The records removed (as a reference exported before them, its evidence digest recomputed): depth 2 claims
    no part, and says why; depth 1 is untouched."""
    import json

    from oracle.trace import evidence_digest

    old = shutil.copy(normal, tmp_path / "old.h5")
    with h5py.File(old, "r+") as f:
        for j in (2, 3):
            for part in QWEN_PARTS:
                del f[f"chain/d{j}/evidence/qk_{part}"]
        arrays = {n: f["evidence"][n][:] for n in f["evidence"]}
        for j in (2, 3):
            arrays |= {f"d{j}/{n}": f[f"chain/d{j}/evidence"][n][:] for n in f[f"chain/d{j}/evidence"]}
        rules = f.attrs["evidence_rules"]
        f.attrs["evidence_digest"] = evidence_digest(json.loads(rules) if isinstance(rules, (str, bytes)) else rules,
                                                     arrays)
    from oracle.trace import evidence_covers_chain, read_trace

    with read_trace(old) as reader:
        assert evidence_covers_chain(reader)  # the chain's evidence is still trusted: only the records are absent
    report = diff_traces(old, _as_candidate(old, tmp_path))
    assert depth_qk_lines(_depth(report, 2)) == ["depth 2: " + depth_not_measured(2)]
    assert report.verdict.name in ("pass", "inconclusive")
    assert all(": evidenced:" in line for line in depth_qk_lines(_depth(report, 2))) is False


def test_chains_in_blocks_give_the_same_records_as_one_pass(normal):
    """chain_part_records in blocks of 2 chains (each block: the bridge rows its chains may see, their entries)
    equals one block of all chains, within float32 rounding: the blocking changes which rows share a pass, never
    what a row sees."""
    from oracle.checkpoint import Checkpoint
    from oracle.families.registry import head_module
    from oracle.qk_parts import DepthRows, chain_part_records
    from oracle.trace import read_trace

    ckpt = Checkpoint(TINY)
    impl = head_module(ckpt.family)
    head, rotary = impl.build_head(ckpt.config, impl.torch_weights(ckpt.read_head(widen=False, digest=False)))
    with read_trace(normal) as r:
        inputs = r.inputs()
    with h5py.File(normal) as f:
        depths = {j: DepthRows(*(f[f"chain/d{j}/inputs/{n}"][:] for n in ("token_ids", "positions", "recycled",
                                                                            "embed")),
                               f[f"chain/d{j}/stages/ah"][:], f[f"chain/d{j}/stages/attn"][:]) for j in (2, 3)}
        ah, attn = f["stages/ah"][:], f["stages/attn"][:]
        recorded = {j: {f"qk_{p}": f[f"chain/d{j}/evidence/qk_{p}"][:] for p in QWEN_PARTS} for j in (2, 3)}
    whole = chain_part_records(impl, head, rotary, inputs, ah, attn, depths, QWEN_PARTS, block=64)
    blocks = chain_part_records(impl, head, rotary, inputs, ah, attn, depths, QWEN_PARTS, block=2)
    for j in (2, 3):
        assert set(whole[j]) == set(blocks[j]) == set(recorded[j])
        for name in whole[j]:
            np.testing.assert_allclose(blocks[j][name], whole[j][name], rtol=1e-4, atol=1e-6, err_msg=name)
            np.testing.assert_allclose(whole[j][name], recorded[j][name], rtol=1e-4, atol=1e-6, err_msg=name)
