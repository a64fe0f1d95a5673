"""`mtp-oracle export` as a library call: checkpoint + inputs -> an `mtp-trace/1` reference trace."""

import datetime
import importlib.metadata
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np
import torch
import transformers

from oracle.attention_evidence import qk_blind_tokens, qk_warning
from oracle.checkpoint import Checkpoint, check_token_ids
from oracle.errors import InputError
from oracle.families import qwen3_5
from oracle.inputs import hidden_from_file, hidden_from_seed, positions_from_start
from oracle.limits import check_export_limits
from oracle.output import check_writable
from oracle.trace import TraceInputs, write_trace

MODES = ("batched", "stepwise")


@dataclass(frozen=True)
class HiddenSource:
    """Where H comes from: exactly one of `file`, `seed`, or `main_model` (which needs `first_token`)."""

    file: str | None = None
    seed: int | None = None
    main_model: bool = False
    first_token: int | None = None  # x_0: the token before the first step token, read by the main model

    def describe(self) -> dict:
        if self.main_model:
            return {"kind": "main-model", "first_token": self.first_token}
        if self.file is not None:
            return {"kind": "file", "file": self.file}
        return {"kind": "seed", "seed": self.seed}


def export_trace(checkpoint_dir: Path, out: Path, token_ids: np.ndarray, hidden: HiddenSource,
                 start_pos: int = 0, mode: str = "batched", command: str = "",
                 log: Callable[[str], None] = lambda msg: None,
                 warn: Callable[[str], None] = lambda msg: None) -> Path:
    """Run the head on T teacher-forced steps and write every stage to `out` (atomically).

    `warn` receives what the user must know about the trace (e.g. inputs that cannot evidence q/k), even when
    `log` is silenced."""
    check_writable(out)
    token_ids = np.asarray(token_ids, dtype=np.int64)
    ckpt = Checkpoint(checkpoint_dir)
    cfg = ckpt.config
    check_token_ids(token_ids, cfg.vocab_size)
    check_export_limits(cfg, len(token_ids), start_pos, mode)  # positions RoPE can represent, memory
    positions = positions_from_start(len(token_ids), start_pos)
    log(f"checkpoint {ckpt.path}: D={cfg.hidden_size}, heads={cfg.num_attention_heads}/"
        f"{cfg.num_key_value_heads} kv, head_dim={cfg.head_dim}, T={len(token_ids)} steps")
    h = _resolve_hidden(ckpt, hidden, token_ids, start_pos, log)
    weights = ckpt.read_head(widen=False)  # bf16 stays bf16: half the memory
    inputs = TraceInputs(token_ids=token_ids, positions=positions, hidden=h,
                         embed=ckpt.embedding_rows(token_ids))
    head, rotary = qwen3_5.build_head(cfg, qwen3_5.torch_weights(weights))
    log(f"running the head ({mode})")
    if mode == "batched":
        stages = qwen3_5.run_batched(head, rotary, inputs)
    else:
        stages = qwen3_5.run_stepwise(head, rotary, inputs)
    evidence = {"attn_uniform": qwen3_5.attention_with_uniform_weights(head, rotary, inputs, stages["ah"])}
    blind = qk_blind_tokens(stages["attn"], evidence["attn_uniform"])
    if blind.all():
        warn(qk_warning(inputs.num_tokens))
    attrs = {
        "family": cfg.family,
        "producer": _producer(),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "h5py": h5py.__version__, "numpy": np.__version__},
        "config": cfg.to_dict(),
        "checkpoint_digest": weights.digest,
        "provenance": {"command": command, "checkpoint": str(ckpt.path), "hidden": hidden.describe(),
                       "mode": mode, "dtype": "float32", "attn_implementation": "eager",
                       "oracle_commit": _git_commit(), "created": _now()},
    }
    log(f"writing {out}")
    write_trace(out, inputs, stages, attrs, evidence=evidence)
    return Path(out)


def _resolve_hidden(ckpt: Checkpoint, source: HiddenSource, token_ids: np.ndarray, start_pos: int,
                    log: Callable[[str], None]) -> np.ndarray:
    t, d = len(token_ids), ckpt.config.hidden_size
    if source.file is not None:
        return hidden_from_file(source.file, t, d)
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
    log("running the main model for H (post-final-norm)")
    return qwen3_5.main_model_hidden(qwen3_5.load_main_model(ckpt), sequence)


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
