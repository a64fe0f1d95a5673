"""The head against the official transformers layer, stepwise vs batched, and its sensitivity to the four
"runs but wrong" pitfalls."""

import numpy as np
import pytest
import torch
from transformers import DynamicCache
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer

from oracle.checkpoint import Checkpoint
from oracle.errors import CheckpointError
from oracle.families import qwen3_5, torch_parts
from oracle.inputs import hidden_from_seed
from oracle.stages import STAGE_BY_NAME, STAGE_NAMES
from oracle.trace import TraceInputs
from tests.helpers import TINY

TOKENS = np.array([17, 42, 3, 255, 100, 7, 511, 64], dtype=np.int64)


def teacher_forced(ckpt: Checkpoint, tokens=TOKENS, hidden=None, start_pos=0) -> TraceInputs:
    d = ckpt.config.hidden_size
    hidden = hidden_from_seed(0, len(tokens), d) if hidden is None else hidden
    return TraceInputs(token_ids=tokens, positions=np.arange(start_pos, start_pos + len(tokens)),
                       hidden=hidden, embed=ckpt.embedding_rows(tokens))


def built(ckpt_dir=TINY):
    """The head as export builds it: stored (bf16) weights, linears widened block-wise."""
    ckpt = Checkpoint(ckpt_dir)
    head, rotary = qwen3_5.build_head(ckpt.config, qwen3_5.torch_weights(ckpt.read_head(widen=False)))
    return ckpt, head, rotary


def as_torch(arrays: dict) -> dict:
    return {name: torch.from_numpy(arr) for name, arr in arrays.items()}


def rel_err(actual: np.ndarray, expected: np.ndarray) -> float:
    """Largest difference relative to the largest reference magnitude (the probe's max_rel)."""
    return float(np.abs(actual.astype(np.float64) - expected).max() / np.abs(expected).max())


def first_changed_stage(stages: dict, reference: dict, rtol: float = 1e-5) -> str | None:
    return next((n for n in STAGE_NAMES if rel_err(stages[n], reference[n]) > rtol), None)


def test_every_stage_recorded_with_its_width():
    ckpt, head, rotary = built()
    stages = qwen3_5.run_batched(head, rotary, teacher_forced(ckpt))
    assert list(stages) == list(STAGE_NAMES)
    for name, arr in stages.items():
        assert arr.shape == (len(TOKENS), STAGE_BY_NAME[name].width(64)) and arr.dtype == np.float32
        assert np.isfinite(arr).all() and np.abs(arr).max() > 0


def test_loaded_parameters_are_exactly_the_checkpoint_tensors():
    ckpt, head, _ = built()
    weights = ckpt.read_head().tensors
    state = head.state_dict()
    assert {f"mtp.{k}" for k in state} == set(weights)
    for name, value in state.items():
        np.testing.assert_array_equal(value.float().numpy(), weights[f"mtp.{name}"], err_msg=name)
    assert head.fc.weight.dtype == torch.bfloat16  # linears stay as stored; UpcastLinear widens block-wise


@pytest.mark.parametrize("drop", ["mtp.norm.weight", "mtp.layers.0.self_attn.q_norm.weight"])
def test_a_missing_norm_weight_is_an_error_not_an_identity_norm(drop):
    ckpt = Checkpoint(TINY)
    weights = as_torch(ckpt.read_head().tensors)
    del weights[drop]
    with pytest.raises(CheckpointError, match=drop.removeprefix("mtp.")):
        qwen3_5.build_head(ckpt.config, weights)


def official_layer_stages(ckpt: Checkpoint, fc_rows: np.ndarray, positions: np.ndarray) -> dict[str, np.ndarray]:
    """ah..res2 from an official Qwen3_5DecoderLayer stepping through its own KV cache, captured with hooks."""
    text = qwen3_5.head_text_config(ckpt.config)
    layer = Qwen3_5DecoderLayer(text, layer_idx=0)
    prefix = "mtp.layers.0."
    layer.load_state_dict({k.removeprefix(prefix): torch.from_numpy(v)
                           for k, v in ckpt.read_head().tensors.items() if k.startswith(prefix)}, strict=True)
    rotary = qwen3_5.build_head(ckpt.config, as_torch(ckpt.read_head().tensors))[1]
    seen: dict[str, list] = {n: [] for n in ("ah", "attn", "res1", "mh", "mlp", "res2")}
    layer.input_layernorm.register_forward_hook(lambda m, i, o: seen["ah"].append(o))
    layer.self_attn.register_forward_hook(lambda m, i, o: seen["attn"].append(o[0]))
    layer.post_attention_layernorm.register_forward_pre_hook(lambda m, i: seen["res1"].append(i[0]))
    layer.post_attention_layernorm.register_forward_hook(lambda m, i, o: seen["mh"].append(o))
    layer.mlp.register_forward_hook(lambda m, i, o: seen["mlp"].append(o))
    cache = DynamicCache(config=text)
    x, pos = torch.from_numpy(fc_rows)[None], torch.from_numpy(positions)[None]
    with torch.inference_mode():
        for t in range(len(positions)):
            out = layer(x[:, t:t + 1], position_embeddings=rotary(x[:, t:t + 1], pos[:, t:t + 1]), cache=cache)
            seen["res2"].append(out)
    return {n: torch.cat(v, dim=1)[0].numpy() for n, v in seen.items()}


@pytest.mark.parametrize("mode", ["batched", "stepwise"])
def test_tail_equals_official_decoder_layer_with_kv_cache(mode):
    ckpt, head, rotary = built()
    inputs = teacher_forced(ckpt)
    run = qwen3_5.run_batched if mode == "batched" else qwen3_5.run_stepwise
    stages = run(head, rotary, inputs)
    official = official_layer_stages(ckpt, stages["fc"], inputs.positions)
    for name, expected in official.items():
        assert rel_err(stages[name], expected) <= 1e-6, name


def test_stepwise_equals_batched():
    ckpt, head, rotary = built()
    inputs = teacher_forced(ckpt, start_pos=11)
    batched = qwen3_5.run_batched(head, rotary, inputs)
    stepwise = qwen3_5.run_stepwise(head, rotary, inputs)
    for name in STAGE_NAMES:
        assert rel_err(stepwise[name], batched[name]) <= 1e-6, name


def test_batched_pass_is_causal():
    """Changing the last step's inputs must leave every earlier step's stages untouched."""
    ckpt, head, rotary = built()
    inputs = teacher_forced(ckpt)
    hidden = inputs.hidden.copy()
    hidden[-1] += 1.0
    changed = qwen3_5.run_batched(head, rotary, TraceInputs(inputs.token_ids, inputs.positions, hidden,
                                                            inputs.embed))
    reference = qwen3_5.run_batched(head, rotary, inputs)
    for name in STAGE_NAMES:
        np.testing.assert_array_equal(changed[name][:-1], reference[name][:-1], err_msg=name)
        if name != "e":  # e reads only the embedding; everything from h on sees the changed hidden
            assert not np.array_equal(changed[name][-1], reference[name][-1]), name


# --- the four pitfalls, injected into a copy of the stem: each must change the trace first at its stage ---

def _w_norm(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The wrong flavour: w * x_hat instead of (1 + w) * x_hat."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight


class PlainWeightNormStem(qwen3_5.MtpHead):
    def stem(self, embed, hidden):
        s = {"e": _w_norm(self.pre_fc_norm_embedding, embed), "h": self.pre_fc_norm_hidden(hidden)}
        s["fc_in"] = torch.cat([s["e"], s["h"]], dim=-1)
        s["fc"] = self.fc(s["fc_in"])
        return s


class HiddenFirstStem(qwen3_5.MtpHead):
    def stem(self, embed, hidden):
        s = {"e": self.pre_fc_norm_embedding(embed), "h": self.pre_fc_norm_hidden(hidden)}
        s["fc_in"] = torch.cat([s["h"], s["e"]], dim=-1)
        s["fc"] = self.fc(s["fc_in"])
        return s


def _with_stem(head: qwen3_5.MtpHead, cls) -> qwen3_5.MtpHead:
    head.__class__ = cls
    return head


def _q_gate_as_halves(weights: dict) -> dict:
    """q_proj rows rearranged so the official per-head split sees what a naive `q, gate = x.chunk(2)` sees."""
    name = "mtp.layers.0.self_attn.q_proj.weight"
    w = weights[name]
    heads, hd = 4, 32
    queries, gates = w[: heads * hd].reshape(heads, hd, -1), w[heads * hd:].reshape(heads, hd, -1)
    return weights | {name: np.concatenate([queries, gates], axis=1).reshape(w.shape)}  # (H, 2hd, D) -> (2H*hd, D)


@pytest.mark.parametrize("pitfall, first_stage", [("w_norm", "e"), ("concat_order", "fc_in"),
                                                  ("q_gate_halves", "attn")])
def test_stem_and_attention_pitfalls_change_the_trace_first_at_their_stage(pitfall, first_stage):
    ckpt, head, rotary = built()
    inputs = teacher_forced(ckpt)
    reference = qwen3_5.run_batched(head, rotary, inputs)
    if pitfall == "q_gate_halves":
        head = qwen3_5.build_head(ckpt.config, as_torch(_q_gate_as_halves(ckpt.read_head().tensors)))[0]
    else:
        head = _with_stem(head, {"w_norm": PlainWeightNormStem, "concat_order": HiddenFirstStem}[pitfall])
    wrong = qwen3_5.run_batched(head, rotary, inputs)
    assert first_changed_stage(wrong, reference) == first_stage
    assert all(np.isfinite(v).all() for v in wrong.values())  # it runs: finite and well-shaped
    assert rel_err(wrong["out"], reference["out"]) > 1e-2


def test_pre_norm_hidden_changes_the_trace_first_at_h():
    ckpt, head, rotary = built()
    model = qwen3_5.load_main_model(ckpt)
    sequence = np.concatenate([[1], TOKENS[:-1]])
    last_layer = []
    model.layers[-1].register_forward_hook(lambda m, i, o: last_layer.append(o[0].detach().numpy()))
    post_norm = qwen3_5.main_model_hidden(model, sequence)
    pre_norm = last_layer[0]
    reference = qwen3_5.run_batched(head, rotary, teacher_forced(ckpt, hidden=post_norm))
    wrong = qwen3_5.run_batched(head, rotary, teacher_forced(ckpt, hidden=pre_norm))
    assert first_changed_stage(wrong, reference) == "h"
    assert rel_err(wrong["out"], reference["out"]) > 1e-2


def test_main_model_hidden_is_post_final_norm():
    ckpt = Checkpoint(TINY)
    model = qwen3_5.load_main_model(ckpt)
    sequence = np.array([1, 17, 42, 3, 255], dtype=np.int64)
    last_layer = []
    model.layers[-1].register_forward_hook(lambda m, i, o: last_layer.append(o))
    hidden = qwen3_5.main_model_hidden(model, sequence)
    with torch.inference_mode():
        normed = model.norm(last_layer[0])[0].numpy()
        all_hidden = model(input_ids=torch.from_numpy(sequence)[None], output_hidden_states=True).hidden_states
    np.testing.assert_array_equal(hidden, normed)
    np.testing.assert_array_equal(hidden, all_hidden[-1][0].numpy())  # transformers' [-1] is post-norm too
    assert rel_err(last_layer[0][0].numpy(), hidden) > 1e-2  # and the pre-norm tensor really differs


def test_official_modules_carry_the_checkpoint_config_not_transformers_defaults():
    """theta, rotary dim, eps, GQA groups and scaling checked against config.json by an independent formula."""
    import json

    text = json.loads((TINY / "config.json").read_text())["text_config"]
    rope = text["rope_parameters"]
    ckpt, head, rotary = built()
    rot = int(text["head_dim"] * rope["partial_rotary_factor"])
    expected_inv_freq = 1.0 / rope["rope_theta"] ** (np.arange(0, rot, 2) / rot)
    np.testing.assert_allclose(rotary.inv_freq.numpy(), expected_inv_freq, rtol=1e-6)
    attn = head.layers[0].self_attn
    assert attn.head_dim == text["head_dim"] and attn.scaling == text["head_dim"] ** -0.5
    assert attn.num_key_value_groups == text["num_attention_heads"] // text["num_key_value_heads"]
    norms = [m for m in head.modules() if type(m).__name__ == "Qwen3_5RMSNorm"]
    assert len(norms) == 7 and all(m.eps == text["rms_norm_eps"] for m in norms)


@pytest.mark.parametrize("rows, out_features, in_features", [(8, 96, 64), (1, 600, 128), (13, 256, 700)])
def test_upcast_linear_equals_a_float32_linear_bit_for_bit(rows, out_features, in_features):
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, in_features, generator=gen).to(torch.bfloat16)
    x = torch.randn(2, rows, in_features, generator=gen)
    expected = torch.nn.functional.linear(x, weight.float())
    assert torch.equal(torch_parts.UpcastLinear(weight)(x), expected)


@pytest.mark.parametrize("x_rows", [3, 70])  # below and above LARGE_FROM: one unit, or the large block budget
def test_upcast_linear_blocks_of_several_units_write_their_own_columns_bit_for_bit(monkeypatch, x_rows):
    # Tiny sizes: blocks of 1 and 3 UNITs of 8 rows and a short last block, as a real head's 256-row units
    monkeypatch.setattr(torch_parts.UpcastLinear, "UNIT", 8)
    monkeypatch.setattr(torch_parts.UpcastLinear, "LARGE_BLOCK", 24 * 40)
    monkeypatch.setattr(torch_parts.UpcastLinear, "LARGE_FROM", 64)
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(61, 40, generator=gen).to(torch.bfloat16)
    linear = torch_parts.UpcastLinear(weight)
    assert linear.block_rows(x_rows) == (8 if x_rows < linear.LARGE_FROM else 24)
    x = torch.randn(1, x_rows, 40, generator=gen)
    assert torch.equal(linear(x), torch.nn.functional.linear(x, weight.float()))
    assert torch.equal(linear(x.double()), torch.nn.functional.linear(x.double(), weight.double()))


def test_upcast_linear_block_comparison_sees_a_change_in_the_last_block(monkeypatch):
    # the twin: the comparison above reaches every block (a weight changed in the short last one is seen)
    monkeypatch.setattr(torch_parts.UpcastLinear, "UNIT", 8)
    monkeypatch.setattr(torch_parts.UpcastLinear, "LARGE_BLOCK", 24 * 40)
    monkeypatch.setattr(torch_parts.UpcastLinear, "LARGE_FROM", 2)
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(61, 40, generator=gen).to(torch.bfloat16)
    x = torch.randn(1, 3, 40, generator=gen)
    changed = weight.clone()
    changed[60, 0] += 1
    assert not torch.equal(torch_parts.UpcastLinear(changed)(x), torch.nn.functional.linear(x, weight.float()))


def test_float32_and_bf16_stored_weights_give_the_same_trace():
    ckpt, head, rotary = built()
    widened = qwen3_5.build_head(ckpt.config, as_torch(ckpt.read_head().tensors))[0]
    inputs = teacher_forced(ckpt)
    a, b = qwen3_5.run_batched(head, rotary, inputs), qwen3_5.run_batched(widened, rotary, inputs)
    for name in STAGE_NAMES:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
