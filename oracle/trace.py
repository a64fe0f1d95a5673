"""`mtp-trace/1`: the reference-trace file format, and the only code in the project that touches HDF5.

A trace records T teacher-forced steps of an MTP head. Datasets are addressed by name, never by order, so a C/CUDA
team can write one with the HDF5 C API (or h5py) from this description alone.

Root attributes
    schema             "mtp-trace/1"                                          (required)
    num_tokens         T, integer                                             (required)
    hidden_size        D, integer                                             (required)
    stages             names of the /stages datasets present, in the family's stage order (oracle/stages.py);
                       absent: the default order (e, h, fc_in, fc, ah, attn, res1, mh, mlp, res2, out)
    family             e.g. "qwen3_5", "qwen3_5_moe" (oracle/families/registry.py); absent: LEGACY_FAMILY (oracle/stages.py)
    dims               JSON {"D", "E", "k", "hc"}: the sizes stage shapes are written in (absent: D = hidden_size)
    evidence_rules     JSON {"qk_dependent": [stages that see q/k only through attention], "absolute_positions",
                       "qk_parts": {part: [variant names]} (the columns of /evidence/qk_<part>),
                       "qk_parts_at_depth": {"j": {part: [names]}} (a chain depth's own columns), ...}
    producer           package and version, e.g. "mtp-oracle 0.1.0"
    versions           JSON: {"torch", "transformers", "h5py", "numpy"}
    config             JSON of the head config used
    checkpoint_digest  "sha256:<hex>" over (name, dtype, shape, stored bytes) of each head tensor, in name order
    inputs_digest      "sha256:<hex>" of the four /inputs datasets, see `inputs_digest`
    evidence_digest    "sha256:<hex>" of evidence_rules and the /evidence datasets, see `evidence_digest`; the
                       probe uses a reference's evidence only when it matches
    stage_checksums    JSON {stage: "crc32:<hex>"} of each stage's rows, see `stage_checksums`; the probe's diff
                       verifies every stage it read whole (absent in traces written before it: not verified)
    provenance         JSON: command line, checkpoint path, hidden source, seed, mode, dtype, git commit, time

Datasets
    /inputs/token_ids  int64   [T]      step i's token t_{i+1}
    /inputs/positions  int64   [T]      step i's RoPE position p_i
    /inputs/hidden     float32 [T, hc·D] H_i: the main model's post-final-norm hidden (the lm_head input); hc =
                                        dims.hc, 1 but for DeepSeek-V4, whose H is the main model's hc residual
                                        streams (last block output, before hc_head and the final norm)
    /inputs/embed      float32 [T, D]   embedding rows of token_ids as stored (bf16 widened exactly)
    /stages/<name>     float32 [T, w]   row t = step t; chunked by token rows. Attributes: `doc` (one line: what the
                                        stage is), `kind` ("rows": judged by the tolerance rule; "index_set": int64
                                        [T, k] compared as sets, e.g. topk_ids; the `draft` stage, [T, 1]) and
                                        `shape` (TxD, Tx2D, TxE, Txk, Txhc*D, Tx1; ASCII. Older traces: T×D …,
                                        still read). Absent attributes mean kind "rows".
    /evidence/attn_uniform
                       float32 [T, D]   optional (the oracle always writes it): `attn` recomputed from the same
                                        `ah` rows with uniform attention weights over the visible keys. Where it
                                        passes the tolerance rule against /stages/attn, that row cannot witness
                                        q, k, q_norm, k_norm or RoPE (oracle/attention_evidence.py); a reference
                                        without it can at best give an inconclusive verdict. It evidences the
                                        attention weights as a whole, never one part of the q/k path:
    /evidence/qk_<part>
                       float32 [T, V]   optional (the oracle writes one per part its family has: rope, q_norm,
                                        k_norm, kv_append, window, sink; QK_PARTS): column v = max_i |attn_i under
                                        the part's wrong variant v - attn_i| of that row, rounded toward zero; the
                                        variants' names, in column order, are evidence_rules.qk_parts {part:
                                        [names]} (oracle/qk_parts.py). The probe judges each column with the attn
                                        tolerance (max_rel = max_abs / max|attn row|): a row evidences a variant
                                        only where the variant would fail there; a reference without these
                                        datasets has the parts "not measured" (never claimed).

    /evidence/<name>   the other EVIDENCE_DOCS records (routing margins, draft_margin with its `row_norm_max`
                                        attribute), each [T, w] float32
    /chain/d{j}/...    depths 2..K of the draft loop, with the root `chain` record and `chain_digest`: see Chains
                                        at the end of this module

Every dataset above (and its group) is stored in the file itself: a hard link, not virtual. External and soft
links, virtual datasets and external raw storage are refused (TraceFormatError): the direct reader reads this
file's byte offsets. Every dataset has num_tokens rows (a file that contradicts itself is refused), and stores what
it claims: HDF5 reads rows never written as the fill value, so a tiny file can claim 1e9 rows; a dataset claiming
more than CLAIM_RATIO times the bytes it stores (plus CLAIM_SLACK) is refused when the file is opened.

The oracle writes every stage of its family. A candidate may omit stages it does not capture (never counted as passed) and
may omit /inputs. Files are written under a temporary name beside the target and renamed when complete, so an
interrupted write never leaves a file that looks finished.
"""

import functools
import hashlib
import json
import os
import re
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import h5py
import numpy as np

from oracle.errors import InputError, TraceFormatError
from oracle.output import atomic_output, hdf5_target
from oracle.reading import loads_json
from oracle.stages import (DRAFT, KINDS, KNOWN_STAGE_NAMES, ROWS, SHAPES, STAGE_BY_NAME, STAGE_NAMES, STAGES, Dims,
                           Stage, StageList, shape_symbol)

SCHEMA = "mtp-trace/1"
INPUT_NAMES = ("token_ids", "positions", "hidden", "embed")
HASH_BLOCK_BYTES = 4 << 20  # rows of /inputs and /evidence hashed at a time when a reader verifies their digests
# The parts of the q/k path whose wrong variants the export measures (oracle/qk_parts.py), each in its own
# /evidence/qk_<part> dataset, and what a row that evidences the part rules out (reports quote these).
QK_PARTS = {
    "rope": "RoPE (absent, over all head dims instead of the rotary ones, the other pairing of dims)",
    "q_norm": "q_norm (absent, or in the other RMSNorm form: w instead of 1+w or the reverse)",
    "k_norm": "k_norm (absent, or in the other RMSNorm form)",
    "kv_append": "the KV append (the current step's key missing from the keys it attends)",
    "window": "the sliding window (one key fewer, one key more, or no window)",
    "sink": "the attention sink (absent)",
}
# Per-token evidence records, [T, w] float32 like a stage, with the one-line meaning stored as the dataset's `doc`.
EVIDENCE_DOCS = {
    "attn_uniform": "attn recomputed from the same ah rows with uniform attention weights over the visible keys: "
                    "where it passes the tolerance rule against attn, that attn row cannot witness q, k, q_norm, "
                    "k_norm or RoPE",
    **{f"qk_{part}": f"[T, V] per token and wrong variant of {what}, in the order evidence_rules.qk_parts "
                     f"names them: max |variant attn row - attn row| over the measured columns (all up to 512, "
                     f"else every ceil(D/512)-th: a lower bound; oracle/qk_parts.py). Judged by the attn "
                     f"tolerance (max_rel = that / max|attn row|): where a variant passes, the row cannot witness "
                     f"that part" for part, what in QK_PARTS.items()},
    "topk_margin": "[T, 1] per token, the k-th selected expert's selection score minus the best unselected one's, "
                   "in router-logit units: where it is within the router_logits tolerance, a topk_ids flip is a "
                   "near-tie (rounding), not a wiring bug",
    "topk_flip": "[T, E] per token and expert, the smallest router-logit error (topk_margin's units; their minimum "
                 "is topk_margin) that could move that expert into or out of the chosen set: at a near-tie token a "
                 "topk_ids difference is rounding only when every expert the sets disagree on is within tolerance",
    "router_group_limited": "[T, 1] per token, 1 where a group-limited router's group limit (n_group, topk_group) "
                            "changed the expert choice (the plain top-k over all experts differs): a group-limit "
                            "error can show only at these tokens",
    "draft_margin": "[T, 1] per token, the top-1 minus the top-2 logit of the draft projection on out (exact, "
                    "rounded down); attribute row_norm_max is the largest L2 norm of a projection row: a draft flip "
                    "of a candidate whose out row is off by d (L2) is rounding only where draft_margin <= 2 * "
                    "row_norm_max * d (a near-tie), never a pass",
    "h_if_prenorm": "[n_j, width of h] chain depths only: the h this depth would have had, had the engine recycled "
                    "the family's pre-norm tensor (e.g. res2) instead of the recorded recycle; a row evidences the "
                    "recycle choice only where this fails the tolerance rule against stage h",
    "h_if_main": "[n_j, width of h] chain depths only: the h this depth would have had, had the engine fed the main "
                 "model's H_i at every depth; a row evidences the recycle choice only where this fails the "
                 "tolerance rule against stage h",
    "out_if_layer0": "[n_j, width of out] chain depths of an N-layer head that run a layer other than 0: the out this "
                     "depth would have had, had the engine run MTP layer 0 there (its weights on the same inputs; "
                     "vLLM without spec_step_idx); a row evidences the layer choice only where this fails the "
                     "tolerance rule against stage out",
}
_JSON_ATTRS = ("versions", "config", "provenance", "dims", "evidence_rules", "experts", "embedding",
               "stage_checksums")
_CHUNK_BYTES = 1 << 20
CLAIM_RATIO = 1100  # deflate, HDF5's strongest standard filter, compresses at most 1032:1
CLAIM_SLACK = 64 << 20  # unwritten rows below this are reported row by row (the diff's "unwritten" issue)


@dataclass(frozen=True)
class TraceInputs:
    """What every step consumes: token t_{i+1}, its embedding row, hidden H_i and position p_i."""

    token_ids: np.ndarray  # int64 [T]
    positions: np.ndarray  # int64 [T]
    hidden: np.ndarray  # float32 [T, hc·D] (hc = 1 but for hyper-connection heads: DeepSeek-V4)
    embed: np.ndarray  # float32 [T, D]

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def hidden_size(self) -> int:
        return int(self.embed.shape[1])  # D (the hidden is hc·D wide for a hyper-connection head)


def inputs_digest(inputs) -> str:
    """sha256 over name, dtype, shape and little-endian bytes of each input array, in INPUT_NAMES order. `inputs`:
    a TraceInputs, or {name: callable returning (dtype, shape, row blocks)} to hash rows as a reader streams them
    (TraceReader.inputs_digest: the same value, memory flat in T)."""
    digest = hashlib.sha256()
    for name in INPUT_NAMES:
        _hash_array(digest, name, inputs[name] if isinstance(inputs, dict) else getattr(inputs, name))
    return "sha256:" + digest.hexdigest()


def _hash_array(digest, name: str, arr) -> None:
    """`{name}|{little-endian dtype}|{shape}|` then the array's little-endian bytes, into `digest`. `arr`: an array,
    or a callable giving (dtype, shape, row blocks in order), hashed block by block without holding the whole."""
    if callable(arr):
        dtype, shape, blocks = arr()
    else:
        arr = np.ascontiguousarray(arr)
        dtype, shape, blocks = arr.dtype, arr.shape, (arr,)
    little = np.dtype(dtype).newbyteorder("<")
    digest.update(f"{name}|{little.str}|{list(shape)}|".encode())
    for block in blocks:
        digest.update(memoryview(np.ascontiguousarray(block, little).reshape(-1)).cast("B"))  # in place: no copy


def stage_checksums(stages: dict[str, np.ndarray]) -> dict[str, str]:
    """Per stage, the CRC-32 of its rows' little-endian bytes in row order ("crc32:%08x"): a reader that reads the
    rows anyway (the probe's diff) verifies them in passing, so a reference damaged or edited after export is
    refused instead of blaming the candidate. Unkeyed, like every digest here: it detects damage and careless
    edits, not a forger who recomputes it."""
    return {name: f"crc32:{zlib.crc32(np.ascontiguousarray(rows, rows.dtype.newbyteorder('<'))):08x}"
            for name, rows in stages.items()}


def evidence_digest(rules: dict | None, evidence: dict[str, np.ndarray]) -> str:
    """sha256 over the evidence rules (canonical JSON) and each /evidence dataset (name, dtype, shape, little-endian
    bytes, in name order). The probe trusts a reference's evidence only where this matches: edited evidence could
    otherwise turn blind rows into evidence (a false pass)."""
    digest = hashlib.sha256(json.dumps(rules or {}, sort_keys=True).encode())
    for name in sorted(evidence):
        _hash_array(digest, name, evidence[name])  # an array, or (dtype, shape, blocks) as a reader streams it
    return "sha256:" + digest.hexdigest()


def rows_per_chunk(width: int, num_tokens: int) -> int:
    """Token rows per HDF5 chunk (about 1 MiB of float32), also the probe's read granularity."""
    return max(1, min(num_tokens, _CHUNK_BYTES // (4 * width)))


@dataclass(frozen=True)
class ChainDepthRecord:
    """What a trace records of chain depth j (/chain/d{j}): its inputs (CHAIN_INPUT_NAMES), stages and evidence, each
    [n_j, ...] with row r = bridge position r; `evidence_attrs` {name: {attribute: value}} (draft_margin's
    row_norm_max)."""

    inputs: dict[str, np.ndarray]
    stages: dict[str, np.ndarray]
    evidence: dict[str, np.ndarray]
    evidence_attrs: dict[str, dict] = field(default_factory=dict)


def write_trace(path: Path, inputs: TraceInputs, stages: dict[str, np.ndarray], attrs: dict,
                option: str = "--out", evidence: dict[str, np.ndarray] | None = None,
                stage_list: StageList = STAGES, dims: Dims | None = None,
                evidence_attrs: dict[str, dict] | None = None,
                chain: dict | None = None, chains: dict[int, ChainDepthRecord] | None = None) -> None:
    """Write an `mtp-trace/1` file atomically.

    `stages` maps stage names (a subset of STAGES) to float32 [T, width] arrays; `attrs` holds the optional root
    attributes (family, producer, versions, config, checkpoint_digest, provenance); dict values are stored as JSON.
    The required attributes, `stages` and `inputs_digest` are derived here. `evidence` holds /evidence datasets
    (EVIDENCE_DOCS names), each float32 [T, w], `evidence_attrs` attributes on them. `stage_list` (the family's)
    gives order, widths, dtypes and the metadata stored on each dataset; `dims` the sizes widths are written in
    (default: D only). `chain` (the root `chain` record) and `chains` {j: ChainDepthRecord} add depths 2..K (see
    Chains below): their stages join stage_checksums as "d{j}/<name>", their evidence the evidence_digest as
    "d{j}/<name>", and chain_digest covers their inputs.
    """
    dims = dims or Dims(inputs.hidden_size)
    names = [n for n in stage_list.names if n in stages]
    unknown = set(stages) - set(names)
    if unknown:
        raise ValueError(f"unknown stage names {sorted(unknown)}; valid: {stage_list.names}")
    chains = _checked_chains(chain, chains or {}, inputs.num_tokens, names)
    checksums = stage_checksums({n: stages[n] for n in names})
    all_evidence = dict(evidence or {})
    for depth, record in chains.items():
        checksums |= {f"d{depth}/{k}": v for k, v in stage_checksums({n: record.stages[n] for n in names}).items()}
        all_evidence |= {f"d{depth}/{n}": v for n, v in record.evidence.items()}
    attrs = {"dims": dims.to_dict()} | attrs | {"stage_checksums": checksums}
    if all_evidence:
        attrs["evidence_digest"] = evidence_digest(attrs.get("evidence_rules"), all_evidence)
    if chains:
        attrs |= {"chain": chain, "chain_digest": chain_digest({j: r.inputs for j, r in chains.items()})}
    # h5py writes through hdf5_target: HDF5 never sees a failed write (a full disk), which it does not survive
    with atomic_output(path, option) as tmp, hdf5_target(tmp) as sink, _create_hdf5(sink) as f:
        _write_root_attrs(f, inputs, names, attrs)
        for name in INPUT_NAMES:
            f.create_dataset(f"inputs/{name}", data=getattr(inputs, name))
        for name in names:
            _write_stage(f, stage_list[name], stages[name], inputs.num_tokens, dims)
        for name, values in (evidence or {}).items():
            _write_evidence(f, name, values, inputs.num_tokens, attrs=(evidence_attrs or {}).get(name))
        for depth, record in chains.items():
            _write_chain_depth(f, depth, record, stage_list, names, dims)


def _checked_chains(chain: dict | None, chains: dict[int, ChainDepthRecord], num_tokens: int,
                    names: list[str]) -> dict[int, ChainDepthRecord]:
    """`chains` in depth order, checked against the `chain` record: depths 2..K, n_j rows, depth 1's stages."""
    if not chains:
        if chain is not None:
            raise ValueError("a `chain` record without chain depths")
        return {}
    if chain is None or sorted(chains) != list(range(2, chain["depths"] + 1)):
        raise ValueError(f"chain depths {sorted(chains)} do not match the chain record {chain}")
    for depth, record in chains.items():
        rows = chain_rows(num_tokens, depth)
        if set(record.stages) != set(names) or tuple(record.inputs) != CHAIN_INPUT_NAMES:
            raise ValueError(f"depth {depth}: stages {sorted(record.stages)} / inputs {tuple(record.inputs)}; need "
                             f"depth 1's stages {names} and the inputs {CHAIN_INPUT_NAMES}")
        if any(len(v) != rows for v in (*record.inputs.values(), *record.stages.values())):
            raise ValueError(f"depth {depth}: every input and stage needs n_j = {rows} rows")
    return dict(sorted(chains.items()))


def _write_chain_depth(f: h5py.File, depth: int, record: ChainDepthRecord, stage_list: StageList, names: list[str],
                       dims: Dims) -> None:
    rows, prefix = chain_rows(int(f.attrs["num_tokens"]), depth), f"chain/d{depth}"
    for name in CHAIN_INPUT_NAMES:
        f.create_dataset(f"{prefix}/inputs/{name}", data=record.inputs[name])
    for name in names:
        _write_stage(f, stage_list[name], record.stages[name], rows, dims, prefix)
    for name, values in record.evidence.items():
        _write_evidence(f, name, values, rows, prefix, record.evidence_attrs.get(name))


def _put(attrs, key: str, value) -> None:
    """Store an attribute; strings (and lists of them) as fixed-length UTF-8, inline in the object header. h5py's
    default, variable-length strings, live in a global heap, and libhdf5 can loop forever reading a damaged one
    (found by corrupting a trace byte by byte); a damaged inline string reads as garbage or fails cleanly."""
    if isinstance(value, str) or (isinstance(value, list) and value and all(isinstance(v, str) for v in value)):
        encoded = [v.encode("utf-8") for v in value] if isinstance(value, list) else value.encode("utf-8")
        longest = max(len(e) for e in encoded) if isinstance(encoded, list) else len(encoded)
        attrs.create(key, data=np.array(encoded, dtype=h5py.string_dtype("utf-8", max(longest, 1))))
    else:
        attrs[key] = value


def _create_hdf5(sink) -> h5py.File:
    """A new HDF5 file on the file object `sink`, whose groups keep up to 64 attributes in their object header
    ("compact" storage) instead of moving them to a fractal heap after 8: a trace's root has more than 8, and
    libhdf5 can loop forever reading a damaged attribute heap (found by corrupting a trace byte by byte), where a
    damaged compact attribute fails cleanly."""
    from h5py._hl import files

    fcpl = h5py.h5p.create(h5py.h5p.FILE_CREATE)
    fcpl.set_attr_phase_change(64, 48)
    fapl = files.make_fapl("fileobj", fileobj=sink)
    return h5py.File(files.make_fid(repr(sink).encode("ascii", "replace"), "w", None, fapl, fcpl))


def _write_root_attrs(f: h5py.File, inputs: TraceInputs, names: list[str], attrs: dict) -> None:
    _put(f.attrs, "schema", SCHEMA)
    f.attrs["num_tokens"] = inputs.num_tokens
    f.attrs["hidden_size"] = inputs.hidden_size
    _put(f.attrs, "stages", list(names))
    _put(f.attrs, "inputs_digest", inputs_digest(inputs))
    for key, value in attrs.items():
        _put(f.attrs, key, json.dumps(value, sort_keys=True) if isinstance(value, dict) else value)


def _write_stage(f: h5py.File, stage: Stage, values: np.ndarray, rows: int, dims: Dims, prefix: str = "") -> None:
    width = stage.width(dims)
    if values.shape != (rows, width) or values.dtype != np.dtype(stage.dtype):
        raise ValueError(f"stage {prefix}/{stage.name}: got {values.dtype} {values.shape}, need {stage.dtype} "
                         f"{(rows, width)}")
    ds = f.create_dataset(f"{prefix + '/' if prefix else ''}stages/{stage.name}", data=values,
                          chunks=(rows_per_chunk(max(width, 1), rows), max(width, 1)))
    for key, value in (("doc", stage.doc), ("kind", stage.kind), ("shape", stage.shape)):
        _put(ds.attrs, key, value)


def _write_evidence(f: h5py.File, name: str, values: np.ndarray, rows: int, prefix: str = "",
                    attrs: dict | None = None) -> None:
    shape = (rows, values.shape[-1] if values.ndim == 2 else -1)
    if name not in EVIDENCE_DOCS or values.shape != shape or values.dtype != np.float32:
        raise ValueError(f"evidence {prefix}/{name}: got {values.dtype} {values.shape}, need one of "
                         f"{sorted(EVIDENCE_DOCS)} as float32 [{rows}, w]")
    ds = f.create_dataset(f"{prefix + '/' if prefix else ''}evidence/{name}", data=values,
                          chunks=(rows_per_chunk(shape[1], shape[0]), shape[1]))
    _put(ds.attrs, "doc", EVIDENCE_DOCS[name])
    for key, value in (attrs or {}).items():
        _put(ds.attrs, key, value)


class TraceReader:
    """An open trace: root attributes, the stages present, and row-range reads (memory bounded by the range)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._file = _open_hdf5(self.path)
        self._layouts: dict[str, _PlainRows | None] = {}  # per dataset path, found on first read
        try:
            self.attrs = self._guard("the root attributes", lambda: _read_root_attrs(self._file, self.path))
            self.num_tokens = int(self.attrs["num_tokens"])
            self.hidden_size = int(self.attrs["hidden_size"])
            self.stages = self._guard("/stages", self._present_stages)
            for group in ("inputs", "evidence"):
                self._guard(f"/{group}", lambda: _check_datasets_group(self._file, group, self.path))
            self._guard("the datasets' sizes", lambda: _check_claims(self._file, self.path, self.num_tokens))
        except BaseException:
            self._file.close()
            raise

    def _guard(self, what: str, read):
        """Run `read`; h5py reports damage as OSError, RuntimeError or KeyError from whichever call meets it."""
        try:
            return read()
        except (OSError, RuntimeError, KeyError, UnicodeDecodeError) as err:  # (a damaged name: not UTF-8)
            raise TraceFormatError(f"{self.path} is corrupt or truncated: reading {what} failed ({err}). Write "
                                   f"the trace again ({export_hint(self.path)}).") from None

    def __enter__(self) -> "TraceReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._file.close()

    def _present_stages(self) -> tuple[str, ...]:
        """The stage datasets in the file's declared order (root `stages`); without it, the default order."""
        group = _check_datasets_group(self._file, "stages", self.path)
        declared = self.attrs.get("stages")
        if declared is None:
            unknown = sorted(set(group) - set(STAGE_NAMES))
            if unknown:
                raise TraceFormatError(f"{self.path}: unknown stage datasets {unknown} and no `stages` attribute "
                                       f"declaring them; the default names are {', '.join(STAGE_NAMES)}.")
            return tuple(n for n in STAGE_NAMES if n in group)
        odd = next((n for n in declared if not isinstance(n, str) or not STAGE_NAME_PATTERN.fullmatch(n)), None)
        if odd is not None:  # names reach HTML, terminals, plot labels and the verdict line: an identifier only
            raise TraceFormatError(f"{self.path}: the `stages` attribute names a stage {odd!r:.80}; stage names are "
                                   f"lower-case identifiers (letters, digits, _), like {', '.join(STAGE_NAMES[:4])}.")
        extra, missing = sorted(set(group) - set(declared)), sorted(set(declared) - set(group))
        if extra:
            raise TraceFormatError(f"{self.path}: unknown stage datasets {extra}; valid names are "
                                   f"{', '.join(declared)} (the file's `stages` attribute).")
        if missing or len(set(declared)) != len(declared):
            raise TraceFormatError(f"{self.path}: the `stages` attribute lists {list(declared)}, but /stages holds "
                                   f"{sorted(group)}; write them consistently (every dataset named once).")
        return tuple(declared)

    @property
    def stage_list(self) -> StageList:
        """The present stages with their metadata (dataset attributes; the default list's where absent)."""
        return self._guard("/stages", lambda: StageList(self._stage_meta(n) for n in self.stages))

    def _stage_meta(self, name: str) -> Stage:
        attrs = self._dataset(f"stages/{name}").attrs
        known = STAGE_BY_NAME.get(name)
        doc = _as_str(attrs.get("doc", known.doc if known else ""))
        shape = _as_str(attrs.get("shape", known.shape if known else "TxD"))
        shape = shape_symbol(shape) if isinstance(shape, str) else shape  # T×D in traces written before issue 28
        kind = _as_str(attrs.get("kind", ROWS))
        if not isinstance(kind, str) or not isinstance(shape, str) or kind not in KINDS or shape not in SHAPES:
            raise TraceFormatError(f"{self.path}: /stages/{name} has kind {kind!r} / shape {shape!r}; kinds are "
                                   f"{', '.join(KINDS)}, shapes {', '.join(SHAPES)}.")
        return Stage(name, shape, str(doc), kind)

    @property
    def dims(self) -> Dims:
        d = self.attrs.get("dims")
        if d is None:
            return Dims(self.hidden_size)
        try:
            return Dims.from_dict(d)
        except (KeyError, TypeError, ValueError):
            raise TraceFormatError(f"{self.path}: root attribute 'dims' is {d}; expected integers "
                                   f'{{"D", "E", "k", "hc"}}.') from None

    def _dataset(self, path: str) -> h5py.Dataset:
        # Looked up per read on purpose: a kept Dataset keeps its HDF5 chunk cache (measured: +240 MB in a diff).
        return self._file[path]

    def _rows(self, path: str, start: int, stop: int | None, out: np.ndarray | None) -> np.ndarray:
        """Rows start..stop of a dataset (into `out` if given): straight from the file when it is stored plainly,
        else by h5py (which also converts to `out`'s dtype)."""
        if path not in self._layouts:
            self._layouts[path] = _PlainRows.of(self._dataset(path))
        layout = self._layouts[path]
        if layout is not None and (out is None or out.dtype == layout.dtype):
            return layout.read(self._file.id.get_vfd_handle(), start, stop, out, self.path, path)
        if out is None:
            return self._dataset(path)[start:stop]
        self._dataset(path).read_direct(out, np.s_[start:stop])
        return out

    def read_route(self, path: str) -> str:
        """How rows of `path` are read: "direct" (plain storage, os.preadv) or "h5py" (anything else)."""
        return self._guard(path, lambda: "h5py" if _PlainRows.of(self._dataset(path)) is None else "direct")

    def stage_shape(self, name: str) -> tuple[int, ...]:
        return self._guard(f"/stages/{name}", lambda: tuple(self._dataset(f"stages/{name}").shape))

    def stage_dtype(self, name: str) -> np.dtype:
        return self._guard(f"/stages/{name}", lambda: self._dataset(f"stages/{name}").dtype)

    def stage_rows(self, name: str, start: int = 0, stop: int | None = None,
                   out: np.ndarray | None = None) -> np.ndarray:
        """Rows start..stop of /stages/<name>, as stored; or into `out` (C-contiguous, the rows' shape), converted
        to its dtype, so that a long read loop reuses one buffer instead of faulting in fresh pages for each read."""
        return self._guard(f"/stages/{name} rows {start}..{stop}",
                           lambda: self._rows(f"stages/{name}", start, stop, out))

    def unwritten_rows(self, name: str) -> np.ndarray | None:
        """Which rows of /stages/<name> (bool [T]) lie, wholly or in part, in storage the file never wrote (a chunk
        never allocated, a contiguous dataset never written): HDF5 reads them as the dataset's fill value, which no
        computation produced. None when every row was written (the oracle's traces: write_trace writes them all)."""
        return self._guard(f"/stages/{name}", lambda: _unwritten_rows(self._dataset(f"stages/{name}")))

    @property
    def has_inputs(self) -> bool:
        return self._guard("/inputs", lambda: all(f"inputs/{n}" in self._file for n in INPUT_NAMES))

    def input_names(self) -> tuple[str, ...]:
        """The /inputs datasets present, in INPUT_NAMES order (a candidate may record any subset)."""
        return self._guard("/inputs", lambda: tuple(n for n in INPUT_NAMES if f"inputs/{n}" in self._file))

    def has_evidence(self, name: str) -> bool:
        return self._guard("/evidence", lambda: f"evidence/{name}" in self._file)

    def evidence_names(self) -> tuple[str, ...]:
        return self._guard("/evidence", lambda: tuple(sorted(self._file.get("evidence", {}))))

    def evidence_verified(self) -> bool | None:
        """True when the recorded evidence_digest matches the evidence rules and /evidence; None when the trace
        records no digest (then its evidence is not trusted); False when it does not match."""
        recorded = self.attrs.get("evidence_digest")
        if recorded is None:
            return None
        arrays = {n: functools.partial(self._blocks, "evidence", n, self.evidence_rows) for n in self.evidence_names()}
        return evidence_digest(self.attrs.get("evidence_rules"), arrays) == recorded

    def inputs_digest(self) -> str:
        """`inputs_digest` of /inputs as stored, hashed a block of rows at a time (every input must be there)."""
        return inputs_digest({n: functools.partial(self._blocks, "inputs", n, self.input_rows) for n in INPUT_NAMES})

    def _blocks(self, group: str, name: str, read):
        """(dtype, shape, row blocks) of /<group>/<name>, the blocks (~4 MiB each) read one at a time by `read`
        (name, start, stop): hashing keeps memory flat in T (a [T, D] dataset read whole, then copied to bytes,
        was most of the diff's peak: 327 MB at T=4096, D=5120)."""
        dtype, shape = self._guard(f"/{group}/{name}", lambda: (self._file[group][name].dtype,
                                                                 self._file[group][name].shape))
        if not shape:  # a scalar is hashed as the writer's ascontiguousarray saw it: shape [1]
            return dtype, (1,), (np.reshape(read(name), (1,)),)
        rows = max(1, HASH_BLOCK_BYTES // max(1, int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize))
        return dtype, shape, (read(name, start, min(start + rows, shape[0])) for start in range(0, shape[0], rows))

    def evidence_rows(self, name: str, start: int = 0, stop: int | None = None,
                      out: np.ndarray | None = None) -> np.ndarray:
        """Rows start..stop of /evidence/<name> (EVIDENCE_DOCS)."""
        return self._guard(f"/evidence/{name} rows {start}..{stop}",
                           lambda: self._rows(f"evidence/{name}", start, stop, out))

    def input_shape(self, name: str) -> tuple[int, ...]:
        """The stored shape of /inputs/<name> (which may disagree with num_tokens: a reader checks it)."""
        return self._guard(f"/inputs/{name}", lambda: tuple(self._dataset(f"inputs/{name}").shape))

    def input_rows(self, name: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        return self._guard(f"/inputs/{name} rows {start}..{stop}",
                           lambda: self._rows(f"inputs/{name}", start, stop, None))

    def inputs(self) -> TraceInputs:
        """All of /inputs, shape-checked against num_tokens and hidden_size."""
        if not self.has_inputs:
            raise TraceFormatError(f"{self.path} has no complete /inputs group ({', '.join(INPUT_NAMES)}).")
        arrays = {n: self.input_rows(n) for n in INPUT_NAMES}
        t, d = self.num_tokens, self.hidden_size
        w = self.dims.hc_mult * d  # the hidden: hc streams of D (DeepSeek-V4), else D
        for name, shape in (("token_ids", (t,)), ("positions", (t,)), ("hidden", (t, w)), ("embed", (t, d))):
            if arrays[name].shape != shape:
                raise TraceFormatError(f"{self.path}: /inputs/{name} has shape {arrays[name].shape}, "
                                       f"expected {shape} from num_tokens={t}, hidden_size={d}.")
        return TraceInputs(**arrays)

    def verified_inputs(self) -> TraceInputs:
        """inputs(), refused (TraceFormatError) when the recorded inputs_digest does not match them: inputs edited
        after export are not the ones the stages were computed from (the probe refuses such a reference too)."""
        inputs = self.inputs()
        recorded = self.attrs.get("inputs_digest")
        actual = inputs_digest(inputs)
        if recorded is not None and actual != recorded:
            raise TraceFormatError(f"{self.path}: its /inputs hash to {actual[:19]}…, but its inputs_digest "
                                   f"attribute says {str(recorded)[:19]}…: the inputs were changed after export, so "
                                   f"its stages are not the oracle's output for them. Write it again: "
                                   f"{export_hint(self.path)}")
        return inputs


def _chunk_infos(ds: h5py.Dataset) -> list:
    """The allocated chunks of a chunked dataset (offset, filter mask, byte offset, size each)."""
    if hasattr(ds.id, "chunk_iter"):  # one pass over the chunk index (HDF5 >= 1.14)
        infos: list = []
        ds.id.chunk_iter(infos.append)
        return infos
    return [ds.id.get_chunk_info(i) for i in range(ds.id.get_num_chunks())]


def _unwritten_rows(ds: h5py.Dataset) -> np.ndarray | None:
    """See TraceReader.unwritten_rows."""
    if ds.ndim == 0 or ds.shape[0] == 0:
        return None
    layout = ds.id.get_create_plist().get_layout()
    if layout == h5py.h5d.CONTIGUOUS:
        return np.ones(ds.shape[0], dtype=bool) if ds.id.get_offset() is None else None
    if layout != h5py.h5d.CHUNKED:  # compact: stored in the header, always written
        return None
    infos = _chunk_infos(ds)
    per_row_block = int(np.prod([-(-n // c) for n, c in zip(ds.shape[1:], ds.chunks[1:])], dtype=np.int64))
    rows = ds.chunks[0]
    written = np.bincount([info.chunk_offset[0] // rows for info in infos], minlength=-(-ds.shape[0] // rows))
    if (written >= per_row_block).all():
        return None
    return np.repeat(written < per_row_block, rows)[: ds.shape[0]]


class _PlainRows:
    """Where the rows of a plainly stored dataset lie in the file, so they can be read with os.preadv.

    h5py reads a chunk at a time with Python between chunks and takes the GIL back for each, which makes reading
    a few times slower than the disk cache allows and stalls any other thread. "Plain": a little-endian numeric
    dataset with no filters (no compression, no checksum), contiguous or chunked in whole rows, every chunk
    written (an unwritten chunk reads as the fill value, which only HDF5 knows). Every other dataset is read by
    h5py; both routes give the same values (tests/oracle/test_trace_read.py).
    """

    def __init__(self, dtype: np.dtype, shape: tuple[int, ...], extents: list[tuple[int, int, int]]):
        self.dtype, self.shape = dtype, shape
        self.extents = extents  # (first row, rows, byte offset) in row order, adjacent pieces merged

    @staticmethod
    def of(ds: h5py.Dataset) -> "_PlainRows | None":
        """The plain layout of `ds`, or None when h5py must read it."""
        dcpl = ds.id.get_create_plist()
        if (ds.ndim == 0 or ds.dtype.kind not in "fiu" or ds.dtype.byteorder == ">" or not np.little_endian
                or dcpl.get_nfilters() or dcpl.get_external_count()):
            return None
        row_bytes = ds.dtype.itemsize * int(np.prod(ds.shape[1:], dtype=np.int64))
        layout = dcpl.get_layout()
        if layout == h5py.h5d.CONTIGUOUS:
            offset = ds.id.get_offset()
            return None if offset is None else _PlainRows(ds.dtype, ds.shape, [(0, ds.shape[0], offset)])
        if layout != h5py.h5d.CHUNKED or tuple(ds.chunks[1:]) != tuple(ds.shape[1:]):
            return None
        chunks = sorted((info.chunk_offset[0], info.filter_mask, info.byte_offset, info.size)
                        for info in _chunk_infos(ds))
        chunk_rows = ds.chunks[0]
        expected_rows = list(range(0, ds.shape[0], chunk_rows))
        if [c[0] for c in chunks] != expected_rows or any(mask or size != chunk_rows * row_bytes
                                                          for _, mask, _, size in chunks):
            return None  # a chunk never written, or stored differently
        extents: list[tuple[int, int, int]] = []
        for first, _, offset, _ in chunks:
            last = extents[-1] if extents else None
            if last and last[2] + last[1] * row_bytes == offset:  # the next chunk follows in the file
                extents[-1] = (last[0], last[1] + chunk_rows, last[2])
            else:
                extents.append((first, chunk_rows, offset))
        return _PlainRows(ds.dtype, ds.shape, extents)

    def read(self, fd: int, start: int, stop: int | None, out: np.ndarray | None, path: Path,
             name: str) -> np.ndarray:
        start, stop, _ = slice(start, stop).indices(self.shape[0])
        shape = (max(stop - start, 0),) + tuple(self.shape[1:])
        if out is None:
            out = np.empty(shape, dtype=self.dtype.newbyteorder("="))
        elif out.shape != shape or not out.flags.c_contiguous:
            raise ValueError(f"out has shape {out.shape}, rows {start}..{stop} of /{name} need a C-contiguous {shape}")
        buffer = memoryview(out.reshape(-1).view(np.uint8))
        row_bytes = out.itemsize * int(np.prod(self.shape[1:], dtype=np.int64))
        for first, rows, offset in self.extents:
            lo, hi = max(start, first), min(stop, first + rows)
            if lo >= hi:
                continue
            want = (hi - lo) * row_bytes
            got = os.preadv(fd, [buffer[(lo - start) * row_bytes:(hi - start) * row_bytes]],
                            offset + (lo - first) * row_bytes)
            if got != want:
                raise TraceFormatError(f"{path} is truncated: /{name} rows {lo}..{hi - 1} end past the end of the "
                                       f"file. Write the file again.")
        return out


def export_hint(path: Path) -> str:
    """`mtp-oracle export CHECKPOINT --out NEW`, NEW a free name beside `path` (ref.h5, ref-2.h5, ...): never
    `path` itself, which may be the user's weights or the only copy of a damaged trace, nor any existing file, and
    never inside a checkpoint folder (`path` a shard given as the trace: the trace goes beside the folder)."""
    folder = Path(path).parent
    while _is_checkpoint_folder(folder) and folder.parent != folder:
        folder = folder.parent
    names = ["ref.h5", *(f"ref-{n}.h5" for n in range(2, 100))]
    fresh = next((folder / n for n in names if not (folder / n).exists() and folder / n != Path(path)),
                 folder / "new-ref.h5")
    return f"mtp-oracle export CHECKPOINT --out {fresh}"


def _is_checkpoint_folder(folder: Path) -> bool:
    try:
        return (folder / "config.json").is_file() or any(folder.glob("*.safetensors"))
    except OSError:
        return False


def read_trace(path: Path) -> TraceReader:
    """Open an `mtp-trace/1` file for reading (use as a context manager).

    Raises TraceFormatError, with a regeneration hint, if the file is not HDF5, is truncated, or carries another
    schema. Stage datasets are not read until asked for: `stage_rows(name, start, stop)` reads a row range.
    """
    return TraceReader(path)


def _open_hdf5(path: Path) -> h5py.File:
    if not path.is_file():
        what = ("does not exist" if not path.exists() else "is a directory, not a trace file" if path.is_dir()
                else "is not a regular file (a device, FIFO or socket); give the path of an .h5 trace")
        raise TraceFormatError(f"trace {path} {what}.")
    try:
        return h5py.File(path, "r")
    except OSError as err:
        raise TraceFormatError(f"{path} is not a readable HDF5 file (truncated or corrupt?): {err}. "
                               f"A reference trace is written by: {export_hint(path)}") from None


def _read_root_attrs(f: h5py.File, path: Path) -> dict:
    schema = f.attrs.get("schema")
    if schema is None:
        raise TraceFormatError(f"{path} is HDF5 but not an mtp trace (no 'schema' attribute).")
    schema = _as_str(schema)
    if schema != SCHEMA:
        raise TraceFormatError(f"{path} has schema {schema}, this tool reads {SCHEMA}. "
                               f"Regenerate with: {export_hint(path)}")
    attrs = {}
    for key, value in f.attrs.items():
        value = _as_str(value)
        attrs[key] = _json_object_attr(path, key, value) if key in _JSON_ATTRS else value
    for key in ("num_tokens", "hidden_size"):
        if key not in attrs:
            raise TraceFormatError(f"{path}: required root attribute '{key}' is missing.")
        attrs[key] = _positive_int_attr(path, key, attrs[key])
    if "stages" in attrs:
        attrs["stages"] = _stage_names_attr(path, attrs["stages"])
    for key in ("family", "producer", "checkpoint_digest", "inputs_digest", "evidence_digest"):
        if key in attrs and not isinstance(attrs[key], str):
            raise TraceFormatError(f"{path}: root attribute '{key}' is {_attr_kind(attrs[key])}; the schema says a "
                                   f"string (oracle/trace.py).")
    return attrs


# The root attributes' schema, checked where they are read: a wrong type is a TraceFormatError naming it.
def _json_object_attr(path: Path, key: str, value) -> dict:
    try:
        parsed = loads_json(value, "it", TraceFormatError) if isinstance(value, str) else None
    except TraceFormatError as err:  # not JSON, or beyond the limits (oracle/reading.py)
        raise TraceFormatError(f"{path}: root attribute '{key}' must be a string holding a JSON object; {err} Write "
                               f"it with json.dumps (oracle/trace.py).") from None
    if not isinstance(parsed, dict):
        raise TraceFormatError(f"{path}: root attribute '{key}' must be a string holding a JSON object, found "
                               f"{_attr_kind(value)}. Write it with json.dumps (oracle/trace.py).")
    return parsed


def _positive_int_attr(path: Path, key: str, value) -> int:
    if not isinstance(value, (int, np.integer)) or isinstance(value, (bool, np.bool_)):
        raise TraceFormatError(f"{path}: root attribute '{key}' must be an integer, found {_attr_kind(value)}.")
    if key == "num_tokens" and value == 0:
        raise TraceFormatError(f"{path}: the trace has no tokens (num_tokens = 0); there is nothing to compare. "
                               f"Write at least one step.")
    if value <= 0:
        raise TraceFormatError(f"{path}: root attribute '{key}' must be a positive integer, found {value}.")
    return int(value)


def _stage_names_attr(path: Path, value) -> list[str]:
    names = [_as_str(s) for s in value] if isinstance(value, (list, tuple, np.ndarray)) and np.ndim(value) == 1 \
        else None
    if names is None or not all(isinstance(n, str) for n in names):
        raise TraceFormatError(f"{path}: root attribute 'stages' must be a list of stage names, found "
                               f"{_attr_kind(value)}.")
    return names


def _attr_kind(value) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"


def _check_datasets_group(f: h5py.File, name: str, path: Path) -> h5py.Group | dict:
    """/name, which must be a group of datasets when present ({} when absent)."""
    if f.get(name, getlink=True) is None:  # (`name in f` is False for a dangling link)
        return {}
    _check_hard_link(f, name, path)
    group = f[name]
    if not isinstance(group, h5py.Group):
        raise TraceFormatError(f"{path}: /{name} is a dataset; it must be a group holding one dataset per name "
                               f"(oracle/trace.py).")
    for member in group:
        _check_hard_link(group, member, path)
        if group.get(member, getclass=True) is not h5py.Dataset:
            raise TraceFormatError(f"{path}: /{name}/{member} is a group where a dataset belongs; each member of "
                                   f"/{name} is a [T, ...] dataset (oracle/trace.py).")
        dataset = group[member]
        if dataset.is_virtual or dataset.id.get_create_plist().get_external_count():
            kind = "a virtual dataset" if dataset.is_virtual else "stored in external raw files"
            raise TraceFormatError(f"{path}: /{name}/{member} is {kind} (its values live in other files); a "
                                   f"trace stores every dataset in the file itself. Copy the values in (h5py: "
                                   f"f[name] = values) or write the trace with write_trace.")
        if dataset.dtype.kind not in "fiu" or dataset.ndim == 0:
            raise TraceFormatError(f"{path}: /{name}/{member} holds {dataset.dtype} {list(dataset.shape)}; the "
                                   f"schema says a numeric [T, ...] array (float32 for stages, oracle/trace.py).")
    return group


def _check_claims(f: h5py.File, path: Path, num_tokens: int) -> None:
    """Every dataset has num_tokens rows, and stores the bytes it claims (within CLAIM_RATIO): a file that
    contradicts itself, or claims rows it never stored (read for ever, or allocated: 1e9 rows of D=64 are 238 GiB),
    is refused before anything is read."""
    for group in ("inputs", "stages", "evidence"):
        for member, ds in (f[group].items() if f.get(group, getlink=True) is not None else ()):
            where = f"/{group}/{member}"
            if ds.shape[0] != num_tokens:
                raise TraceFormatError(f"{path}: {where} has {ds.shape[0]} rows, but the root attribute num_tokens "
                                       f"says {num_tokens}: the file contradicts itself. Write it again, one row per "
                                       f"step in every dataset.")
            if 0 in ds.shape[1:]:
                raise TraceFormatError(f"{path}: {where} has shape {list(ds.shape)}: rows of no values; every "
                                       f"dataset of a trace has rows of width 1 or more (oracle/trace.py).")
            claimed = ds.dtype.itemsize * int(np.prod(ds.shape, dtype=object))
            stored = ds.id.get_storage_size()
            if claimed > CLAIM_RATIO * stored + CLAIM_SLACK:
                raise TraceFormatError(f"{path}: {where} claims {list(ds.shape)} {ds.dtype} ({_size(claimed)}), but "
                                       f"the file stores {_size(stored)} of it: rows never written read as the "
                                       f"fill value. Write the trace again, every row of every dataset.")


def _size(nbytes: int) -> str:
    return f"{nbytes / (1 << 30):.1f} GiB" if nbytes >= 1 << 30 else f"{nbytes / (1 << 20):.1f} MiB" \
        if nbytes >= 1 << 20 else f"{nbytes} bytes"


def _check_hard_link(group: h5py.Group, member: str, path: Path) -> None:
    """`member` of `group` must be a hard link: HDF5 follows an external or soft link to values stored elsewhere
    (another file, another dataset), while the fast reader (_PlainRows) reads byte offsets in this file, so a
    link could make the reader see one set of values and h5py another (a false pass)."""
    link = group.get(member, getlink=True)
    if not isinstance(link, h5py.HardLink):
        where = f"{group.name.rstrip('/')}/{member}"
        target = f"{link.filename}:{link.path}" if isinstance(link, h5py.ExternalLink) else getattr(link, "path", "?")
        kind = "an external link" if isinstance(link, h5py.ExternalLink) else "a soft link"
        raise TraceFormatError(f"{path}: {where} is {kind} (to {target}); a trace stores every dataset in the file "
                               f"itself. Copy the values in (h5py: del f[name]; f[name] = values) or write the "
                               f"trace with write_trace.")


STAGE_NAME_PATTERN = re.compile(r"[a-z][a-z0-9_]{0,63}")  # every stage of every family; see _present_stages


def _as_str(value):
    return value.decode("utf-8", errors="replace") if isinstance(value, bytes) else value


def array_from_hdf5(path: Path, dataset: str, check=None) -> np.ndarray:
    """One dataset of a user's HDF5 file (for `--hidden FILE.h5:/dataset`), reached through hard links only (a soft
    or external link may dangle, loop or lead to another file); `check(shape, dtype)` runs before a byte is read, so
    a dataset claiming 1e9 rows is refused, never allocated."""
    f = _open_hdf5(Path(path))
    with f:
        try:
            node = _hard_linked(f, dataset, path)
            if check is not None:
                check(tuple(node.shape), node.dtype)
            return node[()]
        except (OSError, RuntimeError, KeyError, ValueError) as err:  # h5py's report of a damaged file
            raise InputError(f"{path}: reading {dataset} failed ({err}); the file is damaged or not plain HDF5. "
                             f"Write it again.") from None


def _hard_linked(f: h5py.File, dataset: str, path: Path) -> h5py.Dataset:
    """`dataset` of `f`, each step of its path a hard link (InputError naming the link otherwise)."""
    node, walked = f, ""
    for part in [p for p in dataset.split("/") if p]:
        walked += "/" + part
        link = node.get(part, getlink=True) if isinstance(node, h5py.Group) else None
        if link is None:
            raise InputError(f"{path} has no dataset {dataset}; its datasets are: "
                             f"{', '.join(_dataset_names(f)) or 'none'}.")
        if not isinstance(link, h5py.HardLink):
            kind = "an external link" if isinstance(link, h5py.ExternalLink) else "a soft link"
            target = f"{link.filename}:{link.path}" if isinstance(link, h5py.ExternalLink) else link.path
            raise InputError(f"{path}: {walked} is {kind} (to {target}); give the dataset itself, stored in this "
                             f"file (--hidden FILE.h5:/path/of/the/dataset).")
        node = node[part]
    if not isinstance(node, h5py.Dataset):
        raise InputError(f"{path}: {dataset} is a group, not a dataset; its datasets are: "
                         f"{', '.join(_dataset_names(f)) or 'none'}.")
    return node


def _dataset_names(f: h5py.File) -> list[str]:
    """The hard-linked datasets of `f` (visititems follows hard links only), at most 20 named."""
    names = []
    f.visititems(lambda name, obj: names.append("/" + name) if isinstance(obj, h5py.Dataset) else None)
    return names[:20] + ([f"… {len(names) - 20} more"] if len(names) > 20 else [])


# --- Chains (issue 24; the schema, summarised here) --------------------------------------------------------------------
# Root attribute `chain` (JSON; absent: the trace records depth 1 only) {"depths": K >= 2, "tokens": "teacher_forced" |
# "argmax", "recycle": stage name, "layers": [l_2..l_K], "num_layers": N, "kv": "dropped_after_chain" (one layer) |
# "per_layer_teacher_forced" | "per_layer_engine_order" (N layers: oracle/export.py KV_CONVENTIONS)}. Depth j = 2..K
# lives in /chain/d{j} with n_j = T - j + 1 rows, row r = bridge position r (bridge i has depth j iff i + j - 1 <= T-1):
#     inputs/{bridge, token_ids, positions, layer} int64 [n_j]; inputs/recycled float32 [n_j, w]; inputs/embed [n_j, D]
#     stages/<name>    [n_j, width], every stage of the family, with depth 1's names, attributes and order
#     evidence/<name>  as /evidence (attn_uniform, topk_margin, draft_margin, qk_<part> with the root's
#                      evidence_rules.qk_parts columns, or evidence_rules.qk_parts_at_depth["j"]'s where given (an
#                      N-layer head's layer j-1), measured on this depth's own attn rows) plus
#                      h_if_<alt> [n_j, width of h]:
#                      the `h` this depth would have had had the engine recycled <alt> ("prenorm", "main") instead
#                      and, where an N-layer head runs a layer other than 0, out_if_layer0 [n_j, width of out]
# Root `stage_checksums` holds "d{j}/<name>" for chain stages; root `chain_digest` ("sha256:...") covers every
# /chain/d{j}/inputs dataset, in depth then CHAIN_INPUT_NAMES order. The root `evidence_digest` covers chain evidence
# too where the writer includes it (keys "d{j}/<name>" among /evidence's names, see evidence_covers_chain): chain
# evidence it does not cover is not trusted by the probe.
CHAIN_INPUT_NAMES = ("bridge", "token_ids", "positions", "layer", "recycled", "embed")
CHAIN_TOKENS = ("teacher_forced", "argmax")
_DEPTH_GROUP = re.compile(r"d([2-9]|[1-9][0-9]{1,3})")


@dataclass(frozen=True)
class ChainInfo:
    """The root `chain` record: which depths a trace holds and the loop conventions they were computed with."""

    depths: int  # K: depths 2..K are recorded
    tokens: str  # teacher_forced | argmax
    recycle: str  # the stage depth j-1 hands to depth j as its hidden
    layers: tuple[int, ...]  # physical layer at depths 2..K
    num_layers: int
    kv: str
    layer_convention: str | None = None  # N-layer heads: how depth j picks its layer (e.g. vLLM's spec_step_idx % N)

    @property
    def chain_depths(self) -> tuple[int, ...]:
        return tuple(range(2, self.depths + 1))


def chain_rows(num_tokens: int, depth: int) -> int:
    """n_j: bridge positions 0..T-j have a depth-j step (teacher-forced depth j of bridge i feeds x_{i+j})."""
    return max(num_tokens - depth + 1, 0)


def chain_info(reader: "TraceReader") -> ChainInfo | None:
    """The trace's `chain` record, validated (TraceFormatError naming the field); None for a depth-1-only trace."""
    raw = reader._file.attrs.get("chain")
    if raw is None:
        return None
    record = _json_object_attr(reader.path, "chain", _as_str(raw))
    fields = {"depths": int, "tokens": str, "recycle": str, "layers": list, "num_layers": int, "kv": str}
    for key, kind in fields.items():
        value = record.get(key)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise TraceFormatError(f"{reader.path}: root attribute 'chain' needs {key} as {kind.__name__}, found "
                                   f"{_attr_kind(value)} (oracle/trace.py, Chains).")
    depths, layers = record["depths"], record["layers"]
    if not 2 <= depths < reader.num_tokens + 1 or record["tokens"] not in CHAIN_TOKENS or \
            len(layers) != depths - 1 or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0
                                                  for x in layers) or not STAGE_NAME_PATTERN.fullmatch(record["recycle"]):
        raise TraceFormatError(f"{reader.path}: root attribute 'chain' is {json.dumps(record)[:200]}; it needs "
                               f"2 <= depths <= T={reader.num_tokens}, tokens one of {', '.join(CHAIN_TOKENS)}, one "
                               f"layer per depth 2..K and a stage name as recycle. Write it again: "
                               f"{export_hint(reader.path)}")
    convention = record.get("layer_convention")
    return ChainInfo(depths, record["tokens"], record["recycle"], tuple(layers), record["num_layers"], record["kv"],
                     convention if isinstance(convention, str) else None)


def chain_groups(reader: "TraceReader") -> tuple[int, ...]:
    """The depths j with a /chain/d{j} group, in order (a candidate may hold any; the reference holds 2..K). Any
    other member of /chain, or a link where a group belongs, is a TraceFormatError."""
    f = reader._file
    if f.get("chain", getlink=True) is None:
        return ()
    _check_hard_link(f, "chain", reader.path)
    group = f["chain"]
    if not isinstance(group, h5py.Group):
        raise TraceFormatError(f"{reader.path}: /chain is a dataset; it must be a group of depth groups d2, d3, ...")
    depths = []
    for member in group:
        _check_hard_link(group, member, reader.path)
        match = _DEPTH_GROUP.fullmatch(member)
        if match is None or group.get(member, getclass=True) is not h5py.Group:
            raise TraceFormatError(f"{reader.path}: /chain/{member:.40} is not a depth group; /chain holds groups "
                                   f"d2, d3, ... (depth 1 is the trace's own /stages).")
        depths.append(int(match.group(1)))
    return tuple(sorted(depths))


class ChainDepthReader:
    """Depth j of an open trace (/chain/d{j}): the reading side of TraceReader for its stages, inputs and evidence,
    rows indexed by bridge position. Closed with its TraceReader."""

    def __init__(self, reader: "TraceReader", depth: int):
        self.reader, self.depth, self.path = reader, depth, reader.path
        self.prefix = f"chain/d{depth}"
        self.hidden_size = reader.hidden_size
        self.num_tokens = chain_rows(reader.num_tokens, depth)  # the rows a complete depth holds
        for sub in ("inputs", "stages", "evidence"):
            group = reader._file.get(self.prefix)
            if group is not None and group.get(sub, getlink=True) is not None:
                _check_hard_link(group, sub, self.path)
            reader._guard(f"/{self.prefix}/{sub}", lambda: _check_datasets_group(reader._file, f"{self.prefix}/{sub}",
                                                                                 self.path))
        self.stages = reader._guard(f"/{self.prefix}/stages", self._present_stages)

    def _present_stages(self) -> tuple[str, ...]:
        """The depth's stage datasets: in the trace's own stage order, then any others by name (a candidate may
        capture a stage at depth j only; the probe orders and checks them against the reference's list)."""
        group = self.reader._file.get(f"{self.prefix}/stages", {})
        odd = next((n for n in group if not STAGE_NAME_PATTERN.fullmatch(n)), None)
        if odd is not None:
            raise TraceFormatError(f"{self.path}: /{self.prefix}/stages holds {odd!r:.80}; stage names are lower-case "
                                   f"identifiers, named as depth 1's ({', '.join(STAGE_NAMES[:4])}, ...).")
        order = [n for n in (*self.reader.stages, *KNOWN_STAGE_NAMES) if n in group]
        return tuple(dict.fromkeys(order + sorted(group)))

    @property
    def stage_list(self) -> StageList:
        """The depth's stages with the metadata stored on their datasets (as depth 1's, TraceReader.stage_list)."""
        return self.reader._guard(f"/{self.prefix}/stages", lambda: StageList(
            _stage_meta_at(self.reader._dataset(self._path("stages", n)).attrs, n, self.path) for n in self.stages))

    def _path(self, group: str, name: str) -> str:
        return f"{self.prefix}/{group}/{name}"

    def stage_shape(self, name: str) -> tuple[int, ...]:
        return self.reader._guard(f"/{self._path('stages', name)}",
                                  lambda: tuple(self.reader._dataset(self._path("stages", name)).shape))

    def stage_dtype(self, name: str) -> np.dtype:
        return self.reader._guard(f"/{self._path('stages', name)}",
                                  lambda: self.reader._dataset(self._path("stages", name)).dtype)

    def stage_rows(self, name: str, start: int = 0, stop: int | None = None,
                   out: np.ndarray | None = None) -> np.ndarray:
        path = self._path("stages", name)
        return self.reader._guard(f"/{path} rows {start}..{stop}", lambda: self.reader._rows(path, start, stop, out))

    def unwritten_rows(self, name: str) -> np.ndarray | None:
        path = self._path("stages", name)
        return self.reader._guard(f"/{path}", lambda: _unwritten_rows(self.reader._dataset(path)))

    def input_names(self) -> tuple[str, ...]:
        f = self.reader._file
        return self.reader._guard(f"/{self.prefix}/inputs", lambda: tuple(
            n for n in CHAIN_INPUT_NAMES if self._path("inputs", n) in f))

    def input_shape(self, name: str) -> tuple[int, ...]:
        path = self._path("inputs", name)
        return self.reader._guard(f"/{path}", lambda: tuple(self.reader._dataset(path).shape))

    def input_rows(self, name: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        path = self._path("inputs", name)
        return self.reader._guard(f"/{path} rows {start}..{stop}", lambda: self.reader._rows(path, start, stop, None))

    def has_evidence(self, name: str) -> bool:
        return self.reader._guard(f"/{self.prefix}/evidence", lambda: self._path("evidence", name) in self.reader._file)

    def evidence_names(self) -> tuple[str, ...]:
        return self.reader._guard(f"/{self.prefix}/evidence", lambda: tuple(
            sorted(self.reader._file.get(f"{self.prefix}/evidence", {}))))

    def evidence_rows(self, name: str, start: int = 0, stop: int | None = None,
                      out: np.ndarray | None = None) -> np.ndarray:
        path = self._path("evidence", name)
        return self.reader._guard(f"/{path} rows {start}..{stop}", lambda: self.reader._rows(path, start, stop, out))

    def evidence_attr(self, name: str, key: str):
        """An attribute of /chain/d{j}/evidence/<name> (e.g. draft_margin's row_norm_max), None when absent."""
        return evidence_attr(self.reader, name, key, self.prefix)


def _stage_meta_at(attrs, name: str, path: Path) -> Stage:
    """A Stage from a stage dataset's `doc`/`kind`/`shape` attributes (the known stage's where absent)."""
    known = STAGE_BY_NAME.get(name) or next((s for s in (DRAFT,) if s.name == name), None)
    doc = _as_str(attrs.get("doc", known.doc if known else ""))
    shape = _as_str(attrs.get("shape", known.shape if known else "TxD"))
    shape = shape_symbol(shape) if isinstance(shape, str) else shape  # T×D in traces written before issue 28
    kind = _as_str(attrs.get("kind", known.kind if known else ROWS))
    if not isinstance(kind, str) or not isinstance(shape, str) or kind not in KINDS or shape not in SHAPES:
        raise TraceFormatError(f"{path}: stage {name} has kind {kind!r} / shape {shape!r}; kinds are "
                               f"{', '.join(KINDS)}, shapes {', '.join(SHAPES)}.")
    return Stage(name, shape, str(doc), kind)


def evidence_attr(reader: "TraceReader", name: str, key: str, prefix: str = ""):
    """An attribute of an evidence dataset (/evidence/<name>, or under `prefix`), None when absent."""
    path = f"{prefix + '/' if prefix else ''}evidence/{name}"
    value = reader._guard(f"/{path}", lambda: reader._dataset(path).attrs.get(key) if path in reader._file else None)
    return _as_str(value)


def evidence_covers_chain(reader: "TraceReader") -> bool:
    """Whether the root evidence_digest covers /evidence and every /chain/d{j}/evidence dataset (keys "d{j}/<name>"
    beside /evidence's names, evidence_digest's order): only then is chain evidence trusted."""
    recorded = reader.attrs.get("evidence_digest")
    if recorded is None:
        return False
    arrays = {n: functools.partial(reader._blocks, "evidence", n, reader.evidence_rows) for n in reader.evidence_names()}
    for depth in chain_groups(reader):
        part = ChainDepthReader(reader, depth)
        for n in part.evidence_names():
            arrays[f"d{depth}/{n}"] = functools.partial(reader._blocks, f"{part.prefix}/evidence", n,
                                                         part.evidence_rows)
    return evidence_digest(reader.attrs.get("evidence_rules"), arrays) == recorded


def chain_digest(depths: dict[int, dict]) -> str:
    """sha256 over every /chain/d{j}/inputs dataset (name "d{j}/<name>", dtype, shape, little-endian bytes), in depth
    then CHAIN_INPUT_NAMES order. `depths`: {j: {name: array, or (dtype, shape, blocks) callable}}."""
    digest = hashlib.sha256()
    for depth in sorted(depths):
        for name in CHAIN_INPUT_NAMES:
            if name in depths[depth]:
                _hash_array(digest, f"d{depth}/{name}", depths[depth][name])
    return "sha256:" + digest.hexdigest()


def recorded_chain_digest(reader: "TraceReader") -> str:
    """chain_digest of the trace's /chain/d{j}/inputs as stored, hashed a block of rows at a time."""
    depths = {}
    for depth in chain_groups(reader):
        part = ChainDepthReader(reader, depth)
        depths[depth] = {n: functools.partial(reader._blocks, f"{part.prefix}/inputs", n, part.input_rows)
                         for n in part.input_names()}
    return chain_digest(depths)
