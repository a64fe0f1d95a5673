"""The exact distributions behind llama.cpp's p_min gate and sampled verification, per (chain, depth).

`accept` finds each draft as the exact argmax of the head's logits (oracle/lm_head.py) without ever forming a
distribution. The gate (p_min) needs the head's own top probability per draft, and sampled verification needs
both distributions per (chain, depth): q, the draft head's softmax of `out` through its own output projection (the
MTP layer's `shared_head.head` where it has one), and p, the main model's softmax of its lm_head input at the
position the draft stands for, through the main lm_head.

How. The drafts are known, so the chains are replayed through the head with every draft forced (no vocabulary
sweep) to get the `out` rows; then, a block of chains at a time, the full-vocabulary logits of both heads are
formed in float64 (products of float32 rows and stored bf16/f16/f32 weights are exact in float64; the sums are
within D·2^-53 of the exact logits) and reduced: the gate's confidence, Σ_v min(p_v, q_v), p(draft). A block holds
about 4k + 1 rows of V float64 logits per chain (q, p, log p per draft, log q): at most BLOCK_BYTES.

Cost: two full-vocabulary float64 GEMMs per (chain, depth) and one extra pass of the head; paid only when
--p-min or --temperature is given.
"""

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from oracle.lm_head import LmHead

BLOCK_BYTES = 256 * 2**20  # float64 logits held at once by one block of chains


@dataclass(frozen=True)
class DraftStats:
    confidence: np.ndarray  # [C, k]: the draft head's top probability over its top-`top_k` logits (all: 0)
    confidence_full: np.ndarray  # [C, k]: the same over the whole vocabulary
    beta: np.ndarray | None  # [C, k]: acceptance probability under sampled verification (None: greedy)


class ForcedDrafts:
    """Stands in for the draft projection in a replay of the chains (oracle/draft_loop.py's `draft`): records each
    depth's `out` rows and returns the drafts already found, so the replay follows the measured chains exactly and
    sweeps no vocabulary."""

    def __init__(self, drafts: np.ndarray):
        self.drafts, self.rows = drafts, []

    def __call__(self, rows: np.ndarray) -> tuple[np.ndarray, None]:
        self.rows.append(np.asarray(rows, dtype=np.float32))
        return self.drafts[:len(rows), len(self.rows)], None  # depth 2 is the first call (depth 1: the bridge's)


def replayed_out_rows(ckpt, head, rotary, sequence: np.ndarray, hidden: np.ndarray, drafts: np.ndarray) -> np.ndarray:
    """The head's `out` row behind every draft [C, k, D], by replaying the chains through the draft loop
    (oracle/draft_loop.py, the loop accept drafts with) with every draft forced."""
    from oracle.draft_loop import ARGMAX, ChainSpec, bridge_pass, embedding_rows, run_chains

    chains, k = drafts.shape
    window = ckpt.family.attention_window(ckpt.config)
    bridge = bridge_pass(head, rotary, embedding_rows(ckpt, sequence[1:chains + 1]), hidden[:chains],
                         np.arange(chains), window)
    forced = ForcedDrafts(drafts)
    spec = ChainSpec(depths=k, rows=lambda depth: chains, tokens=ARGMAX, token_ids=np.asarray(sequence[1:]),
                     recycle=ckpt.family.recycled, window=window, keep=("out",))  # token_ids: as accept's chains
    for depth in run_chains(head, rotary, bridge, spec, lambda ids: embedding_rows(ckpt, ids), draft=forced,
                            first_drafts=drafts[:, 0]):
        if not (depth.token_ids == drafts[:, depth.depth - 2]).all():
            raise RuntimeError("the replayed chains differ from the measured ones")
    return np.stack([bridge.stages["out"].numpy(), *forced.rows], axis=1)


def logits64(lm_head: LmHead, rows: np.ndarray) -> torch.Tensor:
    """Full-vocabulary logits [R, V] in float64 (exact products, float64 sums), a chunk of the head at a time."""
    x = torch.from_numpy(np.ascontiguousarray(rows, dtype=np.float64))
    vocab = lm_head.checkpoint.entry(lm_head.name).shape[0]
    out = torch.empty(len(x), vocab, dtype=torch.float64)
    for start, w in lm_head._chunks():
        out[:, start:start + len(w)] = x @ w.double().T
    return out


def top_probability(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The top probability per row: over the top-`top_k` logits renormalized (llama.cpp's top-k draft sampler;
    0: no truncation), and over the whole vocabulary."""
    full = torch.exp(logits.max(dim=1).values - torch.logsumexp(logits, dim=1))
    if top_k <= 0 or top_k >= logits.shape[1]:
        return full, full
    top = torch.topk(logits, top_k, dim=1).values
    return torch.exp(top[:, 0] - torch.logsumexp(top, dim=1)), full


def draft_stats(draft_head: LmHead, main_head: LmHead | None, out_rows: np.ndarray, main_rows: np.ndarray,
                drafts: np.ndarray, top_k: int, temperature: float | None, draft_sampling: str,
                on_block: Callable[[int], None] = lambda chains: None) -> DraftStats:
    """Per (chain, depth): the gate's confidence, and with a temperature the acceptance probability.

    out_rows [C, k, D]: the head's lm_head input behind each draft; main_rows [N, D]: the main model's lm_head
    input at each position (draft j of chain i stands for position i + j: its target is the main model's
    distribution there); drafts [C, k]."""
    chains, k, _ = out_rows.shape
    vocab = draft_head.checkpoint.entry(draft_head.name).shape[0]
    per_chain = (4 * k + 1) * vocab * 8  # q logits, p logits, log p by (chain, depth), log q
    block = max(1, min(chains, BLOCK_BYTES // per_chain))
    confidence, full = np.empty((chains, k)), np.empty((chains, k))
    beta = None if temperature is None else np.empty((chains, k))
    for a in range(0, chains, block):
        b = min(a + block, chains)
        q_logits = logits64(draft_head, out_rows[a:b].reshape(-1, out_rows.shape[2]))  # ((b-a)·k, V)
        top, whole = top_probability(q_logits, top_k)
        confidence[a:b], full[a:b] = top.numpy().reshape(b - a, k), whole.numpy().reshape(b - a, k)
        if temperature is not None:
            beta[a:b] = _acceptance(main_head, main_rows, q_logits, drafts[a:b], a, temperature, draft_sampling)
        on_block(b - a)
    return DraftStats(confidence, full, beta)


def _acceptance(main_head: LmHead, main_rows: np.ndarray, q_logits: torch.Tensor, drafts: np.ndarray, first: int,
                temperature: float, draft_sampling: str) -> np.ndarray:
    """Acceptance probability [n, k] of chains first..first+n-1 under rejection sampling at `temperature`:
    Σ_v min(p_v, q_v) when drafts are sampled from q, p(draft) when they are the argmax (q one-hot)."""
    n, k = drafts.shape
    p_logits = logits64(main_head, main_rows[first + 1:first + n + k])  # positions first+1 .. first+n+k-1
    log_p = torch.log_softmax(p_logits / temperature, dim=1)
    at = (np.arange(n)[:, None] + np.arange(k)[None, :]).reshape(-1)  # row of position i + j, (n·k,)
    log_p = log_p[torch.from_numpy(at)]  # (n·k, V)
    if draft_sampling == "greedy":
        picked = log_p.gather(1, torch.from_numpy(drafts.reshape(-1, 1)))[:, 0]
        return torch.exp(picked).numpy().reshape(n, k)
    log_q = torch.log_softmax(q_logits / temperature, dim=1)
    return torch.exp(torch.minimum(log_p, log_q)).sum(dim=1).numpy().reshape(n, k)
