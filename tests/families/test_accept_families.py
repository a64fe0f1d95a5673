"""`mtp-oracle accept` for the families beyond Qwen: DeepSeek-V4 (recycled hc streams, a sliding window with sinks)
and the --main-model hidden of DeepSeek-V3 / GLM-4.5 / DeepSeek-V4 feeding the greedy targets.

accept's chains are compared with a plain stepwise loop written here: the head run one step at a time through the
official sliding-window cache (transformers' DynamicSlidingWindowLayer keeps W-1 keys), recycling the block's output
streams, each draft the argmax of the lm_head in float64. Twins: the same loop recycling the collapsed `out`, or
with a cache that keeps every key, drafts differently, so the comparison can fail.
"""

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import DynamicCache

from oracle.accept import draft_chains, measure_acceptance
from oracle.checkpoint import Checkpoint
from oracle.cli import cli as oracle_cli
from oracle.export import HiddenSource
from oracle.families import deepseek_v4
from oracle.families.mtp_model_layout import MtpModelSpec
from oracle.families.registry import FAMILIES, head_module
from oracle.inputs import hidden_from_seed
from tests.families.main_layers import with_hf_main_layers, with_v4_main_layers
from tests.families.test_family_contract import WRITERS
from tests.helpers import run_cli

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from make_fixtures import write_deepseek_v4_checkpoint, write_mtp_layer_checkpoint  # noqa: E402

N, K = 18, 5  # 12 chains; drafts reach positions i+4 >= W, and the sequence is longer than W
V4 = {"bf16_w4_hc3": {}, "fp8_odd_w3_hc4": {"fp8_block": [16, 48], "dims": {
    "hidden_size": 48, "hc_mult": 4, "num_attention_heads": 6, "head_dim": 16, "qk_rope_head_dim": 4, "o_groups": 3,
    "o_lora_rank": 20, "q_lora_rank": 24, "n_routed_experts": 6, "num_experts_per_tok": 3, "sliding_window": 3}}}


@pytest.fixture(scope="module", params=sorted(V4))
def v4(request, tmp_path_factory):
    """(checkpoint dir, Checkpoint, head, rotary, x, H streams, lm_head float64)."""
    ckpt_dir = write_deepseek_v4_checkpoint(tmp_path_factory.mktemp(request.param) / "ckpt", **V4[request.param])
    ckpt = Checkpoint(ckpt_dir)
    head, rotary = deepseek_v4.build_head(ckpt.config, deepseek_v4.torch_weights(ckpt.read_head(widen=False)))
    x = np.random.default_rng(1).integers(0, ckpt.config.vocab_size, N)
    h = hidden_from_seed(2, N, ckpt.config.hc_mult * ckpt.config.hidden_size)
    lm = load_file(ckpt_dir / "model.safetensors")["head.weight"].double().numpy()
    return ckpt_dir, ckpt, head, rotary, x, h, lm


@torch.inference_mode()
def stepwise_chain(v4, i: int, k: int, recycle: str = "block_out", window_cache: bool = True) -> list[int]:
    """Chain i by hand: bridge steps 0..i, then k-1 drafts, one step at a time through a fresh cache."""
    ckpt_dir, ckpt, head, rotary, x, h, lm = v4
    embed = load_file(ckpt_dir / "model.safetensors")["embed.weight"].float()
    cfg = ckpt.config
    cache = DynamicCache(config=head.text_config) if window_cache else DynamicCache()

    def step(token: int, hidden: torch.Tensor, pos: int) -> dict:
        e = embed[token][None, None]  # (1, 1, D)
        p = torch.tensor([[pos]])
        return head(e, hidden, {"main": rotary(e, p, layer_type="main")}, p, None, cache)

    def recycled(s: dict) -> torch.Tensor:
        if recycle == "block_out":
            return s["block_out"]  # (1, 1, hc·D)
        return s["out"].repeat(1, 1, cfg.hc_mult)  # the wrong recycle: the collapsed, normed out on every stream

    def argmax(s: dict) -> int:
        return int(np.argmax(lm @ s["out"][0, 0].double().numpy()))

    for t in range(i + 1):
        s = step(int(x[t + 1]), torch.from_numpy(h[t:t + 1])[None], t)
    drafts = [argmax(s)]
    for j in range(2, k + 1):
        s = step(drafts[-1], recycled(s), i + j - 1)
        drafts.append(argmax(s))
    return drafts


def test_v4_drafts_equal_a_stepwise_run_recycling_the_block_streams(v4):
    _, ckpt, head, rotary, x, h, _ = v4
    assert N > ckpt.config.sliding_window + K  # the window drops bridge keys for every depth
    drafts = draft_chains(ckpt, head, rotary, x, h, K, chunk_rows=100, chain_block=5)[0]  # several blocks
    assert drafts.shape == (N - 1 - K, K) and (drafts[:, 1:] != drafts[:, :1]).any()
    for i in range(len(drafts)):
        assert drafts[i].tolist() == stepwise_chain(v4, i, K), f"chain {i}"
    assert (draft_chains(ckpt, head, rotary, x, h, K)[0] == drafts).all()  # one block = several blocks


def test_twin_recycling_the_collapsed_out_drafts_differently(v4):
    _, ckpt, head, rotary, x, h, _ = v4
    drafts = draft_chains(ckpt, head, rotary, x, h, K)[0]
    wrong = [stepwise_chain(v4, i, K, recycle="out") for i in range(len(drafts))]
    assert [w[0] for w in wrong] == drafts[:, 0].tolist()  # draft 1 does not recycle anything
    assert any(w[1:] != d[1:].tolist() for w, d in zip(wrong, drafts))


def test_twin_a_cache_without_the_window_drafts_differently(v4):
    _, ckpt, head, rotary, x, h, _ = v4
    drafts = draft_chains(ckpt, head, rotary, x, h, K)[0]
    full = [stepwise_chain(v4, i, K, window_cache=False) for i in range(len(drafts))]
    assert any(f != d.tolist() for f, d in zip(full, drafts))


def test_v4_accept_cli_runs_on_a_streams_file_and_refuses_a_narrow_one(v4, tmp_path):
    ckpt_dir, ckpt, _, _, x, h, _ = v4
    np.save(tmp_path / "h.npy", h)
    tokens = ",".join(map(str, x))
    ok = run_cli(oracle_cli, ["accept", ckpt_dir, "--tokens", tokens, "--hidden", tmp_path / "h.npy", "--k", "3",
                              "--target", "text", "-q"])
    assert ok.exit_code == 0 and "ACCEPT | k=3" in ok.output, ok.output
    np.save(tmp_path / "narrow.npy", h[:, : ckpt.config.hidden_size].copy())
    bad = run_cli(oracle_cli, ["accept", ckpt_dir, "--tokens", tokens, "--hidden", tmp_path / "narrow.npy", "-q"])
    width = ckpt.config.hc_mult * ckpt.config.hidden_size
    assert bad.exit_code == 2 and f"[T, {width}]" in bad.output and "Traceback" not in bad.output, bad.output


def test_v4_greedy_targets_need_the_main_hc_head_and_norm(v4, tmp_path):
    """The plain fixture has the main `norm.weight` and `hc_head_fn` but not `hc_head_base`: greedy refuses,
    naming it (exit 2); text runs."""
    ckpt_dir, _, _, _, x, h, _ = v4
    np.save(tmp_path / "h.npy", h)
    args = ["accept", ckpt_dir, "--tokens", ",".join(map(str, x)), "--hidden", tmp_path / "h.npy", "--k", "2", "-q"]
    greedy = run_cli(oracle_cli, args)
    assert greedy.exit_code == 2 and "hc_head_base" in greedy.output and "--target text" in greedy.output, \
        greedy.output
    assert run_cli(oracle_cli, [*args, "--target", "text"]).exit_code == 0


# ---------------------------------------------------------------------------------------------------------------
# --main-model: the hidden the chains read and the greedy targets


def test_v4_accept_main_model_targets_are_the_main_models_argmax(tmp_path):
    ckpt_dir = write_deepseek_v4_checkpoint(tmp_path / "ckpt")
    ref = with_v4_main_layers(ckpt_dir)
    x = np.random.default_rng(3).integers(0, 512, 14)
    with torch.inference_mode():
        logits_in = ref(input_ids=torch.from_numpy(x)[None]).last_hidden_state[0].double().numpy()  # norm(hc_head)
    lm = load_file(ckpt_dir / "model.safetensors")["head.weight"].double().numpy()
    main_argmax = (logits_in @ lm.T).argmax(1)
    k = 3
    result = measure_acceptance(ckpt_dir, x, HiddenSource(main_model=True), k=k)
    i, j = np.meshgrid(np.arange(len(x) - 1 - k), np.arange(1, k + 1), indexing="ij")
    assert result.target == "greedy"
    np.testing.assert_array_equal(result.targets, main_argmax[i + j])
    assert not np.array_equal(result.targets, main_argmax[i + j - 1])  # an off-by-one would show
    streams = deepseek_v4.main_model_hidden(deepseek_v4.load_main_model(Checkpoint(ckpt_dir)), x)
    np.save(tmp_path / "h.npy", streams)
    dumped = measure_acceptance(ckpt_dir, x, HiddenSource(file=tmp_path / "h.npy"), k=k)
    assert np.array_equal(dumped.drafts, result.drafts) and np.array_equal(dumped.targets, result.targets)


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
def test_hf_accept_main_model_targets_are_the_argmax_of_the_post_norm_hidden(family, tmp_path):
    ckpt_dir = write_mtp_layer_checkpoint(tmp_path / "ckpt", family)
    ref = with_hf_main_layers(ckpt_dir, family)
    x = np.random.default_rng(4).integers(0, 512, 14)
    with torch.inference_mode():
        post = ref(input_ids=torch.from_numpy(x)[None]).last_hidden_state[0].double().numpy()
    ckpt = Checkpoint(ckpt_dir)
    lm = ckpt.read("lm_head.weight").astype(np.float64)  # the main model's: the MTP layer's own copy only drafts
    k = 2
    result = measure_acceptance(ckpt_dir, x, HiddenSource(main_model=True), k=k)
    i, j = np.meshgrid(np.arange(len(x) - 1 - k), np.arange(1, k + 1), indexing="ij")
    np.testing.assert_array_equal(result.targets, (post @ lm.T).argmax(1)[i + j])
    cli = run_cli(oracle_cli, ["accept", ckpt_dir, "--tokens", ",".join(map(str, x)), "--main-model", "--k", "2",
                               "-q"])
    assert cli.exit_code == 0 and "| target=greedy |" in cli.output.strip().splitlines()[-1], cli.output


# ---------------------------------------------------------------------------------------------------------------
# every family: accept's batched chains = a stepwise loop through the head's own (official) cache


@torch.inference_mode()
def stepwise_through_steps(ckpt, head, rotary, lm, x, h, i: int, k: int, shift: int = 0) -> list[int]:
    """Chain i one step at a time through `head.steps` and the official cache of the head's config (a window cache
    for V4), recycling the family's recycled stage; drafts positioned `shift` late (the twin)."""
    from oracle.draft_loop import embedding_rows as _embedding_rows

    cache = DynamicCache(config=head.text_config)

    def step(token: int, hidden: torch.Tensor, pos: int) -> dict:
        e = torch.from_numpy(_embedding_rows(ckpt, np.array([token])))[None]  # (1, 1, D)
        return head.steps(rotary, e, hidden, torch.tensor([[pos]]), None, cache)

    for t in range(i + 1):
        s = step(int(x[t + 1]), torch.from_numpy(h[t:t + 1])[None], t)
    drafts = [int(np.argmax(lm @ s["out"][0, 0].double().numpy()))]
    for j in range(2, k + 1):
        s = step(drafts[-1], s[ckpt.family.recycled], i + j - 1 + shift)
        drafts.append(int(np.argmax(lm @ s["out"][0, 0].double().numpy())))
    return drafts


# N-layer heads (transformers' MtpModel) draft as MtpModel.forward does: tests/families/test_mtp_model_families.py
@pytest.mark.parametrize("name", sorted(n for n, spec in FAMILIES.items() if not isinstance(spec, MtpModelSpec)))
def test_every_family_drafts_as_its_head_steps_one_at_a_time(name, tmp_path):
    from oracle.draft_loop import draft_projection as _lm_head

    ckpt = Checkpoint(WRITERS[name](tmp_path / "ckpt"))
    impl = head_module(ckpt.family)
    head, rotary = impl.build_head(ckpt.config, impl.torch_weights(ckpt.read_head(widen=False)))
    n, k = 12, 4
    x = np.random.default_rng(5).integers(0, ckpt.config.vocab_size, n)
    h = hidden_from_seed(6, n, ckpt.family.hidden_width(ckpt.config))
    lm = ckpt.read(_lm_head(ckpt, 64).name).astype(np.float64)
    drafts = draft_chains(ckpt, head, rotary, x, h, k, chain_block=3)[0]
    for i in range(len(drafts)):
        assert drafts[i].tolist() == stepwise_through_steps(ckpt, head, rotary, lm, x, h, i, k), (name, i)
    late = [stepwise_through_steps(ckpt, head, rotary, lm, x, h, i, k, shift=1) for i in range(len(drafts))]
    assert any(d.tolist() != w for d, w in zip(drafts, late))  # twin: drafts one position late draft differently


def test_accept_without_the_heads_output_projection_names_it(tmp_path):
    """A V4 checkpoint without `head.weight` (its shared lm_head) exits 2 naming that tensor, not only the
    `lm_head.weight` fallback; the twin with it present runs."""
    from safetensors.torch import save_file

    ckpt_dir = write_deepseek_v4_checkpoint(tmp_path / "ckpt")
    tensors = load_file(ckpt_dir / "model.safetensors")
    args = ["accept", ckpt_dir, "--k", "2", "--tokens", ",".join(map(str, range(1, 9))), "--hidden-seed", "0",
            "--target", "text", "-q"]
    assert run_cli(oracle_cli, args).exit_code == 0
    del tensors["head.weight"]
    save_file(tensors, ckpt_dir / "model.safetensors")
    result = run_cli(oracle_cli, args)
    assert result.exit_code == 2 and "has no head.weight" in result.output and "Traceback" not in result.output
