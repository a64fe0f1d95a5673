"""What an export may be asked for, checked before any work: positions the head can represent, and the memory the
run needs. Both refusals say why and what would fit.

Positions. RoPE angles are float32 products pos * inv_freq, as in transformers and vLLM, computed from float32
positions. float32 holds every integer exactly only up to 2**24 = 16777216; past it positions round (2**24 + 1
becomes 2**24) and the angles, hence attention, are silently wrong (measured: 13 % off at 2**40). The model itself
was not trained past `max_position_embeddings`. Positions must be below the smaller of the two. (The angles
already lose about pos * 6e-8 rad below that bound; the trace records them as transformers computes them:
docs/DESIGN.md, Known limits.)

Memory. The batched pass runs eager attention over all T steps at once: the scores and the softmax weights are
each [heads, T, T] float32, beside the [T, T] causal mask, so memory grows with T^2 (T=100000 on the tiny fixture
would need about 0.4 TB). The stepwise mode keeps one query at a time: memory linear in T. `accept` runs the same
batched pass over its chains (accept_bytes), and `mtp-probe run` holds every stage's [T, width] buffers (run_bytes):
both are checked before any work as the export is.
"""

import math
from pathlib import Path
from typing import Protocol

from oracle.errors import InputError
from oracle.families.spec import HeadConfig as FamilyConfig


class HeadConfig(FamilyConfig, Protocol):
    """What the limits read from any family's head config."""

    head_dim: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int

FLOAT32_EXACT_POSITIONS = 2**24  # every integer below it is a float32; RoPE angles are float32 pos * inv_freq
INT64_MAX = 2**63 - 1
_GIB = 1 << 30


def check_export_limits(cfg: HeadConfig, num_tokens: int, start_pos: int, mode: str = "batched",
                        available: int | None = None, chain: int = 1) -> None:
    """Refuse an export whose positions the head cannot represent or whose memory exceeds what is available
    (`available` bytes; default: MemAvailable of /proc/meminfo, unchecked where that cannot be read). `chain`: K,
    depths 2..K recorded too (their positions run K-1 past the last step's)."""
    check_positions(cfg, num_tokens + max(chain, 1) - 1, start_pos)
    check_memory(cfg, num_tokens, mode, available_memory() if available is None else available, chain)


def position_limit(cfg: HeadConfig) -> int:
    """Positions must be below this: max_position_embeddings, or 2**24 (float32 RoPE) if that is smaller."""
    return min(cfg.max_position_embeddings, FLOAT32_EXACT_POSITIONS)


def check_positions(cfg: HeadConfig, num_tokens: int, start_pos: int) -> None:
    if not isinstance(start_pos, int) or isinstance(start_pos, bool):
        raise InputError(f"--start-pos {start_pos!r} is not an integer position.")
    if start_pos < 0:
        raise InputError(f"--start-pos {start_pos} is negative; positions start at 0 or later.")
    limit, last = position_limit(cfg), start_pos + num_tokens - 1
    if last < limit:
        return
    reasons = [f"the model's max_position_embeddings is {cfg.max_position_embeddings} (config.json): it was not "
               f"trained past it"]
    if cfg.max_position_embeddings > FLOAT32_EXACT_POSITIONS or start_pos >= FLOAT32_EXACT_POSITIONS:
        reasons.append(f"RoPE angles are float32 pos * inv_freq, and float32 holds integers exactly only below "
                       f"2**24 = {FLOAT32_EXACT_POSITIONS}: past it positions round and the angles are silently "
                       f"wrong")
    if last > INT64_MAX:
        reasons.append("positions are int64 in the trace, and this one does not fit")
    raise InputError(f"--start-pos {start_pos}: the {num_tokens} steps' positions run to {last}, but positions "
                     f"must be below {limit} ({'; '.join(reasons)}). Use --start-pos "
                     f"{max(limit - num_tokens, 0)} or less" + (f", or at most {limit} tokens." if num_tokens > limit
                                                                else "."))


CHAIN_BLOCK = 256  # chains per attention call (oracle/draft_loop.py CHAIN_BLOCK; this module imports no torch)


def estimate_bytes(cfg: HeadConfig, num_tokens: int, mode: str, chain: int = 1) -> int:
    """Peak working memory of an export beyond the mapped weights, in bytes (an estimate, on the high side).
    `chain` K > 1 adds depths 2..K: each keeps its rows (as depth 1's), and a depth's attention call per block of
    chains holds scores over the bridge rows and the block's chain entries, beside every block's cache."""
    base = _estimate_depth1(cfg, num_tokens, mode)
    if chain <= 1:
        return base
    t, depths = num_tokens, chain - 1
    q_width = cfg.num_attention_heads * cfg.head_dim
    kept = depths * t * 4 * (16 * cfg.hidden_size + 4 * q_width + 3 * cfg.intermediate_size)
    block = min(CHAIN_BLOCK, t)
    scores = 4 * 2 * cfg.num_attention_heads * block * (t + block * chain)
    caches = 4 * 2 * cfg.num_key_value_heads * cfg.head_dim * (-(-t // block)) * (t + block * depths)
    return base + kept + scores + caches


def _estimate_depth1(cfg: HeadConfig, num_tokens: int, mode: str) -> int:
    t, d = num_tokens, cfg.hidden_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    # per step, float32: 11 stage rows (fc_in is 2D: 12 D), inputs (4 D), activations inside the modules (q and
    # gate, q/k normed and rotated, k, v, the MLP's gate/up/act). At real scale, T=1024, this gives 0.82 GiB; the
    # README's bench measured a peak RSS of 1.72 GB there, of which about 0.85 GB are the mapped bf16 weights.
    per_token = 4 * (16 * d + 4 * q + 4 * kv + 3 * cfg.intermediate_size)
    if mode == "stepwise":
        return t * per_token + 4 * cfg.num_attention_heads * t  # one query row of scores at a time
    # batched: scores and softmax weights [heads, T, T] float32, the causal mask [T, T] float32 (+ its bool)
    per_pair = 4 * 2 * cfg.num_attention_heads + 4 + 4 + 1
    return t * t * per_pair + t * per_token


def largest_fitting_tokens(cfg: HeadConfig, mode: str, available: int, chain: int = 1) -> int:
    """The largest T whose estimate fits in `available` bytes."""
    lo, hi = 0, 1
    while estimate_bytes(cfg, hi, mode, chain) <= available:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if estimate_bytes(cfg, mid, mode, chain) <= available else (lo, mid)
    return lo


def check_memory(cfg: HeadConfig, num_tokens: int, mode: str, available: int | None, chain: int = 1) -> None:
    if available is None:
        return
    need = estimate_bytes(cfg, num_tokens, mode, chain)
    if need <= available:
        return
    fits = largest_fitting_tokens(cfg, mode, available, chain)
    why = (f"the batched pass holds attention scores and weights of {cfg.num_attention_heads} heads x T x T float32"
           if mode == "batched" else "the stepwise pass keeps every step's activations")
    hint = (f"Export at most {fits} tokens" + (", or a smaller --chain." if chain > 1 else
                                                 ", or use --mode stepwise (memory linear in T)."
                                                 if mode == "batched" else "."))
    chained = f" with --chain {chain}" if chain > 1 else ""
    raise InputError(f"T={num_tokens} steps in --mode {mode}{chained} need about {_gib(need)} of memory ({why}), "
                     f"but only "
                     f"{_gib(available)} is available (MemAvailable). {hint}")


def accept_bytes(cfg: HeadConfig, num_tokens: int, k: int) -> int:
    """Peak working memory of `accept` over N tokens: its bridge pass is one causal pass over the C = N-1-k chains
    (the batched export's [heads, C, C] scores and weights), whose masks are built as [C, C] float32 twice more
    (chain_mask, within_window) beside their bool; the draft depths are linear in C."""
    chains = max(num_tokens - 1 - k, 0)
    return estimate_bytes(cfg, chains, "batched") + chains * chains * (4 + 4 + 2)


def check_accept_memory(cfg: HeadConfig, num_tokens: int, k: int, available: int | None = None) -> None:
    """Refuse an `accept` whose bridge pass would not fit in memory (MemAvailable), with the N that fits."""
    available = available_memory() if available is None else available
    need = accept_bytes(cfg, num_tokens, k)
    if available is None or need <= available:
        return
    lo, hi = k + 2, num_tokens  # accept_bytes grows with N: the largest N that fits, by bisection
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if accept_bytes(cfg, mid, k) <= available else (lo, mid)
    raise InputError(f"accept over N={num_tokens} tokens needs about {_gib(need)} of memory (its bridge pass attends "
                     f"over all {num_tokens - 1 - k} chains at once: {cfg.num_attention_heads} heads x C x C float32 "
                     f"scores, weights and masks), but only {_gib(available)} is available (MemAvailable). Measure "
                     f"at most {lo} tokens at a time, and combine the counts.")


def run_bytes(num_tokens: int, row_floats: int) -> int:
    """Peak memory of `mtp-probe run` over T steps beyond the weights: the reference's inputs and the candidate's
    poison-filled capture buffers, `row_floats` float32 per step in all, held about three times (the buffers, the
    C ABI worker's copy handed back, the rows the diff reads)."""
    return 3 * 4 * num_tokens * row_floats


def check_run_memory(num_tokens: int, row_floats: int, available: int | None = None,
                     batched: HeadConfig | None = None) -> None:
    """Refuse a `run` whose buffers would not fit in memory (MemAvailable), with the T that fits. `batched`: the
    head config of a candidate that attends over all T steps at once (--impl torch), whose scores add the batched
    export's estimate."""
    available = available_memory() if available is None else available

    def need(t: int) -> int:
        return run_bytes(t, row_floats) + (estimate_bytes(batched, t, "batched") if batched is not None else 0)

    if available is None or need(num_tokens) <= available:
        return
    lo, hi = 0, num_tokens
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if need(mid) <= available else (lo, mid)
    why = (f"every stage's [T, width] float32 buffer and the reference's inputs, {row_floats} floats per step"
           + (f", and [{batched.num_attention_heads}, T, T] attention scores" if batched is not None else ""))
    raise InputError(f"running the candidate on T={num_tokens} steps needs about {_gib(need(num_tokens))} of memory "
                     f"({why}), but only {_gib(available)} is available (MemAvailable). Use a reference of at most "
                     f"{lo} steps.")


def available_memory(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """MemAvailable in bytes, or None where it cannot be read (then memory is not checked)."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _gib(nbytes: int) -> str:
    return f"{nbytes / _GIB:.1f} GiB" if nbytes >= _GIB / 10 else f"{math.ceil(nbytes / (1 << 20))} MiB"
