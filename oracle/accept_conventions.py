"""Acceptance the way each engine counts it, from one measurement, with 95 % intervals (no torch).

One measurement is a table of chains: chain i is drafted after bridge step i (context x_0..x_{i+1}), k drafts
deep, each draft scored right or wrong against its target. Every engine's figure is a function of that table:

- ours: conditional α_j = P(draft j right | drafts 1..j-1 right), E[len] = 1 + Σ_j Π_{m<=j} α_m.
- vLLM (v1/spec_decode/metrics.py, SpecDecodingLogging): `mean_acceptance_length = 1 + num_accepted_tokens /
  num_drafts` (the bonus token included), per-position `acceptance_rates = sum(pos_matrix, axis=0) / num_drafts`,
  unconditional (position j counts only when positions 1..j were all accepted, over every round), so
  AL = 1 + Σ_j rate_j; and `Avg Draft acceptance rate` = accepted / drafted tokens.
- SGLang (scheduler's decode log and `avg_spec_accept_length` in /server_info): accepted tokens, one bonus per
  verify round included, over verify rounds (`spec_num_accept_tokens / spec_num_forward_ct`): tokens per *verify*
  forward, not per forward of either model (the k draft forwards are not in the denominator); with one chain per
  round (topk 1) it is the same number as vLLM's AL.
- llama.cpp (common/speculative.cpp, server `draft acceptance rate = accepted / generated`): a draft is only
  proposed while the draft head's top probability `cur_p->data[0].p` is >= p_min (the gate breaks before the
  push); a draft shorter than n_min is dropped; the rate is accepted / proposed tokens. `p` is the softmax over
  the sampler's candidates: its draft sampler keeps the top 10 logits (`top_k = 10`), so p is their softmax.

Rounds. An engine starts a round where the previous one ended; here a chain starts after every bridge step, so
each figure is the average over round starts at every position (teacher-forced on x). Rates the engines count
per round are therefore estimated by the average over chains.

Intervals. A rate whose trials are chains (α_j, vLLM's per-position rates) gets a Wilson score interval. Figures
that are ratios of sums over chains (E[len], AL, the llama.cpp rate, the sampled-verification E[len]) get a
moving-block bootstrap over contiguous chains: neighbouring chains share tokens (chain i's draft j and chain
i+1's draft j-1 target the same token) and context, so chains are not independent; resampling blocks of b
consecutive chains (b = max(k+1, ceil(C^(1/3)))) keeps that dependence inside each block. Wilson intervals of
α_j treat chains as independent, so they are too narrow by the same dependence; the text says so.
"""

import math
from dataclasses import dataclass

import numpy as np

from oracle.errors import InputError

Z95 = 1.959963984540054  # the standard normal's 97.5 % quantile
BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 0
FEW_TRIALS = 20  # below this many trials a rate's interval is too wide to decide anything
FEW_BLOCKS = 10  # a bootstrap over fewer blocks than this says little about the spread
LLAMA_CPP_TOP_K = 10  # common_speculative_init: the draft sampler is {TOP_K} with top_k = 10


# ---- intervals -------------------------------------------------------------------------------------------------


def wilson(successes: int, trials: int, z: float = Z95) -> tuple[float, float] | None:
    """The Wilson score interval of a binomial rate; None without trials."""
    if trials <= 0:
        return None
    p = successes / trials
    centre = (p + z * z / (2 * trials)) / (1 + z * z / trials)
    half = z / (1 + z * z / trials) * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials))
    return max(0.0, centre - half), min(1.0, centre + half)


def block_length(chains: int, k: int) -> int:
    """Blocks of at least k+1 chains (the chains that share a target token) and about C^(1/3) (the usual rate)."""
    return max(1, min(chains, max(k + 1, math.ceil(chains ** (1 / 3)))))


def block_bootstrap_sums(columns: np.ndarray, block: int, resamples: int = BOOTSTRAP_RESAMPLES,
                         seed: int = BOOTSTRAP_SEED) -> tuple[np.ndarray, int]:
    """Moving-block bootstrap of the column sums of `columns` [C, m]: each resample concatenates round(C/b)
    blocks of b consecutive rows, drawn with replacement from the C-b+1 blocks. Returns the resampled sums
    [resamples, m] and the rows per resample (round(C/b)·b, about C). Memory: the block sums, not the resamples."""
    rows = len(columns)
    block = max(1, min(block, rows))
    cumulative = np.concatenate([np.zeros((1, columns.shape[1])), np.cumsum(columns, axis=0, dtype=np.float64)])
    block_sums = cumulative[block:] - cumulative[:-block]  # (C-b+1, m)
    count = max(1, round(rows / block))
    starts = np.random.default_rng(seed).integers(0, len(block_sums), size=(resamples, count))
    sums = np.zeros((resamples, columns.shape[1]))
    for j in range(count):  # one block per resample at a time: memory stays resamples x m
        sums += block_sums[starts[:, j]]
    return sums, count * block


def percentile_interval(values: np.ndarray) -> tuple[float, float]:
    finite = values[np.isfinite(values)]
    if len(finite) == 0:
        return (math.nan, math.nan)
    return float(np.quantile(finite, 0.025)), float(np.quantile(finite, 0.975))


# ---- what an engine does with a chain ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    """The settings every engine figure depends on (all in the JSON)."""

    k: int
    p_min: float | None = None  # llama.cpp's gate; None: not simulated (every chain drafts k, as p_min 0)
    p_min_top_k: int = LLAMA_CPP_TOP_K  # the candidates whose softmax is the gate's p; 0: the whole vocabulary
    n_min: int = 0  # llama.cpp drops a draft shorter than this
    temperature: float | None = None  # None: greedy verification
    draft_sampling: str = "greedy"  # with a temperature: drafts are the argmax ("greedy") or sampled from q
    positions: tuple[int, int] | None = None  # chains (bridge steps) first..last-1 only
    buckets: int = 4

    def as_json(self) -> dict:
        return {"k": self.k, "n_max": self.k, "p_min": self.p_min, "p_min_top_k": self.p_min_top_k,
                "n_min": self.n_min, "verification": "greedy" if self.temperature is None else "sampled",
                "temperature": self.temperature,
                "draft_sampling": None if self.temperature is None else self.draft_sampling,
                "positions": None if self.positions is None else list(self.positions), "buckets": self.buckets,
                "bootstrap": {"resamples": BOOTSTRAP_RESAMPLES, "seed": BOOTSTRAP_SEED,
                              "method": "moving blocks of contiguous chains"}}


def parse_positions(text: str | None) -> tuple[int, int] | None:
    """--positions FIRST:LAST (LAST may be empty: to the end)."""
    if text is None:
        return None
    first, sep, last = text.partition(":")
    try:
        if not sep:
            raise ValueError
        return int(first), (int(last) if last.strip() else 2**62)
    except ValueError:
        raise InputError(f"--positions {text!r}: give FIRST:LAST, bridge steps as integers (e.g. 0:512, or 512: "
                         f"to the end).") from None


def accepted_runs(right: np.ndarray) -> np.ndarray:
    """Per chain, the drafts accepted before the first wrong one (C,), from right [C, k]."""
    return np.logical_and.accumulate(right, axis=1).sum(axis=1)


def proposed_lengths(chains: int, k: int, p_min: float | None, n_min: int,
                     confidence: np.ndarray | None = None) -> np.ndarray:
    """llama.cpp's draft length per chain (C,): drafts while the head's top probability is >= p_min (the gate
    breaks before pushing the first draft below it), k at most (p_min None: k); a draft shorter than n_min is
    dropped (0)."""
    if p_min is None:
        lengths = np.full(chains, k, dtype=np.int64)
    else:
        lengths = np.logical_and.accumulate(confidence >= p_min, axis=1).sum(axis=1)
    return np.where(lengths < n_min, 0, lengths)


def expected_runs(beta: np.ndarray) -> np.ndarray:
    """Per chain and depth, the probability that drafts 1..j are all accepted [C, k], from the per-draft
    acceptance probabilities beta [C, k] of sampled verification (a draft is only tried after its predecessors)."""
    return np.cumprod(beta, axis=1)


# ---- the figures ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Figure:
    """One number under one convention, its 95 % interval, how the interval was made, and its definition."""

    key: str
    engine: str  # ours, vllm, sglang, llama.cpp
    name: str
    value: float | None
    interval: tuple[float, float] | None
    method: str  # wilson, block bootstrap, none
    trials: int  # chains, or drafted tokens: what the rate counts
    definition: str

    @property
    def too_few(self) -> bool:
        return self.trials < FEW_TRIALS

    def as_json(self) -> dict:
        return {"key": self.key, "engine": self.engine, "name": self.name, "value": self.value,
                "interval95": None if self.interval is None else list(self.interval), "method": self.method,
                "trials": self.trials, "too_few": self.too_few, "definition": self.definition}


def _chains_interval(columns: np.ndarray, statistic, k: int) -> tuple[tuple[float, float] | None, str]:
    """A block-bootstrap interval of statistic(sums [R, m], rows) over contiguous chains."""
    if len(columns) < 2:
        return None, "none (fewer than 2 chains)"
    block = block_length(len(columns), k)
    sums, rows = block_bootstrap_sums(columns, block)
    with np.errstate(divide="ignore", invalid="ignore"):
        values = statistic(sums, rows)
    blocks = len(columns) / block
    note = f"block bootstrap (blocks of {block} chains, {BOOTSTRAP_RESAMPLES} resamples)"
    if blocks < FEW_BLOCKS:
        note += f"; only {blocks:.1f} blocks: too few to trust the spread"
    return percentile_interval(values), note


def conventions(right: np.ndarray, settings: Settings, confidence: np.ndarray | None = None,
                beta: np.ndarray | None = None) -> list[Figure]:
    """Every engine's figure from right [C, k] (draft j of chain i equals its target), with the gate's confidence
    [C, k] (the draft head's top probability) when p_min is set and the per-draft acceptance probabilities beta
    [C, k] when verification samples at a temperature."""
    chains, k = right.shape
    runs = np.logical_and.accumulate(right, axis=1)  # (C, k): drafts 1..j all right
    run_counts = runs.sum(axis=0)
    accepted = runs.sum(axis=1)  # (C,)
    figures = []
    den = chains
    for j in range(k):
        num = int(run_counts[j])
        figures.append(Figure(f"alpha_{j + 1}", "ours", f"alpha_{j + 1}", num / den if den else None,
                              wilson(num, den), "wilson", den,
                              "P(draft j right | drafts 1..j-1 right): chains with drafts 1..j right / chains with "
                              "drafts 1..j-1 right (greedy verification)"))
        den = num
    e_len_ci, e_len_method = _chains_interval(accepted[:, None].astype(float), lambda s, n: 1 + s[:, 0] / n, k)
    e_len = 1 + accepted.sum() / chains
    figures.append(Figure("e_len", "ours", "E[len]", float(e_len), e_len_ci, e_len_method, chains,
                          "1 + sum_j prod_(m<=j) alpha_m = 1 + mean accepted run per chain: tokens per verify "
                          "round, the bonus token included (greedy verification)"))
    figures.append(Figure("vllm_mean_acceptance_length", "vllm", "Mean acceptance length", float(e_len), e_len_ci,
                          e_len_method, chains,
                          "1 + num_accepted_tokens / num_drafts (vLLM SpecDecodingLogging; bonus included): equal "
                          "to E[len] when every round drafts k"))
    for j in range(k):
        num = int(run_counts[j])
        figures.append(Figure(f"vllm_rate_{j + 1}", "vllm", f"Per-position acceptance rate {j + 1}", num / chains,
                              wilson(num, chains), "wilson", chains,
                              "rounds whose drafts 1..j were all accepted / all rounds (unconditional; AL = 1 + "
                              "sum_j of these)"))
    tokens = accepted[:, None].astype(float)
    draft_rate_ci, draft_rate_method = _chains_interval(tokens, lambda s, n: s[:, 0] / (n * k), k)
    figures.append(Figure("vllm_draft_acceptance_rate", "vllm", "Avg Draft acceptance rate",
                          float(accepted.sum() / (chains * k)), draft_rate_ci, draft_rate_method, chains * k,
                          "accepted draft tokens / drafted tokens (k per round)"))
    figures.append(Figure("sglang_avg_spec_accept_length", "sglang", "avg_spec_accept_length", float(e_len),
                          e_len_ci, e_len_method, chains,
                          "accepted tokens incl. one bonus per verify round / verify rounds "
                          "(spec_num_accept_tokens / spec_num_forward_ct): tokens per verify forward, not per "
                          "forward (draft forwards not counted); = vLLM's AL for one chain per round"))
    figures += _llama_cpp(right, accepted, settings, confidence)
    if beta is not None:
        figures += _sampled(beta, settings)
    return figures


def _llama_cpp(right: np.ndarray, accepted: np.ndarray, settings: Settings,
               confidence: np.ndarray | None) -> list[Figure]:
    chains, k = right.shape
    if settings.p_min is not None and confidence is None:
        raise ValueError("p_min is set but no confidence table was given")
    lengths = proposed_lengths(chains, k, settings.p_min, settings.n_min, confidence)
    taken = np.minimum(accepted, lengths)  # a gated chain is verified only as far as it was proposed
    columns = np.stack([taken, lengths], axis=1).astype(float)
    rate_ci, method = _chains_interval(columns, lambda s, n: s[:, 0] / s[:, 1], k)
    drafted = int(lengths.sum())
    gate = ("p_min not set: every round drafts k (as --spec-draft-p-min 0)" if settings.p_min is None else
            f"drafts proposed while the head's top probability (softmax over "
            f"{'the whole vocabulary' if settings.p_min_top_k == 0 else f'its top {settings.p_min_top_k} logits'}) "
            f">= p_min={settings.p_min}")
    figures = [Figure("llama_cpp_acceptance_rate", "llama.cpp", "draft acceptance rate",
                      float(taken.sum() / drafted) if drafted else None, rate_ci if drafted else None,
                      method if drafted else "none (nothing proposed)", drafted,
                      f"accepted / generated draft tokens; {gate}; drafts shorter than n_min={settings.n_min} "
                      f"dropped")]
    tokens_ci, tokens_method = _chains_interval(taken[:, None].astype(float), lambda s, n: 1 + s[:, 0] / n, k)
    figures.append(Figure("llama_cpp_tokens_per_round", "llama.cpp", "tokens per round (gated)",
                          float(1 + taken.sum() / chains), tokens_ci, tokens_method, chains,
                          "1 + accepted drafts per round, a round with no draft yielding its 1 token: what the gate "
                          "costs or buys in E[len]"))
    figures.append(Figure("llama_cpp_mean_draft_length", "llama.cpp", "mean proposed draft length",
                          float(lengths.mean()), None, "none (a setting's effect, not an estimate)", chains,
                          "drafts proposed per round under the gate"))
    return figures


def _sampled(beta: np.ndarray, settings: Settings) -> list[Figure]:
    """Sampled verification at a temperature: the rejection-sampling acceptance probability of every draft."""
    chains, k = beta.shape
    reach = expected_runs(beta)  # (C, k): P(drafts 1..j accepted)
    how = ("sum_v min(p_v, q_v)" if settings.draft_sampling == "sampled" else
           "p(draft), the main model's probability of the drafted argmax (q one-hot)")
    figures = []
    before = np.ones(chains)
    for j in range(k):
        num, den = reach[:, j], before
        ci, method = _chains_interval(np.stack([num, den], axis=1), lambda s, n: s[:, 0] / s[:, 1], k)
        figures.append(Figure(f"sampled_alpha_{j + 1}", "ours", f"alpha_{j + 1} (sampled, T={settings.temperature})",
                              float(num.sum() / den.sum()) if den.sum() > 0 else None, ci, method, chains,
                              f"expected acceptance of draft j given drafts 1..j-1 accepted, each draft accepted "
                              f"with probability {how} at temperature {settings.temperature}"))
        before = reach[:, j]
    for j in range(k):
        ci, method = _chains_interval(reach[:, j:j + 1], lambda s, n: s[:, 0] / n, k)
        figures.append(Figure(f"sampled_rate_{j + 1}", "vllm", f"Per-position acceptance rate {j + 1} (sampled)",
                              float(reach[:, j].mean()), ci, method, chains,
                              "expected share of rounds whose drafts 1..j were all accepted under sampled "
                              "verification (vLLM's unconditional per-position rate)"))
    expected = reach.sum(axis=1)  # (C,): expected accepted drafts per chain
    ci, method = _chains_interval(expected[:, None], lambda s, n: 1 + s[:, 0] / n, k)
    figures.append(Figure("sampled_e_len", "ours", f"E[len] (sampled, T={settings.temperature})",
                          float(1 + expected.mean()), ci, method, chains,
                          "1 + mean over chains of sum_j prod_(m<=j) beta_m: expected tokens per verify round "
                          "under rejection sampling, expected over the exact distributions (not one sample); "
                          "vLLM's AL and SGLang's accept length under sampling"))
    ci, method = _chains_interval(expected[:, None], lambda s, n: s[:, 0] / (n * k), k)
    figures.append(Figure("sampled_draft_acceptance_rate", "vllm", "Avg Draft acceptance rate (sampled)",
                          float(expected.mean() / k), ci, method, chains * k,
                          "expected accepted draft tokens / drafted tokens under sampled verification"))
    return figures


# Under sampled verification an engine's figure is compared with its sampled counterpart.
SAMPLED_COUNTERPART = {"vllm_mean_acceptance_length": "sampled_e_len", "sglang_avg_spec_accept_length": "sampled_e_len",
                       "vllm_draft_acceptance_rate": "sampled_draft_acceptance_rate"}


def counterpart(key: str, sampled: bool) -> str:
    if not sampled:
        return key
    if key.startswith("vllm_rate_"):
        return "sampled_rate_" + key.removeprefix("vllm_rate_")
    return SAMPLED_COUNTERPART.get(key, key)


def by_key(figures: list[Figure]) -> dict[str, Figure]:
    return {f.key: f for f in figures}


# ---- along the sequence -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Bucket:
    first: int  # bridge steps first..last-1
    last: int
    figures: dict[str, Figure]


def position_buckets(right: np.ndarray, positions: np.ndarray, settings: Settings,
                     confidence: np.ndarray | None = None, beta: np.ndarray | None = None) -> list[Bucket]:
    """The conventions per bucket of context positions (equal-count contiguous ranges of chains)."""
    count = max(1, min(settings.buckets, len(right)))
    edges = np.linspace(0, len(right), count + 1).round().astype(int)
    buckets = []
    for a, b in zip(edges[:-1], edges[1:]):
        if b <= a:
            continue
        part = slice(a, b)
        figures = conventions(right[part], settings, None if confidence is None else confidence[part],
                              None if beta is None else beta[part])
        buckets.append(Bucket(int(positions[a]), int(positions[b - 1]) + 1, by_key(figures)))
    return buckets
