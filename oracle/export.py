"""`mtp-oracle export` as a library call: checkpoint + inputs -> an `mtp-trace/1` reference trace."""

import contextlib
import dataclasses
import datetime
import functools
import importlib.metadata
import logging
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np

from oracle.checkpoint import Checkpoint, check_token_ids
from oracle.errors import InputError
from oracle.families.registry import head_module
from oracle.finite import check_finite_reference
from oracle.heap import ReservedHeap, enable_huge_pages, forward_bytes, return_free_pages
from oracle.inputs import hidden_from_file, hidden_from_seed, positions_from_start, token_ids_from_array
from oracle.limits import check_export_limits
from oracle.output import check_writable
from oracle.progress import Progress
from oracle.stages import DRAFT, StageList
from oracle.trace import EVIDENCE_DOCS, ChainDepthRecord, TraceInputs, write_trace

MODES = ("batched", "stepwise")


_OPTION = {"file": "--hidden", "seed": "--hidden-seed", "main_model": "--main-model"}


@dataclass(frozen=True)
class HiddenSource:
    """Where H comes from: exactly one of `file`, `seed`, or `main_model` (which needs `first_token`)."""

    file: str | None = None
    seed: int | None = None
    main_model: bool = False
    first_token: int | None = None  # x_0: the token before the first step token, read by the main model

    def __post_init__(self) -> None:
        """The same checks as the CLI's --hidden / --hidden-seed / --main-model options, for library callers."""
        given = [name for name, value in (("file", self.file), ("seed", self.seed),
                                          ("main_model", self.main_model or None)) if value is not None]
        if len(given) != 1:
            raise InputError(f"HiddenSource: give exactly one of file=..., seed=... or main_model=True (CLI: --hidden, "
                             f"--hidden-seed, --main-model); got {', '.join(given) or 'none'}.")
        if self.first_token is not None and not self.main_model:  # else it would be silently ignored
            raise InputError(f"--first-token {self.first_token} applies only with --main-model (x_0 is what the main "
                             f"model reads first); drop it, or use --main-model instead of {_OPTION[given[0]]}.")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, (int, np.integer))):
            raise InputError(f"HiddenSource(seed={self.seed!r}): the seed is an integer (CLI: --hidden-seed N).")
        if isinstance(self.file, Path):
            object.__setattr__(self, "file", str(self.file))  # recorded in the trace's provenance (JSON)

    def describe(self) -> dict:
        if self.main_model:
            return {"kind": "main-model", "first_token": self.first_token}
        if self.file is not None:
            return {"kind": "file", "file": self.file}
        return {"kind": "seed", "seed": self.seed}


@dataclass(frozen=True)
class ChainOptions:
    """`export --chain K`: depths 2..K of every bridge position that has the tokens (oracle/draft_loop.py).

    `tokens`: "teacher" (x_{i+j}, the default) or "argmax" (the head's own draft j-1); `recycle`: the stage depth
    j-1 hands to depth j (None: the family's convention, FamilySpec.recycled)."""

    depths: int
    tokens: str = "teacher"
    recycle: str | None = None
    layers: str = "per-depth"  # N-layer heads: depth j runs layer j-1 ("per-depth") or (j-1) % N ("modulo")
    kv: str = "teacher-forced"  # N-layer argmax chains: the layers' caches as MtpModel fills them, or "engine"


def export_trace(checkpoint_dir: Path, out: Path, token_ids: np.ndarray, hidden: HiddenSource,
                 start_pos: int = 0, mode: str = "batched", command: str = "",
                 log: Callable[[str], None] = lambda msg: None,
                 warn: Callable[[str], None] = lambda msg: None, config_overrides: dict | None = None,
                 chain: ChainOptions | None = None) -> Path:
    """Run the head on T teacher-forced steps and write every stage to `out` (atomically).

    Importing this module loads no torch: the family's torch half (torch, its transformers modules) is imported
    here, while a thread reads and hashes the head and reads the embedding rows (`_Prefetch`). The digest is of
    the bytes the head is built from (oracle/checkpoint.py), and a shard that changed during the export is refused
    before anything is written (`Checkpoint.check_unchanged`).

    `warn` receives what the user must know about the trace (e.g. inputs that cannot evidence q/k), even when
    `log` is silenced. `config_overrides` sets head-config fields where engines disagree on a convention (e.g.
    {"norm_topk_prob": False}); the trace's config records the value used. `chain` records depths 2..K too."""
    check_writable(out)
    enable_huge_pages()  # a library caller that has not imported torch yet gets the CLI's allocator (oracle/heap.py)
    token_ids = token_ids_from_array(token_ids, "token_ids")
    if mode not in MODES:
        raise InputError(f"mode {mode!r}: use one of {', '.join(MODES)} (CLI: --mode).")
    ckpt = Checkpoint(checkpoint_dir)
    ckpt.map_dense = True  # the page cache's pages, not a private copy (oracle/sigbus.py: why, and how it is safe)
    cfg = ckpt.config = _overridden(ckpt, config_overrides or {})
    family = ckpt.family
    check_token_ids(token_ids, cfg.vocab_size)
    recycle = _checked_chain(ckpt, chain, len(token_ids), mode)
    depths = chain.depths if chain else 1
    check_export_limits(cfg, len(token_ids), start_pos, mode, chain=depths)  # positions RoPE can represent, memory
    positions = positions_from_start(len(token_ids), start_pos)
    log(f"checkpoint {ckpt.path}: family {family.name}, D={cfg.hidden_size}, T={len(token_ids)} "
        f"step{'s' if len(token_ids) != 1 else ''}")
    # Synthetic H is drawn on the prefetch thread (numpy's generator releases the GIL). A file is read here, so that
    # its errors come before the imports; the main model runs here too (it reads the checkpoint).
    resolve = functools.partial(_resolve_hidden, ckpt, hidden, token_ids, start_pos, log)
    h = None if hidden.seed is not None else resolve()
    ckpt.check_head()  # its header-level errors before the imports; the bytes are read on the thread
    heap = ReservedHeap(forward_bytes(family.stages(cfg), family.dims(cfg), len(token_ids)))  # oracle/heap.py
    archive = contextlib.ExitStack()  # a chain's q/k-part passes take the real passes' projected rows back
    try:  # the heap keeps what is freed through the forward and the chain steps: glibc's defaults after
        reads = _Prefetch(ckpt, token_ids, hidden=resolve if h is None else None, touch=heap.touch)
        log(f"loading torch and transformers (the {family.name} head's modules; several seconds the first time) …")
        try:
            impl = head_module(family)  # torch and the family's transformers modules, while the thread reads
        finally:
            reads.join()  # from here on only this thread touches the checkpoint
            heap.release()  # its pages, faulted on the thread, serve the forward's tensors
        # bf16 stays bf16: half the memory; routed experts mapped, read where routed; the digest of the same bytes
        weights = dataclasses.replace(reads.head.result(), digest=reads.digest.result())
        from oracle.attention_evidence import (archived_projections, qk_blind_tokens, qk_warning,  # torch: loaded
                                               reused_projections)

        # a family whose head has its own embedding copy (DeepSeek/GLM) reads it, and says which table it used
        embed, embedding = (impl.embedding_rows(ckpt, token_ids) if hasattr(impl, "embedding_rows")
                            else (reads.rows.result(), None))
        if embedding and embedding.get("rows_equal_main") is False:
            warn(f"warning: {embedding['tensor']} differs from {embedding['main']} at these tokens; the trace uses the "
                 f"MTP layer's own copy (recorded in the trace's `embedding` attribute).")
        h = reads.hidden.result() if h is None else h
        inputs = TraceInputs(token_ids=token_ids, positions=positions, hidden=h, embed=embed)
        head, rotary = impl.build_head(cfg, impl.torch_weights(weights))
        projection = _draft_projection(ckpt, warn, needed=chain is not None and chain.tokens == "argmax")
        if projection is not None:
            projection.read_ahead()  # its rows reach the page cache while the head runs, not when the sweep starts
        log(f"running the head ({mode})")
        bridge = None
        if chain is not None and hasattr(impl, "qk_part_variants"):
            archive.enter_context(archived_projections(_output_projections(impl, head, _layer_count(ckpt))))
        with reused_projections(head):  # the uniform-weights pass gets the real pass's q/k/v projections back
            with Progress(f"export ({mode})", total=len(token_ids)) as bar:  # one pass: no ETA before it ends
                if chain is not None:  # the bridge steps through the cache the chains start from (oracle/draft_loop.py)
                    bridge, stages = _bridge(ckpt, head, rotary, inputs)
                    bar.update(len(token_ids))
                elif mode == "batched":
                    stages = impl.run_batched(head, rotary, inputs)
                    bar.update(len(token_ids))
                else:
                    stages = impl.run_stepwise(head, rotary, inputs, on_step=lambda t: bar.update())
            uniform = impl.attention_with_uniform_weights(head, rotary, inputs, stages["ah"])
            part_rows, qk_parts = qk_part_evidence(impl, head, rotary, inputs, stages["ah"], stages["attn"])
        stage_list = family.stages(cfg)
        if projection is None:
            stage_list = StageList(s for s in stage_list if s.name != DRAFT.name)
        recorded = {k: stages.pop(k) for k in list(stages) if k in EVIDENCE_DOCS}  # e.g. topk_margin: evidence
        if set(stages) | {DRAFT.name} != set(stage_list.names) | {DRAFT.name}:  # a bug in the head, never the input
            raise RuntimeError(f"the {family.name} head recorded {sorted(stages)}, its stage list is "
                               f"{stage_list.names}")
        evidence = recorded | {"attn_uniform": uniform} | part_rows
        check_finite_reference(ckpt, inputs, stages, stage_list.names, evidence)  # NaN/Inf: refused, naming the tensor
        # Teacher-forced drafts feed nothing: every depth's are taken in one sweep of the vocabulary, after the chains.
        # Argmax chain tokens need depth j-1's drafts before depth j runs: one sweep per depth, in the loop.
        in_loop = projection is not None and chain is not None and chain.tokens == "argmax"
        if in_loop:
            stages["draft"], evidence["draft_margin"] = _drafted(projection, stages["out"])
        chains, depth_parts = {}, {}
        if chain is not None:
            log(f"running depths 2..{chain.depths} of the chains ({TOKEN_MODES[chain.tokens]} tokens, recycling "
                f"{recycle})")
            chains = _chain_records(ckpt, head, rotary, inputs, bridge, stages, chain, recycle,
                                    projection if in_loop else None)
            heap.close()  # kept longer, the q/k parts' and the sweep's other block sizes fragment it (oracle/heap.py)
            depth_parts = _chain_qk_parts(ckpt, head, rotary, inputs, stages, chains, qk_parts, chain.tokens)
            archive.close()  # its rows go before the draft sweep
            return_free_pages()  # theirs and the q/k parts' freed blocks: not under the sweep's peak (oracle/heap.py)
            chain_stages = {f"d{j}/{n}": v for j, r in chains.items() for n, v in r.stages.items()}
            check_finite_reference(ckpt, inputs, chain_stages,
                                   [f"d{j}/{n}" for j in chains for n in stage_list.names],
                                   {f"d{j}/{n}": v for j, r in chains.items() for n, v in r.evidence.items()})
        evidence_attrs = {}
        if projection is not None:
            if not in_loop:
                _draft_every_depth(projection, stages, evidence, chains)
            evidence_attrs["draft_margin"] = {"row_norm_max": projection.row_norm_max()}
            for record in chains.values():
                record.evidence_attrs["draft_margin"] = evidence_attrs["draft_margin"]
        blind = qk_blind_tokens(stages["attn"], evidence["attn_uniform"])
        if blind.all():
            warn(qk_warning(inputs.num_tokens))
        else:
            from oracle.qk_parts import parts_warning, parts_without_evidence

            missing = parts_without_evidence(part_rows, qk_parts, stages["attn"])
            if missing:
                warn(parts_warning(missing))
        if "topk_margin" in evidence and "router_logits" in stages:
            from oracle.families.routing_evidence import near_tie_tokens, near_tie_warning

            ties = near_tie_tokens(stages["router_logits"], evidence["topk_margin"])
            if len(ties):
                warn(near_tie_warning(ties, inputs.num_tokens))
        import torch
        import transformers  # both loaded by the head module: the versions recorded are the ones that ran

        attrs = {
            "family": family.name,
            "evidence_rules": family.evidence_rules(cfg, inputs.positions)
            | ({"qk_parts": qk_parts} if qk_parts else {})
            | ({"qk_parts_at_depth": {str(j): names for j, names in depth_parts.items()}} if depth_parts else {}),
            "producer": reads.producer.result(),
            "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                         "h5py": h5py.__version__, "numpy": np.__version__},
            "config": cfg.to_dict(),
            "checkpoint_digest": weights.digest,  # of the bytes the head was built from
            "provenance": {"command": command, "checkpoint": str(Path(ckpt.path).resolve()), "source": ckpt.source,
                           "hidden": hidden.describe(),
                           "mode": mode, "dtype": "float32", "attn_implementation": "eager",
                           "oracle_commit": reads.commit.result(), "created": _now()},
        }
        if weights.layout is not None and weights.layout.experts is not None:
            # The head digest leaves the routed experts out (gigabytes); these are the ones this trace used.
            used = sorted(int(e) for e in np.unique(stages["topk_ids"]))
            attrs["experts"] = {"layout": weights.layout.experts.kind, "used": used,
                                "digest": ckpt.experts_digest(used, _hashed_parts(head))}
            if "router_group_limited" in evidence:  # tokens whose choice the group limit changed
                attrs["experts"]["group_limited_tokens"] = int(evidence["router_group_limited"].sum())
        if embedding:
            attrs["embedding"] = embedding
        ckpt.check_unchanged()  # a shard rewritten or cut meanwhile: the stages may mix old and new bytes
        chain_record = None
        if chain is not None:
            num_layers = _layer_count(ckpt)
            chain_record = {"depths": chain.depths, "tokens": TOKEN_MODES[chain.tokens], "recycle": recycle,
                            "layers": [_layer_of(chain, num_layers, j) for j in range(2, chain.depths + 1)],
                            "num_layers": num_layers, "kv": KV_DROPPED if num_layers == 1 else KV_CONVENTIONS[chain.kv]}
            if num_layers > 1:
                chain_record["layer_convention"] = LAYER_CONVENTIONS[chain.layers]
            attrs["provenance"]["chain"] = {"depths": chain.depths, "tokens": chain.tokens, "recycle": recycle,
                                            "recycle_convention": family.recycled}
        log(f"writing {out}")
        write_trace(out, inputs, stages, attrs, evidence=evidence, stage_list=stage_list, dims=family.dims(cfg),
                    evidence_attrs=evidence_attrs, chain=chain_record, chains=chains or None)
        return Path(out)
    finally:
        archive.close()
        heap.close()


def qk_part_evidence(impl, head, rotary, inputs: TraceInputs, ah: np.ndarray,
                     attn: np.ndarray) -> tuple[dict[str, np.ndarray], dict[str, list[str]]]:
    """Per q/k-path part the family's head has, how far each of its wrong variants moves every attn row
    (oracle/qk_parts.py): ({/evidence dataset: [T, V]}, {part: [variant names]}). One step's rows at a time, any
    caller (a chain's depth too) gives its own inputs, `ah` and `attn`."""
    from oracle.qk_parts import measure

    if not hasattr(impl, "qk_part_variants"):  # not measured: the report says so (probe/report.py NOT_MEASURED)
        return {}, {}
    return measure(impl.qk_part_variants(head, rotary, inputs, ah), attn, impl.qk_output_projection(head))


def _output_projections(impl, head, num_layers: int) -> list:
    """Every MTP layer's attention output projection (never archived: oracle/attention_evidence.py)."""
    if num_layers == 1:
        return [impl.qk_output_projection(head)]
    return [impl.qk_output_projection(head, layer=layer) for layer in range(num_layers)]


TOKEN_MODES = {"teacher": "teacher_forced", "argmax": "argmax"}  # --chain-tokens -> the trace's `chain.tokens`
KV_DROPPED = "dropped_after_chain"  # one-layer heads: a chain's KV entries live only for their chain


KV_PER_LAYER = "per_layer_teacher_forced"  # N-layer heads: layer l caches the teacher-forced depth-(l+1) entries
# N-layer argmax chains (--chain-kv engine): layer l caches the entries depth l+1 of the earlier chains wrote
KV_ENGINE_ORDER = "per_layer_engine_order"
KV_CONVENTIONS = {"teacher-forced": KV_PER_LAYER, "engine": KV_ENGINE_ORDER}
LAYER_CONVENTIONS = {"per-depth": "depth j runs layer j-1 (transformers' MtpModel)",
                     "modulo": "depth j runs layer (j-1) % N (vLLM's spec_step_idx % N)"}


def _layer_count(ckpt: Checkpoint) -> int:
    return ckpt.family.layer_count(ckpt.config)


def _layer_of(chain: "ChainOptions", num_layers: int, depth: int) -> int:
    """The physical layer depth j runs: 0 on a one-layer head, else j-1 or (j-1) % N (--chain-layers)."""
    return 0 if num_layers == 1 else (depth - 1) % num_layers if chain.layers == "modulo" else depth - 1


def _checked_chain(ckpt: Checkpoint, chain: "ChainOptions | None", num_tokens: int, mode: str) -> str | None:
    """The recycled stage of a valid `--chain` request (None without one); InputError saying what to pass."""
    if chain is None:
        return None
    k = chain.depths
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 2:
        raise InputError(f"--chain {k}: depth 1 (the bridge step) is what every trace records; pass --chain 2 or "
                         f"more to record depths 2..K as well, or leave --chain out.")
    if k > num_tokens:
        fix = (f"Pass --chain {num_tokens} or less, or more tokens." if num_tokens >= 2 else
               "With one step there is no chain: leave --chain out, or give two tokens or more.")
        raise InputError(f"--chain {k} is past the tokens available: depth K of bridge step 0 feeds the step token "
                         f"t_K, and there are T={num_tokens}. {fix}")
    if mode != "batched":
        raise InputError("--chain runs the bridge steps as one causal pass through the head's cache, then the chains "
                         "from it; --mode stepwise is not supported with it. Drop --mode stepwise.")
    if chain.tokens not in TOKEN_MODES:
        raise InputError(f"--chain-tokens {chain.tokens!r}: use one of {', '.join(TOKEN_MODES)}.")
    if chain.layers not in LAYER_CONVENTIONS:
        raise InputError(f"--chain-layers {chain.layers!r}: use one of {', '.join(LAYER_CONVENTIONS)}.")
    if chain.kv not in KV_CONVENTIONS:
        raise InputError(f"--chain-kv {chain.kv!r}: use one of {', '.join(KV_CONVENTIONS)}.")
    num_layers = _layer_count(ckpt)
    if chain.kv != "teacher-forced" and (num_layers == 1 or chain.tokens != "argmax"):
        why = ("a one-layer head drops each chain's KV entries after it" if num_layers == 1 else
               "on teacher-forced chains the layers' caches are the same either way")
        raise InputError(f"--chain-kv {chain.kv}: {why}; it applies to --chain-tokens argmax on a head with several "
                         f"MTP layers. Leave --chain-kv out.")
    if num_layers > 1 and k > num_layers and chain.layers != "modulo":
        raise InputError(f"--chain {k}: this {ckpt.family.name} head has {num_layers} MTP layers and depth j runs "
                         f"layer j-1, so --chain is at most {num_layers}. Pass --chain {num_layers} or less, "
                         f"or --chain-layers modulo for vLLM's spec_step_idx % {num_layers}.")
    family, cfg = ckpt.family, ckpt.config
    recycle = chain.recycle or family.recycled
    width = family.hidden_width(cfg)
    fits = [s.name for s in family.stages(cfg) if s.kind == "rows" and s.width(family.dims(cfg)) == width]
    if recycle not in fits:
        prenorm = f"; the pre-norm alternative: {family.recycle_prenorm}" if family.recycle_prenorm else ""
        raise InputError(f"--recycle {recycle}: the recycled hidden is {width} wide (the hidden a step reads); the "
                         f"{family.name} stages that fit are {', '.join(fits)} (convention: {family.recycled}"
                         f"{prenorm}).")
    return recycle


def _bridge(ckpt: Checkpoint, head, rotary, inputs: TraceInputs):
    """The bridge pass the chains start from (oracle/draft_loop.py) and its stages as depth 1's [T, w] rows."""
    from oracle.draft_loop import bridge_pass

    bridge = bridge_pass(head, rotary, inputs.embed, inputs.hidden, inputs.positions,
                         ckpt.family.attention_window(ckpt.config))
    return bridge, {name: rows.numpy() for name, rows in bridge.stages.items()}


def _draft_projection(ckpt: Checkpoint, warn: Callable[[str], None], needed: bool):
    """The family's draft projection (oracle/draft_loop.py), or None with a warning when the checkpoint lacks it
    (a head-only checkpoint): the trace then has no `draft` stage. `needed` (argmax chain tokens): refused."""
    from oracle.draft_loop import draft_projection
    from oracle.errors import CheckpointError

    try:
        return draft_projection(ckpt)
    except CheckpointError as missing:
        if needed:
            raise InputError(f"--chain-tokens argmax feeds each depth the head's own draft, which needs the draft "
                             f"projection: {missing}") from None
        warn(f"warning: the trace has no `draft` stage (the argmax of the head's draft projection on out): {missing}")
        return None


def _drafted(projection, out: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Stage `draft` int64 [n, 1] and evidence `draft_margin` float32 [n, 1] of `out` rows."""
    ids, margin = projection.argmax_margin(out)
    return ids[:, None].astype(np.int64), margin[:, None].astype(np.float32)


def _draft_every_depth(projection, stages: dict, evidence: dict, chains: dict) -> None:
    """Stage `draft` and evidence `draft_margin` of depth 1 and every chain depth, in one sweep of the projection."""
    parts = [(stages, evidence)] + [(r.stages, r.evidence) for r in chains.values()]
    ids, margin = _drafted(projection, np.concatenate([rows["out"] for rows, _ in parts]))
    start = 0
    for rows, recorded in parts:
        n = len(rows["out"])
        rows["draft"], recorded["draft_margin"] = ids[start:start + n], margin[start:start + n]
        start += n


def _chain_records(ckpt: Checkpoint, head, rotary, inputs: TraceInputs, bridge, stages: dict, chain: ChainOptions,
                   recycle: str, projection) -> dict:
    """Depths 2..K through the draft loop, as the trace records them (oracle/trace.py ChainDepthRecord); with
    `projection` (argmax chain tokens) each depth's draft too, which the next depth is fed. Their q/k-part records
    come after (_chain_qk_parts)."""
    from oracle.draft_loop import ARGMAX, TEACHER, ChainSpec, chain_rows, embedding_rows, run_chains

    num_steps, family = inputs.num_tokens, ckpt.family
    spec = ChainSpec(depths=chain.depths, rows=lambda j: chain_rows(num_steps, j),
                     tokens=ARGMAX if chain.tokens == "argmax" else TEACHER, token_ids=inputs.token_ids,
                     recycle=recycle, window=family.attention_window(ckpt.config), prenorm=family.recycle_prenorm,
                     record_main=True, uniform=True, engine_kv=chain.kv == "engine", record_layer0=True,
                     layers=lambda j: _layer_of(chain, _layer_count(ckpt), j))
    draft = None if projection is None else lambda rows: projection.argmax_margin(rows)
    first = None if projection is None else stages["draft"][:, 0]
    records = {}
    with Progress("export (chains)", total=chain.depths - 1, unit="depth") as bar:
        for depth in run_chains(head, rotary, bridge, spec, lambda ids: embedding_rows(ckpt, ids), draft, first):
            rows = {name: t.numpy() for name, t in depth.stages.items()}
            evidence = {k: rows.pop(k) for k in list(rows) if k in EVIDENCE_DOCS} | depth.evidence
            if projection is not None:
                rows["draft"] = depth.drafts[:, None].astype(np.int64)
                evidence["draft_margin"] = depth.margins[:, None].astype(np.float32)
            inputs_j = {"bridge": depth.bridge, "token_ids": depth.token_ids, "positions": depth.positions,
                        "layer": depth.layer, "recycled": np.ascontiguousarray(depth.recycled.numpy()),
                        "embed": depth.embed}
            records[depth.depth] = ChainDepthRecord(inputs_j, rows, evidence)
            bar.update()
    return records


def _chain_qk_parts(ckpt: Checkpoint, head, rotary, inputs: TraceInputs, stages: dict, records: dict,
                    qk_parts: dict[str, list[str]], tokens: str = "teacher") -> dict[int, dict[str, list[str]]]:
    """Each depth's own q/k-part records (/chain/d{j}/evidence/qk_<part>, oracle/qk_parts.py) where depth 1 is
    measured (`qk_parts`: depth 1's variants). One-layer heads: chain_part_records (the bridge keys a chain reads
    included), with depth 1's variant names. N-layer heads: each depth on its own layer (layer_part_records), with
    that layer's variant names, returned {depth: {part: [names]}} for evidence_rules.qk_parts_at_depth. An N-layer
    head's argmax chains (each chain's own rows over its layer's teacher-forced cache, rows the trace does not
    record) are not measured: the probe says so at those depths, never "evidenced"."""
    from oracle.qk_parts import DepthRows, chain_part_records, layer_part_records

    if not records or not qk_parts:
        return {}
    rows = {j: DepthRows(r.inputs["token_ids"], r.inputs["positions"], r.inputs["recycled"], r.inputs["embed"],
                         r.stages["ah"], r.stages["attn"]) for j, r in records.items()}
    if getattr(head, "num_layers", 1) > 1:
        if tokens != "teacher":
            return {}
        layers = {j: int(r.inputs["layer"][0]) for j, r in records.items() if len(r.inputs["layer"])}
        measured = layer_part_records(head_module(ckpt.family), head, rotary, {j: rows[j] for j in layers}, layers)
        for j, (found, _) in measured.items():
            records[j].evidence.update(found)
        return {j: names for j, (found, names) in measured.items() if names}
    measured = chain_part_records(head_module(ckpt.family), head, rotary, inputs, stages["ah"], stages["attn"], rows,
                                  qk_parts)
    for j, found in measured.items():
        records[j].evidence.update(found)
    return {}


class _Prefetch:
    """What the export reads before it needs torch, on two threads while the heavy imports run: synthetic H (when
    `hidden` is given), the shared embedding's rows, the head (its dense tensors read with pread) and, beside the
    read, its digest (reads and hashlib run without the GIL; Checkpoint._stored reads each tensor once, under its
    lock, for whichever thread asks first, so the hash of tensor i runs while tensor i+1 is read: Step-3.7's 1.5 GB
    took 2.1 s to read and 1.1 s to hash one after the other), the producer version and git commit (a subprocess);
    last, it faults in the memory the forward will use (`touch`, oracle/heap.py).

    `join` waits for all of it, so the checkpoint is used by no other thread once the forward starts. A result is
    read only where it is needed: the rows of a family that reads its own embedding copy are a page-cache warm-up,
    and an error there (no shared table) is never raised."""

    def __init__(self, ckpt: Checkpoint, token_ids: np.ndarray, hidden: Callable[[], np.ndarray] | None,
                 touch: Callable[[], None] = lambda: None) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.pool = ThreadPoolExecutor(2, thread_name_prefix="export-prefetch")
        self.hidden = self.pool.submit(hidden) if hidden is not None else None
        self.rows = self.pool.submit(ckpt.embedding_rows, token_ids)
        self.head = self.pool.submit(ckpt.read_head, widen=False, digest=False)
        self.digest = self.pool.submit(ckpt.head_digest)
        self.producer, self.commit = self.pool.submit(_producer), self.pool.submit(_git_commit)
        self.pool.submit(touch)  # last: memory for the forward (oracle/heap.py)

    def join(self) -> None:
        self.pool.shutdown(wait=True)


def _hashed_parts(head) -> dict[tuple[int, str], str]:
    """The expert parts the head hashed as it read them (RoutedExperts.part_digests): not read a second time."""
    from oracle.families.moe_experts import routed_experts_of

    return {k: v for routed in routed_experts_of(head) for k, v in routed.part_digests.items()}


def _overridden(ckpt: Checkpoint, overrides: dict):
    """The checkpoint's head config with `overrides` applied; a field the family's config lacks is an input
    error (e.g. --no-norm-topk-prob on a dense head)."""
    import dataclasses

    unknown = sorted(k for k in overrides if k not in {f.name for f in dataclasses.fields(ckpt.config)}
                     or (k == "norm_topk_prob" and not getattr(ckpt.config, "num_experts", 0)))
    if unknown:
        raise InputError(f"{', '.join(unknown)} does not apply to the {ckpt.family.name} head in {ckpt.path}.")
    return dataclasses.replace(ckpt.config, **overrides) if overrides else ckpt.config


def _resolve_hidden(ckpt: Checkpoint, source: HiddenSource, token_ids: np.ndarray, start_pos: int,
                    log: Callable[[str], None]) -> np.ndarray:
    t, d = len(token_ids), ckpt.family.hidden_width(ckpt.config)  # D, or hc·D streams (DeepSeek-V4)
    if source.file is not None:
        return hidden_from_file(source.file, t, d, d // ckpt.config.hidden_size)
    if not source.main_model:
        return hidden_from_seed(source.seed, t, d)
    if source.first_token is None:
        raise InputError("--main-model needs --first-token ID: the token x_0 before the first step token. "
                         "Step i consumes token x_{i+1} and the main model's hidden H_i at x_i, so the main "
                         "model reads x_0, then the step tokens except the last.")
    if start_pos != 0:
        raise InputError("--main-model runs the main model from position 0; it cannot be combined with "
                         f"--start-pos {start_pos}. Dump the hidden from your engine and pass --hidden instead.")
    sequence = np.concatenate([[source.first_token], token_ids[:-1]]).astype(np.int64)
    check_token_ids(sequence[:1], ckpt.config.vocab_size)
    ckpt.check_main_model()  # a head-only checkpoint: said now, before torch loads
    log(f"loading torch and transformers for the main model ({ckpt.family.name}) …")
    log("running the main model for H")
    impl = head_module(ckpt.family)
    with quiet_kernel_fallbacks():
        return impl.main_model_hidden(impl.load_main_model(ckpt), sequence)


_FALLBACK_NOTICE = "is falling back to its reference PyTorch implementation"


@contextlib.contextmanager
def quiet_kernel_fallbacks():
    """Drop transformers' notices that causal_conv1d / flash-linear-attention are not installed so their reference
    PyTorch implementation runs (the main model's linear-attention layers): that path is the one an oracle wants
    (float32, the official code), so the notice would only alarm a CPU user. Other warnings pass."""
    logger = logging.getLogger("transformers.integrations.hub_kernels")
    drop = logging.Filter()
    drop.filter = lambda record: _FALLBACK_NOTICE not in record.getMessage()
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)


def _producer() -> str:
    try:
        return f"mtp-oracle {importlib.metadata.version('mtp-probe')}"
    except importlib.metadata.PackageNotFoundError:
        return "mtp-oracle (not installed)"


def _git_commit() -> str:
    try:
        here = Path(__file__).parent
        rev = subprocess.run(["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=5)
        dirty = subprocess.run(["git", "-C", str(here), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    if rev.returncode != 0:
        return "unknown"
    return rev.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
