"""Acceptance as engines count it: each convention against a hand computation, the intervals' coverage by seeded
simulation (with twins that must undercover), and the p_min gate's draft lengths against a brute-force loop."""

import math

import numpy as np
import pytest

from oracle.accept_conventions import (Settings, block_bootstrap_sums, by_key, conventions, counterpart,
                                       parse_positions, position_buckets, proposed_lengths, wilson)
from oracle.errors import InputError


def right_of(rows: list[str]) -> np.ndarray:
    return np.array([[c == "R" for c in row] for row in rows])


def test_every_convention_on_a_hand_table():
    right = right_of(["RRR", "RRW", "RWR", "WRR", "RRR", "WWW"])  # accepted runs 3, 2, 1, 0, 3, 0
    f = by_key(conventions(right, Settings(k=3)))
    assert [f[f"alpha_{j}"].value for j in (1, 2, 3)] == [4 / 6, 3 / 4, 2 / 3]
    assert f["e_len"].value == pytest.approx(1 + 9 / 6)
    assert f["vllm_mean_acceptance_length"].value == pytest.approx(1 + 9 / 6)  # 1 + accepted / drafts
    assert [f[f"vllm_rate_{j}"].value for j in (1, 2, 3)] == [4 / 6, 3 / 6, 2 / 6]  # unconditional
    rates = [f[f"vllm_rate_{j}"].value for j in (1, 2, 3)]
    assert 1 + sum(rates) == pytest.approx(f["vllm_mean_acceptance_length"].value)
    assert f["vllm_draft_acceptance_rate"].value == pytest.approx(9 / 18)
    assert f["sglang_avg_spec_accept_length"].value == pytest.approx(1 + 9 / 6)
    assert f["llama_cpp_acceptance_rate"].value == pytest.approx(9 / 18)  # no gate: every round drafts k
    assert all(f[key].too_few for key in ("alpha_1", "e_len"))  # 6 chains decide nothing, and it is said


def test_llama_cpp_rate_under_the_gate_against_a_brute_force_loop():
    rng = np.random.default_rng(3)
    right = rng.random((300, 4)) < 0.7
    confidence = rng.random((300, 4))
    for p_min, n_min in ((0.0, 0), (0.3, 0), (0.6, 2), (0.95, 1)):
        accepted = generated = 0
        for row_right, row_conf in zip(right, confidence):  # llama.cpp's loop: break before the push
            draft = []
            for j in range(4):
                if row_conf[j] < p_min:
                    break
                draft.append(j)
            if len(draft) < n_min:
                draft = []
            generated += len(draft)
            for j in draft:  # verification: the prefix of right drafts
                if not row_right[j]:
                    break
                accepted += 1
        f = by_key(conventions(right, Settings(k=4, p_min=p_min, n_min=n_min), confidence=confidence))
        assert f["llama_cpp_acceptance_rate"].trials == generated
        assert f["llama_cpp_acceptance_rate"].value == pytest.approx(accepted / generated)
        assert f["llama_cpp_tokens_per_round"].value == pytest.approx(1 + accepted / 300)
    # twin: the gate changes the number (a head reads very differently by p_min, llama.cpp#25395)
    loose = by_key(conventions(right, Settings(k=4, p_min=0.0), confidence=confidence))
    tight = by_key(conventions(right, Settings(k=4, p_min=0.9), confidence=confidence))
    assert loose["llama_cpp_acceptance_rate"].value != tight["llama_cpp_acceptance_rate"].value
    assert (proposed_lengths(3, 4, 0.5, 0, np.array([[0.9, 0.4, 0.9, 0.9], [0.1, 1, 1, 1], [1, 1, 1, 1]]))
            == [1, 0, 4]).all()


def test_sampled_verification_figures_from_acceptance_probabilities():
    beta = np.array([[0.5, 0.5], [1.0, 0.0], [0.2, 1.0]])
    f = by_key(conventions(np.ones((3, 2), bool), Settings(k=2, temperature=1.0), beta=beta))
    reach = [[0.5, 0.25], [1.0, 0.0], [0.2, 0.2]]
    assert f["sampled_e_len"].value == pytest.approx(1 + np.sum(reach) / 3)
    assert f["sampled_alpha_1"].value == pytest.approx(1.7 / 3)
    assert f["sampled_alpha_2"].value == pytest.approx(0.45 / 1.7)
    assert f["sampled_rate_2"].value == pytest.approx(0.45 / 3)
    assert counterpart("vllm_mean_acceptance_length", True) == "sampled_e_len"
    assert counterpart("vllm_rate_2", True) == "sampled_rate_2" and counterpart("vllm_rate_2", False) == "vllm_rate_2"


def test_wilson_against_published_values():
    lo, hi = wilson(8, 10)  # Newcombe (1998), Table I: 0.4902 - 0.9433
    assert (round(lo, 4), round(hi, 4)) == (0.4902, 0.9433)
    lo, hi = wilson(0, 10)
    assert lo == 0 and round(hi, 4) == 0.2775
    assert wilson(0, 0) is None


def test_wilson_covers_95_percent_by_simulation():
    """Nominal 95 %: over 4000 seeded binomial samples the interval holds the true rate 93-97 % of the time
    (3 s.e. of a 4000-trial coverage estimate is 1 %, plus Wilson's own known oscillation around 95 %)."""
    rng = np.random.default_rng(11)
    for p, n in ((0.7, 200), (0.3, 100)):
        hits = rng.binomial(n, p, size=4000)
        covered = np.mean([lo <= p <= hi for lo, hi in (wilson(int(h), n) for h in hits)])
        assert 0.93 <= covered <= 0.97, (p, n, covered)
    # twin: the naive Wald interval at a small n and an extreme rate does not hold its nominal level
    hits = rng.binomial(20, 0.95, size=4000)
    half = [1.96 * math.sqrt(h / 20 * (1 - h / 20) / 20) for h in hits]
    wald = [(h / 20 - d, h / 20 + d) for h, d in zip(hits, half)]
    assert np.mean([lo <= 0.95 <= hi for lo, hi in wald]) < 0.9


def markov_chains(rng, chains: int, k: int, stay: float, enter: float) -> tuple[np.ndarray, float]:
    """right [C, k] from one stationary two-state Markov sequence of right/wrong tokens: chain i reads tokens
    i+1..i+k, so neighbouring chains overlap as measured chains do. And the true E[len]."""
    pi = enter / (1 - stay + enter)  # P(right) at stationarity
    bits = np.empty(chains + k, dtype=bool)
    bits[0] = rng.random() < pi
    u = rng.random(len(bits))
    for t in range(1, len(bits)):
        bits[t] = u[t] < (stay if bits[t - 1] else enter)
    right = np.lib.stride_tricks.sliding_window_view(bits[1:], k)[:chains]
    return right, 1 + pi * sum(stay ** (j - 1) for j in range(1, k + 1))


def test_block_bootstrap_of_e_len_covers_on_overlapping_chains():
    """Chains overlap and their tokens are correlated (a Markov sequence): the block bootstrap's nominal 95 % holds
    within 90-98 % over 300 seeded sequences (the moving-block bootstrap is known to undercover slightly at this
    size; 3 s.e. of a 300-trial estimate is 3.8 %). Twin: resampling single chains (block 1) undercovers badly."""
    rng = np.random.default_rng(5)
    covered, naive = [], []
    for _ in range(300):
        right, truth = markov_chains(rng, 600, 4, stay=0.85, enter=0.35)
        f = by_key(conventions(right, Settings(k=4)))
        lo, hi = f["e_len"].interval
        covered.append(lo <= truth <= hi)
        accepted = np.logical_and.accumulate(right, axis=1).sum(axis=1)[:, None].astype(float)
        sums, rows = block_bootstrap_sums(accepted, 1, resamples=400, seed=1)
        one = 1 + sums[:, 0] / rows
        naive.append(np.quantile(one, 0.025) <= truth <= np.quantile(one, 0.975))
    assert 0.90 <= np.mean(covered) <= 0.98, np.mean(covered)
    assert np.mean(naive) < 0.85, np.mean(naive)


def test_block_bootstrap_sums_are_those_of_contiguous_blocks():
    columns = np.arange(10, dtype=float)[:, None]
    sums, rows = block_bootstrap_sums(columns, 5, resamples=50, seed=0)
    assert rows == 10
    possible = {a + b for a in range(6) for b in range(6)}  # two blocks, each starting at 0..5
    assert set((sums[:, 0] - 20) / 5) <= possible  # a block from s sums 5s + 10


def test_buckets_split_the_chains_by_position_and_positions_parse():
    right = np.zeros((40, 2), bool)
    right[20:] = True  # acceptance rises along the sequence
    buckets = position_buckets(right, np.arange(40), Settings(k=2, buckets=2))
    assert [(b.first, b.last) for b in buckets] == [(0, 20), (20, 40)]
    assert buckets[0].figures["alpha_1"].value == 0 and buckets[1].figures["alpha_1"].value == 1
    assert parse_positions("3:9") == (3, 9) and parse_positions(None) is None
    assert parse_positions("5:")[0] == 5
    with pytest.raises(InputError, match="FIRST:LAST"):
        parse_positions("x")
