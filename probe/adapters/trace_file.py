"""Reading a trace someone already wrote: an `mtp-trace/1` HDF5 file, or a raw directory an engine dumped.

Both sit behind one small interface, `TraceSource`: the stages present, their shape and dtype as stored, and
row-range reads (memory bounded by the range; `out=` lends a buffer to read into, which a source may use or
ignore: the rows are what it returns), plus the inputs the producer recorded, if any. A source converts
layout to the oracle's (native float32 rows) and does nothing else: checks live in probe/selfcheck.py.

Raw directory layout (for engines that do not write HDF5):

    <stage>.bin    one per captured stage, named as the reference's stages (`mtp-oracle inspect REF` lists them;
                   Qwen3.5: e, h, fc_in, fc, ah, attn, res1, mh, mlp, res2, out); row-major [T, width], width as
                   in the reference: little-endian float32, or little-endian int64 for index-set stages
                   (topk_ids). The files carry no header: T and widths are the reference's. Omit the stages you
                   do not capture.
    inputs.json    optional: {"token_ids": [T ints], "positions": [T ints]} as the engine consumed them
    hidden.bin     optional: the hidden H [T, D] float32 the engine consumed (must be the reference's, bit for bit;
                   DeepSeek-V4: [T, hc·D], the main model's hc residual streams)

    d{j}/          optional, j >= 2: depth j of the draft loop (issue 24), the same `<stage>.bin` files with n_j =
                   T - j + 1 rows, row r = bridge position r (the draft stage as int64, like topk_ids), and an optional
                   inputs.json of the depth's token_ids and positions; a depth the reference lacks is an error

Any other `*.bin` name is an error (a misspelt stage would otherwise be silently "not captured"), and so is one of
these names that is not a readable regular file (dangling symlink, directory, FIFO, device; a symlink to a regular
file is followed).
"""

import os
import stat
from pathlib import Path
from typing import Protocol

import numpy as np

from oracle.errors import TraceFormatError
from oracle.stages import INDEX_SET, STAGES, Dims, StageList
from oracle.trace import (INPUT_NAMES, ChainDepthReader, ChainInfo, chain_groups, chain_info, chain_rows,
                          evidence_attr, evidence_covers_chain, read_trace, recorded_chain_digest)
from probe.poison import poison

CHECKED_INPUTS = ("token_ids", "positions", "hidden")  # the inputs a candidate is given; embed comes from weights
_JSON_INPUTS = ("token_ids", "positions")


class TraceSource(Protocol):
    path: Path
    kind: str
    num_tokens: int
    hidden_size: int
    stages: tuple[str, ...]  # present stages, in the reference's stage order
    stage_list: StageList  # the stages present, with their metadata (kind, doc)
    recorded_inputs: tuple[str, ...]  # subset of CHECKED_INPUTS, each checked on its own
    poisoned: bool  # every buffer was poison-filled before the candidate wrote it: an all-zero row was computed

    def stage_shape(self, name: str) -> tuple[int, ...]: ...
    def stage_dtype(self, name: str) -> np.dtype: ...
    def stage_rows(self, name: str, start: int, stop: int, out: np.ndarray | None = None) -> np.ndarray: ...
    def input_shape(self, name: str) -> tuple[int, ...]: ...
    def input_rows(self, name: str, start: int, stop: int) -> np.ndarray: ...
    def describe(self, name: str) -> str: ...
    def close(self) -> None: ...


def open_reference(path: Path) -> "Hdf5Trace":
    """The oracle trace: always an `mtp-trace/1` file."""
    path = Path(path)
    if path.is_dir():
        raise TraceFormatError(f"reference {path} is a directory; pass the .h5 file written by mtp-oracle export.")
    return Hdf5Trace(path)


def open_candidate(path: Path, ref: "Hdf5Trace | int", hidden_size: int | None = None) -> TraceSource:
    """A candidate trace: an `mtp-trace/1` file, or a raw directory read with the reference's T, stages and widths
    (`ref` an opened reference; or, for the default stage list, T and D as `ref, hidden_size`)."""
    path = Path(path)
    if path.is_dir():
        if isinstance(ref, int):
            return RawDirTrace(path, ref, hidden_size)
        return RawDirTrace(path, ref.num_tokens, ref.hidden_size, ref.stage_list,
                           {n: ref.stage_shape(n)[1] for n in ref.stages}, ref.hidden_width)
    return Hdf5Trace(path)


class _Closing:
    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        pass


class Hdf5Trace(_Closing):
    """An `mtp-trace/1` file, read through oracle.trace (which reports a corrupt file as TraceFormatError)."""

    kind = "mtp-trace/1"

    def __init__(self, path: Path):
        self.path = Path(path)
        self._reader = read_trace(self.path)
        self.num_tokens = self._reader.num_tokens
        self.hidden_size = self._reader.hidden_size
        self.hidden_width = self._reader.dims.hc_mult * self.hidden_size  # the hidden: hc·D (DeepSeek-V4), else D
        self.stages = self._reader.stages
        self.stage_list = self._reader.stage_list
        self.dims = self._reader.dims
        present = self._reader.input_names()
        self.recorded_inputs = tuple(n for n in CHECKED_INPUTS if n in present)
        # `mtp-probe run --out` writes rows the candidate wrote into poison-filled buffers, and says so.
        self.poisoned = self._reader.attrs.get("poison_filled") is True or \
            str(self._reader.attrs.get("poison_filled")).lower() == "true"
        self.attrs = self._reader.attrs
        self._unwritten_by_stage: dict[str, np.ndarray | None] = {}

    def close(self) -> None:
        self._reader.close()

    def stage_shape(self, name: str) -> tuple[int, ...]:
        return self._reader.stage_shape(name)

    def stage_dtype(self, name: str) -> np.dtype:
        return self._reader.stage_dtype(name)

    def stage_rows(self, name: str, start: int, stop: int, out: np.ndarray | None = None) -> np.ndarray:
        rows = _native_float32(self._reader.stage_rows(name, start, stop, out))
        unwritten = self._unwritten(name)
        if unwritten is not None and unwritten[start:stop].any():
            # never written: HDF5 returns the fill value (NaN, 0, ...); poison (or -1 for index sets) makes the diff
            # report these rows as unwritten (invalid, exit 2), not as computed values (a NaN fill was exit 1)
            if rows.dtype.kind in "iu":
                rows = rows.astype(np.int64)  # a copy; -1 fits any index set as int64
                rows[unwritten[start:stop]] = -1
            else:
                rows = np.array(rows, copy=True) if out is None else rows
                rows[unwritten[start:stop]] = poison(rows.shape[1:])
        return rows

    def _unwritten(self, name: str) -> np.ndarray | None:
        if name not in self._unwritten_by_stage:
            self._unwritten_by_stage[name] = self._reader.unwritten_rows(name)
        return self._unwritten_by_stage[name]

    def input_shape(self, name: str) -> tuple[int, ...]:
        # As stored: a recorded input longer than the trace (T+1 token ids) had passed, its extra rows never read.
        return self._reader.input_shape(name)

    def input_rows(self, name: str, start: int, stop: int) -> np.ndarray:
        return _native_float32(self._reader.input_rows(name, start, stop))

    def has_evidence(self, name: str) -> bool:
        """The evidence dataset is present and covered by a matching evidence_digest (check_reference refuses a
        mismatch); evidence without a digest is not trusted."""
        return self._reader.has_evidence(name) and self.evidence_verified is True

    @property
    def evidence_verified(self) -> bool | None:
        if not hasattr(self, "_evidence_verified"):
            verified = self._reader.evidence_verified()
            if verified is False and self.depths:  # a digest over depth 1's and the chain's evidence
                verified = self.chain_evidence_verified
            self._evidence_verified = verified
        return self._evidence_verified

    @property
    def chain_evidence_verified(self) -> bool:
        """Whether the root evidence_digest covers the chain's evidence too (hashed once per file)."""
        if not hasattr(self, "_chain_evidence_verified"):
            self._chain_evidence_verified = bool(self.depths) and evidence_covers_chain(self._reader)
        return self._chain_evidence_verified

    def evidence_attr(self, name: str, key: str):
        """An attribute of /evidence/<name> (draft_margin's row_norm_max), None when absent."""
        return evidence_attr(self._reader, name, key)

    @property
    def chain(self) -> ChainInfo | None:
        """The root `chain` record (oracle/trace.py, Chains); None for a trace of the bridge step only."""
        if not hasattr(self, "_chain"):
            self._chain = chain_info(self._reader)
        return self._chain

    @property
    def depths(self) -> tuple[int, ...]:
        """The chain depths j >= 2 this file holds a /chain/d{j} group for."""
        if not hasattr(self, "_depths"):
            self._depths = chain_groups(self._reader)
        return self._depths

    def depth(self, depth: int) -> "Hdf5DepthTrace":
        """Depth `depth` (>= 2) of the draft loop as a source of its own: rows = bridge positions."""
        return Hdf5DepthTrace(self, depth)

    def recorded_chain_digest(self) -> str:
        """chain_digest of the file's /chain/d{j}/inputs as stored (oracle/trace.py)."""
        return recorded_chain_digest(self._reader)

    def evidence_rows(self, name: str, start: int, stop: int) -> np.ndarray:
        return _native_float32(self._reader.evidence_rows(name, start, stop))

    def all_inputs(self):
        """Every /inputs dataset (TraceInputs), or None when the file does not record all four."""
        return self._reader.inputs() if set(self._reader.input_names()) == set(INPUT_NAMES) else None

    def recorded_inputs_digest(self) -> str | None:
        """`inputs_digest` of the file's /inputs, streamed a block of rows at a time (memory flat in T), or None
        when the file does not record all four."""
        return self._reader.inputs_digest() if set(self._reader.input_names()) == set(INPUT_NAMES) else None

    def describe(self, name: str) -> str:
        return f"{self.path}:/stages/{name}"


class Hdf5DepthTrace(Hdf5Trace):
    """/chain/d{j} of an open `mtp-trace/1` file, read as a trace of n_j = T - j + 1 rows (row r = bridge position r).
    Its checksums are the root's "d{j}/<name>" ones; its evidence is trusted only where the root evidence_digest
    covers the chain's (oracle/trace.py evidence_covers_chain). Closed with the file."""

    def __init__(self, parent: Hdf5Trace, depth: int):
        self.path, self.depth_index, self.parent = parent.path, depth, parent
        self._reader = ChainDepthReader(parent._reader, depth)
        self.num_tokens = chain_rows(parent.num_tokens, depth)
        self.hidden_size, self.hidden_width, self.dims = parent.hidden_size, parent.hidden_width, parent.dims
        self.stages = self._reader.stages
        self.stage_list = self._reader.stage_list
        present = self._reader.input_names()
        # the recycled hidden is the engine's own computation, never an input to check bit for bit
        self.recorded_inputs = tuple(n for n in ("token_ids", "positions") if n in present)
        self.poisoned = parent.poisoned
        prefix = f"d{depth}/"
        checksums = parent.attrs.get("stage_checksums")
        self.attrs = {k: v for k, v in parent.attrs.items() if k not in ("inputs_digest", "stage_checksums")}
        if isinstance(checksums, dict):
            self.attrs["stage_checksums"] = {k[len(prefix):]: v for k, v in checksums.items() if k.startswith(prefix)}
        if "evidence_rules" in parent.attrs:
            self.attrs["evidence_rules"] = self._depth_rules(parent.attrs["evidence_rules"])
        self._unwritten_by_stage = {}

    def _depth_rules(self, rules):
        """The root's evidence_rules as they hold at this depth: the q/k-path parts (qk_parts) are measured where a
        /chain/d{j}/evidence/qk_<part> dataset is recorded (the oracle measures each depth on its own rows,
        oracle/qk_parts.py); their columns are the depth's own variant names where the rules give them
        (qk_parts_at_depth: an N-layer head's depth runs another layer, whose parts may differ), else depth 1's. A
        part this depth lacks is "not measured" here (never claimed, never depth 1's), not a contradiction."""
        if not isinstance(rules, dict):
            return rules
        at_depth = rules.get("qk_parts_at_depth")
        own = at_depth.get(str(self.depth_index)) if isinstance(at_depth, dict) else None
        declared = own if isinstance(own, dict) else rules.get("qk_parts")
        rules = {k: v for k, v in rules.items() if k not in ("qk_parts", "qk_parts_at_depth")}
        if not isinstance(declared, dict):  # absent; or malformed, which the diff refuses as at depth 1
            return rules | ({"qk_parts": declared} if declared is not None else {})
        kept = {part: names for part, names in declared.items() if self._reader.has_evidence(f"qk_{part}")}
        return rules | ({"qk_parts": kept} if kept else {})

    def close(self) -> None:
        pass  # the file is the parent's

    @property
    def evidence_verified(self) -> bool | None:
        return self.parent.chain_evidence_verified or None

    def evidence_attr(self, name: str, key: str):
        return self._reader.evidence_attr(name, key)

    @property
    def chain(self) -> None:
        return None

    @property
    def depths(self) -> tuple[int, ...]:
        return ()

    def all_inputs(self):
        return None

    def recorded_inputs_digest(self) -> None:
        return None  # a depth's inputs are covered by the root chain_digest (checked once per file)

    def chain_input_names(self) -> tuple[str, ...]:
        """The /chain/d{j}/inputs datasets present (CHAIN_INPUT_NAMES order)."""
        return self._reader.input_names()

    def chain_input_rows(self, name: str) -> np.ndarray:
        """All rows of /chain/d{j}/inputs/<name> (bridge, token_ids, positions, layer, recycled, embed)."""
        return _native_float32(self._reader.input_rows(name, 0, None))

    def evidence_names(self) -> tuple[str, ...]:
        return self._reader.evidence_names()

    def describe(self, name: str) -> str:
        return f"{self.path}:/chain/d{self.depth_index}/stages/{name}"


class RawDirTrace(_Closing):
    """A directory of `<stage>.bin` files (module docstring), read by row ranges without loading whole files."""

    kind = "raw dir"
    poisoned = False  # nothing says the engine pre-filled its files: an all-zero row may be an unwritten one
    attrs: dict = {}

    chain = None  # a dump records no loop conventions: the reference's are the truth

    def __init__(self, path: Path, num_tokens: int, hidden_size: int, stage_list: StageList = STAGES,
                 widths: dict[str, int] | None = None, hidden_width: int | None = None, depth: int = 1):
        self.path, self.depth_index = Path(path), depth
        self._args = (hidden_size, stage_list, widths, hidden_width)
        self.num_tokens, self.hidden_size = num_tokens, hidden_size
        self.hidden_width = hidden_width or hidden_size  # hidden.bin rows: hc·D (DeepSeek-V4), else D
        self._widths = widths or {s.name: s.width(Dims(hidden_size)) for s in stage_list}
        self._kinds = {s.name: s.kind for s in stage_list}
        try:
            entries = {p.name for p in self.path.iterdir()}
        except OSError as err:
            raise TraceFormatError(f"raw trace directory {self.path} is not readable: {err}.") from None
        known = {f"{n}.bin" for n in stage_list.names} | ({"hidden.bin"} if depth == 1 else set())
        files = {f for f in entries if f in known or f == "inputs.json"}
        self.depths = _depth_folders(self.path, entries) if depth == 1 else ()
        for name in sorted(files):
            _check_regular_file(self.path / name)
        unknown = sorted(f for f in entries if f.lower().endswith(".bin") and f not in known)  # mlp.BIN too
        if unknown:
            raise TraceFormatError(f"{self.path}: unknown stage files {', '.join(unknown)}; name each file "
                                   f"<stage>.bin with a stage of the reference: {', '.join(stage_list.names)} "
                                   f"(or hidden.bin for the consumed hidden).")
        self.stages = tuple(n for n in stage_list.names if f"{n}.bin" in files)
        self.stage_list = StageList(s for s in stage_list if s.name in self.stages)
        self._ids = _inputs_from_json(self.path / "inputs.json") if "inputs.json" in files else {}
        recorded = set(self._ids) | ({"hidden"} if "hidden.bin" in files else set())
        self.recorded_inputs = tuple(n for n in CHECKED_INPUTS if n in recorded)

    def _file(self, name: str) -> Path:
        return self.path / f"{name}.bin"

    def depth(self, depth: int) -> "RawDirTrace":
        """The d{depth}/ folder, read with n_j = T - depth + 1 rows (row r = bridge position r)."""
        hidden_size, stage_list, widths, hidden_width = self._args
        return RawDirTrace(self.path / f"d{depth}", chain_rows(self.num_tokens, depth), hidden_size, stage_list,
                           widths, hidden_width, depth=depth)

    def _width(self, name: str) -> int:
        return self.hidden_width if name == "hidden" else self._widths[name]

    def _stored(self, name: str) -> np.dtype:
        """Little-endian int64 for index-set stages, float32 for every other file."""
        return np.dtype("<i8") if self._kinds.get(name) == INDEX_SET else np.dtype("<f4")

    def _shape(self, name: str) -> tuple[int, ...]:
        nbytes, item = self._file(name).stat().st_size, self._stored(name).itemsize
        rows, rest = divmod(nbytes, item * self._width(name)) if self._width(name) else (0, nbytes)
        return (rows, self._width(name)) if rest == 0 else (nbytes // item,)

    def _rows(self, name: str, start: int, stop: int) -> np.ndarray:
        width, stored = self._width(name), self._stored(name)
        flat = np.fromfile(self._file(name), dtype=stored, count=(stop - start) * width,
                           offset=start * width * stored.itemsize)
        return flat.reshape(-1, width).astype(stored.newbyteorder("="), copy=False)  # little-endian -> native

    def stage_shape(self, name: str) -> tuple[int, ...]:
        return self._shape(name)

    def stage_dtype(self, name: str) -> np.dtype:
        # raw files are float32 (int64 for index sets) by definition; another dtype shows as a wrong size
        return self._stored(name).newbyteorder("=")

    def stage_rows(self, name: str, start: int, stop: int, out: np.ndarray | None = None) -> np.ndarray:
        if out is None or out.dtype != np.dtype("<f4") or self._stored(name) != np.dtype("<f4"):
            return self._rows(name, start, stop)
        with open(self._file(name), "rb") as f:
            f.seek(start * self._width(name) * 4)
            got = f.readinto(memoryview(out).cast("B"))
        if got != out.nbytes:
            raise TraceFormatError(f"{self._file(name)} ends before row {stop - 1}: was it rewritten while being "
                                   f"read? Run the diff again.")
        return out

    def input_shape(self, name: str) -> tuple[int, ...]:
        return self._ids[name].shape if name in _JSON_INPUTS else self._shape(name)

    def input_rows(self, name: str, start: int, stop: int) -> np.ndarray:
        return self._ids[name][start:stop] if name in _JSON_INPUTS else self._rows(name, start, stop)

    def describe(self, name: str) -> str:
        return f"{self._file(name)} ({self._file(name).stat().st_size} bytes)"


def _depth_folders(path: Path, entries: set[str]) -> tuple[int, ...]:
    """The depth folders d{j} (j >= 2) of a raw dump, in order; a `d1` (depth 1 is the folder itself) or a d{j} that
    is not a directory is an error."""
    depths = []
    for name in entries:
        if not (name[:1] == "d" and name[1:].isdigit()):
            continue
        j = int(name[1:])
        if j < 2 or name != f"d{j}" or not (path / name).is_dir():
            raise TraceFormatError(f"{path / name}: a depth folder is d2, d3, ... (a directory; depth 1's files are "
                                   f"{path}'s own <stage>.bin); rename or remove it.")
        depths.append(j)
    return tuple(sorted(depths))


def _check_regular_file(path: Path) -> None:
    """A file the dump names (a stage, hidden.bin, inputs.json) must be a readable regular file (a symlink to one
    is followed). Anything else (a dangling symlink, a directory, a FIFO, a device such as /dev/zero) would
    otherwise read as "not captured" or as endless bytes; a FIFO is never opened, as opening it would block."""
    try:
        mode = os.stat(path).st_mode
    except OSError as err:
        raise TraceFormatError(f"{path} cannot be read ({err.strerror}: a dangling symlink?); each file of a raw "
                               f"trace directory is a regular file the engine wrote. Write it again or remove "
                               f"it (an absent stage counts as not captured).") from None
    if not stat.S_ISREG(mode):
        raise TraceFormatError(f"{path} is {_file_kind(mode)}, not a regular file; each file of a raw trace "
                               f"directory is a regular file the engine wrote. Write it again or remove it (an "
                               f"absent stage counts as not captured).")
    try:
        with open(path, "rb"):
            pass
    except OSError as err:
        raise TraceFormatError(f"{path} cannot be read ({err.strerror}); give the reader permission to read it."
                               ) from None


def _file_kind(mode: int) -> str:
    kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character "
             "device"), (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))
    return next((text for test, text in kinds if test(mode)), "not a regular file")


def _native_float32(rows: np.ndarray) -> np.ndarray:
    if rows.dtype.kind == "f" and rows.dtype.itemsize == 4:
        return rows.astype(np.float32, copy=False)  # any-endian float32 -> native, bit-exact
    return rows


def _inputs_from_json(path: Path) -> dict[str, np.ndarray]:
    hint = 'expected {"token_ids": [ints], "positions": [ints]}'
    from oracle.reading import read_json

    try:
        data = read_json(path, "inputs file", TraceFormatError)  # JSON within limits: deep nesting, huge ints
    except TraceFormatError as err:
        why = str(err).removeprefix(f"inputs file {path} ")
        raise TraceFormatError(f"{path} is not readable JSON: {why} {hint[0].upper()}{hint[1:]}.") from None
    if not isinstance(data, dict) or not set(data) <= set(_JSON_INPUTS):
        keys = sorted(data) if isinstance(data, dict) else type(data).__name__
        raise TraceFormatError(f"{path} holds {keys}; {hint}.")
    arrays = {}
    for key, values in data.items():
        if not (isinstance(values, list) and all(type(v) is int and -2**63 <= v < 2**63 for v in values)):
            raise TraceFormatError(f"{path}: '{key}' must be a list of int64 integers; {hint}.")
        arrays[key] = np.asarray(values, dtype=np.int64).reshape(len(values))
    return arrays
