"""Fp8Linear (oracle/families/mtp_layer.py): the head's dense FP8 linears stay FP8 and are dequantized a block of
rows at a time into a reused buffer; the trace must keep the bits of the dequantize-whole path it replaced
(oracle/fp8.py dequantize of the whole weight, then F.linear), on every tiny FP8 checkpoint: DeepSeek-V3 with
and without q_lora, partial 128x128 blocks, and GLM-4.5 (whose FP8 q_proj has a bias).

The reference here is test-only: `WholeDequant` holds the whole float32 weight, as the head did before."""

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from oracle.checkpoint import Checkpoint
from oracle.errors import CheckpointError
from oracle.families.torch_parts import Fp8Linear
from oracle.families.registry import head_module
from oracle.fp8 import dequantize
from oracle.trace import TraceInputs

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from make_fixtures import write_mtp_layer_checkpoint  # noqa: E402

CHECKPOINTS = {
    "ds_fp8": dict(family="deepseek_v3", fp8_block=[16, 32]),
    "ds_noq_fp8": dict(family="deepseek_v3", fp8_block=[16, 32], dims={"q_lora_rank": None}),
    "ds_odd_fp8": dict(family="deepseek_v3", fp8_block=[128, 128], copies=False,
                       dims={"hidden_size": 136, "num_attention_heads": 3, "q_lora_rank": 40, "kv_lora_rank": 24,
                             "qk_nope_head_dim": 12, "qk_rope_head_dim": 6, "v_head_dim": 10,
                             "moe_intermediate_size": 20, "n_routed_experts": 12, "n_group": 3, "topk_group": 2,
                             "num_experts_per_tok": 3, "num_hidden_layers": 3, "vocab_size": 520}),
    "glm_fp8": dict(family="glm4_moe", fp8_block=[16, 32]),
}
TOKENS = np.array([5, 17, 3, 99, 4, 250, 5, 11], dtype=np.int64)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8_linear")
    return {name: write_mtp_layer_checkpoint(root / name, **kw) for name, kw in CHECKPOINTS.items()}


class WholeDequant(nn.Module):
    """The path Fp8Linear replaced: the whole weight dequantized to float32 once, then one F.linear."""

    def __init__(self, linear: Fp8Linear, scale_inv: np.ndarray | None = None):
        super().__init__()
        stored = linear.weight.numpy()
        scale = linear.scale_inv if scale_inv is None else scale_inv
        self.weight = torch.from_numpy(dequantize(stored, scale, linear.fp8_block, linear.name))
        self.bias = linear.bias

    def forward(self, x):
        return F.linear(x, self.weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))


def build(ckpt_dir: Path):
    ckpt = Checkpoint(ckpt_dir)
    impl = head_module(ckpt.family)
    head, rotary = impl.build_head(ckpt.config, impl.torch_weights(ckpt.read_head(widen=False)))
    return impl, ckpt, head, rotary


def fp8_linears(head: nn.Module) -> dict[str, Fp8Linear]:
    return {name: m for name, m in head.named_modules() if isinstance(m, Fp8Linear)}


def dense_fp8_names(ckpt: Checkpoint) -> set[str]:
    """The checkpoint's FP8 weights outside the routed experts (those are dequantized one expert at a time)."""
    return {n.removesuffix("weight_scale_inv") + "weight" for n in ckpt.names()
            if n.endswith("weight_scale_inv") and ".mlp.experts." not in n}


def inputs(ckpt: Checkpoint) -> TraceInputs:
    rng = np.random.default_rng(0)
    d = ckpt.config.hidden_size
    return TraceInputs(token_ids=TOKENS, positions=np.arange(len(TOKENS)),
                       hidden=rng.standard_normal((len(TOKENS), d)).astype(np.float32),
                       embed=rng.standard_normal((len(TOKENS), d)).astype(np.float32))


def replace(head: nn.Module, make) -> None:
    """Every Fp8Linear in `head` replaced by make(linear)."""
    for path, linear in fp8_linears(head).items():
        parent, _, leaf = path.rpartition(".")
        setattr(head.get_submodule(parent), leaf, make(linear))


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_every_dense_fp8_linear_stays_fp8(checkpoints, name):
    _, ckpt, head, _ = build(checkpoints[name])
    linears = fp8_linears(head)
    assert {m.name for m in linears.values()} == dense_fp8_names(ckpt)
    assert all(m.weight.dtype == torch.uint8 for m in linears.values())
    if name.startswith("glm"):  # the biased q_proj is FP8 too: its bias kept, in float32
        assert any(m.bias is not None for m in linears.values())


@pytest.mark.parametrize("rows", ["default", "smallest"])
@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_each_fp8_linear_equals_whole_dequant_bit_for_bit(checkpoints, name, rows, monkeypatch):
    if rows == "smallest":  # the smallest chunks (ALIGN rows): several where a linear is wide enough
        monkeypatch.setattr(Fp8Linear, "ROWS", 1)
    _, _, head, _ = build(checkpoints[name])
    chunked, could = 0, 0
    for path, linear in fp8_linears(head).items():
        could += linear.weight.shape[0] >= linear.rows + Fp8Linear.ALIGN
        chunked += len(linear.chunks) > 1
        reference = WholeDequant(linear)
        for t in (1, 7):
            x = torch.randn(1, t, linear.weight.shape[1], generator=torch.Generator().manual_seed(t))
            assert torch.equal(linear(x), reference(x)), (name, path, t)
        # float64 (oracle/noise.py's reference run): the same weight values, widened exactly; CPU float64 GEMMs
        # are not bit-stable under an output-row split (seen at 16-row blocks), and no trace is float64
        x = torch.randn(1, 7, linear.weight.shape[1], dtype=torch.float64)
        torch.testing.assert_close(linear(x), reference(x), rtol=1e-13, atol=1e-13)
    assert chunked == (could if rows == "smallest" else 0)  # GLM's and ds_odd's linears are one chunk each


@pytest.mark.parametrize("mode", ["batched", "stepwise"])
@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_trace_equals_the_dequantize_whole_head(checkpoints, name, mode, monkeypatch):
    """Every stage, bit for bit, against the same head with each Fp8Linear swapped for the whole dequant (the
    smallest chunks, so the row blocking is exercised where a linear is wide enough)."""
    monkeypatch.setattr(Fp8Linear, "ROWS", 1)
    impl, ckpt, head, rotary = build(checkpoints[name])
    run = impl.run_batched if mode == "batched" else impl.run_stepwise
    trace = run(head, rotary, inputs(ckpt))
    replace(head, WholeDequant)
    expected = run(head, rotary, inputs(ckpt))
    assert set(trace) == set(expected)
    for stage in trace:
        np.testing.assert_array_equal(trace[stage], expected[stage], err_msg=f"{name} {mode} {stage}")


@pytest.mark.parametrize("block", [(128, 128), (16, 32), (24, 40)])
def test_many_chunks_and_a_joined_tail_equal_whole_dequant(block, monkeypatch):
    """A linear wide enough for many chunks, its last chunk joined by a tail narrower than ALIGN rows, blocks that
    are not powers of two (chunks then start on multiples of lcm(block rows, ALIGN)), at 1 to 33 tokens."""
    monkeypatch.setattr(Fp8Linear, "ROWS", 200)
    rng = np.random.default_rng(block[0])
    out_features, in_features = 1000, 200
    stored = rng.integers(0, 256, (out_features, in_features), dtype=np.uint8)
    stored[(stored & 0x7F) == 0x7F] = 0x30  # no NaN patterns: NaN != NaN would fail equality for no reason
    scale = rng.uniform(0.5, 2.0, (-(-out_features // block[0]), -(-in_features // block[1]))).astype(np.float32)
    linear = Fp8Linear(torch.from_numpy(stored), torch.from_numpy(scale), block, name="w.weight")
    widths = [stop - start for start, stop in linear.chunks]
    assert len(widths) > 2 and min(widths) >= Fp8Linear.ALIGN and sum(widths) == out_features
    assert all(start % Fp8Linear.ALIGN == 0 and start % block[0] == 0 for start, _ in linear.chunks)
    reference = WholeDequant(linear)
    threads = torch.get_num_threads()
    for t in range(1, 41):
        x = torch.randn(1, t, in_features, generator=torch.Generator().manual_seed(t))
        threaded = linear(x), reference(x)
        # Bit for bit single-threaded. With two threads MKL's small GEMMs are not stable under a change of output
        # width: seen on a 2-core Sapphire Rapids, at 4-8 rows of x over K = 200 the whole 1000-row product and a
        # 192-row chunk each differ from their own single-threaded result (~3e-5 abs), so there the two paths agree
        # to float32 rounding only (a reference needs no more; the traces' layout and FP8 twins compare equal shapes)
        torch.set_num_threads(1)
        try:
            assert torch.equal(linear(x), reference(x)), t
        finally:
            torch.set_num_threads(threads)
        scale = threaded[1].abs().max().item()
        torch.testing.assert_close(threaded[0], threaded[1], rtol=0, atol=1e-6 * scale, msg=f"T={t}")


def test_a_wrong_scale_block_changes_the_output(checkpoints):
    """Twin: the comparison above sees a scale grid read one block row off (rolled), so equality is not vacuous."""
    _, _, head, _ = build(checkpoints["ds_fp8"])
    linear = fp8_linears(head)["layer.mtp_block.self_attn.o_proj"]
    assert linear.scale_inv.shape[0] > 1
    x = torch.randn(1, 5, linear.weight.shape[1], generator=torch.Generator().manual_seed(1))
    wrong = WholeDequant(linear, np.roll(linear.scale_inv, 1, axis=0))
    assert not torch.equal(linear(x), wrong(x))
    assert torch.equal(linear(x), WholeDequant(linear)(x))


def test_scale_grid_that_does_not_fit_is_refused_by_name(checkpoints):
    _, _, head, _ = build(checkpoints["ds_fp8"])
    linear = fp8_linears(head)["layer.mtp_block.self_attn.o_proj"]
    with pytest.raises(CheckpointError, match="o_proj.*weight_scale_inv"):
        Fp8Linear(linear.weight.data, torch.from_numpy(linear.scale_inv.T.copy()), linear.fp8_block,
                  name=linear.name)
    Fp8Linear(linear.weight.data, torch.from_numpy(linear.scale_inv), linear.fp8_block, name=linear.name)  # twin


# ---------------------------------------------------------------------------------------------------------------
# the Qwen heads' FP8 path (oracle/families/qwen3_5_stem.py dequantize_fp8) shares Fp8Weights, so it gets Fp8Linear too


@pytest.fixture(scope="module")
def qwen_pairs(tmp_path_factory):
    """(FP8 copy, its exactly dequantized float32 twin) of the dense tiny Qwen head (24 x 40 blocks: every grid
    ragged) and of Qwen3-Next (16 x 32 blocks, router and shared-expert gates quantised too)."""
    from tests.families.test_qwen_fp8 import CASES

    root = tmp_path_factory.mktemp("qwen_fp8_linear")
    return {case: CASES[case](root) for case in ("dense", "next")}


@pytest.mark.parametrize("case", ["dense", "next"])
def test_qwen_fp8_linears_stay_fp8_and_equal_whole_dequant(qwen_pairs, case, monkeypatch):
    monkeypatch.setattr(Fp8Linear, "ROWS", 1)
    fp8_dir, _ = qwen_pairs[case]
    _, ckpt, head, _ = build(fp8_dir)
    linears = fp8_linears(head)
    nn_linear_weights = {n for n, m in head.named_modules() if isinstance(m, (nn.Linear, Fp8Linear))}
    assert linears and all(m.weight.dtype == torch.uint8 for m in linears.values())
    # every FP8 linear weight of the head is an Fp8Linear (a router that is no nn.Linear is dequantized whole)
    assert {f"mtp.{p}.weight" for p in linears} == {n for n in dense_fp8_names(ckpt)
                                                    if n.removeprefix("mtp.").removesuffix(".weight")
                                                    in nn_linear_weights}
    for path, linear in linears.items():
        for t in (1, 7):
            x = torch.randn(1, t, linear.weight.shape[1], generator=torch.Generator().manual_seed(t))
            assert torch.equal(linear(x), WholeDequant(linear)(x)), (case, path, t)


def test_qwen_explain_variants_read_the_fp8_weights_value(qwen_pairs):
    """--explain's variants that rewrite a linear's rows (oracle/families/qwen3_5_explain.py) read an Fp8Linear's
    value, not its bytes: on the FP8 head they build the very weights they build on the dequantized twin's head."""
    from oracle import variants
    from oracle.families import qwen3_5_explain as qwen

    fp8_dir, deq_dir = qwen_pairs["dense"]
    ops = {}
    for which, path in (("fp8", fp8_dir), ("deq", deq_dir)):
        _, ckpt, head, rotary = build(path)
        ops[which] = qwen.StageOps(head, rotary, inputs(ckpt))
    assert isinstance(ops["fp8"].attn.q_proj, Fp8Linear)
    for variant in (qwen.qgate_halves, qwen.no_gate, qwen.rope_interleaved):
        fp8, deq = variant(ops["fp8"]).attn, variant(ops["deq"]).attn
        for name in ("q_proj", "k_proj", "o_proj"):  # rewritten (UpcastLinear) or untouched (still FP8)
            assert torch.equal(variants._weight(getattr(fp8, name)).float(),
                               variants._weight(getattr(deq, name)).float()), (variant.__name__, name)
        # twin: the bytes are not the weight (reading them would have rewritten nonsense)
        assert not torch.equal(ops["fp8"].attn.q_proj.weight.float(), variants._weight(ops["deq"].attn.q_proj).float())
