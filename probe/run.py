"""`mtp-probe run`: drive an implementation on exactly the reference's recorded inputs, keep its trace, diff it.

The implementation gets the reference's token ids, embedding rows, hidden states and positions, and the weights
of the checkpoint the reference was exported from (checked by digest). Its rows go through the same self-checks,
comparison and verdict as a trace file given to `mtp-probe diff`.
"""

import itertools
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from oracle.checkpoint import Checkpoint
from oracle.errors import MtpError
from oracle.experts_digest import SCHEMES, scheme_of
from oracle.families.spec import CONVENTIONS
from oracle.limits import check_run_memory
from oracle.stages import STAGE_NAMES
from oracle.trace import TraceInputs, read_trace, write_trace
from probe.adapters.base import Adapter
from probe.adapters.spec import SPEC_HELP
from probe.adapters.trace_file import open_reference
from probe.diff import DiffReport, diff_sources
from probe.errors import AdapterError, ProbeError, ReferenceTraceError
from probe.selfcheck import check_reference
from probe.tolerance import Tol

def adapter_from_spec(spec: str, checkpoint: Path, conventions: dict | None = None, early=None) -> Adapter:
    """The adapter an `--impl` SPEC names (SPEC_HELP); `conventions` are the reference's convention fields
    (oracle/families/spec.py CONVENTIONS), handed to the candidate in its config. `early`: a C library's worker
    already started on the reference (probe/adapters/cabi_process.py), which a `c:` adapter then waits for."""
    kind, _, rest = spec.partition(":")
    if kind == "c" and rest:
        from probe.adapters.cabi import CAbiAdapter

        return CAbiAdapter(Path(rest), checkpoint, conventions or {}, early)
    if kind == "python":
        from probe.adapters.python import PythonAdapter

        return PythonAdapter(rest, checkpoint, conventions or {})
    if kind in ("llama.cpp", "llama.cpp-fa") and rest:
        from probe.adapters.llama_cpp import LlamaCppAdapter

        return LlamaCppAdapter(rest, flash_attn=kind == "llama.cpp-fa")
    if kind == "torch":
        from probe.adapters.torch_ref import TorchAdapter

        device, _, dtype = rest.partition(":")
        return TorchAdapter(checkpoint, device or "cpu", dtype or "float32")
    raise AdapterError(f"--impl {spec}: unknown implementation; use one of {SPEC_HELP}.")


def adapter_notes(adapter: Adapter) -> list[str]:
    """What an adapter could not vouch for, or found and did not place (llama.cpp: its unmapped tensor names)."""
    notes = []
    if getattr(adapter, "weights_unverified", None):
        notes.append(f"note: weights not verified against the reference's checkpoint: {adapter.weights_unverified}")
    if getattr(adapter, "flash_attn", False):
        notes.append("note: flash attention on: llama.cpp casts K/V to f16, so attn may diverge under the float32 "
                     "rule; judge it with a measured profile: `mtp-oracle noise CHECKPOINT ... --out noise.json` "
                     "(the reference's tokens and hidden), then `--profile noise.json:float16`")
    if getattr(adapter, "chain_skipped", None):
        notes.append(f"note: {adapter.name} ran no draft loop, only the bridge steps: {adapter.chain_skipped}")
    unmapped = getattr(adapter, "unmapped", None)
    if unmapped:
        shown = ", ".join(unmapped[:12]) + (f" … ({len(unmapped) - 12} more)" if len(unmapped) > 12 else "")
        notes.append(f"note: {adapter.name} named {len(unmapped)} tensor(s) the name map places on no stage (not "
                     f"compared): {shown}")
    return notes


def checkpoint_for(ref_path: Path, given: Path | None, log: Callable[[str], None] = lambda msg: None) -> Path:
    """--checkpoint, or the checkpoint recorded in the reference's provenance if it is here, or else one found
    nearby by its head digest (`find_checkpoint`); its head config must be the one the reference records, and
    where the reference records the routed experts it used (`experts`), their digest too (`check_experts`)."""
    with read_trace(ref_path) as ref:
        recorded = ref.attrs.get("provenance", {}).get("checkpoint")
        ref_config, digest = ref.attrs.get("config"), ref.attrs.get("checkpoint_digest")
    experts = recorded_experts(ref_path)
    path = Path(given) if given is not None else Path(recorded) if recorded and Path(recorded).is_dir() else None
    rejected: list[tuple[Path, str]] = []  # same head digest, other routed experts
    if path is None and digest:
        path = find_checkpoint(ref_path, recorded, ref_config, digest, experts, rejected)
        if path is not None:
            log(f"using checkpoint {path}: {ref_path} records {recorded}, which is not a directory here; {path} "
                f"holds the same head weights (digest {digest[:19]}…)"
                + (" and the same routed experts." if experts else "."))
            return path  # its config and experts were checked where it was found
    if path is not None:
        check_config(Checkpoint(path).config.to_dict(), ref_config, ref_path)
        check_experts(path, experts, ref_path)
        return path
    if rejected:
        folder, got = rejected[0]
        others = f" (and {len(rejected) - 1} more such folder(s))" if len(rejected) > 1 else ""
        raise ProbeError(f"{ref_path} was exported from checkpoint {recorded or '(not recorded)'}, which is not a "
                         f"directory here; {folder}{others} holds the same head weights (digest {digest[:19]}…), but "
                         f"its routed experts differ from those the reference was exported from "
                         f"({_experts_mismatch(experts, got)}). Pass --checkpoint DIR: the checkpoint the reference "
                         f"was exported from (its head and routed experts are checked by digest).")
    looked = (f"; no checkpoint with its head digest ({digest[:19]}…) is in the folders up to {_SEARCH_DEPTH} levels "
              f"below the reference's folder or the current directory (at most {_MAX_FOLDERS} folders looked at, "
              f"{_MAX_CHECKPOINTS} checkpoints hashed)" if digest else "")
    raise ProbeError(f"{ref_path} was exported from checkpoint {recorded or '(not recorded)'}, which is not a "
                     f"directory here{looked}. Pass --checkpoint DIR (the same weights: their digest is checked).")


def find_checkpoint(ref_path: Path, recorded: str | None, ref_config: dict | None, digest: str,
                    experts: dict | None = None, rejected: list | None = None) -> Path | None:
    """A directory near the reference whose head digest is `digest`: the recorded path read from the reference's
    folder and its parents, then the reference's sibling folders and the current directory's (two levels). Only
    folders whose config.json gives the reference's head config are hashed; at most _MAX_CHECKPOINTS of them.

    `experts` (`recorded_experts`): the routed experts the reference used; a folder with the same head digest whose
    digest of those experts differs is not the reference's checkpoint either: it is skipped, and (folder, its
    experts digest) appended to `rejected` when given."""
    hashed = 0
    for folder in _nearby_folders(Path(ref_path).resolve().parent, recorded):
        try:
            ckpt = Checkpoint(folder)
            check_config(ckpt.config.to_dict(), ref_config, ref_path)
        except MtpError:  # not a checkpoint, or another head: not worth hashing
            continue
        hashed += 1
        try:
            if ckpt.head_digest() == digest:
                got = _verified_experts_digest(ckpt, experts) if experts else None
                if got is None or got == experts["digest"]:
                    return folder
                if rejected is not None:
                    rejected.append((folder, got))
        except MtpError:
            pass
        if hashed >= _MAX_CHECKPOINTS:
            return None
    return None


_MAX_CHECKPOINTS, _MAX_FOLDERS, _SEARCH_DEPTH = 8, 400, 2  # checkpoints hashed, folders looked at, levels down


def _nearby_folders(ref_dir: Path, recorded: str | None):
    """Candidate checkpoint folders, most likely first, each once; only folders holding a config.json."""
    seen: set[Path] = set()
    first = []
    if recorded:
        rec = Path(recorded)
        if not rec.is_absolute():  # exported from elsewhere: relative to the reference's folder or an ancestor
            first += [base / rec for base in [ref_dir, *list(ref_dir.parents)[:4]]]
        first += [ref_dir / rec.name, Path.cwd() / rec.name]
    roots = [ref_dir, Path.cwd()]
    listed = (sub for root in roots for sub in _subfolders(root, depth=_SEARCH_DEPTH))
    for folder in itertools.chain(first, itertools.islice(listed, _MAX_FOLDERS)):
        try:
            key = folder.resolve()
            if key in seen or not (folder / "config.json").is_file():
                continue
        except OSError:
            continue
        seen.add(key)
        yield folder


def _subfolders(root: Path, depth: int):
    try:
        children = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    except OSError:
        return
    yield from children
    if depth > 1:
        for child in children:
            yield from _subfolders(child, depth - 1)


def recorded_experts(ref_path: Path) -> dict | None:
    """The reference's `experts` attribute ({layout, used, digest, …}: the routed experts its head read and their
    digest, oracle/export.py), checked; None for a reference without one (a dense head, or a trace written before)."""
    with read_trace(ref_path) as ref:
        experts = ref.attrs.get("experts")
        routed = (sorted(int(e) for e in np.unique(ref.stage_rows("topk_ids")))
                  if experts is not None and "topk_ids" in ref.stages else None)
    if experts is None:
        return None
    used, digest = experts.get("used"), experts.get("digest")

    def bad(what: str) -> ReferenceTraceError:
        return ReferenceTraceError(f"{ref_path}: root attribute 'experts' {what}; export writes {{\"layout\", "
                                   f"\"used\": [expert ids], \"digest\": \"<scheme>:<hex>\"}} (oracle/export.py). "
                                   f"Re-export the reference.")

    if not isinstance(used, list) or not all(isinstance(e, int) and not isinstance(e, bool) and e >= 0 for e in used):
        raise bad(f"has 'used' {_short_repr(used)}, not a list of expert ids (integers >= 0)")
    if not isinstance(digest, str) or scheme_of(digest) is None:
        raise bad(f"has 'digest' {_short_repr(digest)}, not a digest of a known scheme ({', '.join(SCHEMES)})")
    if routed is not None and routed != sorted(used):  # export records exactly the experts its topk_ids select
        raise bad(f"lists {len(used)} used experts, but its own topk_ids select {len(routed)} "
                  f"({_preview_ids(sorted(set(routed) ^ set(used)))} differ): the digest would cover other experts "
                  f"than the ones the trace used")
    return experts


def experts_digest_of_checkpoint(ckpt: Checkpoint, experts: dict) -> str:
    """The checkpoint's digest of the experts `experts["used"]`, in the scheme of the recorded digest."""
    layout = ckpt.layout().experts
    if layout is None:
        raise ProbeError(f"checkpoint {ckpt.path} has no routed experts, but the reference records the "
                         f"{len(experts['used'])} it used; pass the reference's checkpoint.")
    outside = [e for e in experts["used"] if e >= layout.num_experts]
    if outside:
        raise ProbeError(f"the reference used routed experts {_preview_ids(outside)}, but checkpoint {ckpt.path} has "
                         f"{layout.num_experts} (ids 0..{layout.num_experts - 1}); pass the reference's checkpoint.")
    return ckpt.experts_digest(experts["used"], scheme=scheme_of(experts["digest"]))


def check_experts(checkpoint: Path, experts: dict | None, ref_path: Path) -> None:
    """The routed experts the reference used (`recorded_experts`) must be the checkpoint's: the head digest leaves
    routed experts out, so the same dense head with other experts would blame a correct candidate for `routed`.
    Nothing to check for a reference that records no experts."""
    if not experts:
        return
    ckpt = Checkpoint(checkpoint)
    got = _verified_experts_digest(ckpt, experts)
    if got != experts["digest"]:
        raise ProbeError(f"checkpoint {ckpt.path}: its routed experts differ from those {ref_path} was exported from "
                         f"({_experts_mismatch(experts, got)}; the head digest does not cover routed experts). Pass "
                         f"the reference's checkpoint (--checkpoint DIR), the one it was exported from.")


def _verified_experts_digest(ckpt: Checkpoint, experts: dict) -> str:
    """`experts_digest_of_checkpoint`, remembered in this process once it matched the recorded digest, while the
    files it read are unchanged: `run --explain` checks the same checkpoint twice (run, then explain)."""
    key = _experts_key(ckpt, experts)
    if key is not None and key in _EXPERTS_VERIFIED:
        return experts["digest"]
    got = experts_digest_of_checkpoint(ckpt, experts)
    if got == experts["digest"] and key is not None:
        _EXPERTS_VERIFIED.add(key)
    return got


_EXPERTS_VERIFIED: set[tuple] = set()


def _experts_key(ckpt: Checkpoint, experts: dict) -> tuple | None:
    """What a checked experts digest depends on: the checkpoint, the recorded experts, where their tensors lie and
    their files' identity and times (a rewrite in place changes the ctime). None when any of it is unreadable."""
    try:
        layout = ckpt.layout().experts
        names = (layout.tensor_names() if layout.kind == "fused" else
                 [layout.names[p].format(e=e) for e in experts["used"] for p in ("gate", "up", "down")])
        entries = [ckpt.entry(name) for name in names]
        files = sorted({str(entry.file) for entry in entries})
        stats = tuple((f, s.st_dev, s.st_ino, s.st_size, s.st_mtime_ns, s.st_ctime_ns)
                      for f, s in ((f, os.stat(f)) for f in files))
    except (OSError, MtpError, AttributeError, KeyError):  # no experts, another layout: hashed every time
        return None
    return (str(Path(ckpt.path).resolve()), experts["digest"], tuple(experts["used"]),
            tuple((e.name, e.dtype, e.shape, str(e.file), e.offset, e.nbytes) for e in entries), stats)


def _experts_mismatch(experts: dict, got: str) -> str:
    used = experts["used"]
    return (f"the {len(used)} routed expert(s) the reference used ({_preview_ids(used)}) have digest {got} here, "
            f"{experts['digest']} in the reference")


def _preview_ids(ids: list[int], limit: int = 8) -> str:
    return ", ".join(map(str, ids[:limit])) + (f" … ({len(ids)} in all)" if len(ids) > limit else "")


def _short_repr(value, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "…"


@dataclass(frozen=True)
class RunResult:
    adapter: str
    deterministic: bool
    report: DiffReport
    written: Path | None  # the candidate trace, when --out was given and its layout allowed writing it
    stages: dict | None = None  # the candidate's rows, by stage (for --explain)
    depths: dict | None = None  # a driven draft loop's rows {depth j >= 2: {stage: rows}} (for --explain)


def run_and_diff(ref_path: Path, adapter: Adapter, tols: dict[str, Tol], out: Path | None = None,
                 fail_fast: bool = False, command: str = "") -> RunResult:
    """Run `adapter` on the reference's inputs, optionally write its trace to `out`, and diff it."""
    with open_reference(ref_path) as ref:
        check_reference(ref)
        row_floats = sum(ref.stage_shape(n)[1] for n in ref.stages) + ref.hidden_width + ref.hidden_size
        check_run_memory(ref.num_tokens, row_floats, batched=getattr(adapter, "batched_config", None))
        with read_trace(ref_path) as reader:
            inputs, ref_digest = reader.inputs(), reader.attrs.get("checkpoint_digest")
        chain = chain_inputs(ref) if getattr(adapter, "supports_chains", False) else None
        if hasattr(adapter, "reference_stages"):  # an engine that offers every stage returns only the reference's
            adapter.reference_stages = tuple(ref.stages)
        result = adapter.run(inputs) if chain is None else adapter.run(inputs, chain)
        _check_weights(adapter, ref_digest, ref_path)
        depths = _depth_results(result, adapter.name, ref.stages)
        stages = _checked_result(result, adapter.name, ref.stages)
        written = _write_candidate(out, inputs, stages, adapter, command, ref, depths, chain) if out else None
        source = ArraySource(adapter.name, inputs, stages, depths)
        if getattr(adapter, "weights_unverified", None):  # e.g. llama.cpp on its GGUF: said, never claimed
            source.kind = "adapter, own weights"
        report = diff_sources(ref, source, tols, fail_fast)
    return RunResult(adapter.name, adapter.deterministic, report, written, stages, depths)


def chain_inputs(ref) -> dict[int, dict[str, np.ndarray]] | None:
    """What a driven draft loop is handed per depth j (the reference's /chain/d{j}/inputs): token_ids, positions and
    the embedding rows of the tokens, row i = bridge i; None for a reference without chains."""
    if getattr(ref, "chain", None) is None:
        return None
    from probe.chain import check_chain_reference

    check_chain_reference(ref, ref.chain)
    return {j: {name: ref.depth(j).chain_input_rows(name) for name in ("token_ids", "positions", "embed")}
            for j in ref.chain.chain_depths}


def _depth_results(result, name: str, valid: tuple[str, ...]) -> dict[int, dict[str, np.ndarray]]:
    """The "d{j}" entries of an adapter's result (taken out of it), each checked like depth 1's."""
    if not isinstance(result, dict):
        return {}
    keys = [k for k in result if isinstance(k, str) and k[:1] == "d" and k[1:].isdigit() and int(k[1:]) >= 2]
    return {int(k[1:]): _checked_result(result.pop(k), f"{name} depth {k[1:]}", valid) for k in sorted(keys)}


def check_config(config: dict | None, ref_config: dict | None, ref_path: Path) -> None:
    """The head config the candidate is given must be the reference's, field by field: the same weights with
    another partial_rotary_factor or rope_theta would blame a correct candidate."""
    if config is None or ref_config is None:
        return
    ours, theirs = _plain(config), _plain(ref_config)
    differ = sorted(k for k in set(ours) | set(theirs) if ours.get(k, "(absent)") != theirs.get(k, "(absent)")
                    and k not in CONVENTIONS)  # conventions come from the reference (reference_conventions)
    if differ:
        fields = "; ".join(f"{k}: checkpoint {ours.get(k, '(absent)')!r}, reference {theirs.get(k, '(absent)')!r}"
                           for k in differ)
        raise ProbeError(f"the checkpoint's head config differs from the one {ref_path} was exported with ({fields}); "
                         f"the candidate would run another head. Pass the reference's checkpoint (--checkpoint) "
                         f"with its original config.json.")


def reference_conventions(ref_path: Path) -> dict:
    """The convention fields (e.g. norm_topk_prob) the reference was exported with: the candidate gets these."""
    with read_trace(ref_path) as ref:
        config = ref.attrs.get("config") or {}
    return {k: config[k] for k in CONVENTIONS if k in config}


def _plain(config: dict) -> dict:
    """JSON round trip: tuples and lists compare equal, as the trace stores them."""
    import json

    return json.loads(json.dumps(config, sort_keys=True))


def _check_weights(adapter: Adapter, ref_digest: str | None, ref_path: Path) -> None:
    if getattr(adapter, "weights_unverified", None):  # runs on its own copy (a GGUF): said in the report instead
        return
    if ref_digest and adapter.weights_digest != ref_digest:
        raise ProbeError(f"{adapter.name} ran with head weights of digest {adapter.weights_digest}, but {ref_path} "
                         f"was exported from weights of digest {ref_digest}; pass the reference's checkpoint.")


def _checked_result(result, name: str, valid: tuple[str, ...] = STAGE_NAMES) -> dict[str, np.ndarray]:
    """The checks every adapter's result gets alike: a dict of arrays keyed by the reference's stage names."""
    if not isinstance(result, dict):
        raise AdapterError(f"{name} returned {type(result).__name__}, not a dict of stage name -> array.")
    unknown = sorted(set(result) - set(valid))
    if unknown:
        raise AdapterError(f"{name} returned unknown stages {unknown}; valid names: {', '.join(valid)}.")
    not_arrays = sorted(k for k, v in result.items() if not isinstance(v, np.ndarray))
    if not_arrays:
        raise AdapterError(f"{name} returned non-arrays for {not_arrays}; return numpy arrays.")
    return {n: result[n] for n in valid if n in result}


def _write_candidate(out: Path, inputs: TraceInputs, stages: dict, adapter: Adapter, command: str,
                     ref, depths: dict[int, dict[str, np.ndarray]] | None = None,
                     chain: dict[int, dict[str, np.ndarray]] | None = None) -> Path | None:
    """The candidate's trace at `out` (atomic, oracle/trace.py write_trace): depth 1 and every depth 2..m it
    computed (/chain/d{j}, the trace schema's chains), so `mtp-probe diff REF OUT` compares them again. None (not
    written) where a layout is wrong: the diff reports that as invalid, and it cannot be stored as mtp-trace/1."""
    listed = ref.stage_list
    if _layout_differs(stages, listed, ref.stage_shape):
        return None
    depths = depths or {}
    if depths and (_chain_unwritable(depths, stages, ref) or chain is None):
        return None  # the diff says what is wrong with those depths; no trace that drops some is written
    attrs = {"producer": f"mtp-probe run --impl {adapter.name}", "family": ref.attrs.get("family", "qwen3_5"),
             "poison_filled": True,  # the adapter poisoned every buffer: an all-zero row was computed
             "provenance": {"command": command, "adapter": adapter.name}}
    if adapter.weights_digest is not None:  # llama.cpp runs the GGUF's own weights: no digest is claimed
        attrs["checkpoint_digest"] = adapter.weights_digest
    record, chains = _candidate_chains(depths, chain, ref) if depths else (None, None)
    write_trace(out, inputs, stages, attrs, stage_list=listed, dims=ref.dims, chain=record, chains=chains)
    return Path(out)


def _layout_differs(stages: dict, listed, shape_of) -> bool:
    return any(a.dtype != np.dtype(listed[n].dtype) or a.shape != tuple(shape_of(n)) for n, a in stages.items())


def _chain_unwritable(depths: dict, stages: dict, ref) -> bool:
    """Depths that mtp-trace/1 cannot hold as they are: not 2..m without a gap, another stage set than depth 1's,
    or a layout other than the reference's depth. The diff reports each of these (invalid, or the depths missing)."""
    if sorted(depths) != list(range(2, max(depths) + 1)) or max(depths) > getattr(ref.chain, "depths", 0):
        return True
    return any(set(part) != set(stages) or _layout_differs(part, ref.stage_list, ref.depth(j).stage_shape)
               for j, part in depths.items())


def _candidate_chains(depths: dict, chain: dict, ref) -> tuple[dict, dict]:
    """The root `chain` record and {j: ChainDepthRecord} of the depths the candidate computed. Its inputs are what
    it was handed (bridge, token, position, embedding row); the hidden it recycled and the layer it ran are its
    own and not seen by the probe: `recycled` is NaN and `layer` -1 (the probe never checks either of a
    candidate). The record's conventions are the reference's, under which the candidate was driven."""
    from oracle.trace import ChainDepthRecord

    info, k = ref.chain, max(depths)
    record = {"depths": k, "tokens": info.tokens, "recycle": info.recycle, "layers": list(info.layers[:k - 1]),
              "num_layers": info.num_layers, "kv": info.kv}
    chains = {}
    for j, part in depths.items():
        n = len(chain[j]["token_ids"])
        inputs = {"bridge": np.arange(n, dtype=np.int64),
                  "token_ids": np.asarray(chain[j]["token_ids"], dtype=np.int64),
                  "positions": np.asarray(chain[j]["positions"], dtype=np.int64),
                  "layer": np.full(n, -1, dtype=np.int64),
                  "recycled": np.full((n, ref.hidden_width), np.nan, dtype=np.float32),
                  "embed": np.asarray(chain[j]["embed"], dtype=np.float32)}
        chains[j] = ChainDepthRecord(inputs, dict(part), {})
    return record, chains


class ArraySource:
    """A candidate held in memory (an adapter's result), behind the TraceSource interface of trace files."""

    recorded_inputs = ()  # the adapter was handed the reference's inputs: nothing of its own to check
    poisoned = True  # adapters hand the candidate poison-filled buffers: an all-zero row is a computed value
    attrs: dict = {}

    def __init__(self, name: str, inputs: TraceInputs, stages: dict[str, np.ndarray],
                 depths: dict[int, dict[str, np.ndarray]] | None = None):
        self.path, self.kind = Path(name), "adapter"
        self.num_tokens, self.hidden_size = inputs.num_tokens, inputs.hidden_size
        self.stages = tuple(stages)
        self._stages = stages
        self._depths = depths or {}
        self.depths = tuple(sorted(self._depths))  # chain depths the adapter ran (issue 24)

    def depth(self, depth: int) -> "ArraySource":
        """Depth `depth`'s rows (row i = bridge i) as a source of their own."""
        rows = len(next(iter(self._depths[depth].values()))) if self._depths[depth] else 0
        empty = np.empty((0, self.hidden_size), np.float32)
        shape_only = TraceInputs(np.empty(rows, np.int64), np.empty(rows, np.int64), empty, empty)
        return ArraySource(f"{self.path}", shape_only, self._depths[depth])

    def stage_shape(self, name: str) -> tuple[int, ...]:
        return self._stages[name].shape

    def stage_dtype(self, name: str) -> np.dtype:
        return self._stages[name].dtype

    def stage_rows(self, name: str, start: int, stop: int, out: np.ndarray | None = None) -> np.ndarray:
        return self._stages[name][start:stop]  # already in memory: no copy into `out`

    def describe(self, name: str) -> str:
        return f"{self.path} stage {name}"

    def close(self) -> None:
        pass
