"""Measuring, at export, which attention rows could witness q, k, q_norm, k_norm and RoPE.

Attention's output at step t is Σ_j p_j v_j over the visible keys j ≤ t. Whatever q and k compute only moves the
weights p. So if the output with *uniform* weights over the visible keys equals the real output (within the
tolerance), a candidate with a broken q/k path can produce the same row: that row is no evidence of q/k. That is
always so at t = 0 (one key, softmax ≡ 1), and at every t when the value rows coincide (repeated token and hidden).

`uniform_attention` is an attention function with the signature of transformers' attention interface
(`ALL_ATTENTION_FUNCTIONS`): the official attention module computes q, k, v, gate and o_proj exactly as in the real
pass, and only the softmax(q·k) weights are replaced by uniform ones over the keys the mask lets through. The
oracle records the resulting rows as `/evidence/attn_uniform`; the probe counts an `attn` row as q/k evidence only
where that row would FAIL the tolerance rule against the real one (probe/evidence.py).
"""

from contextlib import contextmanager

import numpy as np
import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv

UNIFORM = "mtp_uniform_weights"


def uniform_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, s_aux=None, **kwargs):
    """Attention with uniform weights over the visible keys: (B, H, T, d) q/k/v -> ((B, T, H, d), weights).

    With attention sinks (`s_aux`, one logit per head that joins the softmax and is dropped: DeepSeek-V4,
    gpt-oss), the sink is one more slot of the softmax at the same logit as every visible key: each of n visible
    keys gets 1/(n+1). At t=0 that is 1/2, where the real weight is sigmoid(q·k·scale - sink), so a t=0 row with
    sinks does depend on q and k (their score against the sink), unlike a sink-free softmax (≡ 1)."""
    value = repeat_kv(value, query.shape[1] // value.shape[1])  # GQA: each query head reads its kv head
    slots = key.shape[2] + (s_aux is not None)  # the sink: one more slot, dropped after the softmax
    scores = torch.zeros(query.shape[0], query.shape[1], query.shape[2], slots, dtype=query.dtype)
    if attention_mask is not None:  # additive: 0 visible, finfo.min blocked
        scores[..., : key.shape[2]] = scores[..., : key.shape[2]] + attention_mask[:, :, :, : key.shape[2]]
    weights = torch.softmax(scores, dim=-1)[..., : key.shape[2]]
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


AttentionInterface.register(UNIFORM, uniform_attention)


@contextmanager
def uniform_weights(config):
    """Within the block, attention modules built from `config` use uniform weights (they read
    config._attn_implementation at every forward)."""
    saved = config._attn_implementation
    config._attn_implementation = UNIFORM
    try:
        yield
    finally:
        config._attn_implementation = saved


# The probe's default float32 tolerance (probe/tolerance.py DEFAULT). The oracle never imports the probe, so the
# export's warning restates the probe's rule (probe/rule.py RULE) here; tests/probe/test_rule.py holds the two equal
# (and these numbers equal DEFAULT). The probe itself re-judges /evidence/attn_uniform through RULE.
WARN_RTOL, WARN_ATOL = 1e-4, 1e-5


def qk_blind_tokens(attn: np.ndarray, uniform: np.ndarray) -> np.ndarray:
    """Per token: True where uniform weights give the same attn row within the default float32 tolerance, i.e.
    the row cannot witness q/k; only to decide whether the export warns."""
    a = np.asarray(uniform, dtype=np.float64).reshape(len(uniform), -1)
    e = np.asarray(attn, dtype=np.float64).reshape(len(attn), -1)
    with np.errstate(invalid="ignore"):
        max_abs = np.abs(a - e).max(axis=1, initial=0.0)
    e_max = np.abs(e).max(axis=1, initial=0.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        max_rel = np.where(max_abs == 0, 0.0, max_abs / e_max)
    finite = np.isfinite(a).all(axis=1) & np.isfinite(e).all(axis=1)
    return finite & ((max_rel < WARN_RTOL) | (max_abs < WARN_ATOL))


def qk_warning(num_tokens: int) -> str:
    why = ("T=1: step 0 attends to one key (softmax ≡ 1)" if num_tokens == 1 else
           "every attn row equals the one uniform attention weights give (repeated token and hidden make the "
           "value rows coincide)")
    return (f"warning: these inputs cannot evidence q, k, q_norm, k_norm or RoPE: {why}. A diff against this "
            f"trace can at best be inconclusive about them; export with T >= 2 distinct tokens and hidden rows.")
