"""The exact distributions behind the p_min gate and sampled verification, against an independent float64 brute
force (a stepwise run of the head through a fresh cache, numpy softmax over the tiny vocabulary); and greedy
targets scored with the main model's lm_head where the MTP layer carries its own, different, copy."""

import sys

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import DynamicCache

from oracle.accept import measure_acceptance
from oracle.accept_conventions import Settings
from oracle.checkpoint import Checkpoint
from oracle.export import HiddenSource
from oracle.families import qwen3_5
from oracle.inputs import hidden_from_seed, token_ids_from_file
from tests.helpers import FIXTURES, ROOT

TRAINED = FIXTURES / "qwen3_5_trained"
K = 3


@torch.inference_mode()
def stepwise_out_rows(ckpt, x, h, drafts, i: int) -> np.ndarray:
    """Chain i one step at a time through a fresh cache, its measured drafts fed back: its `out` rows [k, D]."""
    head, rotary = qwen3_5.build_head(ckpt.config, qwen3_5.torch_weights(ckpt.read_head(widen=False)))
    cache = DynamicCache(config=head.text_config)

    def step(token: int, hidden: torch.Tensor, pos: int) -> torch.Tensor:
        e = torch.from_numpy(ckpt.embedding_rows(np.array([token])))[None]
        return head(e, hidden, rotary(e, torch.tensor([[pos]])), None, cache)["out"]

    for t in range(i + 1):
        out = step(int(x[t + 1]), torch.from_numpy(h[t:t + 1])[None], t)
    rows = [out[0, 0].numpy()]
    for j in range(2, len(drafts) + 1):
        out = step(int(drafts[j - 2]), out, i + j - 1)
        rows.append(out[0, 0].numpy())
    return np.array(rows)


def softmax64(logits: np.ndarray) -> np.ndarray:
    z = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return z / z.sum(axis=-1, keepdims=True)


@pytest.fixture(scope="module")
def measured():
    x = token_ids_from_file(TRAINED / "heldout_tokens.txt")[:40]
    ckpt = Checkpoint(TRAINED)
    h = qwen3_5.main_model_hidden(qwen3_5.load_main_model(ckpt), x)
    runs = {sampling: measure_acceptance(TRAINED, x, HiddenSource(main_model=True), k=K, chunk_rows=100,
                                         settings=Settings(k=K, p_min=0.5, temperature=0.7, draft_sampling=sampling))
            for sampling in ("greedy", "sampled")}
    return ckpt, x, h, runs


def test_confidence_and_acceptance_probabilities_against_a_float64_brute_force(measured):
    ckpt, x, h, runs = measured
    w = ckpt.read("lm_head.weight").astype(np.float64)  # (V, D)
    for i in (0, 7, 20, len(x) - 2 - K):
        drafts = runs["greedy"].drafts[i]
        q_logits = stepwise_out_rows(ckpt, x, h, drafts, i).astype(np.float64) @ w.T  # (k, V)
        assert (q_logits.argmax(axis=1) == drafts).all()  # the replay and the stepwise run draft alike
        top10 = np.sort(q_logits, axis=1)[:, ::-1][:, :10]
        conf = 1 / np.exp(top10 - top10[:, :1]).sum(axis=1)
        full = softmax64(q_logits).max(axis=1)
        p = softmax64(h[i + 1:i + 1 + K].astype(np.float64) @ w.T / 0.7)  # the main model at positions i+1..i+k
        q = softmax64(q_logits / 0.7)
        for run in runs.values():  # 1e-5: the float32 out rows of a batched and a stepwise run differ by rounding
            np.testing.assert_allclose(run.stats.confidence[i], conf, rtol=1e-5, atol=1e-9)
            np.testing.assert_allclose(run.stats.confidence_full[i], full, rtol=1e-5, atol=1e-9)
        np.testing.assert_allclose(runs["greedy"].stats.beta[i], p[np.arange(K), drafts], rtol=1e-5, atol=1e-9)
        np.testing.assert_allclose(runs["sampled"].stats.beta[i], np.minimum(p, q).sum(axis=1), rtol=1e-5, atol=1e-9)
        shifted = softmax64(h[i:i + K].astype(np.float64) @ w.T / 0.7)  # twin: the target one position early
        assert not np.allclose(runs["greedy"].stats.beta[i], shifted[np.arange(K), drafts], rtol=1e-3)
    assert not np.allclose(runs["greedy"].stats.beta, runs["sampled"].stats.beta)


def test_a_cold_temperature_approaches_greedy_verification():
    x = token_ids_from_file(TRAINED / "heldout_tokens.txt")[:30]
    cold = measure_acceptance(TRAINED, x, HiddenSource(main_model=True), k=2,
                              settings=Settings(k=2, temperature=1e-4, draft_sampling="sampled"))
    right = cold.drafts == cold.targets
    np.testing.assert_allclose(cold.stats.beta, right.astype(float), atol=1e-3)


def test_bad_settings_are_refused():
    x = token_ids_from_file(TRAINED / "heldout_tokens.txt")[:30]
    from oracle.errors import InputError

    for settings, message in ((Settings(k=2, temperature=0.0), "temperature"), (Settings(k=2, p_min=1.5), "p-min"),
                              (Settings(k=2, positions=(50, 60)), "positions")):
        with pytest.raises(InputError, match=message):
            measure_acceptance(TRAINED, x, HiddenSource(main_model=True), k=2, settings=settings)
    with pytest.raises(InputError, match="synthetic"):
        measure_acceptance(TRAINED, x, HiddenSource(seed=0), k=2, target="text",
                           settings=Settings(k=2, temperature=1.0))


def test_a_position_range_keeps_those_chains():
    x = token_ids_from_file(TRAINED / "heldout_tokens.txt")[:40]
    whole = measure_acceptance(TRAINED, x, HiddenSource(main_model=True), k=2)
    part = measure_acceptance(TRAINED, x, HiddenSource(main_model=True), k=2,
                              settings=Settings(k=2, positions=(10, 20)))
    assert list(part.chain_positions) == list(range(10, 20))
    np.testing.assert_array_equal(part.drafts, whole.drafts[10:20])
    assert part.metrics.chains == 10


# --- greedy targets come from the main lm_head (issue 29, item 9) --------------------------------------------------


def deepseek_with_its_own_head_copy(tmp_path):
    """A DeepSeek-V3 MTP checkpoint whose shared_head.head differs from the main lm_head (rows rolled by one)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from make_fixtures import write_mtp_layer_checkpoint

    ckpt_dir = write_mtp_layer_checkpoint(tmp_path / "ds")
    tensors = load_file(ckpt_dir / "model.safetensors")
    name = next(n for n in tensors if n.endswith("shared_head.head.weight"))
    tensors[name] = torch.roll(tensors["lm_head.weight"], 1, dims=0).contiguous()
    save_file(tensors, ckpt_dir / "model.safetensors", metadata={"format": "pt"})
    return ckpt_dir, name


def test_greedy_targets_use_the_main_lm_head_not_the_mtp_layers_copy(tmp_path):
    ckpt_dir, own = deepseek_with_its_own_head_copy(tmp_path)
    ckpt = Checkpoint(ckpt_dir)
    x = np.random.default_rng(1).integers(0, ckpt.config.vocab_size, 30)
    h = hidden_from_seed(0, len(x), ckpt.config.hidden_size)
    np.save(tmp_path / "h.npy", h)
    k = 2
    result = measure_acceptance(ckpt_dir, x, HiddenSource(file=str(tmp_path / "h.npy")), k=k, target="greedy")
    main = h.astype(np.float64) @ ckpt.read("lm_head.weight").astype(np.float64).T
    copy = h.astype(np.float64) @ ckpt.read(own).astype(np.float64).T
    i, j = np.meshgrid(np.arange(len(x) - 1 - k), np.arange(1, k + 1), indexing="ij")
    np.testing.assert_array_equal(result.targets, main.argmax(axis=1)[i + j])
    assert (result.targets != copy.argmax(axis=1)[i + j]).all()  # twin: the MTP copy would score other targets
    assert result.source["lm_head"] == own and result.source["target_lm_head"] == "lm_head.weight"


def test_an_n_layer_head_replays_its_chains_for_the_p_min_gate_and_sampling(tmp_path):
    """step3p7 (3 MTP layers): the replay through the draft loop feeds the teacher-forced tokens its layer caches
    hold, so the distributions exist (it raised a TypeError without them) and the replayed drafts equal the
    measured ones (replayed_out_rows checks that itself)."""
    from oracle.cli import cli as oracle_cli
    from tests.helpers import run_cli

    tokens = tmp_path / "tokens.txt"
    rng = np.random.default_rng(0)
    tokens.write_text(",".join(map(str, rng.integers(0, 512, 30))))
    hidden = tmp_path / "h.npy"
    np.save(hidden, rng.standard_normal((30, 32)).astype(np.float32))  # H [N, D] as a main model's dump
    for extra in (["--p-min", "0.5"], ["--temperature", "0.7"]):
        result = run_cli(oracle_cli, ["accept", FIXTURES / "step3p7_tiny", "--tokens-file", tokens, "--hidden", hidden,
                                      "--k", "3", "-q", *extra])
        assert result.exit_code == 0, (extra, result.output)
        assert result.output.strip().splitlines()[-1].startswith("ACCEPT | k=3")
