"""Acceptance: the metric arithmetic, batched chains = a stepwise run of the head, the trained head against a
random one, and `mtp-oracle accept` as a user runs it (bad input -> exit 2, nothing half-written)."""

import json
import re
import shutil
from fractions import Fraction

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import DynamicCache

from oracle import accept, draft_loop
from oracle.accept import acceptance_metrics, draft_chains, measure_acceptance
from oracle.accept_report import render_report, result_json, summary_line
from oracle.checkpoint import Checkpoint
from oracle.cli import cli
from oracle.export import HiddenSource
from oracle.families import qwen3_5
from oracle.inputs import hidden_from_seed, token_ids_from_file
from oracle.trace import TraceInputs
from tests.helpers import FIXTURES, TINY, run_cli

TRAINED = FIXTURES / "qwen3_5_trained"
HELDOUT = TRAINED / "heldout_tokens.txt"
SUMMARY = re.compile(r"ACCEPT \| k=(\d+) chains=(\d+) \| E\[len\]=(\d+\.\d{3}) \(naive upper bound (\d+\.\d{3})\) "
                     r"\| alpha=([-0-9.,]+) \| target=(greedy|text) \| 95% E\[len\] \[(\d+\.\d{3}), (\d+\.\d{3})\]")


# --- the arithmetic ------------------------------------------------------------------------------------------


def table(rows: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Drafts/targets from rows like 'RWR' (R: draft right, W: wrong)."""
    right = np.array([[c == "R" for c in row] for row in rows])
    targets = np.arange(right.size).reshape(right.shape)
    return np.where(right, targets, -1), targets


def test_metrics_exact_values_on_a_hand_table():
    m = acceptance_metrics(*table(["RRR", "RRW", "RWR", "WRR", "RRR"]))
    assert (m.k, m.chains, m.hits, m.runs, m.alpha_den) == (3, 5, (4, 4, 4), (4, 3, 2), (5, 4, 3))
    assert m.p == (0.8, 0.8, 0.8)
    assert m.alpha == (0.8, 0.75, 2 / 3)
    assert m.e_len == float(1 + Fraction(4, 5) + Fraction(3, 5) + Fraction(2, 5)) == 2.8
    assert m.e_len_naive == 3.4


def test_conditional_and_unconditional_figures_part_when_depth_2_is_right_only_after_a_miss():
    m = acceptance_metrics(*table(["RW", "RW", "WR", "WR"]))
    assert m.p == (0.5, 0.5)  # unconditionally depth 2 looks as good as depth 1 ...
    assert m.alpha == (0.5, 0.0)  # ... but it is never right when it would be checked
    assert (m.e_len, m.e_len_naive) == (1.5, 2.0)
    aligned = acceptance_metrics(*table(["RR", "RR", "WW", "WW"]))  # twin: same p_j, depth 2 right after a hit
    assert aligned.p == m.p and aligned.alpha == (0.5, 1.0) and aligned.e_len == aligned.e_len_naive == 2.0


def test_alpha_is_undefined_where_no_chain_got_that_far_and_e_len_stops():
    m = acceptance_metrics(*table(["WRR", "WRR"]))
    assert m.alpha == (0.0, None, None) and m.alpha_den == (2, 0, 0)
    assert (m.e_len, m.e_len_naive) == (1.0, 3.0)


def test_e_len_equals_one_plus_the_share_of_chains_with_their_first_j_drafts_right():
    rng = np.random.default_rng(0)
    for _ in range(20):
        right = rng.random((37, 5)) < rng.uniform(0.2, 0.9)
        m = acceptance_metrics(np.where(right, 1, 0), np.ones(right.shape, dtype=int))
        prefix = [int(right[:, :j].all(axis=1).sum()) for j in range(1, 6)]
        assert m.e_len == float(1 + sum(Fraction(n, 37) for n in prefix))
        if prefix[1] < right[:, 1].sum():  # twin: where some draft 2 was right after a miss, naive overstates
            assert m.e_len_naive > m.e_len


def test_report_marks_undefined_alpha_with_a_dash_and_json_null():
    drafts, targets = table(["WRR", "WRR"])
    result = accept.AcceptResult(acceptance_metrics(drafts, targets), "text", np.zeros(6, dtype=np.int64),
                                 drafts, targets, {})
    assert summary_line(result) == ("ACCEPT | k=3 chains=2 | E[len]=1.000 (naive upper bound 3.000) "
                                    "| alpha=0.00,-,- | target=text | 95% E[len] [1.000, 1.000]")
    assert "    2  1.000  (2/2)" + " " * 12 + "-  (0/0)" in render_report(result).splitlines()
    data = json.loads(json.dumps(result_json(result)))
    assert data["alpha"] == [0.0, None, None] and data["per_chain"][0]["accepted"] == 0


# --- batched chains against a stepwise run of the head -------------------------------------------------------


def setup(ckpt_dir):
    """(checkpoint, head, rotary, x, H, float32 lm_head): held-out text + main-model H, or seeded on tiny."""
    ckpt = Checkpoint(ckpt_dir)
    head, rotary = qwen3_5.build_head(ckpt.config, qwen3_5.torch_weights(ckpt.read_head(widen=False)))
    if ckpt_dir == TRAINED:
        x = token_ids_from_file(HELDOUT)[:80]
        h = qwen3_5.main_model_hidden(qwen3_5.load_main_model(ckpt), x)
    else:
        x = np.random.default_rng(0).integers(0, ckpt.config.vocab_size, 24)
        h = hidden_from_seed(0, len(x), ckpt.config.hidden_size)
    return ckpt, head, rotary, x, h, ckpt.read("lm_head.weight")


@torch.inference_mode()
def stepwise_chain(ckpt, head, rotary, lm, x, h, i: int, k: int, shift: int = 0) -> list[int]:
    """Chain i, one step at a time through a fresh cache: bridge steps 0..i, then its own drafts."""
    cache = DynamicCache(config=head.text_config)

    def step(token: int, hidden: torch.Tensor, pos: int) -> torch.Tensor:
        e = torch.from_numpy(ckpt.embedding_rows(np.array([token])))[None]  # (1, D) -> (1, 1, D)
        return head(e, hidden, rotary(e, torch.tensor([[pos]])), None, cache)["out"]  # (1, 1, D)

    for t in range(i + 1):
        out = step(int(x[t + 1]), torch.from_numpy(h[t:t + 1])[None], t)
    drafts = [int(np.argmax(out[0, 0].numpy() @ lm.T))]
    for j in range(2, k + 1):
        out = step(drafts[-1], out, i + j - 1 + shift)
        drafts.append(int(np.argmax(out[0, 0].numpy() @ lm.T)))
    return drafts


@pytest.fixture(scope="module", params=[TINY, TRAINED], ids=["tiny", "trained"])
def model(request):
    return setup(request.param)


def test_draft_1_is_the_argmax_of_lm_head_on_the_trace_out(model):
    ckpt, head, rotary, x, h, lm = model
    k = 3
    chains = len(x) - 1 - k
    drafts = draft_chains(ckpt, head, rotary, x, h, k, chunk_rows=40)[0]  # uneven chunks: 96 and 512 rows
    steps = TraceInputs(token_ids=x[1:chains + 1], positions=np.arange(chains), hidden=h[:chains],
                        embed=ckpt.embedding_rows(x[1:chains + 1]))
    out = qwen3_5.run_batched(head, rotary, steps)["out"]
    np.testing.assert_array_equal(drafts[:, 0], np.argmax(out @ lm.T, axis=1))
    shifted = qwen3_5.run_batched(head, rotary, TraceInputs(steps.token_ids, steps.positions, h[1:chains + 1],
                                                            steps.embed))["out"]
    assert (np.argmax(shifted @ lm.T, axis=1) != drafts[:, 0]).any()  # twin: H_{i+1} instead of H_i shows


def test_batched_chains_equal_a_stepwise_run_of_the_head(model):
    ckpt, head, rotary, x, h, lm = model
    k = 4
    chains = len(x) - 1 - k
    drafts = draft_chains(ckpt, head, rotary, x, h, k, chunk_rows=40, chain_block=5)[0]  # several blocks
    assert (drafts[:, 1:] != drafts[:, :1]).any()  # not a degenerate constant chain
    for i in sorted({0, 1, 4, 5, chains // 2, chains - 1}):  # block edges, middle, last
        assert drafts[i].tolist() == stepwise_chain(ckpt, head, rotary, lm, x, h, i, k), f"chain {i}"
    assert (draft_chains(ckpt, head, rotary, x, h, k)[0] == drafts).all()  # one block = several blocks


def test_the_stepwise_comparison_sees_a_wrong_mask_or_position(model, monkeypatch):
    """Twins: chains that see later bridge steps, or drafts one position off, draft differently."""
    ckpt, head, rotary, x, h, lm = model
    k = 4
    drafts = draft_chains(ckpt, head, rotary, x, h, k)[0]
    chains = range(0, len(x) - 1 - k, 4)
    assert any(drafts[i].tolist() != stepwise_chain(ckpt, head, rotary, lm, x, h, i, k, shift=1) for i in chains)
    right_mask = draft_loop.chain_mask

    def leaky(first: int, bridge_keys: int, counts: tuple[int, ...]) -> torch.Tensor:
        return torch.zeros_like(right_mask(first, bridge_keys, counts))  # every chain sees every bridge step, draft

    monkeypatch.setattr(draft_loop, "chain_mask", leaky)
    assert (draft_chains(ckpt, head, rotary, x, h, k)[0][:, 1:] != drafts[:, 1:]).any()


# --- the trained head is worth something, a random one is not ------------------------------------------------


def random_head(ckpt_dir, seed: int) -> dict[str, np.ndarray]:
    """Random mtp.* tensors of the checkpoint's shapes, initialised as scripts/make_fixtures.py does."""
    from tests.helpers import load_script

    values = load_script("make_fixtures").tensor_values
    return {n: values(n, a.shape, seed) for n, a in Checkpoint(ckpt_dir).read_head().tensors.items()}


def test_trained_head_accepts_far_above_a_random_head_on_heldout_text():
    x = token_ids_from_file(HELDOUT)
    trained = measure_acceptance(TRAINED, x, HiddenSource(main_model=True), k=4)
    rand = [measure_acceptance(TRAINED, x, HiddenSource(main_model=True), k=4, head_weights=random_head(TRAINED, s))
            for s in range(3)]
    tokens, counts = np.unique(trained.targets[:, 0], return_counts=True)
    chance = counts.max() / counts.sum()  # always drafting the commonest target token
    assert trained.target == "greedy" and trained.metrics.chains == len(x) - 5
    assert trained.metrics.alpha[0] > 0.6 and trained.metrics.e_len > 2.0, summary_line(trained)
    for r in rand:
        assert r.metrics.alpha[0] <= chance and r.metrics.e_len < 1.1, summary_line(r)
    assert trained.metrics.e_len > max(r.metrics.e_len for r in rand) + 1.0


# --- the command ---------------------------------------------------------------------------------------------


def accept_cli(*args):
    return run_cli(cli, ["accept", *args, "-q"])


def test_accept_end_to_end_on_the_trained_fixture(tmp_path):
    out_json, out_png = tmp_path / "acc.json", tmp_path / "acc.png"
    result = accept_cli(TRAINED, "--tokens-file", HELDOUT, "--main-model", "--json", out_json, "--plot", out_png)
    assert result.exit_code == 0, result.output
    last = result.stdout.strip().splitlines()[-1]
    match = SUMMARY.fullmatch(last)
    assert match and match.group(1, 2, 6) == ("4", "195", "greedy"), last
    assert float(match.group(7)) < float(match.group(3)) < float(match.group(8))  # E[len] inside its interval
    assert "alpha_j (given drafts 1..j-1 right)" in result.stdout and "upper bound" in result.stdout
    data = json.loads(out_json.read_text())
    assert data["schema"] == "mtp-accept/1" and data["k"] == 4 and data["chains"] == 195
    assert len(data["p"]) == len(data["alpha"]) == 4 and len(data["per_chain"]) == 195
    assert f"{data['e_len']:.3f}" == match.group(3) and f"{data['e_len_naive']:.3f}" == match.group(4)
    chains = data["per_chain"]
    assert [sum(c["accepted"] >= j for c in chains) for j in range(1, 5)] == data["alpha_num"]
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_hidden_dump_gives_what_the_main_model_gives(tmp_path):
    x = token_ids_from_file(HELDOUT)[:60]
    np.save(tmp_path / "h.npy", qwen3_5.main_model_hidden(qwen3_5.load_main_model(Checkpoint(TRAINED)), x))
    tokens = ",".join(map(str, x))
    sources = (["--main-model"], ["--hidden", tmp_path / "h.npy"])
    runs = [accept_cli(TRAINED, "--tokens", tokens, *src) for src in sources]
    assert runs[0].exit_code == runs[1].exit_code == 0
    assert runs[0].stdout == runs[1].stdout
    text = accept_cli(TRAINED, "--tokens", tokens, "--main-model", "--target", "text", "--k", "2")
    assert "| target=text |" in text.stdout.strip().splitlines()[-1] and "a proxy" in text.stdout


def tokens_arg(n: int) -> str:
    return ",".join(map(str, token_ids_from_file(HELDOUT)[:n]))


@pytest.mark.parametrize("args, message", [
    (["--k", "0", "--tokens", tokens_arg(20), "--main-model"], "--k 0: a chain has at least one draft"),
    (["--k", "4", "--tokens", tokens_arg(5), "--main-model"], "too short for k=4: .* N >= k \\+ 2 = 6"),
    (["--tokens", tokens_arg(20), "--hidden", "ROWS19"], "has 19 rows but 20 token ids"),
    (["--tokens", tokens_arg(20), "--hidden", "WIDTH32"], "hidden_size is 64, so it must be \\[T, 64\\]"),
    (["--tokens", "1,2,3,4,5,6,96", "--main-model"], "token id 96 at row 6 is out of range"),
    (["--tokens", tokens_arg(20), "--hidden-seed", "0", "--target", "greedy"], "--target greedy .* synthetic"),
    (["--tokens", tokens_arg(20), "--main-model", "--chunk-rows", "0"], "--chunk-rows 0"),
])
def test_bad_input_exits_2_with_a_message_and_writes_nothing(tmp_path, args, message):
    args = list(args)
    hidden = {"ROWS19": np.zeros((19, 64), np.float32), "WIDTH32": np.zeros((20, 32), np.float32)}
    for i, a in enumerate(args):
        if a in hidden:
            np.save(tmp_path / f"{a}.npy", hidden[a])
            args[i] = tmp_path / f"{a}.npy"
    out_json = tmp_path / "acc.json"
    result = accept_cli(TRAINED, *args, "--json", out_json)
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
    assert re.search(message, result.output), result.output
    assert "Traceback" not in result.output
    assert not out_json.exists() and not list(tmp_path.glob(".*tmp*"))


def without_lm_head(tmp_path, tie: bool):
    """A copy of the trained fixture without lm_head.weight, its config tying (or not) lm_head to the embedding."""
    out = tmp_path / f"tied_{tie}"
    out.mkdir()
    tensors = load_file(TRAINED / "model.safetensors")
    del tensors["lm_head.weight"]
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((TRAINED / "config.json").read_text())
    config["tie_word_embeddings"] = config["text_config"]["tie_word_embeddings"] = tie
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_missing_lm_head_exits_2_unless_the_config_ties_it_to_the_embedding(tmp_path):
    untied = accept_cli(without_lm_head(tmp_path, False), "--tokens", tokens_arg(20), "--main-model")
    assert untied.exit_code == 2 and "has no lm_head.weight" in untied.output, untied.output
    tied_dir = without_lm_head(tmp_path, True)
    copied = tmp_path / "embed_as_lm_head"
    shutil.copytree(TRAINED, copied)
    tensors = load_file(TRAINED / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.language_model.embed_tokens.weight"].clone()
    save_file(tensors, copied / "model.safetensors", metadata={"format": "pt"})
    runs = [accept_cli(d, "--tokens", tokens_arg(40), "--main-model") for d in (tied_dir, copied)]
    assert runs[0].exit_code == runs[1].exit_code == 0 and runs[0].stdout == runs[1].stdout


def test_targets_are_the_main_models_argmax_and_the_next_tokens():
    """greedy: draft j of chain i against argmax(lm_head @ H_{i+j}); text: against x_{i+1+j} (computed here
    from the whole lm_head, independently of the chunked sweep the first drafts share)."""
    trained = FIXTURES / "qwen3_5_trained"
    x = token_ids_from_file(trained / "heldout_tokens.txt")[:40]
    h = qwen3_5.main_model_hidden(qwen3_5.load_main_model(Checkpoint(trained)), x)
    logits = h.astype(np.float64) @ Checkpoint(trained).read("lm_head.weight").astype(np.float64).T  # (N, V)
    k = 3
    i, j = np.meshgrid(np.arange(len(x) - 1 - k), np.arange(1, k + 1), indexing="ij")  # (C, k) each
    greedy = accept.target_table(x, logits.argmax(axis=1)[1:-1], k, "greedy")
    np.testing.assert_array_equal(greedy, logits.argmax(axis=1)[i + j])
    np.testing.assert_array_equal(accept.target_table(x, None, k, "text"), x[i + 1 + j])
    result = measure_acceptance(trained, x, HiddenSource(main_model=True), k=k, chunk_rows=17)
    np.testing.assert_array_equal(result.targets, logits.argmax(axis=1)[i + j])
    assert not np.array_equal(result.targets, logits.argmax(axis=1)[i + j - 1])  # an off-by-one would show
