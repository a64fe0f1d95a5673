"""Routed experts for a MoE head, read and widened one at a time, only where the traced tokens route.

A 512-expert MTP layer is gigabytes of bf16 (or FP8), and a short trace touches a fraction of it. The official
experts module (transformers' eager experts forward) reads its weights only as `gate_up_proj[e]` and
`down_proj[e]`, for each expert e its tokens route to, in ascending order, each used at once in F.linear.
`RoutedExperts` gives it, in place of those two parameters, objects whose indexing returns expert e widened to
float32 (bf16 -> float32 is exact; FP8 is dequantized with its block scales, oracle/fp8.py) in a reused buffer: the
official forward runs unchanged, the result is bit-identical to a fully loaded float32 module, and memory holds two
experts in float32 instead of all of them.

Pipelined: the forward's pre-hook sees which experts it routes to (its `top_k_index`), so a thread reads, hashes and
widens the next expert into a second buffer while the forward multiplies by the current one (reads, the hash, the
FP8 kernel and the widening copy release the GIL). Reading, widening and the expert GEMMs then overlap instead of
adding up: at Qwen3-Next and DeepSeek-V3 scale they are most of an export's time. An expert asked for out of that
order (another forward, a patched module) is read on the spot.

Reading: an expert whose stored bytes lie in a file mapping (a checkpoint shard, mapped by oracle/checkpoint.py)
is read with os.preadv from that file into a reused staging buffer, not through the mapping: one copy from the page
cache at the sequential read rate, no page faults, and the resident set never holds the stored experts. Anything
else (tensors in ordinary memory) is read where it lies. Each part is hashed (`part_digest`, xxh3-128) the first
time it is read: the trace's experts digest then costs no second read of gigabytes of experts.
"""

import math
import os
import queue
import threading
import weakref

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_map

from oracle.errors import CheckpointError
from oracle.experts_digest import EXPERT_PARTS, part_digest
from oracle.families.spec import ExpertLayout
from oracle.fp8 import dequantize


ALIGN = 64  # output-row alignment of blocks (see output_row_blocks)
BLOCK_ROWS = 256  # output rows widened at a time for a matrix too large to widen whole in cache
BLOCKWISE_ABOVE = 1 << 20  # float32 bytes above which an expert matrix is widened a block at a time (measured
# faster at Qwen3-Next (8 MB, 4 MB) as well as DeepSeek-V3 (117 MB) scale; below it a block is about the matrix)


class _Slot:
    """One expert in float32 (gate_up [2I, D], gate rows first; down [D, I]) and the staging bytes it is read into."""

    def __init__(self, intermediate: int, hidden: int, staging_bytes: int):
        self.gate_up = torch.empty(2 * intermediate, hidden)  # allocated once: fresh buffers would fault every time
        self.down = torch.empty(hidden, intermediate)  # (pages of a buffer never widened into are never touched)
        self.staging = torch.empty(staging_bytes, dtype=torch.uint8)
        self.staged: dict[str, tuple[str | None, torch.Tensor]] = {}  # part -> (name, stored bytes as read)
        self.widened: set[str] = set()  # "gate_up" / "down" when whole in the float32 buffers
        self.expert: int | None = None


class RoutedExperts:
    """The routed experts of one MoE head. `fp8`: an object with `.fp8` (the names of FP8 weights), `.block` and
    `.scale(name)` (float32 block scales), for checkpoints whose per-expert weights are FP8; None for bf16/f16/f32."""

    def __init__(self, layout: ExpertLayout, weights: dict[str, torch.Tensor], fp8=None):
        self.layout = layout
        self.fp8 = fp8
        self._names = set(layout.tensor_names())
        missing = sorted(self._names - set(weights))
        if missing:
            raise ValueError(f"expert tensors missing from the weights: {missing[:3]}")
        self._weights = {n: weights[n] for n in self._names}
        self.touched: set[int] = set()  # every expert widened so far (the trace's routed set)
        self.part_digests: dict[tuple[int, str], str] = {}  # (expert, "gate"/"up"/"down") -> part_digest, once read
        self.activation_dtype = torch.float32  # of the forward in progress: a widened expert follows it (noise.py)
        # the largest of each part over all experts (a checkpoint may store experts in different dtypes)
        self._part_bytes = {p: max(self._stored_part(e, p)[1].nbytes for e in range(layout.num_experts))
                            for p in EXPERT_PARTS}
        self._slots = [_Slot(layout.intermediate, layout.hidden, sum(self._part_bytes.values())) for _ in range(2)]
        self._chunks = {which: self._chunk_plan(which) for which in ("gate_up", "down")}
        widest = max((stop - start) * (layout.hidden if which == "gate_up" else layout.intermediate)
                     for which, plan in self._chunks.items() if plan for start, stop in plan) if any(
            self._chunks.values()) else 0
        self._chunk = torch.empty(widest)  # one block of widened rows, reused (main thread only)
        self._files = _Files()
        self._pipeline: _Pipeline | None = None
        self._current: _Slot | None = None  # the slot whose buffer the forward holds now

    def owns(self, name: str) -> bool:
        return name in self._names

    def __deepcopy__(self, memo) -> "RoutedExperts":
        """A deep copy of a module these experts are attached to (a copied layer: a test's or a variant's) shares
        them: they are read-only stored bytes, so the copy computes what the original does (a copy would copy the
        open files, locks and threads)."""
        return self

    @staticmethod
    def parameter_names(prefix: str) -> set[str]:
        return {prefix + "gate_up_proj", prefix + "down_proj"}

    def attach(self, module: nn.Module) -> None:
        """Replace `module`'s gate_up_proj [E, 2I, D] and down_proj [E, D, I] by widening views."""
        for name in ("gate_up_proj", "down_proj"):
            if name in module._parameters:
                del module._parameters[name]
        object.__setattr__(module, "gate_up_proj", _Widened(self, "gate_up"))
        object.__setattr__(module, "down_proj", _Widened(self, "down"))
        module.register_forward_pre_hook(self._routed)
        module.register_forward_hook(self._done, always_call=True)  # also when the forward raises

    def _routed(self, module: nn.Module, args) -> None:
        """Before the official forward: start reading the experts it routes to, in the order it will ask."""
        self.activation_dtype = args[0].dtype
        self._stop()
        order = sorted(int(e) for e in torch.unique(args[1]).tolist() if 0 <= int(e) < self.layout.num_experts)
        if len(order) > 1:  # one expert: nothing to overlap with
            self._pipeline = _Pipeline(self, order)
            _ONE_CORE_FOR_READING.enter()

    def _done(self, module: nn.Module, args, output) -> None:
        self._stop()

    def _stop(self) -> None:
        if self._pipeline is not None:
            self._pipeline.stop()
            self._pipeline = None
            _ONE_CORE_FOR_READING.leave()
        self._current = None

    def expert(self, which: str, e: int) -> torch.Tensor:
        """Expert e's `gate_up` [2I, D] or `down` [D, I] as float32 (valid until another expert is asked for): the
        float32 buffer, widened whole, or for a matrix too large for the cache a `_Blockwise` view that F.linear
        widens a block of rows at a time."""
        if self._current is None or self._current.expert != e:
            self._current = self._slot_with(e)
        slot = self._current
        if self._chunks[which] is not None and self.activation_dtype == torch.float32:
            view = (slot.gate_up if which == "gate_up" else slot.down).as_subclass(_Blockwise)
            view._source = (self, slot, which, e)
            return view
        return self.whole(slot, which)

    def _slot_with(self, e: int) -> _Slot:
        if self._pipeline is not None:
            slot = self._pipeline.take(e, previous=self._current)
            if slot is not None:
                return slot
            self._stop()  # asked out of order: read on the spot from here on
        slot = self._slots[0]
        self.fill(e, slot)
        return slot

    def fill(self, e: int, slot: _Slot) -> None:
        """Read expert e's three parts (hashing each the first time) into `slot`, and widen into its float32 buffers
        the matrices that are used whole (the others are widened a block at a time by `linear`)."""
        slot.expert, slot.widened, slot.staged, offset = None, set(), {}, 0  # half-filled until the end
        for part in EXPERT_PARTS:
            name, stored = self._stored_part(e, part)
            stored = self._files.read(stored, slot.staging[offset:offset + self._part_bytes[part]])
            offset += self._part_bytes[part]
            if (e, part) not in self.part_digests:
                self.part_digests[(e, part)] = part_digest(_as_bytes(stored), _STORED_DTYPE[stored.dtype], stored.shape)
            slot.staged[part] = (name, stored)
        for which in ("gate_up", "down"):
            if self._chunks[which] is None:
                self._widen_rows(slot, which, 0, self._rows(which), self._buffer(slot, which))
                slot.widened.add(which)
        slot.expert = e
        self.touched.add(e)

    def whole(self, slot: _Slot, which: str) -> torch.Tensor:
        """`which` of the slot's expert widened whole into its float32 buffer (once)."""
        if which not in slot.widened:
            self._widen_rows(slot, which, 0, self._rows(which), self._buffer(slot, which))
            slot.widened.add(which)
        return self._buffer(slot, which)

    def linear(self, slot: _Slot, which: str, x: torch.Tensor) -> torch.Tensor:
        """F.linear(x, `which` of the slot's expert), widening a block of output rows at a time into one reused
        buffer that stays in cache, instead of writing the whole float32 matrix to memory and reading it back (at
        DeepSeek-V3 scale 176 MB per expert, three times the bytes of its FP8). The same bits: blocks are split as
        Fp8Linear's (ALIGN-aligned output rows, where the CPU GEMM is bit-stable)."""
        width = self.layout.hidden if which == "gate_up" else self.layout.intermediate
        out = x.new_empty(*x.shape[:-1], self._rows(which))
        for start, stop in self._chunks[which]:
            rows = self._chunk[: (stop - start) * width].view(stop - start, width)
            self._widen_rows(slot, which, start, stop, rows, forward_thread=True)
            out[..., start:stop] = F.linear(x, rows)
        return out

    def _rows(self, which: str) -> int:
        return 2 * self.layout.intermediate if which == "gate_up" else self.layout.hidden

    @staticmethod
    def _buffer(slot: _Slot, which: str) -> torch.Tensor:
        return slot.gate_up if which == "gate_up" else slot.down

    def _widen_rows(self, slot: _Slot, which: str, start: int, stop: int, out: torch.Tensor,
                    forward_thread: bool = False) -> None:
        """Rows start..stop of `which` (gate_up: the gate part's rows, then the up part's) into `out`."""
        parts = ((("gate", 0), ("up", self.layout.intermediate)) if which == "gate_up" else (("down", 0),))
        for part, first in parts:
            name, stored = slot.staged[part]
            lo, hi = max(start, first) - first, min(stop, first + stored.shape[0]) - first
            if lo < hi:
                self._widen(name, stored, lo, hi, out[lo + first - start: hi + first - start], forward_thread)

    def _chunk_plan(self, which: str) -> list[tuple[int, int]] | None:
        """The blocks of output rows `linear` widens at a time, or None where the matrix is widened whole: when its
        float32 fits in cache (BLOCKWISE_ABOVE bytes; the reading thread widens it then, beside the forward), or
        when an FP8 scale block would straddle the gate/up boundary."""
        width = self.layout.hidden if which == "gate_up" else self.layout.intermediate
        if self._rows(which) * width * 4 <= BLOCKWISE_ABOVE:
            return None
        block_rows = self.fp8.block[0] if self.fp8 is not None and self.fp8.fp8 else 1
        if which == "gate_up" and self.layout.intermediate % block_rows:
            return None
        step = math.lcm(block_rows, ALIGN)  # blocks start on a scale block's first row, and aligned
        return output_row_blocks(self._rows(which), max(step, BLOCK_ROWS // step * step))

    def _stored_part(self, e: int, part: str) -> tuple[str | None, torch.Tensor]:
        """(its tensor name, or None for a slice of a fused tensor; expert e's stored `part`)."""
        n = self.layout.names
        if self.layout.kind == "fused":
            if part == "down":
                return None, self._weights[n["down"]][e]
            gate_up = self._weights[n["gate_up"]][e]
            half = gate_up.shape[0] // 2
            return None, gate_up[:half] if part == "gate" else gate_up[half:]
        name = n[part].format(e=e)
        return name, self._weights[name]

    def _widen(self, name: str | None, stored: torch.Tensor, lo: int, hi: int, out: torch.Tensor,
               forward_thread: bool = False) -> None:
        """Rows lo..hi of a stored part -> float32 `out`: FP8 dequantized with its block scales (lo on a block's
        first row), anything else widened (exact). `forward_thread`: called on the forward's own thread, whose
        OpenMP team torch's vectorised copy may use (about 4x numpy's shift-and-widen for a bf16 block of 256 rows,
        measured at Qwen3-Next's shapes: 0.43 against 1.69 ms per gate_up matrix, GEMM included)."""
        if self.fp8 is not None and name in self.fp8.fp8:
            bo = self.fp8.block[0]
            dequantize(stored.numpy()[lo:hi], self.fp8.scale(name)[lo // bo: -(-hi // bo)], self.fp8.block, name,
                       out=out.numpy())
        elif forward_thread:  # bf16, f16, f32 -> float32: exact in any implementation
            out.copy_(stored[lo:hi])
        elif stored.dtype == torch.bfloat16:  # the float32 with these 16 high bits: exact
            bits = stored[lo:hi].view(torch.int16).numpy().view(np.uint16)
            np.left_shift(bits, 16, out=out.numpy().view(np.uint32), dtype=np.uint32)
        else:  # f16, f32: exact
            np.copyto(out.numpy(), stored[lo:hi].numpy(), casting="safe")
        # numpy, not torch's copy_: on the reading thread torch would start a second OpenMP team beside the
        # forward's (2 cores: 10x slower under load, measured); numpy widens on this thread alone.


def output_row_blocks(rows: int, block: int) -> list[tuple[int, int]]:
    """[start, stop) blocks of `block` output rows (a multiple of ALIGN) covering `rows`; a tail narrower than ALIGN
    joins the block before it. Blocks start on multiples of ALIGN and are at least ALIGN wide because the CPU GEMM
    is bit-stable under an output-row split only then: measured on this torch, a block 1-11 rows wide, or (one
    token) starting off a multiple of 4, reduces in another order."""
    blocks = [(start, min(start + block, rows)) for start in range(0, rows, block)]
    if len(blocks) > 1 and blocks[-1][1] - blocks[-1][0] < ALIGN:
        blocks[-2:] = [(blocks[-2][0], rows)]
    return blocks


class _Blockwise(torch.Tensor):
    """An expert matrix as the official forward receives it, when it is too large to widen whole in cache: F.linear
    on it widens it a block of rows at a time (`RoutedExperts.linear`); any other use widens it whole first. Only
    valid until another expert is asked for (as the widened buffers always were); a use after that is a bug here,
    refused rather than computed on another expert's bytes."""

    _source: tuple

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (func is F.linear and len(args) == 2 and not kwargs and type(args[1]) is cls
                and type(args[0]) is not cls and args[0].dtype == torch.float32):
            experts, slot, which, _ = args[1]._checked()
            return experts.linear(slot, which, args[0])
        args, kwargs = tree_map(lambda a: a._whole() if type(a) is cls else a, (args, kwargs))
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    def _checked(self) -> tuple:
        experts, slot, which, e = self._source
        if slot.expert != e:
            raise RuntimeError(f"routed expert {e}'s {which} used after another expert was read into its buffer")
        return self._source

    def _whole(self) -> torch.Tensor:
        experts, slot, which, _ = self._checked()
        return experts.whole(slot, which)


class _Widened:
    """Stands in for a fused experts parameter: `[e]` is expert e widened to float32 (valid until another expert is
    asked for; the official eager forward uses each at once in F.linear)."""

    def __init__(self, experts: RoutedExperts, which: str):
        self.experts, self.which = experts, which

    def __getitem__(self, index) -> torch.Tensor:
        widened, dtype = self.experts.expert(self.which, int(index)), self.experts.activation_dtype
        return widened if type(widened) is _Blockwise or widened.dtype == dtype else widened.to(dtype)


class _FewerTorchThreads:
    """torch computes on one thread fewer while any pipeline reads, and gets its thread count back when the last
    one stops. The reading thread needs a core of its own: with torch's default of one OpenMP thread per core the
    forward's second thread (busy, then spinning between parallel regions) took it, and the reads ran at half speed
    (Qwen3-Next scale, T=16: the forward waited 0.21 s for experts; with one thread fewer, 0.01 s). The count is
    process-wide, so pipelines of heads running at once (threads of a library caller) share one saved value: each
    restoring its own would leave the process at the reduced count."""

    def __init__(self):
        self._lock, self._active, self._saved = threading.Lock(), 0, None

    def enter(self) -> None:
        with self._lock:
            if self._active == 0:
                self._saved = torch.get_num_threads()
                torch.set_num_threads(max(1, self._saved - 1))
            self._active += 1

    def leave(self) -> None:
        with self._lock:
            self._active -= 1
            if self._active == 0:
                torch.set_num_threads(self._saved)


_ONE_CORE_FOR_READING = _FewerTorchThreads()


class _Pipeline:
    """Fills the experts of `order` into the two slots on one thread, one expert ahead of the forward."""

    def __init__(self, experts: RoutedExperts, order: list[int]):
        self.order, self.next = order, 0
        self.free: queue.Queue = queue.Queue()
        self.ready: queue.Queue = queue.Queue()
        for slot in experts._slots:
            self.free.put(slot)
        self.stopping = False
        self.thread = threading.Thread(target=self._run, args=(experts,), name="routed-experts", daemon=True)
        self.thread.start()

    def _run(self, experts: RoutedExperts) -> None:
        for e in self.order:
            slot = self.free.get()
            if self.stopping or slot is None:
                return
            try:
                experts.fill(e, slot)
            except BaseException as error:  # raised where the forward asks for this expert
                self.ready.put((e, slot, error))
                return
            self.ready.put((e, slot, None))

    def take(self, e: int, previous: _Slot | None) -> _Slot | None:
        """The slot holding expert e, once filled; None when e is not the next in order. `previous` (the forward is
        done with it) goes back to the thread."""
        if self.next >= len(self.order) or self.order[self.next] != e:
            return None
        if previous is not None:
            self.free.put(previous)
        got, slot, error = self.ready.get()
        self.next += 1
        if error is not None:
            raise error
        assert got == e and slot.expert == e  # the thread fills in order
        return slot

    def stop(self) -> None:
        """Let the thread finish the expert it is reading, and end it (no slot is filled after this returns)."""
        self.stopping = True
        self.free.put(None)
        self.thread.join()


class _Files:
    """Reads a tensor that lies in a file mapping from the file itself (os.preadv into a staging buffer)."""

    def __init__(self):
        self._maps = _file_mappings()  # (start, end, file offset, path, device, inode): shards are mapped before the head
        self._looked_again = False
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()
        weakref.finalize(self, _close_all, self._fds)

    def read(self, stored: torch.Tensor, staging: torch.Tensor) -> torch.Tensor:
        """`stored`'s bytes read from its file into `staging`, viewed as `stored` (dtype, shape); `stored` itself
        when it is not a contiguous tensor in a file mapping (ordinary memory: nothing to read)."""
        nbytes = stored.numel() * stored.element_size()
        where = self._extent(stored.data_ptr(), nbytes) if stored.is_contiguous() and nbytes else None
        if where is None:
            return stored
        path, offset, device, inode = where
        fd = self._fd(path, device, inode)
        if fd is None:  # that path is no longer the mapped file (replaced, deleted, an escaped name): use the mapping
            return stored
        if _written_in_place(stored.data_ptr(), nbytes):  # a caller edited the mapped weights: the file lacks it
            return stored
        view, done = memoryview(staging.numpy())[:nbytes], 0
        while done < nbytes:
            try:
                got = os.preadv(fd, [view[done:]], offset + done)
            except OSError as error:
                raise CheckpointError(f"{path}: reading a routed expert failed ({error.strerror}); check the "
                                      f"disk and re-copy the shard.") from None
            if got <= 0:
                raise CheckpointError(f"{path} ended inside a routed expert (byte {offset + done}); re-copy the "
                                      f"shard.")
            done += got
        return staging[:nbytes].view(stored.dtype).view(stored.shape)

    def _extent(self, start: int, nbytes: int) -> tuple[str, int] | None:
        for lo, hi, offset, path, device, inode in self._maps:
            if lo <= start and start + nbytes <= hi:
                return path, offset + (start - lo), device, inode
        with self._lock:
            if self._looked_again:  # tensors in ordinary memory: /proc/self/maps is not read for each of them
                return None
            self._looked_again, self._maps = True, _file_mappings()  # a shard mapped after the first look
        return self._extent(start, nbytes)

    def _fd(self, path: str, device: tuple[int, int], inode: int) -> int | None:
        """An open descriptor of `path` if it is still the mapped file (same device and inode), else None."""
        with self._lock:
            if path not in self._fds:
                try:
                    fd = os.open(path, os.O_RDONLY)
                except OSError:
                    fd = None
                if fd is not None:
                    st = os.fstat(fd)
                    if (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino) != (*device, inode):
                        os.close(fd)
                        fd = None
                self._fds[path] = fd
            return self._fds[path]


_PAGE = os.sysconf("SC_PAGE_SIZE")
_PRESENT, _SWAPPED, _FILE_PAGE = 1 << 63, 1 << 62, 1 << 61  # /proc/self/pagemap entry bits (Documentation/admin-guide/mm/pagemap.rst)


def _written_in_place(start: int, nbytes: int) -> bool:
    """Whether any page of [start, start + nbytes), part of a private file mapping, was written in this process.

    Shards are mapped copy-on-write, so a library caller may edit a weight in place (its tensors share the
    mapping); the written page is then this process's own (anonymous: present without the file-page bit, or
    swapped out), and the file no longer holds what the head is asked to compute with. Reading the file would
    silently drop the edit, so such a part is read through memory. /proc/self/pagemap gives these flags to any
    process about itself (only the frame numbers need privileges); where it cannot be read, the file is read, as
    before."""
    first, last = start // _PAGE, (start + nbytes - 1) // _PAGE
    try:
        fd = os.open("/proc/self/pagemap", os.O_RDONLY)
    except OSError:
        return False
    try:
        entries = os.pread(fd, 8 * (last - first + 1), 8 * first)
    except OSError:
        return False
    finally:
        os.close(fd)
    flags = np.frombuffer(entries, dtype=np.uint64)
    present = (flags & np.uint64(_PRESENT)) != 0
    anonymous = present & ((flags & np.uint64(_FILE_PAGE)) == 0)
    return bool(anonymous.any() or ((flags & np.uint64(_SWAPPED)) != 0).any())


def _close_all(fds: dict[str, int]) -> None:
    for fd in fds.values():
        if fd is not None:
            os.close(fd)


def _file_mappings() -> list[tuple[int, int, int, str]]:
    """(start, end, file offset, path, (major, minor), inode) of this process's mappings of regular files that still exist
    (/proc/self/maps); none where it cannot be read: everything is then read through memory."""
    found = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].startswith("/") and not fields[5].endswith("(deleted)\n"):
                    lo, hi = (int(x, 16) for x in fields[0].split("-"))
                    major, minor = (int(x, 16) for x in fields[3].split(":"))
                    found.append((lo, hi, int(fields[2], 16), fields[5].rstrip("\n"), (major, minor), int(fields[4])))
    except OSError:
        return []
    return found


# a stored part's safetensors dtype, as Checkpoint.experts_digest reads it from the header (FP8 bytes are uint8 here)
_STORED_DTYPE = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.uint8: "F8_E4M3"}


def _as_bytes(stored: torch.Tensor) -> np.ndarray:
    """A stored tensor's bytes (bf16 has no numpy dtype: viewed as uint8 first)."""
    stored = stored.contiguous()
    return stored.reshape(-1).view(torch.uint8).numpy()


def routed_experts_of(module: nn.Module) -> list[RoutedExperts]:
    """The RoutedExperts behind every experts module inside `module` (a head)."""
    found = []
    for child in module.modules():
        widened = child.__dict__.get("gate_up_proj")
        if isinstance(widened, _Widened) and widened.experts not in found:
            found.append(widened.experts)
    return found
