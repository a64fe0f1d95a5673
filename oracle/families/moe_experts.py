"""Routed experts for a MoE head, read and widened one at a time, only where the traced tokens route.

A 512-expert MTP layer is gigabytes of bf16, and a short trace touches a fraction of it. The official experts
module (transformers' eager experts forward) reads its weights only as `gate_up_proj[e]` and `down_proj[e]`, for
each expert e its tokens route to. `RoutedExperts` gives it, in place of those two parameters, objects whose
indexing widens expert e's stored (mapped) checkpoint tensors into one reused float32 buffer each, exactly as
`UpcastLinear` widens a dense weight block by block: the official forward runs unchanged, the result is
bit-identical to a fully loaded float32 module (bf16 -> float32 is exact), and memory holds one expert in float32
instead of all of them. Each expert's mapped pages are populated in one call and released once widened (only
file-backed ranges), so the resident set does not keep the stored experts either. Each part is hashed
(`part_digest`, xxh3-128) the first time it is read, while its pages are populated: the trace's experts digest
then costs no second read of gigabytes of experts (it was a sha256 pass of its own, which doubled the export's
time at Qwen3-Next scale).
"""

import ctypes
import mmap

import torch
from torch import nn

from oracle.experts_digest import part_digest
from oracle.families.spec import ExpertLayout

_LIBC = ctypes.CDLL(None, use_errno=True)
_MADV_DONTNEED, _MADV_POPULATE_READ = 4, 22


class RoutedExperts:
    def __init__(self, layout: ExpertLayout, weights: dict[str, torch.Tensor]):
        self.layout = layout
        self._names = set(layout.tensor_names())
        missing = sorted(self._names - set(weights))
        if missing:
            raise ValueError(f"expert tensors missing from the weights: {missing[:3]}")
        self._weights = {n: weights[n] for n in self._names}
        self.touched: set[int] = set()  # every expert widened so far (the trace's routed set)
        self.part_digests: dict[tuple[int, str], str] = {}  # (expert, "gate"/"up"/"down") -> part_digest, once read
        self.activation_dtype = torch.float32  # of the forward in progress: a widened expert follows it (noise.py)
        i, d = layout.intermediate, layout.hidden
        self._gate_up = torch.empty(2 * i, d)  # allocated once: fresh buffers would fault in pages every time
        self._down = torch.empty(d, i)
        self._file_backed = _file_mappings()

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
        """Replace `module`'s gate_up_proj [E, 2I, D] and down_proj [E, D, I] by widening views."""
        for name in ("gate_up_proj", "down_proj"):
            if name in module._parameters:
                del module._parameters[name]
        object.__setattr__(module, "gate_up_proj", _Widened(self, "gate_up"))
        object.__setattr__(module, "down_proj", _Widened(self, "down"))
        module.register_forward_pre_hook(self._routed)

    def _routed(self, module: nn.Module, args) -> None:
        self.activation_dtype = args[0].dtype

    def widen(self, which: str, e: int) -> torch.Tensor:
        """Expert e's `gate_up` [2I, D] (gate rows first) or `down` [D, I] in float32, in the reused buffer."""
        gate, up, down = self.parts(e)
        if which == "gate_up":
            _populate(gate, self._file_backed), _populate(up, self._file_backed)
            self.hash_part(e, "gate", gate), self.hash_part(e, "up", up)
            half = gate.shape[0]
            self._gate_up[:half].copy_(gate)
            self._gate_up[half:].copy_(up)
            _release(gate, self._file_backed), _release(up, self._file_backed)
            self.touched.add(e)
            return self._gate_up
        _populate(down, self._file_backed)
        self.hash_part(e, "down", down)
        self._down.copy_(down)
        _release(down, self._file_backed)
        return self._down


    def hash_part(self, e: int, part: str, stored: torch.Tensor) -> None:
        """Record `part_digest` of expert e's stored part (its bytes as the checkpoint holds them), once."""
        if (e, part) not in self.part_digests:
            raw = stored.contiguous().view(torch.uint8) if stored.dim() else stored.reshape(1).view(torch.uint8)
            self.part_digests[(e, part)] = part_digest(raw.numpy())


class _Widened:
    """Stands in for a fused experts parameter: `[e]` is expert e widened to float32 (valid until the next `[e]`;
    the official eager forward uses each at once in F.linear)."""

    def __init__(self, experts: RoutedExperts, which: str):
        self.experts, self.which = experts, which

    def __getitem__(self, index) -> torch.Tensor:
        widened, dtype = self.experts.widen(self.which, int(index)), self.experts.activation_dtype
        return widened if widened.dtype == dtype else widened.to(dtype)


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
        return []  # unknown: never advise anything
    return ranges


def _pages(stored: torch.Tensor, file_backed: list[tuple[int, int]]) -> tuple[int, int] | None:
    """The whole pages inside a tensor that lies in a file mapping (a checkpoint shard), else None."""
    start, size = stored.data_ptr(), stored.numel() * stored.element_size()
    if not any(lo <= start and start + size <= hi for lo, hi in file_backed):
        return None
    first = (start + mmap.PAGESIZE - 1) // mmap.PAGESIZE * mmap.PAGESIZE
    last = (start + size) // mmap.PAGESIZE * mmap.PAGESIZE
    return (first, last - first) if last > first else None


def _populate(stored: torch.Tensor, file_backed) -> None:
    """Map a stored expert's pages in one call (MADV_POPULATE_READ, Linux >= 5.14) instead of a fault per page.
    Best effort: without it the copy faults them in."""
    pages = _pages(stored, file_backed)
    if pages:
        _LIBC.madvise(ctypes.c_void_p(pages[0]), ctypes.c_size_t(pages[1]), _MADV_POPULATE_READ)


def _release(stored: torch.Tensor, file_backed) -> None:
    """Let the kernel drop a widened expert's mapped pages (re-read from the page cache if touched again). Only
    file-backed ranges: on anonymous memory MADV_DONTNEED would zero the data."""
    pages = _pages(stored, file_backed)
    if pages:
        _LIBC.madvise(ctypes.c_void_p(pages[0]), ctypes.c_size_t(pages[1]), _MADV_DONTNEED)


def routed_experts_of(module: nn.Module) -> list[RoutedExperts]:
    """The RoutedExperts behind every experts module inside `module` (a head)."""
    found = []
    for child in module.modules():
        widened = child.__dict__.get("gate_up_proj")
        if isinstance(widened, _Widened) and widened.experts not in found:
            found.append(widened.experts)
    return found
