"""Routed experts for a MoE head, read and widened only where the traced tokens route.

A 512-expert MTP layer is gigabytes of bf16, and a short trace touches a fraction of it. The official experts
module (transformers' eager experts forward: for each expert hit, `F.linear(x, gate_up_proj[e])`, ...) reads only
the experts its tokens route to; `RoutedExperts` keeps the stored (mapped) checkpoint tensors and, in a forward
pre-hook that sees the routing, fills the module's two fused float32 parameters for exactly those experts: the
rest of each parameter is allocated but never touched (no memory is committed for it), and both are released after
the forward. Widening bf16 -> float32 is exact, so the result is bit-identical to a fully loaded float32 module.
"""

import ctypes
import mmap

import torch
from torch import nn

from oracle.families.spec import ExpertLayout


class RoutedExperts:
    def __init__(self, layout: ExpertLayout, weights: dict[str, torch.Tensor]):
        self.layout = layout
        self._names = set(layout.tensor_names())
        missing = sorted(self._names - set(weights))
        if missing:
            raise ValueError(f"expert tensors missing from the weights: {missing[:3]}")
        self._weights = {n: weights[n] for n in self._names}
        self.touched: set[int] = set()  # every expert widened so far (the trace's routed set)

    def owns(self, name: str) -> bool:
        return name in self._names

    @staticmethod
    def parameter_names(prefix: str) -> set[str]:
        return {prefix + "gate_up_proj", prefix + "down_proj"}

    def parts(self, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Expert e's stored gate [I, D], up [I, D], down [D, I]."""
        if self.layout.kind == "fused":
            gate_up = self._weights[self.layout.names["gate_up"]][e]
            half = gate_up.shape[0] // 2
            return gate_up[:half], gate_up[half:], self._weights[self.layout.names["down"]][e]
        n = self.layout.names
        return tuple(self._weights[n[p].format(e=e)] for p in ("gate", "up", "down"))

    def attach(self, module: nn.Module) -> None:
        """Fill `module`'s gate_up_proj [E, 2I, D] and down_proj [E, D, I] for the routed experts of each call."""
        module.register_forward_pre_hook(self._fill)
        module.register_forward_hook(self._release)

    def _fill(self, module: nn.Module, args) -> None:
        top_k_index = args[1]
        e, i, d = self.layout.num_experts, self.layout.intermediate, self.layout.hidden
        gate_up = torch.empty(e, 2 * i, d)  # committed only where written: the routed experts
        down = torch.empty(e, d, i)
        file_backed = _file_mappings()
        for expert in torch.unique(top_k_index).tolist():
            gate, up, dn = self.parts(expert)
            gate_up[expert, :i].copy_(gate)  # gate rows first, as the fused layout and the official forward use
            gate_up[expert, i:].copy_(up)
            down[expert].copy_(dn)
            for part in (gate, up, dn):
                _drop_pages(part, file_backed)  # widened: the stored copy's mapped pages need not stay resident
            self.touched.add(int(expert))
        module.gate_up_proj = nn.Parameter(gate_up, requires_grad=False)
        module.down_proj = nn.Parameter(down, requires_grad=False)

    def _release(self, module: nn.Module, args, output) -> None:
        e, i, d = self.layout.num_experts, self.layout.intermediate, self.layout.hidden
        module.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, d, device="meta"), requires_grad=False)
        module.down_proj = nn.Parameter(torch.empty(e, d, i, device="meta"), requires_grad=False)


_LIBC = ctypes.CDLL(None, use_errno=True)
_MADV_DONTNEED = 4


def _file_mappings() -> list[tuple[int, int]]:
    """Address ranges of this process's file-backed mappings (/proc/self/maps lines with a path)."""
    ranges = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].startswith("/"):
                    lo, hi = (int(x, 16) for x in fields[0].split("-"))
                    ranges.append((lo, hi))
    except OSError:
        return []  # unknown: never drop anything
    return ranges


def _drop_pages(stored: torch.Tensor, file_backed: list[tuple[int, int]]) -> None:
    """Let the kernel drop the whole pages of a tensor that lies in a file mapping (a checkpoint shard, mapped
    copy-on-write and never written): they are re-read from the file (page cache) if touched again. Without it a
    MoE export's resident set holds every routed expert twice (mapped bf16 and widened float32). Only file-backed
    ranges: on anonymous memory MADV_DONTNEED would zero the data. Best effort: a failure leaves pages resident."""
    start, size = stored.data_ptr(), stored.numel() * stored.element_size()
    if not any(lo <= start and start + size <= hi for lo, hi in file_backed):
        return
    first = (start + mmap.PAGESIZE - 1) // mmap.PAGESIZE * mmap.PAGESIZE  # whole pages inside the tensor only
    last = (start + size) // mmap.PAGESIZE * mmap.PAGESIZE
    if last > first:
        _LIBC.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), _MADV_DONTNEED)
