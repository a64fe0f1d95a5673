"""The MtpModel family's routed experts are read and widened lazily (oracle/families/mtp_model.py StackedExperts):
every MTP layer of the step3p7 tiny fixture gives bit for bit the stages of the official modules with every expert
widened to float32 at load (the path before), and the check fails when one routed expert's bytes change.

Bit for bit at the same torch thread count: while RoutedExperts reads on its thread the forward computes on one
thread fewer (moe_experts._FewerTorchThreads), and the CPU GEMM's low bits depend on the thread count (measured
here: 2 threads against 1 moved `routed` by ~8e-7). So the eager head is run with that same schedule (one thread
fewer inside each experts module), and both also at one thread throughout."""

from pathlib import Path

import numpy as np
import pytest
import torch

from oracle.checkpoint import Checkpoint
from oracle.families import mtp_model
from oracle.families.moe_experts import routed_experts_of

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "step3p7_tiny"
T = 10


@pytest.fixture(scope="module")
def stored():
    ckpt = Checkpoint(FIXTURE)
    return ckpt.config, mtp_model.torch_weights(ckpt.read_head(widen=False, digest=False))


def build(cfg, weights, lazy: bool):
    if lazy:
        return mtp_model.build_head(cfg, weights)
    original = mtp_model.MtpModelHead.stacked_experts
    mtp_model.MtpModelHead.stacked_experts = lambda self, w: {}  # every expert widened by the official converters
    try:
        return mtp_model.build_head(cfg, weights)
    finally:
        mtp_model.MtpModelHead.stacked_experts = original


def same_thread_schedule(head) -> None:
    """Inside each experts module, one torch thread fewer (as RoutedExperts' pipeline runs the lazy forward)."""
    saved = []

    def enter(module, args):
        saved.append(torch.get_num_threads())
        torch.set_num_threads(max(1, saved[-1] - 1))

    def leave(module, args, output):
        torch.set_num_threads(saved.pop())

    for layer in head.mtp.layers:
        layer.mtp_block.mlp.experts.register_forward_pre_hook(enter)
        layer.mtp_block.mlp.experts.register_forward_hook(leave, always_call=True)


def inputs(cfg):
    rng = np.random.default_rng(3)
    d = cfg.hidden_size
    embed = torch.from_numpy(rng.standard_normal((1, T, d)).astype(np.float32))
    hidden = torch.from_numpy(rng.standard_normal((1, T, d)).astype(np.float32))
    return embed, hidden, torch.arange(T)[None]


@torch.inference_mode()
def every_layer(head, rotary, cfg) -> list[dict[str, torch.Tensor]]:
    """Each MTP layer's stages over the same T rows, batched under its own mask."""
    embed, hidden, positions = inputs(cfg)
    return [head.steps(rotary, embed, hidden, positions, mtp_model.layer_mask(positions[0], head.window(layer)),
                       head.pass_cache(), layer=layer) for layer in range(cfg.num_mtp_layers)]


def test_lazy_experts_equal_the_eagerly_widened_official_modules_bit_for_bit(stored):
    cfg, weights = stored
    (lazy, rotary), (eager, eager_rotary) = build(cfg, weights, True), build(cfg, weights, False)
    assert sorted(lazy.routed) == list(range(cfg.num_mtp_layers))  # every (sparse) layer's experts are lazy
    assert eager.routed == {} and eager.mtp.layers[0].mtp_block.mlp.experts.gate_up_proj.dtype == torch.float32
    # nothing of the lazy head's experts is a float32 parameter: they stay as stored
    assert not any(".mlp.experts." in name for name, _ in lazy.mtp.named_parameters())
    same_thread_schedule(eager)
    threads = torch.get_num_threads()
    for count in sorted({threads, 1}):
        torch.set_num_threads(count)
        try:
            got, want = every_layer(lazy, rotary, cfg), every_layer(eager, eager_rotary, cfg)
        finally:
            torch.set_num_threads(threads)
        for layer, (g, w) in enumerate(zip(got, want)):
            assert g.keys() == w.keys() and "routed" in g
            for name in w:
                assert torch.equal(g[name], w[name]), f"{count} thread(s): layer {layer} stage {name}"
    touched = [sorted(r.touched) for r in routed_experts_of(lazy)]
    assert len(touched) == cfg.num_mtp_layers and all(touched)


def test_a_perturbed_routed_expert_changes_the_lazy_result(stored):
    """The twin: the equality above can fail. One expert that layer 1's tokens route to gets one changed down_proj
    row; the lazy head's routed output at layer 1 must differ from the unperturbed one (and layer 0's must not)."""
    cfg, weights = stored
    head, rotary = build(cfg, weights, True)
    before = every_layer(head, rotary, cfg)
    expert = int(before[1]["topk_ids"][0, 0, 0])
    name = cfg.layer_prefix(1) + "moe.down_proj.weight"
    perturbed = dict(weights)
    perturbed[name] = weights[name].clone()
    perturbed[name][expert, 0] += 1.0
    head2, rotary2 = build(cfg, perturbed, True)
    after = every_layer(head2, rotary2, cfg)
    assert torch.equal(after[0]["routed"], before[0]["routed"])
    assert not torch.equal(after[1]["routed"], before[1]["routed"])


def test_dense_mtp_layers_as_released_export_without_routed_stages(tmp_path):
    """Step-3.5/3.7-Flash as released: n_routed_experts set (the main stack's) but moe_layers_enum stops before the
    MTP layers, so transformers builds them dense; the head config has no experts and `export --chain` records no
    router stages (it refused before: the stage list named router stages the dense layers never record). Twin: the
    same config with the MTP layers in moe_layers_enum is MoE and records them."""
    import h5py

    from oracle.cli import cli as oracle_cli
    from tests.helpers import load_script, run_cli

    fixtures = load_script("make_fixtures")
    for enum, moe in (("1", False), ("1,2,3,4", True)):
        ckpt = fixtures.write_mtp_model_checkpoint(tmp_path / f"ckpt{enum}", "step3p7", {"moe_layers_enum": enum})
        assert (Checkpoint(ckpt).config.num_experts > 0) is moe
        out = tmp_path / f"trace{len(enum)}.h5"
        result = run_cli(oracle_cli, ["export", ckpt, "--out", out, "--tokens", "5,17,3,99,200,7", "--hidden-seed",
                                      "0", "--chain", "3", "-q"])
        assert result.exit_code == 0, result.output
        with h5py.File(out) as f:
            assert ("router_logits" in f["stages"]) is moe and "out" in f["chain/d3/stages"]
