"""`mtp-oracle export` as a library call: checkpoint + inputs -> an `mtp-trace/1` reference trace."""

import contextlib
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
from oracle.heap import ReservedHeap, forward_bytes
from oracle.inputs import hidden_from_file, hidden_from_seed, positions_from_start, token_ids_from_array
from oracle.limits import check_export_limits
from oracle.output import check_writable
from oracle.progress import Progress
from oracle.trace import EVIDENCE_DOCS, TraceInputs, write_trace

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


def export_trace(checkpoint_dir: Path, out: Path, token_ids: np.ndarray, hidden: HiddenSource,
                 start_pos: int = 0, mode: str = "batched", command: str = "",
                 log: Callable[[str], None] = lambda msg: None,
                 warn: Callable[[str], None] = lambda msg: None, config_overrides: dict | None = None) -> Path:
    """Run the head on T teacher-forced steps and write every stage to `out` (atomically).

    Importing this module loads no torch: the family's torch half (torch, its transformers modules) is imported
    here, while a thread reads and hashes the head and reads the embedding rows (`_Prefetch`). The digest is of
    the bytes the head is built from (oracle/checkpoint.py), and a shard that changed during the export is refused
    before anything is written (`Checkpoint.check_unchanged`).

    `warn` receives what the user must know about the trace (e.g. inputs that cannot evidence q/k), even when
    `log` is silenced. `config_overrides` sets head-config fields where engines disagree on a convention (e.g.
    {"norm_topk_prob": False}); the trace's config records the value used."""
    check_writable(out)
    token_ids = token_ids_from_array(token_ids, "token_ids")
    if mode not in MODES:
        raise InputError(f"mode {mode!r}: use one of {', '.join(MODES)} (CLI: --mode).")
    ckpt = Checkpoint(checkpoint_dir)
    cfg = ckpt.config = _overridden(ckpt, config_overrides or {})
    family = ckpt.family
    check_token_ids(token_ids, cfg.vocab_size)
    check_export_limits(cfg, len(token_ids), start_pos, mode)  # positions RoPE can represent, memory
    positions = positions_from_start(len(token_ids), start_pos)
    log(f"checkpoint {ckpt.path}: family {family.name}, D={cfg.hidden_size}, T={len(token_ids)} "
        f"step{'s' if len(token_ids) != 1 else ''}")
    # Synthetic H is drawn on the prefetch thread (numpy's generator releases the GIL). A file is read here, so that
    # its errors come before the imports; the main model runs here too (it reads the checkpoint).
    resolve = functools.partial(_resolve_hidden, ckpt, hidden, token_ids, start_pos, log)
    h = None if hidden.seed is not None else resolve()
    ckpt.check_head()  # its header-level errors before the imports; the bytes are read on the thread
    heap = ReservedHeap(forward_bytes(family.stages(cfg), family.dims(cfg), len(token_ids)))  # oracle/heap.py
    reads = _Prefetch(ckpt, token_ids, hidden=resolve if h is None else None, touch=heap.touch)
    log(f"loading torch and transformers (the {family.name} head's modules; several seconds the first time) …")
    try:
        impl = head_module(family)  # torch and the family's transformers modules, while the thread reads
    finally:
        reads.join()  # from here on only this thread touches the checkpoint
        heap.release()  # its pages, faulted on the thread, serve the forward's tensors
    weights = reads.head.result()  # bf16 stays bf16: half the memory; routed experts mapped, read where routed
    from oracle.attention_evidence import qk_blind_tokens, qk_warning, reused_projections  # torch: loaded already

    # a family whose head has its own embedding copy (DeepSeek/GLM) reads it, and says which table it used
    embed, embedding = (impl.embedding_rows(ckpt, token_ids) if hasattr(impl, "embedding_rows")
                        else (reads.rows.result(), None))
    if embedding and embedding.get("rows_equal_main") is False:
        warn(f"warning: {embedding['tensor']} differs from {embedding['main']} at these tokens; the trace uses the "
             f"MTP layer's own copy (recorded in the trace's `embedding` attribute).")
    h = reads.hidden.result() if h is None else h
    inputs = TraceInputs(token_ids=token_ids, positions=positions, hidden=h, embed=embed)
    head, rotary = impl.build_head(cfg, impl.torch_weights(weights))
    log(f"running the head ({mode})")
    with reused_projections(head):  # the uniform-weights pass gets the real pass's q/k/v projections back
        with Progress(f"export ({mode})", total=len(token_ids)) as bar:  # one pass: no ETA before it ends
            if mode == "batched":
                stages = impl.run_batched(head, rotary, inputs)
                bar.update(len(token_ids))
            else:
                stages = impl.run_stepwise(head, rotary, inputs, on_step=lambda t: bar.update())
        uniform = impl.attention_with_uniform_weights(head, rotary, inputs, stages["ah"])
        part_rows, qk_parts = qk_part_evidence(impl, head, rotary, inputs, stages["ah"], stages["attn"])
    heap.close()
    stage_list = family.stages(cfg)
    recorded = {k: stages.pop(k) for k in list(stages) if k in EVIDENCE_DOCS}  # e.g. topk_margin: evidence
    if set(stages) != set(stage_list.names):  # a bug in the family's head, never the user's input
        raise RuntimeError(f"the {family.name} head recorded {sorted(stages)}, its stage list is {stage_list.names}")
    evidence = recorded | {"attn_uniform": uniform} | part_rows
    check_finite_reference(ckpt, inputs, stages, stage_list.names, evidence)  # NaN/Inf: refused, naming the tensor
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
        "evidence_rules": family.evidence_rules(cfg, inputs.positions) | {"qk_parts": qk_parts},
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
    log(f"writing {out}")
    write_trace(out, inputs, stages, attrs, evidence=evidence, stage_list=stage_list, dims=family.dims(cfg))
    return Path(out)


def qk_part_evidence(impl, head, rotary, inputs: TraceInputs, ah: np.ndarray,
                     attn: np.ndarray) -> tuple[dict[str, np.ndarray], dict[str, list[str]]]:
    """Per q/k-path part the family's head has, how far each of its wrong variants moves every attn row
    (oracle/qk_parts.py): ({/evidence dataset: [T, V]}, {part: [variant names]}). One step's rows at a time, any
    caller (a chain's depth too) gives its own inputs, `ah` and `attn`."""
    from oracle.qk_parts import measure

    return measure(impl.qk_part_variants(head, rotary, inputs, ah), attn, impl.qk_output_projection(head))


class _Prefetch:
    """What the export reads before it needs torch, on one thread while the heavy imports run: synthetic H (when
    `hidden` is given), the shared embedding's rows, the head (its dense tensors read with pread, then hashed:
    reads and hashlib run without the GIL), the producer version and git commit (a subprocess); last, it faults in
    the memory the forward will use (`touch`, oracle/heap.py).

    `join` waits for all of it, so the checkpoint is never used by two threads at once. A result is read only
    where it is needed: the rows of a family that reads its own embedding copy are a page-cache warm-up, and an
    error there (no shared table) is never raised."""

    def __init__(self, ckpt: Checkpoint, token_ids: np.ndarray, hidden: Callable[[], np.ndarray] | None,
                 touch: Callable[[], None] = lambda: None) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.pool = ThreadPoolExecutor(1, thread_name_prefix="export-prefetch")
        self.hidden = self.pool.submit(hidden) if hidden is not None else None
        self.rows = self.pool.submit(ckpt.embedding_rows, token_ids)
        self.head = self.pool.submit(ckpt.read_head, widen=False, digest=True)
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
