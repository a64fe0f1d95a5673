"""Torch building blocks every family shares (none of them is a family's own): the linears that keep a weight as
stored and widen (bf16: UpcastLinear) or dequantize (FP8 with block scales: Fp8Linear, Fp8Weights,
RoutedFp8Experts) it a block of output rows at a time right before the matmul, the float32 widening of the other
parameters, the causal mask, the trace inputs as (1, T, ·) tensors and back, and the router's selection margin.

Why a module of its own: these lived in the Qwen3.5 family file and the MtpLayer family file, and each family
imported the other's (the only import circle among the families)."""

import math
import threading

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from oracle.errors import CheckpointError
from oracle.families.moe_experts import ALIGN, RoutedExperts, output_row_blocks
from oracle.fp8 import check_scale_shape, dequantize
from oracle.trace import TraceInputs

Stages = dict[str, torch.Tensor]


class UpcastLinear(nn.Module):
    """A bias-free linear whose weight stays in the checkpoint's dtype (bf16: half the memory of float32) and is
    widened to float32 exactly, a block of output rows at a time into a reused buffer, right before the matmul.

    It computes F.linear(x, weight.float()) without ever holding the float32 weight; the output is bit-identical
    to it (tests/oracle/test_head.py), because each output column reduces over the same K as before. Blocks are
    whole multiples of UNIT rows: the BLAS then lays every column out as for the whole weight (a block of 819 rows
    changed the low bits). UNIT rows per block below LARGE_FROM rows of x; from there, blocks of about LARGE_BLOCK
    weights: a compute-bound matmul re-packs x on every call, so fewer, larger calls (Qwen3.5-27B-shaped head,
    T=1024: 4.37 s against 4.59 s; at T=169 the large blocks were 8% slower). Each block's product is copied into
    its columns (an `out=` view with the full row stride made MKL 5-10% slower at T=32 and T=169).
    """

    UNIT = 256
    LARGE_BLOCK = 1 << 24  # elements: 64 MB of float32
    LARGE_FROM = 512  # rows of x

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)

    def block_rows(self, x_rows: int) -> int:
        """Output rows widened per matmul: a multiple of UNIT, the whole weight at most."""
        out_features, in_features = self.weight.shape
        units = max(1, self.LARGE_BLOCK // (self.UNIT * max(in_features, 1))) if x_rows >= self.LARGE_FROM else 1
        return min(out_features, self.UNIT * units)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out_features, in_features = self.weight.shape
        out = x.new_empty(*x.shape[:-1], out_features)
        step = self.block_rows(x.numel() // max(in_features, 1))
        block = _widening_buffer(step * in_features)[: step * in_features].view(step, in_features)
        for start in range(0, out_features, step):
            stop = min(start + step, out_features)
            rows = block[: stop - start]
            rows.copy_(self.weight[start:stop])  # exact widening: bf16 is the top half of a float32
            # the weight follows activations of another dtype (oracle/noise.py runs the head in float64, bf16, fp16)
            out[..., start:stop] = F.linear(x, rows if x.dtype == rows.dtype else rows.to(x.dtype))
        return out


_WIDENING = threading.local()


def _widening_buffer(elements: int) -> torch.Tensor:
    """One float32 buffer per thread, shared by every UpcastLinear and grown to the largest block asked for:
    allocated once (a fresh one per call would pay its page faults on every matmul), not one per linear."""
    buffer = getattr(_WIDENING, "buffer", None)
    if buffer is None or buffer.numel() < elements:
        with torch.inference_mode(False):  # a normal tensor: an inference one could not be written outside the mode
            buffer = _WIDENING.buffer = torch.empty(elements, dtype=torch.float32)
    return buffer


def widen_non_linear_parameters(module: nn.Module) -> None:
    """Parameters outside an nn.Linear (e.g. a MoE router's [E, D] weight) become float32 (exact from bf16);
    nn.Linear weights stay stored and are widened block-wise by UpcastLinear."""
    for child in module.modules():
        if isinstance(child, nn.Linear):
            continue
        for name, param in child.named_parameters(recurse=False):
            if not param.is_meta and param.dtype != torch.float32:
                setattr(child, name, nn.Parameter(param.float(), requires_grad=False))


def upcast_linears(module: nn.Module, fp8: dict[str, nn.Module] | None = None, prefix: str = "") -> None:
    """Replace every nn.Linear under `module` (official modules included) by an UpcastLinear on its weight, or by
    the Fp8Linear in `fp8` under its weight's name (FP8 bytes stay FP8: dequantized in row blocks in use)."""
    for name, child in module.named_children():
        if isinstance(child, nn.Linear):
            setattr(module, name, (fp8 or {}).get(f"{prefix}{name}.weight") or UpcastLinear(child.weight.data))
        else:
            upcast_linears(child, fp8, f"{prefix}{name}.")


def is_linear_weight(module: nn.Module, key: str) -> bool:
    """`key` (a parameter name) is the weight of an nn.Linear under `module` (built on meta: nothing loaded)."""
    path, _, leaf = key.rpartition(".")
    try:
        return leaf == "weight" and isinstance(module.get_submodule(path), nn.Linear)
    except AttributeError:  # no such module: load_state_dict reports the name as unexpected
        return False


def causal_mask(num_steps: int) -> torch.Tensor:
    """Additive mask (1, 1, T, T): step i attends to steps 0..i of the head's own KV."""
    blocked = torch.triu(torch.ones(num_steps, num_steps, dtype=torch.bool), diagonal=1)
    return torch.zeros(num_steps, num_steps).masked_fill(blocked, torch.finfo(torch.float32).min)[None, None]


def step_tensors(inputs: TraceInputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    embed = torch.from_numpy(inputs.embed)[None]  # (T, D) -> (1, T, D)
    hidden = torch.from_numpy(inputs.hidden)[None]  # (T, D) -> (1, T, D)
    positions = torch.from_numpy(inputs.positions)[None]  # (T,) -> (1, T)
    return embed, hidden, positions


def to_numpy(stages: Stages) -> dict[str, np.ndarray]:
    return {name: rows[0].numpy() for name, rows in stages.items()}  # (1, T, w) -> (T, w)


def selection_margin(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Per token, how far the k-th selected expert's score lies above the best unselected one ((N, 1); inf when
    every expert is selected). Softmax is monotone, so for a softmax top-k router this is in router-logit units;
    the probe calls a topk_ids flip a near-tie where it is within the router_logits tolerance."""
    if k >= scores.shape[-1]:
        return torch.full((scores.shape[0], 1), float("inf"))
    top = torch.topk(scores.float(), k + 1, dim=-1).values
    return (top[:, k - 1] - top[:, k])[:, None]


FP8_SCALE = "weight_scale_inv"


class Fp8Weights:
    """Dequantizes FP8 linears with their block scales; checks every FP8 weight has a scale and every scale an FP8
    weight."""

    def __init__(self, weights: dict[str, torch.Tensor], block: tuple[int, int] | None):
        self.weights, self.block = weights, tuple(block or (128, 128))
        fp8 = {n for n, t in weights.items() if t.dtype == torch.uint8}  # F8_E4M3 bit patterns (torch_weights)
        scales = {n for n in weights if n.endswith(FP8_SCALE)}
        unscaled = sorted(n for n in fp8 if n.removesuffix("weight") + FP8_SCALE not in scales)
        orphan = sorted(s for s in scales if s.removesuffix(FP8_SCALE) + "weight" not in fp8)
        if unscaled or orphan:
            raise CheckpointError(f"FP8 weights without weight_scale_inv {unscaled[:3]}, or weight_scale_inv beside a "
                                  f"weight that is not F8_E4M3 {orphan[:3]}: the checkpoint is inconsistent.")
        self.fp8 = fp8

    def scale(self, name: str) -> np.ndarray:
        """The float32 block scales of the FP8 weight `name`."""
        return np.ascontiguousarray(self.weights[name.removesuffix("weight") + FP8_SCALE].float().numpy())

    def value(self, name: str) -> torch.Tensor:
        """The weight the model means: FP8 dequantized to float32, anything else as stored."""
        t = self.weights[name]
        if name not in self.fp8:
            return t
        scale = self.weights[name.removesuffix("weight") + FP8_SCALE]
        return torch.from_numpy(dequantize(t.numpy(), scale.numpy(), self.block, name))

    def linear(self, name: str, bias: torch.Tensor | None = None) -> "Fp8Linear":
        """The FP8 weight `name` as a linear that dequantizes it in row blocks in use (never whole)."""
        return Fp8Linear(self.weights[name], self.weights[name.removesuffix("weight") + FP8_SCALE], self.block, bias,
                         name)


class Fp8Linear(nn.Module):
    """A linear whose weight stays FP8 as stored (e4m3 bytes, mapped) beside its block scales, dequantized a block
    of output rows at a time (whole scale blocks, about ROWS rows) into one reused float32 buffer right before the
    matmul, as UpcastLinear widens bf16.

    It computes F.linear(x, dequantize(weight, scale_inv), bias) without ever holding the float32 weight, with the
    same bits: each output column reduces over the same K in the same order (tests/families/test_fp8_linear.py,
    and at DeepSeek-V3's shapes in scripts/bench_moe.py --fp8-linear). Why: dequantizing the head's dense FP8
    linears whole into fresh float32 arrays cost ~1.7 s of a 6.5 s DeepSeek-V3-scale export, nearly all first-touch
    page faults (o_proj: 1.08 s into a fresh array, 25 ms into an already-written one), and held ~750 MB.
    """

    ROWS = 1024
    # Every chunk starts on a multiple of ALIGN output rows and is at least ALIGN wide (a narrower tail joins the
    # chunk before it), because the CPU GEMM is bit-stable under an output-row split only then: measured on this
    # torch, a chunk 1-11 rows wide, or (one token) starting off a multiple of 4, reduces in another order.
    ALIGN = ALIGN

    def __init__(self, stored: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                 bias: torch.Tensor | None = None, name: str = "weight"):
        super().__init__()
        if stored.dim() != 2 or stored.dtype != torch.uint8:
            raise CheckpointError(f"{name}: an FP8 weight must be 2-D e4m3 bytes, found {stored.dtype} "
                                  f"{tuple(stored.shape)}.")
        check_scale_shape(tuple(stored.shape), tuple(scale_inv.shape), block, name)
        self.weight = nn.Parameter(stored, requires_grad=False)  # uint8: head.to(dtype) leaves it as stored
        self.bias = None if bias is None else nn.Parameter(bias.data.float(), requires_grad=False)
        # plain attributes, not buffers: head.to(dtype) (oracle/noise.py) must not round the scales or the buffer
        self.scale_inv = np.ascontiguousarray(scale_inv.numpy(), dtype=np.float32)
        self.fp8_block, self.name = tuple(block), name
        step = math.lcm(block[0], self.ALIGN)  # chunks start on a scale block's first row, and aligned
        self.rows = max(step, self.ROWS // step * step)
        self.chunks = self._chunks(stored.shape[0])
        # Allocated once: a fresh buffer per call would pay its page faults on every matmul.
        self.buffer = torch.empty(max(stop - start for start, stop in self.chunks), stored.shape[1],
                                  dtype=torch.float32)

    def _chunks(self, out_features: int) -> list[tuple[int, int]]:
        return output_row_blocks(out_features, self.rows)  # the routed experts' blocks: the same alignment rule

    def value(self) -> torch.Tensor:
        """The whole float32 weight the model means (for a variant that rewrites it; never in the forward)."""
        return torch.from_numpy(dequantize(self.weight.numpy(), self.scale_inv, self.fp8_block, self.name))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        stored, bo = self.weight.numpy(), self.fp8_block[0]
        out = x.new_empty(*x.shape[:-1], stored.shape[0])
        for start, stop in self.chunks:
            rows = self.buffer[: stop - start]
            dequantize(stored[start:stop], self.scale_inv[start // bo: -(-stop // bo)], self.fp8_block, self.name,
                       out=rows.numpy())
            # the weight follows activations of another dtype (oracle/noise.py runs the head in float64, bf16, fp16)
            weight = rows if x.dtype == rows.dtype else rows.to(x.dtype)
            bias = None if self.bias is None else self.bias[start:stop].to(x.dtype)
            out[..., start:stop] = F.linear(x, weight, bias)
        return out


class RoutedFp8Experts(RoutedExperts):
    """Routed experts widened (bf16) or dequantized (FP8, with their weight_scale_inv), one expert at a time, only
    where tokens route (oracle/families/moe_experts.py)."""

    def __init__(self, layout, weights: dict, fp8: Fp8Weights):
        super().__init__(layout, weights, fp8)
