"""`export --chain K` for every registered family, against an independent stepwise computation.

The reference here never touches oracle/draft_loop.py: it drives the head's official modules one token at a time
(`head.steps` with one query and no mask) through a transformers DynamicCache built from the head's config (a
sliding-window cache for DeepSeek-V4). Bridge steps 0..i go into the cache; bridge i's chain steps are appended
after it and then dropped again (cropped back; a copy of the cache for a sliding window, which cannot restore the
keys it evicted), so bridge i+1 sees bridge rows only. Dims are ones no fixture uses. Twins: keeping the chain's KV
rows changes later bridge rows, a chain position that does not advance changes the chain rows, and `--recycle res2`
changes depth 2's `h`: each would have made the comparison fail.
"""

import copy
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import DynamicCache

from oracle.accept import draft_chains
from oracle.attention_evidence import uniform_weights
from oracle.checkpoint import Checkpoint
from oracle.draft_loop import draft_projection
from oracle.export import ChainOptions, HiddenSource, export_trace
from oracle.families.mtp_model_layout import MtpModelSpec
from oracle.families.registry import FAMILIES, head_module
from oracle.inputs import hidden_from_seed
from oracle.stages import INDEX_SET
from oracle.trace import ChainDepthReader, chain_groups, chain_info, read_trace, recorded_chain_digest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import make_fixtures as F  # noqa: E402

HELD_OUT = {  # dims no fixture uses (hidden 48 / 40, odd head counts, 160-token vocabulary)
    "qwen3_5": lambda p: F.write_checkpoint(p, dims={
        "hidden_size": 48, "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 16,
        "intermediate_size": 56, "vocab_size": 160, "partial_rotary_factor": 0.5}),
    "qwen3_5_moe": lambda p: F.write_moe_checkpoint(p, "qwen3_5_moe", "fused", main_model=False, dims={
        "hidden_size": 48, "num_attention_heads": 6, "num_key_value_heads": 3, "head_dim": 16, "num_experts": 6,
        "num_experts_per_tok": 3, "moe_intermediate_size": 24, "shared_expert_intermediate_size": 20,
        "vocab_size": 160}),
    "qwen3_next": lambda p: F.write_moe_checkpoint(p, "qwen3_next", "per_expert", main_model=False, dims={
        "hidden_size": 48, "num_attention_heads": 6, "num_key_value_heads": 3, "head_dim": 16, "num_experts": 6,
        "num_experts_per_tok": 3, "moe_intermediate_size": 24, "shared_expert_intermediate_size": 20,
        "vocab_size": 160}),
    "deepseek_v3": lambda p: F.write_mtp_layer_checkpoint(p, "deepseek_v3", dims={
        "hidden_size": 48, "num_attention_heads": 3, "q_lora_rank": 40, "kv_lora_rank": 24, "qk_nope_head_dim": 12,
        "qk_rope_head_dim": 4, "v_head_dim": 12, "n_routed_experts": 12, "num_experts_per_tok": 3, "n_group": 3,
        "topk_group": 2, "moe_intermediate_size": 20, "vocab_size": 160}),
    "glm4_moe": lambda p: F.write_mtp_layer_checkpoint(p, "glm4_moe", dims={
        "hidden_size": 48, "num_attention_heads": 6, "num_key_value_heads": 3, "head_dim": 16, "n_routed_experts": 6,
        "num_experts_per_tok": 3, "moe_intermediate_size": 20, "vocab_size": 160}),
    "deepseek_v4": lambda p: F.write_deepseek_v4_checkpoint(p, dims={
        "hidden_size": 40, "hc_mult": 2, "num_attention_heads": 5, "head_dim": 16, "qk_rope_head_dim": 4,
        "o_groups": 5, "o_lora_rank": 12, "q_lora_rank": 20, "n_routed_experts": 5, "num_experts_per_tok": 2,
        "sliding_window": 3, "vocab_size": 160}),
}
T, K, START = 9, 4, 3  # chains from 9 bridge steps, depths 2..4; positions from 3 (a chain position != its row)
RTOL, ATOL = 1e-5, 1e-5  # the batched loop and one query at a time round differently (measured: < 2e-6)


# MtpModel families (transformers' MtpModel: depth j on layer j-1) have their chains held equal to MtpModel.forward in
# tests/families/test_mtp_model_families.py; the one-token-at-a-time reference here is the one-layer loop's (Qwen3.5's
# N-layer heads: tests/families/test_qwen_multi_layer.py)
ONE_LAYER = sorted(name for name, spec in FAMILIES.items() if not isinstance(spec, MtpModelSpec))


def test_every_registered_family_has_held_out_dims():
    from tests.families.test_mtp_model_families import HELD_OUT as MULTI_LAYER

    assert sorted(HELD_OUT) == ONE_LAYER
    own_tests = ["mimo_v2_flash"]  # N-layer families with their own held-out tests (tests/families/test_<name>.py)
    assert sorted([*HELD_OUT, *MULTI_LAYER, *own_tests]) == sorted(FAMILIES)


@pytest.fixture(scope="module", params=ONE_LAYER)
def family(request, tmp_path_factory):
    """(name, checkpoint dir, Checkpoint, head, rotary, trace path) with a default --chain K export."""
    root = tmp_path_factory.mktemp(request.param)
    ckpt_dir = HELD_OUT[request.param](root / "ckpt")
    ckpt = Checkpoint(ckpt_dir)
    impl = head_module(ckpt.family)
    head, rotary = impl.build_head(ckpt.config, impl.torch_weights(ckpt.read_head(widen=False)))
    tokens = np.random.default_rng(11).integers(0, ckpt.config.vocab_size, T)
    trace = export_trace(ckpt_dir, root / "ref.h5", tokens, HiddenSource(seed=4), start_pos=START,
                         chain=ChainOptions(K))
    return request.param, ckpt_dir, ckpt, head, rotary, trace


def depth_one(trace: Path) -> dict:
    with read_trace(trace) as ref:
        inputs = ref.inputs()
        return {"inputs": inputs, "stages": {n: ref.stage_rows(n) for n in ref.stages}}


def depth_rows(trace: Path, depth: int) -> dict:
    with read_trace(trace) as ref:
        part = ChainDepthReader(ref, depth)
        return {"inputs": {n: part.input_rows(n) for n in part.input_names()},
                "stages": {n: part.stage_rows(n) for n in part.stages},
                "evidence": {n: part.evidence_rows(n) for n in part.evidence_names()},
                "kinds": {s.name: s.kind for s in part.stage_list}}


@torch.inference_mode()
def stepwise_reference(ckpt, head, rotary, inputs, recycle: str, keep_chain_kv: bool = False,
                       frozen_position: bool = False) -> tuple[list[dict], dict[int, list[dict]]]:
    """Depth-1 rows and chain rows {j: [row of bridge i]} one token at a time (module docstring), with attn under
    uniform weights per chain step from the same cache (a copy: the uniform step must not leave its keys)."""
    sliding = ckpt.family.attention_window(ckpt.config) is not None
    cache = DynamicCache(config=head.text_config)

    def step(where: DynamicCache, t: int, hidden: torch.Tensor, pos: int, uniform: bool = False) -> dict:
        e = torch.from_numpy(inputs.embed[t:t + 1])[None]  # (1, 1, D): step token t's row, as depth 1 read it
        p = torch.tensor([[pos]])
        if uniform:
            with uniform_weights(head.text_config):
                return {n: v[0, 0] for n, v in head.steps(rotary, e, hidden[None, None], p, None, where).items()}
        return {n: v[0, 0] for n, v in head.steps(rotary, e, hidden[None, None], p, None, where).items()}

    bridge, chains = [], {j: [] for j in range(2, K + 1)}
    for i in range(T):
        s = step(cache, i, torch.from_numpy(inputs.hidden[i]), int(inputs.positions[i]))
        bridge.append(s)
        work = copy.deepcopy(cache) if sliding and not keep_chain_kv else cache
        added, recycled = 0, s[recycle]
        for j in range(2, K + 1):
            if i + j - 1 > T - 1:
                break
            pos = int(inputs.positions[i]) + (0 if frozen_position else j - 1)
            uniform = step(copy.deepcopy(work), i + j - 1, recycled, pos, uniform=True)["attn"]  # keys: the same
            row = step(work, i + j - 1, recycled, pos)  # teacher-forced: step token t_{i+j} = token_ids[i+j-1]
            row["attn_uniform"] = uniform
            chains[j].append(row)
            recycled, added = row[recycle], added + 1
        if added and not keep_chain_kv and not sliding:
            cache.crop(-added)  # the chain's rows dropped: the cache holds bridge rows 0..i again
    return bridge, chains


def assert_rows_close(got: np.ndarray, want: np.ndarray, kind: str, what: str) -> None:
    if kind == INDEX_SET:
        np.testing.assert_array_equal(np.sort(got, axis=1), np.sort(want, axis=1), err_msg=what)
    else:
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL, err_msg=what)


def stacked(rows: list[dict], name: str) -> np.ndarray:
    return torch.stack([r[name] for r in rows]).reshape(len(rows), -1).numpy()


def test_chain_rows_equal_a_stepwise_run_through_a_dynamic_cache(family):
    name, _, ckpt, head, rotary, trace = family
    one = depth_one(trace)
    recycle = ckpt.family.recycled
    bridge, chains = stepwise_reference(ckpt, head, rotary, one["inputs"], recycle)
    projection = ckpt.read(draft_projection(ckpt).name).astype(np.float64)
    with read_trace(trace) as ref:
        info = chain_info(ref)
        assert chain_groups(ref) == tuple(range(2, K + 1))
        assert recorded_chain_digest(ref) == ref.attrs["chain_digest"]
    assert (info.depths, info.tokens, info.recycle, info.layers, info.kv) == (
        K, "teacher_forced", recycle, (0,) * (K - 1), "dropped_after_chain")
    for stage in one["stages"]:
        if stage != "draft":
            assert_rows_close(one["stages"][stage], stacked(bridge, stage), "rows", f"{name} depth 1 {stage}")
    for j in range(2, K + 1):
        got, n = depth_rows(trace, j), T - j + 1
        assert len(chains[j]) == n
        inputs = got["inputs"]
        np.testing.assert_array_equal(inputs["bridge"], np.arange(n))
        np.testing.assert_array_equal(inputs["token_ids"], one["inputs"].token_ids[j - 1:j - 1 + n])  # x_{i+j}
        np.testing.assert_array_equal(inputs["positions"], one["inputs"].positions[:n] + j - 1)
        np.testing.assert_array_equal(inputs["layer"], np.zeros(n))
        np.testing.assert_array_equal(inputs["embed"], one["inputs"].embed[j - 1:j - 1 + n])
        previous = bridge if j == 2 else chains[j - 1]
        np.testing.assert_allclose(inputs["recycled"], stacked(previous[:n], recycle), rtol=RTOL, atol=ATOL)
        assert tuple(got["stages"]) == tuple(one["stages"])  # every stage of the family, in depth 1's order
        for stage, rows in got["stages"].items():
            if stage == "draft":
                continue
            assert_rows_close(rows, stacked(chains[j], stage), got["kinds"][stage], f"{name} depth {j} {stage}")
        np.testing.assert_allclose(got["evidence"]["attn_uniform"], stacked(chains[j], "attn_uniform"),
                                   rtol=RTOL, atol=ATOL)
        logits = stacked(chains[j], "out").astype(np.float64) @ projection.T
        clear = got["evidence"]["draft_margin"][:, 0] > 1e-4
        assert clear.any()
        np.testing.assert_array_equal(got["stages"]["draft"][clear, 0], logits.argmax(axis=1)[clear])
        np.testing.assert_allclose(got["evidence"]["h_if_main"], one["stages"]["h"][:n], rtol=RTOL, atol=ATOL)
        assert ("h_if_prenorm" in got["evidence"]) == (ckpt.family.recycle_prenorm is not None)


def test_twin_chain_kv_left_in_the_cache_changes_later_bridge_rows(family):
    name, _, ckpt, head, rotary, trace = family
    one = depth_one(trace)
    kept, _ = stepwise_reference(ckpt, head, rotary, one["inputs"], ckpt.family.recycled, keep_chain_kv=True)
    np.testing.assert_allclose(stacked(kept[:1], "out"), one["stages"]["out"][:1], rtol=RTOL, atol=ATOL)
    later = np.abs(stacked(kept[1:], "attn") - one["stages"]["attn"][1:]).max()
    assert later > 100 * ATOL, name  # bridge i+1 attending to bridge i's chain rows shows in attn


def test_twin_a_frozen_chain_position_changes_the_chain_rows(family):
    name, _, ckpt, head, rotary, trace = family
    one = depth_one(trace)
    _, frozen = stepwise_reference(ckpt, head, rotary, one["inputs"], ckpt.family.recycled, frozen_position=True)
    got = depth_rows(trace, 2)["stages"]["attn"]
    assert np.abs(stacked(frozen[2], "attn") - got).max() > 100 * ATOL, name


def test_recycle_option_changes_depth_2_h_and_equals_the_recorded_alternative(family, tmp_path):
    name, ckpt_dir, ckpt, _, _, trace = family
    prenorm = ckpt.family.recycle_prenorm
    if prenorm is None:  # DeepSeek-V4: no pre-norm tensor of the streams' width; --recycle res2 is refused
        tokens = depth_one(trace)["inputs"].token_ids
        from oracle.errors import InputError

        with pytest.raises(InputError, match="--recycle res2"):
            export_trace(ckpt_dir, tmp_path / "r.h5", tokens, HiddenSource(seed=4),
                         chain=ChainOptions(K, recycle="res2"))
        return
    one = depth_one(trace)
    other = export_trace(ckpt_dir, tmp_path / "res2.h5", one["inputs"].token_ids, HiddenSource(seed=4),
                         start_pos=START, chain=ChainOptions(K, recycle=prenorm))
    default, chosen = depth_rows(trace, 2), depth_rows(other, 2)
    with read_trace(other) as ref:
        assert chain_info(ref).recycle == prenorm
    np.testing.assert_array_equal(chosen["inputs"]["recycled"], one["stages"][prenorm][:T - 1])
    assert np.abs(chosen["stages"]["h"] - default["stages"]["h"]).max() > 100 * ATOL, name
    np.testing.assert_allclose(default["evidence"]["h_if_prenorm"], chosen["stages"]["h"], rtol=RTOL, atol=ATOL)
    for stage in one["stages"]:  # depth 1 never recycles anything
        np.testing.assert_array_equal(depth_one(other)["stages"][stage], one["stages"][stage])


def test_argmax_chain_tokens_are_accepts_drafts(family, tmp_path):
    """`--chain-tokens argmax` feeds each depth the head's own draft: over x_0..x_{N-1} its depth-j draft of bridge i
    is accept's draft j of chain i (the one loop, reached from both)."""
    name, ckpt_dir, ckpt, head, rotary, _ = family
    n = T + 1
    x = np.random.default_rng(12).integers(0, ckpt.config.vocab_size, n)
    h = hidden_from_seed(13, n, ckpt.family.hidden_width(ckpt.config))
    np.save(tmp_path / "h.npy", h[:n - 1])
    trace = export_trace(ckpt_dir, tmp_path / "argmax.h5", x[1:], HiddenSource(file=str(tmp_path / "h.npy")),
                         chain=ChainOptions(K, tokens="argmax"))
    drafts = draft_chains(ckpt, head, rotary, x, h, K)[0]  # [C, K], C = N-1-K chains
    chains = len(drafts)
    np.testing.assert_array_equal(depth_one(trace)["stages"]["draft"][:chains, 0], drafts[:, 0])
    for j in range(2, K + 1):
        got = depth_rows(trace, j)
        np.testing.assert_array_equal(got["stages"]["draft"][:chains, 0], drafts[:, j - 1], err_msg=f"{name} {j}")
        previous = depth_one(trace)["stages"] if j == 2 else depth_rows(trace, j - 1)["stages"]
        np.testing.assert_array_equal(got["inputs"]["token_ids"], previous["draft"][:T - j + 1, 0])
    with read_trace(trace) as ref:
        assert chain_info(ref).tokens == "argmax"
