"""RoutedExperts (oracle/families/moe_experts.py): experts read from the shard files on a thread, one ahead of the
official forward, give the same bits as experts in ordinary memory; an expert asked for out of order is read on the
spot; a read that fails on the thread is raised where the forward asks for that expert (exit 2, naming the file)."""

import os
import shutil

import numpy as np
import pytest
import torch

from oracle.checkpoint import Checkpoint
from oracle.cli import cli as oracle_cli
from oracle.errors import CheckpointError
from oracle.families import moe_experts
from oracle.families.registry import head_module
from oracle.inputs import hidden_from_seed
from oracle.trace import TraceInputs
from tests.helpers import load_script, run_cli

FIXTURES = load_script("make_fixtures")
TOKENS = [5, 17, 3, 99, 200, 7, 42, 5, 300, 11]


@pytest.fixture(scope="module", params=["fused", "per_expert"])
def checkpoint(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"routed_{request.param}")
    return FIXTURES.write_moe_checkpoint(root / "ckpt", "qwen3_next", request.param, main_model=False)


def head_and_inputs(ckpt, in_memory=False, edit=None):
    checkpoint = Checkpoint(ckpt)
    impl = head_module(checkpoint.family)
    weights = impl.torch_weights(checkpoint.read_head(widen=False))
    if in_memory:  # ordinary memory: nothing for the experts to read from a file
        weights = {n: t.clone() for n, t in weights.items()}
    if edit:
        edit(weights)
    head, rotary = impl.build_head(checkpoint.config, weights)
    ids = np.array(TOKENS, dtype=np.int64)
    d = checkpoint.config.hidden_size
    inputs = TraceInputs(token_ids=ids, positions=np.arange(len(ids), dtype=np.int64),
                         hidden=hidden_from_seed(0, len(ids), d), embed=checkpoint.embedding_rows(ids))
    return impl, head, rotary, inputs


def routed_of(head) -> moe_experts.RoutedExperts:
    (routed,) = moe_experts.routed_experts_of(head)
    return routed


def test_experts_read_from_the_files_on_a_thread_equal_experts_in_memory(checkpoint):
    impl, head, rotary, inputs = head_and_inputs(checkpoint)
    from_files = impl.run_batched(head, rotary, inputs)
    assert routed_of(head)._files._fds  # the shard was opened: the experts were read from it, not the mapping
    impl, head, rotary, inputs = head_and_inputs(checkpoint, in_memory=True)
    in_memory = impl.run_batched(head, rotary, inputs)
    assert not routed_of(head)._files._fds
    for stage in from_files:
        assert torch.equal(torch.from_numpy(from_files[stage]), torch.from_numpy(in_memory[stage])), stage


def test_twin_one_changed_expert_weight_in_memory_changes_the_routed_output(checkpoint):
    impl, head, rotary, inputs = head_and_inputs(checkpoint)
    reference = impl.run_batched(head, rotary, inputs)
    used = int(reference["topk_ids"][0, 0])
    layout = Checkpoint(checkpoint).layout().experts

    def edit(weights):
        name = (layout.names["down"] if layout.kind == "fused" else layout.names["down"].format(e=used))
        tensor = weights[name][used] if layout.kind == "fused" else weights[name]
        tensor[0, 0] = tensor[0, 0] * 2 + 1

    impl, head, rotary, inputs = head_and_inputs(checkpoint, in_memory=True, edit=edit)
    changed = impl.run_batched(head, rotary, inputs)
    assert not torch.equal(torch.from_numpy(changed["routed"]), torch.from_numpy(reference["routed"]))
    assert torch.equal(torch.from_numpy(changed["router_logits"]), torch.from_numpy(reference["router_logits"]))


def test_an_expert_asked_for_out_of_order_is_read_on_the_spot(checkpoint):
    _, head, _, _ = head_and_inputs(checkpoint)
    routed = routed_of(head)
    module = head.layers[0].mlp.experts
    layout = routed.layout
    routed._routed(module, (torch.zeros(3, layout.hidden), torch.tensor([[1, 3], [5, 3], [1, 5]])))
    assert routed._pipeline is not None and routed._pipeline.order == [1, 3, 5]
    for e in (5, 1, 3, 3, 0):  # 5 first: out of the forward's order
        gate, up, down = (routed._stored_part(e, p)[1].float() for p in ("gate", "up", "down"))
        assert torch.equal(module.gate_up_proj[e], torch.cat([gate, up]))
        assert torch.equal(module.down_proj[e], down)
    assert routed._pipeline is None  # given up at the first request out of order
    routed._done(module, (), None)


def shard_cut_short(monkeypatch, tmp_path) -> None:
    """The experts' reads see the shard ending early (as if cut after it was mapped): they get an empty file."""
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    monkeypatch.setattr(moe_experts._Files, "_fd", lambda self, *where: os.open(empty, os.O_RDONLY))


def test_a_read_that_fails_on_the_thread_is_raised_where_the_forward_asks(checkpoint, monkeypatch, tmp_path):
    impl, head, rotary, inputs = head_and_inputs(checkpoint)
    shard_cut_short(monkeypatch, tmp_path)
    threads = torch.get_num_threads()
    with pytest.raises(CheckpointError, match="ended inside a routed expert"):
        impl.run_batched(head, rotary, inputs)
    assert routed_of(head)._pipeline is None  # stopped although the forward raised (no thread left blocked)
    assert torch.get_num_threads() == threads  # and torch's thread count given back
    monkeypatch.undo()
    impl.run_batched(head, rotary, inputs)  # and then runs
    assert routed_of(head)._pipeline is None


def test_the_export_cli_exits_2_naming_the_shard_when_an_expert_cannot_be_read(checkpoint, tmp_path, monkeypatch):
    shard_cut_short(monkeypatch, tmp_path)
    out = tmp_path / "t.h5"
    result = run_cli(oracle_cli, ["export", checkpoint, "--out", out, "--tokens", ",".join(map(str, TOKENS)),
                                  "--hidden-seed", "0", "-q"])
    assert result.exit_code == 2 and "ended inside a routed expert" in result.output and "safetensors" in result.output
    assert not out.exists()


def test_twin_the_same_export_without_the_fault_succeeds(checkpoint, tmp_path):
    out = tmp_path / "t.h5"
    result = run_cli(oracle_cli, ["export", checkpoint, "--out", out, "--tokens", ",".join(map(str, TOKENS)),
                                  "--hidden-seed", "0", "-q"])
    assert result.exit_code == 0 and out.is_file(), result.output



# ---------------------------------------------------------------------------------------------------------------
# blockwise: an expert matrix too large for the cache is widened a block of output rows at a time inside F.linear

BLOCKWISE_CASES = {
    # gate_up 192 rows: blocks [0,64) [64,128) [128,192), the gate/up boundary (96) inside one; down 160 rows:
    # [0,64) [64,160) (a tail under 64 rows joins the block before it)
    "qwen3_next_fused": lambda root: FIXTURES.write_moe_checkpoint(
        root, "qwen3_next", "fused", dims=FIXTURES.MOE_TINY | {"hidden_size": 160, "moe_intermediate_size": 96},
        main_model=False),
    "qwen3_5_moe_per_expert": lambda root: FIXTURES.write_moe_checkpoint(
        root, "qwen3_5_moe", "per_expert", dims=FIXTURES.MOE_TINY | {"hidden_size": 160, "moe_intermediate_size": 96},
        main_model=False),
    "deepseek_v3_fp8": lambda root: FIXTURES.write_mtp_layer_checkpoint(
        root, "deepseek_v3", dims=FIXTURES.DEEPSEEK_TINY | {"hidden_size": 160, "moe_intermediate_size": 96},
        fp8_block=[16, 32]),
    # I = 40 is not a multiple of the 16-row scale block: gate_up is widened whole, down blockwise
    "deepseek_v3_fp8_odd": lambda root: FIXTURES.write_mtp_layer_checkpoint(
        root, "deepseek_v3", dims=FIXTURES.DEEPSEEK_TINY | {"hidden_size": 160, "moe_intermediate_size": 40},
        fp8_block=[16, 32]),
}


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    root = tmp_path_factory.mktemp("blockwise")
    return {name: make(root / name) for name, make in BLOCKWISE_CASES.items()}


def blockwise(monkeypatch) -> list:
    """Every expert matrix widened blockwise, 64 rows at a time; returns the log of RoutedExperts.linear calls."""
    monkeypatch.setattr(moe_experts, "BLOCKWISE_ABOVE", 0)
    monkeypatch.setattr(moe_experts, "BLOCK_ROWS", 64)
    calls, linear = [], moe_experts.RoutedExperts.linear

    def logged(self, slot, which, x):
        calls.append((which, self._chunks[which]))
        return linear(self, slot, which, x)

    monkeypatch.setattr(moe_experts.RoutedExperts, "linear", logged)
    return calls


@pytest.mark.parametrize("mode", ["run_batched", "run_stepwise"])
@pytest.mark.parametrize("name", list(BLOCKWISE_CASES))
def test_blockwise_widening_gives_the_same_bits_as_whole_matrices(wide, name, mode, monkeypatch):
    impl, head, rotary, inputs = head_and_inputs(wide[name])
    whole = getattr(impl, mode)(head, rotary, inputs)
    calls = blockwise(monkeypatch)
    impl, head, rotary, inputs = head_and_inputs(wide[name])
    blocks = getattr(impl, mode)(head, rotary, inputs)
    plans = dict(calls)
    assert plans["down"] == [(0, 64), (64, 160)]
    assert plans.get("gate_up") == (None if name.endswith("odd") else [(0, 64), (64, 128), (128, 192)])
    for stage in whole:
        assert torch.equal(torch.from_numpy(whole[stage]), torch.from_numpy(blocks[stage])), stage


def test_twin_a_blockwise_matrix_used_after_its_buffer_was_reused_is_refused(wide, monkeypatch):
    blockwise(monkeypatch)
    _, head, _, _ = head_and_inputs(wide["qwen3_next_fused"])
    routed, module = routed_of(head), head.layers[0].mlp.experts
    held = module.gate_up_proj[0]
    assert type(held) is moe_experts._Blockwise
    x = torch.randn(2, routed.layout.hidden)
    expected = torch.nn.functional.linear(x, held)  # used at once: fine
    assert torch.equal(expected, torch.nn.functional.linear(x, held.clone()))  # any other use widens it whole
    module.gate_up_proj[1], module.gate_up_proj[2]  # the slot is refilled (read on the spot: one slot)
    with pytest.raises(RuntimeError, match="used after another expert"):
        torch.nn.functional.linear(x, held)


def test_a_shard_replaced_after_it_was_mapped_is_read_through_the_mapping(checkpoint, tmp_path):
    """Red team: a shard renamed over by another checkpoint's after the head was built; the experts must still be
    the mapped (original) file's, as every other tensor is. Twin: the replacement's own export differs."""
    ckpt = shutil.copytree(checkpoint, tmp_path / "ckpt")
    other = FIXTURES.write_moe_checkpoint(tmp_path / "other", "qwen3_next", Checkpoint(checkpoint).layout().experts.kind,
                                          seed=1, main_model=False)
    impl, head, rotary, inputs = head_and_inputs(ckpt)
    for shard in sorted(other.glob("*.safetensors")):
        os.replace(shutil.copy(shard, ckpt / (shard.name + ".new")), ckpt / shard.name)
    replaced = impl.run_batched(head, rotary, inputs)
    impl, head, rotary, inputs = head_and_inputs(checkpoint)
    original = impl.run_batched(head, rotary, inputs)
    impl, head, rotary, inputs = head_and_inputs(other)
    theirs = impl.run_batched(head, rotary, inputs)
    assert torch.equal(torch.from_numpy(replaced["routed"]), torch.from_numpy(original["routed"]))
    assert not torch.equal(torch.from_numpy(theirs["routed"]), torch.from_numpy(original["routed"]))


def test_the_forward_leaves_the_reading_thread_a_core_and_gives_it_back(checkpoint):
    """While the pipeline reads, torch computes on one thread fewer (its second OpenMP thread had taken the reading
    thread's core: reads at half speed at Qwen3-Next scale); after the forward the thread count is as before."""
    impl, head, rotary, inputs = head_and_inputs(checkpoint)
    module = head.layers[0].mlp.experts
    threads, seen = torch.get_num_threads(), []
    hook = module.register_forward_pre_hook(lambda *_: seen.append(torch.get_num_threads()))
    try:  # registered after the pipeline's own pre-hook: sees the forward's thread count
        impl.run_batched(head, rotary, inputs)
    finally:
        hook.remove()
    assert seen == [max(1, threads - 1)]
    assert torch.get_num_threads() == threads


def test_an_expert_edited_in_place_in_the_mapped_weights_is_computed_with_the_edit(checkpoint):
    """A library caller's tensors share the shard's copy-on-write mapping; an expert weight edited there in place is
    no longer what the file holds, so it is read through memory (its written pages are this process's own), never
    from the file, which would silently drop the edit."""
    layout = Checkpoint(checkpoint).layout().experts
    _, _, _, inputs = head_and_inputs(checkpoint)
    used = None

    def edit(weights):
        name = layout.names["down"] if layout.kind == "fused" else layout.names["down"].format(e=used)
        tensor = weights[name][used] if layout.kind == "fused" else weights[name]
        tensor[0, 0] = tensor[0, 0] * 2 + 1

    impl, head, rotary, _ = head_and_inputs(checkpoint)
    reference = impl.run_batched(head, rotary, inputs)
    used = int(reference["topk_ids"][0, 0])
    impl, head, rotary, _ = head_and_inputs(checkpoint, in_memory=True, edit=edit)
    expected = impl.run_batched(head, rotary, inputs)  # the edit, in ordinary memory
    impl, head, rotary, _ = head_and_inputs(checkpoint, edit=edit)  # the same edit, in the mapping
    edited = impl.run_batched(head, rotary, inputs)
    assert not torch.equal(torch.from_numpy(expected["routed"]), torch.from_numpy(reference["routed"]))
    for stage in expected:
        assert torch.equal(torch.from_numpy(edited[stage]), torch.from_numpy(expected[stage])), stage


def test_twin_pages_only_read_are_not_taken_for_written_ones(checkpoint):
    """Untouched and read-only-touched mapped pages are the file's: the experts are still read from the file."""
    impl, head, rotary, inputs = head_and_inputs(checkpoint)
    routed = routed_of(head)
    name, stored = routed._stored_part(0, "down")
    float(stored.float().sum())  # read every page of it through the mapping
    assert not moe_experts._written_in_place(stored.data_ptr(), stored.numel() * stored.element_size())
    impl.run_batched(head, rotary, inputs)
    assert routed._files._fds  # read from the shard


def test_overlapping_pipelines_give_the_thread_count_back_once_the_last_stops():
    """Two heads' pipelines at once (a library caller's threads) share the saved count: the first to stop does not
    restore it under the other, and the last does (each restoring its own value would leave the process reduced)."""
    threads = torch.get_num_threads()
    fewer = moe_experts._FewerTorchThreads()
    fewer.enter()
    fewer.enter()
    assert torch.get_num_threads() == max(1, threads - 1)
    fewer.leave()
    assert torch.get_num_threads() == max(1, threads - 1)
    fewer.leave()
    assert torch.get_num_threads() == threads
