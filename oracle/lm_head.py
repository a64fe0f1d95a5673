"""The main model's output projection as the acceptance measurement uses it: argmax over the full vocabulary.

The real lm_head is 248320 x 5120 (2.5 GB in bf16, 5 GB in float32), so it is never held whole: it is read a
vocabulary chunk at a time into one reused buffer, widened exactly to float32 by torch, and multiplied in float32
with a running argmax (no bf16 screening). Peak memory is one chunk, stored and widened, plus the logits.
"""

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from oracle.checkpoint import Checkpoint
from oracle.errors import CheckpointError, InputError
from oracle.families.qwen3_5_layout import LM_HEAD

CHUNK_ROWS = 8192  # lm_head rows per read: 8192 x 5120 float32 = 160 MiB at real scale

_TORCH_STORED = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


@dataclass(frozen=True)
class LmHead:
    """The main model's output projection, read from the checkpoint a vocabulary chunk at a time."""

    checkpoint: Checkpoint
    name: str
    chunk_rows: int = CHUNK_ROWS

    def argmax(self, rows: np.ndarray) -> np.ndarray:
        """argmax over the full vocabulary of lm_head(row) for each row [R, D]; ties go to the lowest id."""
        x = torch.from_numpy(np.ascontiguousarray(rows, dtype=np.float32))
        best = torch.full((len(x),), -torch.inf)
        ids = torch.zeros(len(x), dtype=torch.int64)
        for start, w in self._chunks():
            value, index = (x @ w.T).max(dim=1)  # (R, D) x (D, n) -> (R, n) -> (R,)
            better = value > best  # strict: an equal logit later in the vocabulary keeps the lower id
            best, ids = torch.where(better, value, best), torch.where(better, index + start, ids)
        return ids.numpy()

    def _chunks(self) -> Iterator[tuple[int, torch.Tensor]]:
        """(first row, float32 rows [n, D]) per chunk: stored rows (a view of the mapped shard) widened exactly
        by torch into one reused buffer (a fresh float32 chunk per read would pay its page faults every time)."""
        vocab, width = self.checkpoint.entry(self.name).shape
        wide = torch.empty(min(self.chunk_rows, vocab), width)
        for start in range(0, vocab, self.chunk_rows):
            stored, dtype = self.checkpoint.stored_rows(self.name, start, min(start + self.chunk_rows, vocab))
            raw = torch.from_numpy(stored.view(np.int16)).view(torch.bfloat16) if dtype == "BF16" else \
                torch.from_numpy(stored)
            yield start, wide[: len(stored)].copy_(raw)  # bf16 is the top half of a float32: exact


def lm_head_of(ckpt: Checkpoint, chunk_rows: int = CHUNK_ROWS) -> LmHead:
    """The checkpoint's lm_head (or the embedding, where config.json ties them), shape-checked."""
    if chunk_rows < 1:
        raise InputError(f"--chunk-rows {chunk_rows}: read at least 1 lm_head row at a time (default {CHUNK_ROWS}).")
    text = ckpt.raw_config.get("text_config", {})
    tied = bool(text.get("tie_word_embeddings", ckpt.raw_config.get("tie_word_embeddings", False)))
    if LM_HEAD in ckpt.names():
        name = LM_HEAD
    elif tied:
        name = ckpt.main_model_prefix() + "embed_tokens.weight"
    else:
        raise CheckpointError(f"{ckpt.path} has no {LM_HEAD}, and config.json does not tie it to the embedding "
                              f"(tie_word_embeddings). Acceptance needs the main model's output projection: "
                              f"every draft is its argmax. Copy the complete checkpoint.")
    cfg, entry = ckpt.config, ckpt.entry(name)
    if entry.dtype not in _TORCH_STORED:
        raise CheckpointError(f"{name} is {entry.dtype}; acceptance reads {', '.join(_TORCH_STORED)}.")
    shape = tuple(entry.shape)
    if shape != (cfg.vocab_size, cfg.hidden_size):
        raise CheckpointError(f"{name} has shape {list(shape)}; config.json implies "
                              f"[{cfg.vocab_size}, {cfg.hidden_size}] (vocab_size, hidden_size).")
    return LmHead(ckpt, name, chunk_rows)
