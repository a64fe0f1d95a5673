"""`--main-model` for DeepSeek-V3, GLM-4.5 and DeepSeek-V4: which hidden the head reads, from the official classes.

DeepSeek-V3 / GLM-4.5: H is the main model's final hidden state AFTER its final norm (`last_hidden_state`): vLLM's
deepseek_mtp target (DeepseekV2Model.forward ends with `self.norm`) and transformers' MTP candidate generator
(`outputs.hidden_states[-1]`, tied to `last_hidden_state`). DeepSeek-V4: the last decoder layer's output streams
[T, hc·D], before the main hc_head and final norm, which is neither what DeepseekV4Model returns nor its last
`output_hidden_states` entry. Each is checked against a hand loop over the official layers of a reference model that
the test builds itself (tests/families/main_layers.py), with twins: the neighbouring hidden differs.
"""

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from oracle.checkpoint import Checkpoint
from oracle.cli import cli as oracle_cli
from oracle.families import deepseek_v3, deepseek_v4, glm4_moe
from oracle.trace import read_trace
from tests.families.main_layers import v4_config, with_hf_main_layers, with_v4_main_layers
from tests.helpers import run_cli

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from make_fixtures import write_deepseek_v4_checkpoint, write_mtp_layer_checkpoint  # noqa: E402

SEQUENCE = np.array([1, 5, 17, 3, 99, 4, 250, 7, 8, 9, 11, 12], dtype=np.int64)  # T = 12 > V4's W = 4 (and 3)
HF = {"ds_bf16": ("deepseek_v3", None, {}), "ds_fp8": ("deepseek_v3", [16, 32], {}),
      "ds_noq_sharded": ("deepseek_v3", None, {"dims": {"q_lora_rank": None}, "sharded": True}),
      "glm": ("glm4_moe", None, {})}
MODULES = {"deepseek_v3": deepseek_v3, "glm4_moe": glm4_moe}
V4 = {"bf16": {}, "fp8_odd": {"fp8_block": [16, 48], "dims": {
    "hidden_size": 48, "hc_mult": 4, "num_attention_heads": 6, "head_dim": 16, "qk_rope_head_dim": 4, "o_groups": 3,
    "o_lora_rank": 20, "q_lora_rank": 24, "n_routed_experts": 6, "num_experts_per_tok": 3, "sliding_window": 3}}}


def rel(a, e) -> float:
    a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
    return float(np.abs(a - e).max() / np.abs(e).max())


@pytest.fixture(scope="module", params=sorted(HF))
def hf(request, tmp_path_factory):
    family, block, kw = HF[request.param]
    ckpt = write_mtp_layer_checkpoint(tmp_path_factory.mktemp(request.param) / "ckpt", family, **kw)
    return family, ckpt, with_hf_main_layers(ckpt, family, fp8_block=block)


@pytest.fixture(scope="module", params=sorted(V4))
def v4(request, tmp_path_factory):
    kw = V4[request.param]
    ckpt = write_deepseek_v4_checkpoint(tmp_path_factory.mktemp(request.param) / "ckpt", **kw)
    return ckpt, with_v4_main_layers(ckpt, fp8_block=kw.get("fp8_block"))


@torch.inference_mode()
def hf_by_hand(model, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(pre-norm, post-norm) last hidden: embed, every official decoder layer, the final norm, by hand."""
    x = model.embed_tokens(torch.from_numpy(ids)[None])
    pos = torch.arange(len(ids))[None]
    rope = model.rotary_emb(x, pos)
    t = len(ids)
    mask = torch.zeros(t, t).masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), torch.finfo(torch.float32).min)
    for layer in model.layers:
        x = layer(x, attention_mask=mask[None, None], position_ids=pos, position_embeddings=rope)
        x = x[0] if isinstance(x, tuple) else x
    return x[0].numpy(), model.norm(x)[0].numpy()


@torch.inference_mode()
def v4_by_hand(model, ids: np.ndarray, upto: int | None = None) -> np.ndarray:
    """The streams after decoder layer `upto` (default the last), [T, hc·D]: embed broadcast to hc streams, then the
    official layers under a W-key sliding-window mask."""
    cfg = model.config
    idx = torch.from_numpy(ids)[None]
    e = model.embed_tokens(idx)
    x = e.unsqueeze(2).expand(-1, -1, cfg.hc_mult, -1).contiguous()
    pos = torch.arange(len(ids))[None]
    rope = {kind: model.rotary_emb(e, pos, layer_type=kind) for kind in ("main", "compress")}
    i, j = torch.arange(len(ids))[:, None], torch.arange(len(ids))[None, :]
    mask = torch.zeros(len(ids), len(ids)).masked_fill((j > i) | (j <= i - cfg.sliding_window),
                                                       torch.finfo(torch.float32).min)[None, None]
    for layer in model.layers[: (upto if upto is not None else len(model.layers) - 1) + 1]:
        x = layer(x, position_embeddings=rope, position_ids=pos, attention_mask=mask, input_ids=idx, cache=None)
    return x[0].flatten(1).numpy()


# ---------------------------------------------------------------------------------------------------------------
# DeepSeek-V3 / GLM-4.5: the post-final-norm hidden


def test_hf_main_model_hidden_is_the_post_final_norm_state(hf):
    family, ckpt, ref = hf
    impl = MODULES[family]
    h = impl.main_model_hidden(impl.load_main_model(Checkpoint(ckpt)), SEQUENCE)
    pre, post = hf_by_hand(ref, SEQUENCE)
    assert h.shape == (len(SEQUENCE), ref.config.hidden_size)
    assert rel(h, post) < 1e-5, rel(h, post)
    assert rel(h, pre) > 0.1  # twin: the pre-norm state (a hook on the last layer) is another tensor
    with torch.inference_mode():  # what transformers' MTP candidate generator feeds: hidden_states[-1]
        out = ref(input_ids=torch.from_numpy(SEQUENCE)[None], output_hidden_states=True)
    assert np.array_equal(out.hidden_states[-1][0].numpy(), out.last_hidden_state[0].numpy())
    assert rel(h, out.last_hidden_state[0].numpy()) < 1e-6


def test_hf_export_main_model_reads_x0_then_the_step_tokens(hf, tmp_path):
    family, ckpt, ref = hf
    steps = SEQUENCE[1:]
    result = run_cli(oracle_cli, ["export", ckpt, "--out", tmp_path / "t.h5", "--tokens", ",".join(map(str, steps)),
                                  "--main-model", "--first-token", str(SEQUENCE[0]), "-q"])
    assert result.exit_code == 0, result.output
    with read_trace(tmp_path / "t.h5") as trace:
        hidden = trace.inputs().hidden
    _, post = hf_by_hand(ref, SEQUENCE[:-1])  # H_i at x_i: x_0 and the step tokens but the last
    assert rel(hidden, post) < 1e-5
    _, shifted = hf_by_hand(ref, SEQUENCE[1:])
    assert rel(hidden, shifted) > 0.1  # twin: H taken one token late


# ---------------------------------------------------------------------------------------------------------------
# DeepSeek-V4: the last block's output streams


def test_v4_main_model_hidden_is_the_last_block_output_streams(v4):
    ckpt, ref = v4
    h = deepseek_v4.main_model_hidden(deepseek_v4.load_main_model(Checkpoint(ckpt)), SEQUENCE)
    cfg = ref.config
    streams = v4_by_hand(ref, SEQUENCE)
    assert h.shape == (len(SEQUENCE), cfg.hc_mult * cfg.hidden_size)
    assert rel(h, streams) < 1e-5, rel(h, streams)
    with torch.inference_mode():
        out = ref(input_ids=torch.from_numpy(SEQUENCE)[None], output_hidden_states=True)
    collapsed = out.last_hidden_state[0].numpy()  # after the main hc_head and final norm: [T, D]
    assert collapsed.shape == (len(SEQUENCE), cfg.hidden_size)
    assert rel(np.tile(collapsed, cfg.hc_mult), streams) > 0.1  # twin: the returned hidden, broadcast, is not it
    assert out.hidden_states[-1].shape[-1] == cfg.hidden_size  # nor is the last output_hidden_states entry
    assert rel(v4_by_hand(ref, SEQUENCE, upto=len(ref.layers) - 2), streams) > 0.1  # twin: one layer early
    assert deepseek_v4.main_lm_head_input(Checkpoint(ckpt), h).shape == collapsed.shape
    assert rel(deepseek_v4.main_lm_head_input(Checkpoint(ckpt), h), collapsed) < 1e-5  # its lm_head input


def test_v4_export_main_model_writes_the_streams(v4, tmp_path):
    ckpt, ref = v4
    steps = SEQUENCE[1:]
    result = run_cli(oracle_cli, ["export", ckpt, "--out", tmp_path / "t.h5", "--tokens", ",".join(map(str, steps)),
                                  "--main-model", "--first-token", str(SEQUENCE[0]), "-q"])
    assert result.exit_code == 0, result.output
    with read_trace(tmp_path / "t.h5") as trace:
        hidden = trace.inputs().hidden
    assert rel(hidden, v4_by_hand(ref, SEQUENCE[:-1])) < 1e-5


# ---------------------------------------------------------------------------------------------------------------
# bad input: exit 2, naming the missing tensor, nothing written


def drop(ckpt: Path, name: str) -> None:
    tensors = load_file(ckpt / "model.safetensors")
    del tensors[name]
    save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe", "deepseek_v4"])
def test_main_model_without_main_layers_exits_2_before_loading(family, tmp_path):
    """The tiny writers' checkpoints hold only the main tensors the head shares: refused by name (the decoder layers
    that have no tensors), before torch loads, suggesting --hidden / --hidden-seed (issue 28)."""
    ckpt = (write_deepseek_v4_checkpoint(tmp_path / "ckpt") if family == "deepseek_v4"
            else write_mtp_layer_checkpoint(tmp_path / "ckpt", family))
    out = tmp_path / "t.h5"
    result = run_cli(oracle_cli, ["export", ckpt, "--out", out, "--tokens", "5,17,3", "--main-model",
                                  "--first-token", "1"])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert "--main-model" in result.output and "holds no complete main model" in result.output, result.output
    assert "layer(s) 1 have no tensors" in result.output and "--hidden-seed" in result.output
    assert not out.exists()


@pytest.mark.parametrize("family, name", [("deepseek_v3", "model.layers.1.self_attn.kv_b_proj.weight"),
                                          ("deepseek_v3", "model.layers.1.mlp.experts.3.up_proj.weight"),
                                          ("deepseek_v4", "layers.1.attn.indexer.weights_proj.weight"),
                                          ("deepseek_v4", "layers.0.ffn.gate.tid2eid")])
def test_one_missing_main_tensor_is_named(family, name, tmp_path):
    if family == "deepseek_v4":
        ckpt = write_deepseek_v4_checkpoint(tmp_path / "ckpt")
        with_v4_main_layers(ckpt)
    else:
        ckpt = write_mtp_layer_checkpoint(tmp_path / "ckpt", family)
        with_hf_main_layers(ckpt, family)
    good = run_cli(oracle_cli, ["export", ckpt, "--out", tmp_path / "ok.h5", "--tokens", "5,17,3", "--main-model",
                                "--first-token", "1", "-q"])
    assert good.exit_code == 0, good.output  # twin: complete, it runs
    drop(ckpt, name)
    result = run_cli(oracle_cli, ["export", ckpt, "--out", tmp_path / "t.h5", "--tokens", "5,17,3", "--main-model",
                                  "--first-token", "1"])
    assert result.exit_code == 2 and name in result.output and "Traceback" not in result.output, result.output
    assert not (tmp_path / "t.h5").exists()


def test_v4_main_config_reads_the_release_key_names(tmp_path):
    a = write_deepseek_v4_checkpoint(tmp_path / "hf")
    b = write_deepseek_v4_checkpoint(tmp_path / "release", release_keys=True)
    ca, cb = (deepseek_v4.main_text_config(Checkpoint(c)) for c in (a, b))
    reference = v4_config(a)
    for key in ("hidden_size", "num_attention_heads", "sliding_window", "layer_types", "mlp_layer_types",
                "num_experts_per_tok", "moe_intermediate_size", "partial_rotary_factor"):
        assert getattr(ca, key) == getattr(cb, key) == getattr(reference, key), key
