"""Reading an MTP checkpoint directory in the HF release layout, without transformers (and without torch).

A checkpoint is `config.json` (flat, or nested under `text_config`) plus either one `model.safetensors` or shards
listed in `model.safetensors.index.json`. The family (oracle/families/registry.py) says which tensors are the
head's and how they are laid out; only what the head needs is read: its tensors (mapped, so a MoE head's experts
are read only where a traced token routes to them) and the embedding rows of the requested token ids, located from
the safetensors headers and read with `os.pread` (a real embedding is 248320 x 5120: it is never read whole).

What is read is what is hashed. The head's dense tensors are read once with `os.pread` into private memory, and both
the head and its digest use those bytes, so a shard rewritten in place while an export runs can never give stages
of new weights under the digest of the old. Reading with pread also means a shard truncated meanwhile is a short
read (CheckpointError naming the file), where a mapped page past the new end would kill the process (SIGBUS). So
is every other read here: the lm_head's vocabulary chunks and rows (`stored_rows`, `stored_rows_at`, for acceptance
and the draft stage), expert slices (`expert_parts`), routed experts when widened. Only the routed experts of an
unwidened head stay mapped, and only as addresses: oracle/families/moe_experts.py reads their bytes from the file
with pread too (and hashes them as read). `check_unchanged` says whether any shard changed since it was opened
(export and accept refuse to write a result then).
"""

import hashlib
import json
import math
import mmap
import os
import re
import struct
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash

from oracle import gguf_source
from oracle.errors import CheckpointError, InputError
from oracle.experts_digest import EXPERT_PARTS, TYPED, experts_digest_of, part_record
from oracle.families.registry import detect
from oracle.families.spec import FamilySpec, HeadConfig, TensorLayout
from oracle.fp8 import E4M3, decode_e4m3, dequantize
from oracle.reading import check_regular_file, read_json

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
E8M0 = "F8_E8M0"  # UE8M0 block scales (DeepSeek-V4 `.scale`): 2^(bits - 127), 255 is NaN
_ITEMSIZE = {"BF16": 2, "F16": 2, "F32": 4, E4M3: 1, E8M0: 1}
# numpy has no bfloat16 or float8: keep their bit patterns (FP8 block scales are applied by oracle/fp8.py)
_STORED_NUMPY = {"BF16": "<u2", "F16": "<f2", "F32": "<f4", E4M3: "u1", E8M0: "u1"}


@dataclass(frozen=True)
class TensorEntry:
    name: str
    file: Path
    dtype: str
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the first element in `file`
    nbytes: int


@dataclass(frozen=True)
class HeadWeights:
    tensors: dict[str, np.ndarray]  # checkpoint name -> array (float32, or as stored: see dtypes)
    dtypes: dict[str, str]  # checkpoint name -> "F32", "F16", "BF16" (uint16 bit patterns) or "F8_E4M3" (uint8)
    digest: str | None  # Checkpoint.head_digest(); None when read_head(digest=False)
    layout: TensorLayout | None = None  # which tensors these are (dense + the experts' layout)


class Checkpoint:
    """An opened checkpoint directory: its head config and a map from tensor name to where its bytes lie."""

    def __init__(self, path: Path):
        self.path = gguf_source.checkpoint_dir(Path(path))  # a GGUF: dequantized once into a cache folder
        self.source = gguf_source.source_of(self.path)  # {"format": "safetensors"} or the GGUF's record
        if not self.path.is_dir():
            raise CheckpointError(f"checkpoint {self.path} is not a directory; pass the folder that holds "
                                  f"config.json and the safetensors files.")
        self.raw_config = _read_json(self.path / "config.json")
        self.family: FamilySpec = detect(self.raw_config, str(self.path / "config.json"))
        self.config: HeadConfig = self.family.parse_config(self.raw_config, str(self.path / "config.json"))
        self._headers: dict[str, dict[str, TensorEntry]] = {}
        self._maps: dict[Path, mmap.mmap] = {}
        self._read: dict[str, np.ndarray] = {}  # dense tensors as read (pread, private): the head and digest use these
        self._read_lock = threading.Lock()  # the digest may run on a thread beside the head's reads
        self._map_dense = False  # `map_dense`: dense tensors as views of their shards' mappings, not pread copies
        self._identity: dict[Path, tuple] = {}  # each shard's identity when its header was read (check_unchanged)
        self._shard_of = self._weight_map()

    def _weight_map(self) -> dict[str, str]:
        index = self.path / INDEX_NAME
        if index.is_file():
            weight_map = _read_json(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index} has no 'weight_map' object; regenerate the index.")
            for name, shard in weight_map.items():
                if not isinstance(shard, str) or not shard or Path(shard).name != shard:
                    raise CheckpointError(f"{index}: weight_map[{name!r}] is {shard!r}; it must be the file name "
                                          f"of a shard in {self.path}. Regenerate the index.")
            return weight_map
        single = self.path / SINGLE_NAME
        if single.is_file():
            return {name: SINGLE_NAME for name in self._header(SINGLE_NAME)}
        raise CheckpointError(f"{self.path} has neither {SINGLE_NAME} nor {INDEX_NAME}; "
                              f"pass a checkpoint directory in the HF layout.")

    def _header(self, shard: str) -> dict[str, TensorEntry]:
        if shard not in self._headers:
            self._identity[self.path / shard] = _identity(self.path / shard)  # before any byte of it is read
            header = _read_safetensors_header(self.path / shard)
            if hasattr(self, "_shard_of"):  # an index: a tensor it places in another shard must not be here too
                elsewhere = next((n for n in header if self._shard_of.get(n, shard) != shard), None)
                if elsewhere is not None:
                    raise CheckpointError(f"tensor {elsewhere} is in two shards of {self.path}: {shard} and "
                                          f"{self._shard_of[elsewhere]} (where {INDEX_NAME} places it), with "
                                          f"possibly different values. Re-shard the checkpoint so that each tensor "
                                          f"is stored once.")
            self._headers[shard] = header
        return self._headers[shard]

    def names(self) -> list[str]:
        return sorted(self._shard_of)

    def entry(self, name: str) -> TensorEntry:
        shard = self._shard_of.get(name)
        if shard is None:
            raise CheckpointError(f"tensor {name} is missing from checkpoint {self.path} "
                                  f"(not in {INDEX_NAME if (self.path / INDEX_NAME).is_file() else SINGLE_NAME}).")
        if shard not in self._headers and not (self.path / shard).is_file():  # (a header read: it was there)
            raise CheckpointError(f"shard {shard} is missing from {self.path}: {INDEX_NAME} lists tensor {name} "
                                  f"in it. Copy the complete checkpoint (every shard the index names).")
        entry = self._header(shard).get(name)
        if entry is None:
            raise CheckpointError(f"{INDEX_NAME} says {name} is in {shard}, but that file's header does not "
                                  f"list it; the index and the shards come from different checkpoints.")
        return entry

    def read(self, name: str, expected_shape: tuple[int, ...] | None = None) -> np.ndarray:
        """One whole tensor as float32, checked against `expected_shape` when given."""
        entry = self.entry(name)
        _check_shape(entry, expected_shape, self.config)
        return _widen(self._pread(entry, 0, entry.shape[0] if entry.shape else None), entry.dtype)

    def _stored(self, entry: TensorEntry) -> np.ndarray:
        """A dense tensor as stored, read once: every later use (the head, its digest, the NaN scan) sees these
        bytes. Into private memory with pread, whatever happens to the file meanwhile; or, where `map_dense` is
        set (the export), a view of its shard's mapping: the page cache's pages, no copy (oracle/sigbus.py says
        why), the bytes then the file's until check_unchanged, which refuses a shard changed since its header was
        read, and a shard cut short is exit 2 naming it (the SIGBUS guard)."""
        with self._read_lock:
            if entry.name not in self._read:
                self._read[entry.name] = (self._mapped(entry) if self.map_dense else
                                          self._pread(entry, 0, entry.shape[0] if entry.shape else None))
            return self._read[entry.name]

    @property
    def map_dense(self) -> bool:
        return self._map_dense

    @map_dense.setter
    def map_dense(self, wanted: bool) -> None:
        """Read the dense tensors through mappings from now on, where the SIGBUS guard is available (else pread)."""
        from oracle import sigbus

        self._map_dense = bool(wanted) and sigbus.available()

    def _pread(self, entry: TensorEntry, start: int, stop: int | None, into: np.ndarray | None = None) -> np.ndarray:
        """Rows start..stop of a tensor as stored (all of a 0-d one: stop None), read with os.preadv into fresh
        memory (or the front of `into`, a uint8 buffer that is large enough): a file cut short meanwhile is a
        CheckpointError naming it, never a SIGBUS."""
        row_shape = entry.shape[1:] if entry.shape else ()
        rows = (stop - start) if entry.shape else 1
        row_bytes = self._row_bytes(entry)
        out = np.empty(rows * row_bytes, dtype=np.uint8) if into is None else into[: rows * row_bytes]
        self._preadv(entry, [(memoryview(out), entry.offset + start * row_bytes)])
        return out.view(_STORED_NUMPY[entry.dtype]).reshape((rows, *row_shape) if entry.shape else ())

    def _row_bytes(self, entry: TensorEntry) -> int:
        row_bytes = math.prod(entry.shape[1:] if entry.shape else ()) * _ITEMSIZE[entry.dtype]
        if row_bytes * (entry.shape[0] if entry.shape else 1) > entry.nbytes:
            raise CheckpointError(f"{entry.file}: tensor {entry.name} is {entry.dtype} {list(entry.shape)} but its "
                                  f"data_offsets cover only {entry.nbytes} bytes; re-copy or re-save the file.")
        return row_bytes

    @staticmethod
    def _preadv(entry: TensorEntry, pieces: list[tuple[memoryview, int]]) -> None:
        """Fill each (buffer, file offset) piece of `entry`'s file with os.preadv; a short read or an OSError is a
        CheckpointError naming the file and the tensor."""
        try:
            with open(entry.file, "rb", buffering=0) as f:
                for view, at in pieces:
                    done = 0
                    while done < len(view):
                        got = os.preadv(f.fileno(), [view[done:]], at + done)
                        if got <= 0:
                            raise CheckpointError(f"{entry.file} ended inside tensor {entry.name} (byte {at + done}): "
                                                  f"it was cut short, maybe while being read. Re-copy the shard and "
                                                  f"run again.")
                        done += got
        except OSError as err:  # removed meanwhile, no permission, an I/O error
            raise CheckpointError(f"{entry.file}: reading tensor {entry.name} failed ({err.strerror or err}); check "
                                  f"the file and the disk, or re-copy the shard.") from None

    def stored_bytes(self, name: str) -> bytearray:
        """A whole tensor's stored bytes (any dtype: integer tables, FP8, E8M0 scales), read with pread into fresh
        memory: a shard cut short meanwhile is a CheckpointError naming it, never a SIGBUS."""
        entry = self.entry(name)
        out = bytearray(entry.nbytes)
        self._preadv(entry, [(memoryview(out), entry.offset)])
        return out

    def check_unchanged(self) -> None:
        """Raise CheckpointError if a shard read so far is no longer the file it was when opened (another inode,
        size, modification or change time): its bytes may then be a mix of old and new weights."""
        for path, before in self._identity.items():
            now = _identity(path)
            if now != before:
                raise CheckpointError(f"{path} changed while it was being read (its size, inode or modification "
                                      f"time differ from when it was opened), so what was read may mix old and new "
                                      f"weights. Run again once nothing writes to the checkpoint.")

    def _mapped(self, entry: TensorEntry) -> np.ndarray:
        """The tensor as stored, a view into its shard mapped copy-on-write: no copy, pages read only when touched.
        An unwidened head's routed experts (moe_experts reads their bytes from the file with pread, not through
        the mapping) and, with `map_dense`, the dense tensors. Every mapping is guarded (oracle/sigbus.py): a page
        past the end of a shard cut short meanwhile is exit 2 naming the shard, not a bare SIGBUS."""
        if entry.file not in self._maps:
            with open(entry.file, "rb") as f:
                self._maps[entry.file] = mapping = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE,
                                                             prot=mmap.PROT_READ | mmap.PROT_WRITE)
            _guarded(mapping, entry.file)
        count = entry.nbytes // _ITEMSIZE[entry.dtype]
        try:
            return np.frombuffer(self._maps[entry.file], dtype=_STORED_NUMPY[entry.dtype], count=count,
                                 offset=entry.offset).reshape(entry.shape)
        except ValueError:  # the file was cut short between its header read and its mapping
            raise CheckpointError(f"{entry.file} ended inside tensor {entry.name}: it was cut short, maybe while "
                                  f"being read. Re-copy the shard and run again.") from None

    def stored_rows(self, name: str, start: int, stop: int, into: np.ndarray | None = None) -> tuple[np.ndarray, str]:
        """Rows start..stop of a tensor (2-D, or its first axis) as stored, with its dtype ("BF16" comes as uint16 bit patterns), read
        with pread (only those rows: e.g. a vocabulary chunk of lm_head) into fresh memory or the front of `into`
        (a uint8 buffer of at least that many bytes, reused by the caller). Never a view of a mapping: a shard cut
        short while it is read is a CheckpointError, not a SIGBUS."""
        entry = self.entry(name)
        _check_shape(entry, None, self.config)
        if len(entry.shape) < 1 or not 0 <= start <= stop <= entry.shape[0]:
            raise CheckpointError(f"{name} has shape {list(entry.shape)}; rows {start}..{stop} are not in it.")
        return self._pread(entry, start, stop, into), entry.dtype

    def stored_rows_at(self, name: str, rows: np.ndarray) -> tuple[np.ndarray, str]:
        """Rows `rows` (any order, repeats allowed) of a 2-D tensor as stored [len(rows), width], with its dtype,
        read with pread one distinct row at a time (scattered rows of a cold table each cost one read, where a
        mapping would fault in a readahead window for each)."""
        entry = self.entry(name)
        _check_shape(entry, None, self.config)
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        if len(entry.shape) != 2 or (rows.size and not (0 <= rows.min() and rows.max() < entry.shape[0])):
            raise CheckpointError(f"{name} has shape {list(entry.shape)}; rows {rows.min()}..{rows.max()} are not "
                                  f"all in it.")
        unique, inverse = np.unique(rows, return_inverse=True)
        row_bytes = self._row_bytes(entry)
        stored = np.empty((len(unique), entry.shape[1]), dtype=_STORED_NUMPY[entry.dtype])
        self._preadv(entry, [(memoryview(row).cast("B"), entry.offset + int(r) * row_bytes)
                             for row, r in zip(stored, unique)])
        return stored[inverse.reshape(-1)], entry.dtype

    def read_rows(self, name: str, start: int, stop: int) -> np.ndarray:
        """Rows start..stop of a 2-D tensor as float32, read with pread (a truncated file: CheckpointError)."""
        entry = self.entry(name)
        _check_shape(entry, None, self.config)
        if len(entry.shape) != 2 or not 0 <= start <= stop <= entry.shape[0]:
            raise CheckpointError(f"{name} has shape {list(entry.shape)}; rows {start}..{stop} are not in it.")
        return _widen(self._pread(entry, start, stop), entry.dtype)

    def read_head(self, widen: bool = True, digest: bool = True) -> HeadWeights:
        """Every `mtp.*` tensor of the head, shape-checked against config.json; all of them must be used.

        float32 when `widen`; otherwise as stored (HeadWeights.dtypes says how: bf16 comes as uint16 bit patterns),
        mapped from the shard without a copy: half the memory of float32 for a bf16 head. With `digest=False` the
        digest is left to the caller (head_digest, e.g. in a thread while the head runs)."""
        tensors, dtypes = {}, {}
        entries = self._head_entries()
        layout = self.layout()
        routed = set(layout.experts.tensor_names()) if layout.experts else set()
        for name, entry in entries.items():
            # routed experts of an unwidened head: mapped, read (by moe_experts, with pread) only where a token routes
            # to them; widened ones are read whole anyway, so with pread now (uncached: no second copy kept)
            stored = (self._stored(entry) if name not in routed else self._mapped(entry) if not widen
                      else self._pread(entry, 0, entry.shape[0] if entry.shape else None))
            if name.endswith(("weight_scale_inv", ".scale")) and entry.dtype in ("F32", "BF16", "F16"):
                _check_block_scales(self.path, name, _widen(stored, entry.dtype))
            tensors[name] = _widen(stored, entry.dtype) if widen else stored
            dtypes[name] = "F32" if widen else entry.dtype
            scale = name.removesuffix("weight") + "weight_scale_inv"
            if scale not in entries:  # DeepSeek-V4 names the block scale `X.scale`
                scale = name.removesuffix("weight") + "scale"
            if widen and entry.dtype == E4M3 and scale in entries:  # FP8: the value the model means
                block = tuple(getattr(self.config, "weight_block_size", None) or (128, 128))
                scales = _widen(self._stored(entries[scale]), entries[scale].dtype)
                tensors[name] = dequantize(stored, scales, block, name)
            elif widen and entry.dtype == E4M3:  # decoded unscaled it would be off by its block scale: never guess
                raise CheckpointError(f"{self.path}: {name} is {E4M3} but the checkpoint has no block scale beside it "
                                      f"({name.removesuffix('weight')}weight_scale_inv); re-copy the complete "
                                      f"checkpoint (every shard the index names).")
        return HeadWeights(tensors=tensors, dtypes=dtypes, digest=self.head_digest() if digest else None,
                           layout=layout)

    def check_head(self) -> None:
        """The head's tensors checked from the headers alone (names, shapes, dtypes): read_head's errors but the
        block scales', before a byte of the head is read."""
        self._head_entries()

    def layout(self) -> TensorLayout:
        """The head's tensors as this checkpoint stores them (the family picks the experts' layout)."""
        return self.family.layout(self.config, set(self._shard_of))

    def head_digest(self) -> str:
        """sha256 over (name, dtype, shape, stored bytes) of every head tensor but the routed experts, in name order.

        Routed experts are left out so that a digest never reads gigabytes of experts no token uses; the experts a
        trace used are covered by `experts_digest`."""
        return self.digest(sorted(self.layout().dense))

    def experts_digest(self, experts: list[int], known: dict[tuple[int, str], str] | None = None,
                       scheme: str = TYPED) -> str:
        """`experts_digest_of` the given routed experts' stored parts (gate, up, down: their slices of a fused
        tensor, or their own tensors; dtype, shape and bytes). Parts already hashed where the head read them (`known`,
        (expert, part) -> `part_digest`, e.g. RoutedExperts.part_digests) are not read again; the others are read
        with os.pread into one reused buffer, not through the mapping (the resident set does not grow by the experts
        it hashes). `scheme`: the digest's scheme (oracle/experts_digest.py; a recorded digest's own, to check it)."""
        layout = self.layout().experts
        known = known or {}
        parts = {}
        buffer = memoryview(bytearray(8 << 20))
        for e in sorted(set(int(x) for x in experts)):
            types = self._expert_part_types(layout, e)
            for name, (path, offset, nbytes) in self._expert_extents(layout, e):
                if (e, name) in known:
                    parts[(e, name)] = known[(e, name)]
                    continue
                digest = xxhash.xxh3_128()
                try:
                    with open(path, "rb", buffering=0) as f:
                        while nbytes:
                            got = os.preadv(f.fileno(), [buffer[:min(nbytes, len(buffer))]], offset)
                            if got <= 0:
                                raise CheckpointError(f"{path} ended inside expert {e}; re-copy the shard.")
                            digest.update(buffer[:got])
                            offset, nbytes = offset + got, nbytes - got
                except OSError as error:  # unreadable, removed meanwhile, an I/O error: the user's to fix
                    raise CheckpointError(f"{path}: reading routed expert {e} failed ({error.strerror or error}); "
                                          f"check the file's permissions and the disk, or re-copy the shard.") from None
                dtype, shape = types[name]
                parts[(e, name)] = part_record(dtype, shape, digest.hexdigest())
        return experts_digest_of(parts, scheme)

    def _expert_part_types(self, layout, e: int) -> dict[str, tuple[str, tuple[int, ...]]]:
        """part -> (stored dtype, shape) of expert `e`'s gate [I, D], up [I, D] and down [D, I]."""
        if layout.kind == "fused":
            gate_up, down = self.entry(layout.names["gate_up"]), self.entry(layout.names["down"])
            half = (gate_up.shape[1] // 2, *gate_up.shape[2:])
            return {"gate": (gate_up.dtype, half), "up": (gate_up.dtype, half), "down": (down.dtype, down.shape[1:])}
        entries = {p: self.entry(layout.names[p].format(e=e)) for p in EXPERT_PARTS}
        return {p: (x.dtype, x.shape) for p, x in entries.items()}

    def _expert_extents(self, layout, e: int) -> list[tuple[str, tuple[Path, int, int]]]:
        """(part, (file, byte offset, bytes)) of expert `e`'s gate, up and down as stored."""
        if layout.kind == "fused":
            gate_up, down = self.entry(layout.names["gate_up"]), self.entry(layout.names["down"])
            per, half = gate_up.nbytes // gate_up.shape[0], gate_up.nbytes // gate_up.shape[0] // 2
            per_down = down.nbytes // down.shape[0]
            return [("gate", (gate_up.file, gate_up.offset + e * per, half)),
                    ("up", (gate_up.file, gate_up.offset + e * per + half, half)),
                    ("down", (down.file, down.offset + e * per_down, per_down))]
        entries = [(p, self.entry(layout.names[p].format(e=e))) for p in ("gate", "up", "down")]
        return [(p, (x.file, x.offset, x.nbytes)) for p, x in entries]

    def expert_parts(self, layout, e: int) -> list[tuple[str, np.ndarray]]:
        """Expert `e`'s stored arrays: (gate [I, D], up [I, D], down [D, I]), read with pread (its slices of a
        fused tensor, or its own tensors)."""
        if layout.kind == "fused":
            gate_up = self._pread(self.entry(layout.names["gate_up"]), e, e + 1)[0]
            down = self._pread(self.entry(layout.names["down"]), e, e + 1)[0]
            half = gate_up.shape[0] // 2
            return [("gate", gate_up[:half]), ("up", gate_up[half:]), ("down", down)]
        return [(p, self._pread(entry, 0, entry.shape[0])) for p in ("gate", "up", "down")
                for entry in [self.entry(layout.names[p].format(e=e))]]

    def digest(self, names: list[str]) -> str:
        """sha256 over (name, dtype, shape, stored bytes) of `names`, in the order given."""
        digest = hashlib.sha256()
        for name in names:
            entry = self.entry(name)
            digest.update(f"{name}|{entry.dtype}|{list(entry.shape)}|".encode())
            digest.update(self._stored(entry))  # hashlib releases the GIL on large buffers
        return "sha256:" + digest.hexdigest()

    def _head_entries(self) -> dict[str, TensorEntry]:
        """The head's tensor entries in name order, shape-checked; a head tensor the family does not use is an
        error (never silently ignored)."""
        expected = self.layout().shapes()
        # a head stored as a layer of the main stack names its index (DeepSeek/GLM: model.layers.{num_hidden_layers}.)
        prefix = self.family.head_prefix.format(num_hidden_layers=getattr(self.config, "num_hidden_layers", None))
        self._refuse_layers_past_the_head(expected)
        unused = sorted(n for n in self._shard_of if n.startswith(prefix) and n not in expected)
        if unused:
            raise CheckpointError(f"{self.path}: the head has tensors the {self.family.name} head does not use: "
                                  f"{', '.join(unused[:5])}{' …' if len(unused) > 5 else ''} "
                                  f"(another family, or a multi-layer head? config.json: {self._declared_layers()}). "
                                  f"Refusing to ignore them.")
        entries = {}
        for name in sorted(expected):
            entries[name] = self.entry(name)
            _check_shape(entries[name], expected[name], self.config)
        return entries

    def _refuse_layers_past_the_head(self, expected) -> None:
        """A head stored in the main stack (model.layers.{num_hidden_layers}.) whose checkpoint also holds layers
        past the ones the layout reads (model.layers.{num_hidden_layers + 1}. …: a second MTP layer the config's
        count leaves out) is refused, naming the config key and the tensors: read as a one-layer head, depth 2 would
        silently run layer 0 where the checkpoint has its own layer for it."""
        if not self.family.head_prefix.startswith("model.layers.{num_hidden_layers}"):
            return
        count = getattr(self.config, "num_hidden_layers", None)
        if not isinstance(count, int):
            return
        read = sorted({int(m.group(1)) for n in expected if (m := _STACK_LAYER.match(n))})
        # layers the layout does not read at all (an unknown tensor inside a read layer is the unused-tensor error's)
        extra = sorted({int(m.group(1)) for n in self._shard_of if n not in expected
                        and (m := _STACK_LAYER.match(n)) and int(m.group(1)) >= count and int(m.group(1)) not in read})
        if not extra:
            return
        declared = self._declared_layers()
        shown = ", ".join(f"model.layers.{i}.*" for i in extra[:4]) + (" …" if len(extra) > 4 else "")
        raise CheckpointError(
            f"{self.path / 'config.json'}: {declared} (MTP layer(s) at model.layers.{', '.join(map(str, read))}, "
            f"num_hidden_layers {count}) but the checkpoint also holds {shown}: the tensors of more MTP layers than "
            f"the config declares. Refusing to ignore them: fix the layer count in config.json (this "
            f"{self.family.name} oracle runs one MTP layer), or remove those tensors.")

    def _declared_layers(self) -> str:
        """The MTP layer count config.json declares, as `key = value`, or that it declares none."""
        text = self.raw_config.get("text_config", self.raw_config)
        keys = [k for k in _LAYER_COUNT_KEYS if k in text]
        return (f"{keys[0]} = {text[keys[0]]!r}" if keys else
                f"no MTP layer count ({' / '.join(_LAYER_COUNT_KEYS)}; the family's default applies)")

    def main_model_prefix(self) -> str:
        """Where the shared embedding lies (e.g. `model.language_model.` in a VLM release, `model.` text-only)."""
        prefixes, embedding = self.family.main_model_prefixes, self.family.embedding
        for prefix in prefixes:
            if prefix + embedding in self._shard_of:
                return prefix
        raise CheckpointError(f"{self.path}: no embedding table; looked for "
                              f"{' and '.join(p + embedding for p in prefixes)}.")

    def check_main_model(self, alternatives: str = "--hidden FILE (H from your engine) or --hidden-seed N "
                                                   "(synthetic H)") -> None:
        """--main-model needs the main model's decoder layers: refuse a head-only checkpoint (e.g. a release's MTP
        part alone, or one with only the few main tensors the head shares) by its tensor names, before torch loads
        and before a strict load lists hundreds of missing keys."""
        text = self.raw_config.get("text_config", self.raw_config)
        count = text.get("num_hidden_layers", text.get("n_layers"))  # main decoder layers (V4 release: n_layers)
        head_layer = count if self.family.head_prefix.startswith("model.layers.") else None  # DeepSeek/GLM's MTP
        present = {int(m.group(1)) for m in map(_MAIN_LAYER.match, self._shard_of) if m} - {head_layer}
        if not present:
            raise CheckpointError(
                f"{self.path} holds no main model (no main decoder layer tensors, only the MTP head and the tensors it "
                f"shares), so --main-model cannot compute H. Pass {alternatives}.")
        missing = sorted(set(range(count)) - present) if isinstance(count, int) else []
        if missing:
            shown = ", ".join(map(str, missing[:8])) + (" …" if len(missing) > 8 else "")
            raise CheckpointError(
                f"{self.path} holds no complete main model: config.json has {count} decoder layers, and layer(s) "
                f"{shown} have no tensors, so --main-model cannot compute H. Pass {alternatives}.")

    def embedding_rows(self, token_ids: np.ndarray) -> np.ndarray:
        """Float32 rows [T, D] of the shared embedding for `token_ids`; only those rows are read."""
        name = self.main_model_prefix() + self.family.embedding
        entry = self.entry(name)
        _check_shape(entry, (self.config.vocab_size, self.config.hidden_size), self.config)
        check_token_ids(token_ids, self.config.vocab_size)
        stored, dtype = self.stored_rows_at(name, token_ids)
        return _widen(stored, dtype)


_MAIN_LAYER = re.compile(r"(?:model\.(?:language_model\.)?)?layers\.(\d+)\.")  # HF layouts; V4's release: layers.N.
_STACK_LAYER = re.compile(r"model\.layers\.(\d+)\.")  # DeepSeek/GLM/Step: the MTP layers follow the main stack
_LAYER_COUNT_KEYS = ("num_nextn_predict_layers", "num_mtp_layers", "mtp_num_hidden_layers")


def _guarded(mapping: mmap.mmap, path: Path) -> None:
    """Register `mapping` with the SIGBUS guard (oracle/sigbus.py) for as long as it lives."""
    from oracle import sigbus

    if len(mapping) and sigbus.available():
        key = sigbus.guard(np.frombuffer(mapping, dtype=np.uint8).ctypes.data, len(mapping), str(path))
        weakref.finalize(mapping, sigbus.unguard, key)


def _identity(path: Path) -> tuple | None:
    """What says a file is still the one it was: device, inode, size, modification and change times (a rewrite
    in place changes the times, and no user tool sets a ctime back); None when it cannot be stat-ed."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def check_token_ids(token_ids: np.ndarray, vocab_size: int) -> None:
    bad = np.flatnonzero((token_ids < 0) | (token_ids >= vocab_size))
    if bad.size:
        row = int(bad[0])
        raise InputError(f"token id {int(token_ids[row])} at row {row} is out of range: the checkpoint's "
                         f"vocab_size is {vocab_size} (config.json), so ids must be in 0..{vocab_size - 1}.")


def _read_json(path: Path) -> dict:
    """config.json or the index: a regular file of JSON within oracle/reading.py's limits, holding an object."""
    if not os.path.lexists(path):
        raise CheckpointError(f"{path} is missing; a checkpoint directory needs its config.json and "
                              f"safetensors index.")
    data = read_json(path, "checkpoint file", CheckpointError)
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} does not hold a JSON object.")
    return data


def _read_safetensors_header(path: Path) -> dict[str, TensorEntry]:
    """Parse a safetensors header: 8-byte little-endian length, then JSON {name: {dtype, shape, data_offsets}}."""
    check_regular_file(path, "safetensors file", CheckpointError)  # a FIFO would block the open forever
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > size - 8:
                raise ValueError("header length beyond end of file")
            header = json.loads(f.read(length), object_pairs_hook=_without_repeated_keys)
    except _RepeatedKey as err:
        raise CheckpointError(f"{path}: its safetensors header lists {err} twice (JSON keeps only the last, which "
                              f"the safetensors library refuses); re-copy or re-save the file.") from None
    except (OSError, ValueError, struct.error, RecursionError) as err:
        raise CheckpointError(f"{path} is not a readable safetensors file ({err}); re-copy it.") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: the safetensors header is {type(header).__name__}, not a JSON object of "
                              f"tensors; re-copy the file.")
    entries = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        start, end = _checked_header_entry(path, name, meta)
        entries[name] = TensorEntry(name, path, meta["dtype"], tuple(meta["shape"]), 8 + length + start, end - start)
        if 8 + length + end > size:
            raise CheckpointError(f"{path} is truncated: tensor {name} ends at byte {8 + length + end} of a "
                                  f"{size}-byte file. Re-copy the shard.")
    _check_tiling(path, entries, 8 + length, size)
    return entries


class _RepeatedKey(ValueError):
    pass


def _without_repeated_keys(pairs: list) -> dict:
    """json object_pairs_hook: a key given twice is an error (json.loads would keep the last silently)."""
    found = {}
    for key, value in pairs:
        if key in found:
            raise _RepeatedKey(repr(key))
        found[key] = value
    return found


def _check_tiling(path: Path, entries: dict[str, TensorEntry], data_start: int, size: int) -> None:
    """The tensors' byte ranges must tile the data after the header exactly, in order, as the safetensors format
    requires (its library refuses anything else): overlapping ranges had let one tensor be read from another's
    bytes (a norm computed with the hidden norm's values, exit 0). Overlaps are named first, before the gap an
    aliased tensor leaves: they say which tensor holds whose bytes."""
    ordered = sorted(entries.values(), key=lambda e: (e.offset, e.offset + e.nbytes))
    at, holder = data_start, None  # the end of the bytes covered so far, and the tensor that reaches it
    for entry in ordered:
        if entry.nbytes and entry.offset < at:
            raise CheckpointError(f"{path}: tensors {holder.name} and {entry.name} share bytes (data_offsets "
                                  f"overlap); a safetensors file stores each tensor in its own bytes, back to back. "
                                  f"Re-copy or re-save the file.")
        if entry.offset + entry.nbytes > at:
            at, holder = entry.offset + entry.nbytes, entry
    at = data_start
    for entry in ordered:
        if entry.offset > at:
            raise CheckpointError(f"{path}: bytes {at}..{entry.offset} before tensor {entry.name} belong to no "
                                  f"tensor; a safetensors file stores its tensors back to back. Re-copy or re-save "
                                  f"the file.")
        at = max(at, entry.offset + entry.nbytes)
    if at != size:
        raise CheckpointError(f"{path}: {size - at} bytes follow the last tensor (byte {at}); a safetensors file "
                              f"ends with its last tensor. Re-copy or re-save the file.")


# bytes per element of every safetensors dtype, to check that data_offsets cover the shape exactly
_HEADER_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F16": 2, "BF16": 2, "I16": 2, "U16": 2,
                    "F32": 4, "I32": 4, "U32": 4, "F64": 8, "I64": 8, "U64": 8}


def _checked_header_entry(path: Path, name: str, meta) -> tuple[int, int]:
    """One header entry's (start, end) after checking its JSON shape: {"dtype": str, "shape": [int >= 0, ...],
    "data_offsets": [start, end]} with 0 <= start <= end and end - start = prod(shape) x itemsize."""
    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{path}: header entry for tensor {name!r} {what}; the file is not valid "
                               f"safetensors. Re-copy or re-save it.")

    if not isinstance(meta, dict):
        raise bad(f"is {type(meta).__name__}, not an object")
    dtype, shape, offsets = meta.get("dtype"), meta.get("shape"), meta.get("data_offsets")
    if not isinstance(dtype, str):
        raise bad(f"has dtype {dtype!r}, not a string")
    if not isinstance(shape, list) or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0
                                              for n in shape):
        raise bad(f"has shape {shape!r}, not a list of non-negative integers")
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(isinstance(n, int) and not isinstance(n, bool) for n in offsets)):
        raise bad(f"has data_offsets {offsets!r}, not [start, end]")
    start, end = offsets
    if not 0 <= start <= end:
        raise bad(f"has data_offsets {offsets!r}: they must satisfy 0 <= start <= end")
    itemsize = _HEADER_ITEMSIZE.get(dtype)
    if itemsize is not None and end - start != math.prod(shape) * itemsize:
        raise bad(f"has data_offsets {offsets!r} covering {end - start} bytes, but {dtype} {shape} needs "
                  f"{math.prod(shape) * itemsize}")
    return start, end


def _check_block_scales(path: Path, name: str, scales: np.ndarray) -> None:
    """FP8 block scales are positive finite magnitudes: refuse NaN/Inf, a negative scale, or a tensor whose every
    scale is 0 (its weight would dequantize to all zeros and export without complaint; red team). Scale tensors
    are 1/(block area) of their weight, so this costs next to nothing."""
    problem = ("holds NaN/Inf" if not np.isfinite(scales).all() else "holds a negative scale" if (scales < 0).any()
               else "is 0 in every block (the weight would dequantize to all zeros)" if not scales.any() else None)
    if problem:
        raise CheckpointError(f"{path}: block scale {name} {problem}; a scale is a positive magnitude. Re-export or "
                              f"re-copy the checkpoint.")


def _check_shape(entry: TensorEntry, expected: tuple[int, ...] | None, cfg: HeadConfig) -> None:
    if entry.dtype not in _ITEMSIZE:
        raise CheckpointError(f"{entry.name} in {entry.file.name} is {entry.dtype}; this reader handles "
                              f"{', '.join(_ITEMSIZE)}.")
    if expected is not None and tuple(entry.shape) != tuple(expected):
        sizes = ", ".join(f"{k}={v}" for k, v in cfg.to_dict().items() if isinstance(v, int)
                          and not isinstance(v, bool))
        raise CheckpointError(
            f"{entry.name} in {entry.file.name} has shape {list(entry.shape)}, but config.json implies "
            f"{list(expected)} ({sizes}). The config and the weights come from different models.")


def _widen(stored: np.ndarray, dtype: str) -> np.ndarray:
    """Stored array -> float32 in one allocation. bfloat16 is the top half of a float32: the widening is exact.
    F8_E4M3 is decoded exactly, without its block scale (oracle/fp8.py dequantize applies that)."""
    if dtype == E4M3:
        return decode_e4m3(stored)
    if dtype == E8M0:  # exact: every 2^k, k in -127..127, is a float32 (2^-127 subnormal)
        return np.where(stored == 255, np.nan, np.ldexp(1.0, stored.astype(np.int32) - 127)).astype(np.float32)
    if dtype != "BF16":
        return stored.astype(np.float32)
    out = np.empty(stored.shape, dtype=np.uint32)
    out[...] = stored
    out <<= 16
    return out.view(np.float32)
