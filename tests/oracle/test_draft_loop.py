"""The draft loop (oracle/draft_loop.py) on the Qwen3.5 fixtures: masks, the draft stage and its margin, the chain
trace as written, accept unchanged, and the bad-input refusals of `export --chain`. Every family against an
independent stepwise run: tests/families/test_draft_loop_families.py."""

import json

import h5py
import numpy as np
import pytest
import torch

from oracle import draft_loop
from oracle.accept import measure_acceptance
from oracle.checkpoint import Checkpoint
from oracle.cli import cli
from oracle.export import ChainOptions, HiddenSource, export_trace
from oracle.limits import estimate_bytes
from oracle.lm_head import lm_head_of
from oracle.trace import ChainDepthReader, chain_digest, read_trace, stage_checksums
from tests.helpers import FIXTURES, TINY, run_cli

TRAINED = FIXTURES / "qwen3_5_trained"
TOKENS = "17,42,3,255,100,7,511,64"


def export(*args):
    return run_cli(cli, ["export", *map(str, args)])


# --- masks ---------------------------------------------------------------------------------------------------------


def visible(mask: torch.Tensor) -> np.ndarray:
    return (mask[0, 0] == 0).numpy()


def test_the_bridge_mask_is_causal_and_a_chain_sees_its_bridge_rows_and_own_entries_only():
    np.testing.assert_array_equal(visible(draft_loop.chain_mask(0, 4, ())), np.tril(np.ones((4, 4), bool)))
    # block of chains 2..4 (bridge keys 0..4), depth 3 after depth 2 held 3 entries and depth 3 holds 2 (shrinking)
    got = visible(draft_loop.chain_mask(2, 5, (3, 2)))
    want = np.array([[1, 1, 1, 0, 0, 1, 0, 0, 1, 0],  # chain 2: bridge 0..2, its depth-2 and depth-3 entries
                     [1, 1, 1, 1, 0, 0, 1, 0, 0, 1]], bool)  # chain 3: bridge 0..3, its own entries
    np.testing.assert_array_equal(got, want)
    keys = draft_loop.key_positions(2, torch.arange(10, 15), (3, 2))  # bridge positions from 10
    np.testing.assert_array_equal(keys.numpy(), [10, 11, 12, 13, 14, 13, 14, 15, 14, 15])


def test_chain_rows_count_the_bridges_that_have_the_tokens():
    assert [draft_loop.chain_rows(8, j) for j in (2, 4, 8, 9)] == [7, 5, 1, 0]


# --- the draft's margin ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk_rows", [40, 8192])
def test_draft_margin_is_a_lower_bound_within_rounding_of_the_exact_margin(chunk_rows):
    ckpt = Checkpoint(TRAINED)
    lm = lm_head_of(ckpt, chunk_rows)
    w = ckpt.read(lm.name).astype(np.float64)
    x = np.random.default_rng(0).standard_normal((40, w.shape[1])).astype(np.float32)
    x[3] = 0  # every logit ties: margin 0
    ids, margin = lm.argmax_margin(x)
    logits = x.astype(np.float64) @ w.T
    top2 = np.sort(logits, axis=1)[:, -2:]
    exact = top2[:, 1] - top2[:, 0]
    np.testing.assert_array_equal(ids, lm.argmax(x))
    assert (margin <= exact).all() and np.abs(margin - exact).max() < 1e-5 and margin[3] == 0
    assert np.linalg.norm(w, axis=1).max() <= lm.row_norm_max() <= np.linalg.norm(w, axis=1).max() * (1 + 2**-9)


def test_twin_a_screen_keeping_only_the_argmax_candidates_misses_the_runner_up(monkeypatch):
    """The top-2 screen is what finds the runner-up: with the argmax-only screen the margin is wrong somewhere."""
    ckpt = Checkpoint(TRAINED)
    lm = lm_head_of(ckpt, 40)
    x = np.random.default_rng(1).standard_normal((40, ckpt.config.hidden_size)).astype(np.float32)
    right = lm.argmax_margin(x)[1]
    screen = type(lm)._screen
    monkeypatch.setattr(type(lm), "_screen", lambda self, rows, second=False: screen(self, rows))
    assert (lm.argmax_margin(x)[1] != right).any()


# --- the trace as written ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chained(tmp_path_factory):
    path = tmp_path_factory.mktemp("chain") / "chain.h5"
    assert export(TINY, "--out", path, "--tokens", TOKENS, "--hidden-seed", "0", "--chain", "4", "-q").exit_code == 0
    return path


def test_depth_1_of_a_chained_trace_is_the_plain_export(chained, tmp_path):
    assert export(TINY, "--out", tmp_path / "plain.h5", "--tokens", TOKENS, "--hidden-seed", "0", "-q").exit_code == 0
    with read_trace(chained) as c, read_trace(tmp_path / "plain.h5") as p:
        assert c.stages == p.stages and c.stages[-1] == "draft"
        for name in p.stages:
            np.testing.assert_array_equal(c.stage_rows(name), p.stage_rows(name))
        assert c.attrs["inputs_digest"] == p.attrs["inputs_digest"] and "chain" not in p.attrs


def test_the_chain_record_digests_and_checksums_cover_every_depth(chained):
    with h5py.File(chained) as f:
        record = json.loads(f.attrs["chain"].decode())
        assert record == {"depths": 4, "tokens": "teacher_forced", "recycle": "out", "layers": [0, 0, 0],
                          "num_layers": 1, "kv": "dropped_after_chain"}
        depths = {j: {n: f[f"chain/d{j}/inputs/{n}"][()] for n in f[f"chain/d{j}/inputs"]} for j in (2, 3, 4)}
        recorded = f.attrs["chain_digest"].decode()
        assert recorded == chain_digest(depths)
        checks = json.loads(f.attrs["stage_checksums"].decode())
        for j in (2, 3, 4):
            stages = {n: f[f"chain/d{j}/stages/{n}"][()] for n in f[f"chain/d{j}/stages"]}
            assert all(checks[f"d{j}/{n}"] == v for n, v in stage_checksums(stages).items())
            assert f[f"chain/d{j}/stages/draft"].attrs["kind"].decode() == "index_set"
            assert f[f"chain/d{j}/evidence/draft_margin"].attrs["row_norm_max"] > 0
        depths[3]["positions"] = depths[3]["positions"] + 1  # twin: an edited chain input changes the digest
        assert recorded != chain_digest(depths)


def test_draft_is_the_argmax_of_lm_head_on_out_at_every_depth(chained):
    ckpt = Checkpoint(TINY)
    w = ckpt.read("lm_head.weight").astype(np.float64)
    with read_trace(chained) as ref:
        parts = [(ref.stage_rows("out"), ref.stage_rows("draft"))]
        parts += [(ChainDepthReader(ref, j).stage_rows("out"), ChainDepthReader(ref, j).stage_rows("draft"))
                  for j in (2, 3, 4)]
    for out, draft in parts:
        np.testing.assert_array_equal(draft[:, 0], (out.astype(np.float64) @ w.T).argmax(axis=1))
    embed = ckpt.read("model.language_model.embed_tokens.weight").astype(np.float64)
    wrong = (parts[1][0].astype(np.float64) @ embed.T).argmax(axis=1)  # twin: drafting through embed_tokens
    assert (wrong != parts[1][1][:, 0]).any()


# --- accept is unchanged ------------------------------------------------------------------------------------------


def test_accept_metrics_are_the_old_loops_on_the_trained_fixture():
    """Measured with the chain loop accept had before oracle/draft_loop.py (commit b2a8235), same inputs."""
    x = np.array([int(t) for t in (TRAINED / "heldout_tokens.txt").read_text().split()][:80])
    result = measure_acceptance(TRAINED, x, HiddenSource(main_model=True), k=4)
    assert (result.metrics.hits, result.metrics.runs) == ((58, 37, 24, 16), (58, 34, 16, 7))


# --- bad input -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("args, message", [
    (["--chain", "1"], "pass --chain 2 or more"),
    (["--chain", "9"], "--chain 9 is past the tokens available"),
    (["--chain", "3", "--mode", "stepwise"], "Drop --mode stepwise"),
    (["--chain", "3", "--recycle", "fc_in"], "--recycle fc_in"),
    (["--chain", "3", "--recycle", "nosuch"], "stages that fit are e, h, fc"),
    (["--recycle", "res2"], "--recycle applies only with --chain K"),
    (["--chain-tokens", "argmax"], "--chain-tokens argmax applies only with --chain K"),
])
def test_bad_chain_requests_exit_2_saying_what_to_pass_and_write_nothing(tmp_path, args, message):
    result = export(TINY, "--out", tmp_path / "x.h5", "--tokens", TOKENS, "--hidden-seed", "0", *args)
    assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output, result.output
    assert not (tmp_path / "x.h5").exists()


def test_one_step_has_no_chain_and_is_told_to_leave_chain_out(tmp_path):
    """T=1: the advice is not "--chain 1 or less" (refused itself), but to leave --chain out."""
    result = export(TINY, "--out", tmp_path / "x.h5", "--tokens", "17", "--hidden-seed", "0", "--chain", "2")
    assert result.exit_code == 2 and "leave --chain out" in result.output, result.output
    assert "--chain 1 or less" not in result.output and not (tmp_path / "x.h5").exists()


def test_twin_the_longest_chain_the_tokens_allow_is_accepted(tmp_path):
    path = tmp_path / "k8.h5"
    assert export(TINY, "--out", path, "--tokens", TOKENS, "--hidden-seed", "0", "--chain", "8", "-q").exit_code == 0
    with read_trace(path) as ref:
        assert ChainDepthReader(ref, 8).input_rows("token_ids").tolist() == [64]  # one bridge has depth 8


def test_argmax_tokens_without_a_draft_projection_are_refused(tmp_path):
    from safetensors.torch import load_file, save_file
    import shutil

    head_only = tmp_path / "head_only"
    shutil.copytree(TINY, head_only)
    tensors = load_file(head_only / "model.safetensors")
    del tensors["lm_head.weight"]
    save_file(tensors, head_only / "model.safetensors")
    with pytest.raises(Exception, match="--chain-tokens argmax feeds each depth"):
        export_trace(head_only, tmp_path / "a.h5", np.array([1, 2, 3]), HiddenSource(seed=0),
                     chain=ChainOptions(2, tokens="argmax"))
    warnings = []
    export_trace(head_only, tmp_path / "t.h5", np.array([1, 2, 3]), HiddenSource(seed=0), chain=ChainOptions(2),
                 warn=warnings.append)  # teacher-forced chains need no projection: no draft stage, said
    with read_trace(tmp_path / "t.h5") as ref:
        assert "draft" not in ref.stages and "draft" not in ChainDepthReader(ref, 2).stages
    assert any("no `draft` stage" in w for w in warnings)


def test_the_memory_estimate_grows_with_the_chain():
    cfg = Checkpoint(TINY).config
    one, four = estimate_bytes(cfg, 1000, "batched"), estimate_bytes(cfg, 1000, "batched", chain=4)
    assert four > one and estimate_bytes(cfg, 1000, "batched", chain=8) > four
