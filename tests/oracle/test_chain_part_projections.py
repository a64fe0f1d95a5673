"""What the per-depth q/k-part records cost (issue 24, speed): the stacked chain pass of oracle/qk_parts.py
chain_part_records was never a real pass, so no real record can be replayed to its variants. Within one measure()
call the first variant computes each attention projection and every later variant with the same input (and the same
weight) gets it back (attention_evidence.replayed_projections' scope), and the output projection runs on the chain
rows only (the bridge rows of a stacked pass are keys and values, never measured).

Each test compares against the same records with every projection computed again (specified_uniform_weights turns
the memo off): bit-identical. (The export itself takes the stacked rows' projections from the real passes:
tests/oracle/test_projection_archive.py.) Twins: a variant that swaps a projection's weight is computed again (the memo would
hand back the unswapped rows and record a distance of 0); the bridge rows are what the rows kept drop."""

import h5py
import numpy as np
import pytest
import torch

from oracle.attention_evidence import reused_projections, specified_uniform_weights
from oracle.checkpoint import Checkpoint
from oracle.export import ChainOptions, HiddenSource, export_trace
from oracle.families.registry import head_module
from oracle.qk_parts import DepthRows, PartVariant, chain_part_records, measure, swapped
from oracle.trace import read_trace
from tests.helpers import TINY
from tests.probe.test_qk_parts import QWEN_PARTS, TOKENS


@pytest.fixture(scope="module")
def loop(tmp_path_factory):
    """A chained reference on the tiny Qwen fixture, its head and the rows chain_part_records measures."""
    ref = export_trace(TINY, tmp_path_factory.mktemp("chain-speed") / "ref.h5", TOKENS, HiddenSource(seed=0),
                       chain=ChainOptions(3))
    ckpt = Checkpoint(TINY)
    impl = head_module(ckpt.family)
    head, rotary = impl.build_head(ckpt.config, impl.torch_weights(ckpt.read_head(widen=False, digest=False)))
    with read_trace(ref) as r:
        inputs = r.inputs()
    with h5py.File(ref) as f:
        depths = {j: DepthRows(*(f[f"chain/d{j}/inputs/{n}"][:] for n in ("token_ids", "positions", "recycled",
                                                                            "embed")),
                               f[f"chain/d{j}/stages/ah"][:], f[f"chain/d{j}/stages/attn"][:]) for j in (2, 3)}
        recorded = {j: {f"qk_{p}": f[f"chain/d{j}/evidence/qk_{p}"][:] for p in QWEN_PARTS} for j in (2, 3)}
        bridge = f["stages/ah"][:], f["stages/attn"][:]
    return impl, head, rotary, inputs, depths, recorded, bridge


class Counted:
    """Calls and rows of one linear's class forward (what the memo wraps: the matmuls that really run)."""

    def __init__(self, monkeypatch, linear):
        self.calls, self.rows = 0, 0
        forward = type(linear).forward

        def counting(module, x):
            if module is linear:
                self.calls += 1
                self.rows += x.shape[-2]
            return forward(module, x)
        monkeypatch.setattr(type(linear), "forward", counting)


@pytest.mark.parametrize("block", [64, 2])
def test_each_blocks_variants_share_one_projection_pass_bit_identical(loop, monkeypatch, block):
    impl, head, rotary, inputs, depths, recorded, (ah, attn) = loop
    attention = head.layers[0].self_attn
    q = Counted(monkeypatch, attention.q_proj)
    fast = chain_part_records(impl, head, rotary, inputs, ah, attn, depths, QWEN_PARTS, block=block)
    fast_calls = q.calls
    q.calls = 0
    with specified_uniform_weights():  # the memo off: every variant projects its rows again
        slow = chain_part_records(impl, head, rotary, inputs, ah, attn, depths, QWEN_PARTS, block=block)
    blocks = -(-len(depths[2].token_ids) // block)
    passes = sum(len(v) for v in QWEN_PARTS.values()) + 1  # and the baseline pass (qk_parts.measure)
    assert fast_calls == blocks and q.calls == blocks * passes  # once per block, against once per pass
    for j in (2, 3):
        assert set(fast[j]) == set(slow[j]) == set(recorded[j])
        for name in fast[j]:
            np.testing.assert_array_equal(fast[j][name], slow[j][name], err_msg=name)
            if block == 64:  # the export's own blocking (one block): the records it wrote, whose projections
                # are the real passes' own rows (attention_evidence.ProjectionArchive), not one stacked matmul's:
                # equal within float32 rounding (tests/oracle/test_projection_archive.py holds the bits)
                np.testing.assert_allclose(fast[j][name], recorded[j][name], rtol=1e-5, atol=1e-6, err_msg=name)


def test_the_output_projection_runs_on_the_chain_rows_only(loop, monkeypatch):
    impl, head, rotary, inputs, depths, _, (ah, attn) = loop
    o = Counted(monkeypatch, head.layers[0].self_attn.o_proj)
    chain_part_records(impl, head, rotary, inputs, ah, attn, depths, QWEN_PARTS, block=64)
    chain_rows = sum(len(d.token_ids) for d in depths.values())
    variants = sum(len(v) for v in QWEN_PARTS.values())
    assert o.calls == 1 and o.rows == variants * chain_rows  # one matmul, no bridge row in it


def _stacked_variants(loop):
    """The variants of one stacked pass (all chains in one block) and its attn rows, as _block_records builds them."""
    from oracle.draft_loop import key_positions, within_window
    from oracle.qk_parts import stacked_mask
    from oracle.trace import TraceInputs

    impl, head, rotary, inputs, depths, _, (ah, attn) = loop
    b, counts = inputs.num_tokens, tuple(len(depths[j].token_ids) for j in (2, 3))
    keys = key_positions(0, torch.from_numpy(np.asarray(inputs.positions, dtype=np.int64)), counts)
    mask = stacked_mask(b, counts)
    stacked = TraceInputs(
        token_ids=np.concatenate([inputs.token_ids, *(depths[j].token_ids for j in (2, 3))]).astype(np.int64),
        positions=keys.numpy(), hidden=np.concatenate([inputs.hidden, *(depths[j].recycled for j in (2, 3))]),
        embed=np.concatenate([inputs.embed, *(depths[j].embed for j in (2, 3))]))
    rows = np.concatenate([ah, *(depths[j].ah for j in (2, 3))]).astype(np.float32)
    variants = impl.qk_part_variants(head, rotary, stacked, rows,
                                     mask_of=lambda w: within_window(mask, keys, keys, w))
    return variants, np.concatenate([attn, *(depths[j].attn for j in (2, 3))]), b


def test_measured_rows_are_the_whole_passes_rows_and_drop_the_bridge(loop):
    impl, head, *_ = loop
    variants, attn, b = _stacked_variants(loop)
    output = impl.qk_output_projection(head)
    with specified_uniform_weights():
        whole, names = measure(variants, attn, output)
    with reused_projections(head):
        kept, kept_names = measure(variants, attn, output, rows=slice(b, None))
    assert kept_names == names
    for name in whole:
        assert kept[name].shape == (len(attn) - b, whole[name].shape[1])
        np.testing.assert_array_equal(kept[name], whole[name][b:], err_msg=name)
        # twin: the rows dropped are the bridge's, which move under the variants too (they were measured before)
        assert (whole[name][:b] > 0).any(), name


def test_twin_a_variant_that_swaps_a_projections_weight_is_projected_again(loop):
    """The scope hands a projection back only for the same input AND the same weight: a variant with a zeroed
    q_proj (after variants that recorded the real one) must record its own distance, not 0."""
    impl, head, *_ = loop
    variants, attn, b = _stacked_variants(loop)
    q_proj = head.layers[0].self_attn.q_proj
    zero = torch.nn.Parameter(torch.zeros_like(q_proj.weight), requires_grad=False)
    rope = next(v for v in variants if v.part == "rope")  # a pass projecting the same rows with the real weight first

    def zeroed_q():
        with swapped(q_proj, "weight", zero):
            return variants[-1].run()  # the real mask under kv_append's variant; q zeroed on top

    extra = PartVariant("rope", "q_zeroed", zeroed_q)
    output = impl.qk_output_projection(head)
    with reused_projections(head) as memo:  # as _block_records measures: a memo with no real records
        fast, _ = measure([rope, extra], attn, output, rows=slice(b, None))
    with specified_uniform_weights():
        slow, _ = measure([rope, extra], attn, output, rows=slice(b, None))
        alone, _ = measure([variants[-1]], attn, output, rows=slice(b, None))
    np.testing.assert_array_equal(fast["qk_rope"], slow["qk_rope"])
    # q zeroed: uniform weights over the visible keys, a different row from the kv_append variant's alone
    assert not np.array_equal(fast["qk_rope"][:, 1], alone["qk_kv_append"][:, 0])
    assert memo.hits == 2  # k and v came back to the second pass; q, under another weight, was projected again
