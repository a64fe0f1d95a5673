"""Multi-layer heads (transformers' MtpModel, step3p7): depth j runs MTP layer j-1, so its draft step reads that
layer's tensors (its top_k routed experts of E, its own KV cache or sliding window) and the lm_head; accept's report
and JSON say which layer each depth ran; k > N exits 2 before any work. The main model of a Step config counts what
transformers' own Step3p7TextModel holds. Each term by hand from the checkpoint's safetensors header."""

import json
import math
import re
import struct

import pytest
import torch

from oracle.cli import cli
from oracle.families.mtp_model_layout import step3p7_tiny_config
from oracle.speedup import main_model, verify_terms
from tests.helpers import FIXTURES as FIXTURE_DIR
from tests.helpers import load_script, run_cli

FIXTURES = load_script("make_fixtures")
# held out: 3 MTP layers (types full, sliding, full after the 2 main layers), window 5, 6 experts (top 2)
HELD_OUT = {"hidden_size": 48, "head_dim": 12, "num_nextn_predict_layers": 3, "sliding_window": 5,
            "n_routed_experts": 6, "vocab_size": 230}
TOKENS = ",".join(str((7 * i + 3) % 230) for i in range(40))  # N = 40
DTYPE_BYTES = {"BF16": 2, "F32": 4}


@pytest.fixture(scope="module")
def step_head(tmp_path_factory):
    return FIXTURES.write_mtp_model_checkpoint(tmp_path_factory.mktemp("step") / "ckpt", "step3p7", HELD_OUT)


@pytest.fixture(scope="module")
def measured(step_head, tmp_path_factory):
    out = tmp_path_factory.mktemp("acc") / "acc.json"
    r = run_cli(cli, ["accept", step_head, "--tokens", TOKENS, "--hidden-seed", "0", "--k", "3",
                      "--bandwidth", "2TB/s", "--json", out, "-q"])
    assert r.exit_code == 0, r.output
    return r.stdout, json.loads(out.read_text())


def header_bytes(ckpt) -> dict[str, tuple[str, tuple[int, ...], int]]:
    """name -> (dtype, shape, stored bytes), read from the safetensors header by hand."""
    with open(ckpt / "model.safetensors", "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    return {n: (m["dtype"], tuple(m["shape"]), m["data_offsets"][1] - m["data_offsets"][0])
            for n, m in header.items() if n != "__metadata__"}


def hand_draft_step(ckpt, layer: int, context: int) -> dict[str, float]:
    """Layer `layer` = model.layers.{2 + layer}.*: its tensors but its vocabulary copies (shared_head.head and
    embed_tokens, which MtpModel does not read), its stacked routed experts [6, ...] at 2 of 6, the main lm_head,
    one embedding row, K and V of 2 KV heads x 12 (bf16) for the tokens its cache holds (layer 1 is sliding)."""
    stored = header_bytes(ckpt)
    prefix = f"model.layers.{2 + layer}."
    mine = {n: v for n, v in stored.items() if n.startswith(prefix)
            and not n.endswith(("shared_head.head.weight", "embed_tokens.weight"))}
    routed = sum(b for n, (_, shape, b) in mine.items() if len(shape) == 3 and shape[0] == 6)
    assert routed == 3 * 6 * 32 * 48 * 2  # gate, up, down of 6 experts (32 x 48), bf16
    tokens = min(context, 5) if layer == 1 else context
    return {"head layer (dense tensors)": sum(b for _, _, b in mine.values()) - routed,
            "head routed experts (top_k=2)": routed * 2 / 6,
            "draft lm_head (V x D)": stored["lm_head.weight"][2],
            "embedding row": stored["model.embed_tokens.weight"][2] / 230,
            f"head KV cache at {context} tokens" + (" (sliding window: 5)" if layer == 1 else ""):
                2 * 2 * 12 * tokens * 2}


def test_each_depth_runs_its_layer_and_costs_that_layers_bytes(step_head, measured):
    stdout, data = measured
    assert data["layers"] == [0, 1, 2]
    steps = data["speed"]["draft_steps"]
    assert [(s["depth"], s["layer"]) for s in steps] == [(1, 0), (2, 1), (3, 2)]
    for step in steps:
        assert step["bytes"] == pytest.approx(hand_draft_step(step_head, step["layer"], 40), rel=1e-12)
    # the sliding layer's cache holds 5 tokens, the full layers' all 40: the steps differ by exactly that
    assert steps[0]["total_bytes"] - steps[1]["total_bytes"] == 2 * 2 * 12 * (40 - 5) * 2
    assert "depth 1 -> layer 0, depth 2 -> layer 1, depth 3 -> layer 2" in stdout
    assert re.search(r"^depth  layer  p_j", stdout, re.M)
    assert re.search(r"^\s+3\s+2\s+\d\.\d{3}", stdout, re.M)  # the alpha table's depth 3 row names layer 2
    for depth in (1, 2, 3):
        assert f"draft step at depth {depth} (MTP layer {depth - 1})" in stdout


def test_a_round_pays_each_depths_own_draft_step(measured):
    """Round of k: verify of k+1 tokens plus the draft steps of depths 1..k, each its own bytes at 2 TB/s."""
    _, data = measured
    speed = data["speed"]
    steps = [s["total_bytes"] / 2e12 for s in speed["draft_steps"]]
    plain = speed["verify_step"]["1"]["total_bytes"] / 2e12
    accepted = [c["accepted"] for c in data["per_chain"]]
    for row in speed["rows"]:
        k = row["k"]
        assert row["drafts_s"] == pytest.approx(sum(steps[:k]), rel=1e-12)
        assert row["draft_s"] == pytest.approx(steps[k - 1], rel=1e-12)
        e_len = 1 + sum(min(a, k) for a in accepted) / len(accepted)
        verify = speed["verify_step"][str(k + 1)]["total_bytes"] / 2e12
        assert row["speedup"] == pytest.approx(e_len * plain / (verify + sum(steps[:k])), rel=1e-9)


def test_a_one_layer_head_runs_layer_0_at_every_depth(tmp_path):
    out = tmp_path / "acc.json"
    r = run_cli(cli, ["accept", FIXTURE_DIR / "qwen3_5_trained", "--tokens-file",
                      FIXTURE_DIR / "qwen3_5_trained" / "heldout_tokens.txt", "--hidden-seed", "0", "--k", "3",
                      "--bandwidth", "1TB/s", "--json", out, "-q"])
    assert r.exit_code == 0, r.output
    data = json.loads(out.read_text())
    assert data["layers"] == [0, 0, 0]
    steps = data["speed"]["draft_steps"]
    assert [s["layer"] for s in steps] == [0, 0, 0] and steps[0]["bytes"] == steps[1]["bytes"] == steps[2]["bytes"]
    assert "draft step (every depth, MTP layer 0)" in r.stdout and "-> layer" not in r.stdout
    assert re.search(r"^depth  p_j", r.stdout, re.M)  # no layer column: one layer


def test_k_beyond_the_layers_exits_2_before_any_work(step_head, tmp_path):
    out = tmp_path / "acc.json"
    r = run_cli(cli, ["accept", step_head, "--tokens", TOKENS, "--hidden-seed", "0", "--k", "4", "--json", out,
                      "-q"])
    assert r.exit_code == 2 and "Traceback" not in r.output
    assert "--k 4: the step3p7 head has 3 MTP layers" in r.output and "use --k 3 or less" in r.output
    assert not out.exists()


STEP_HELD_OUT = {"num_hidden_layers": 4, "num_nextn_predict_layers": 2, "sliding_window": 7,
                 "layer_types": ["full_attention", "sliding_attention", "sliding_attention", "full_attention",
                                 "full_attention", "sliding_attention"],
                 "moe_layers_enum": "2,3,5", "gating": False, "share_expert_dim": 40,
                 "attention_other_setting": {"num_attention_heads": 8}}


@pytest.mark.parametrize("overrides", [{}, STEP_HELD_OUT], ids=["tiny", "held_out"])
def test_step_main_model_counts_what_transformers_builds(overrides):
    """Step3p7TextModel on the meta device: its main layers (the MTP ones are not built), per-layer head counts,
    the g_proj gate (per head, or per value where gating is false), MoE layers by moe_layers_enum, the shared
    expert, the router's correction bias (a buffer, stored in the release)."""
    from transformers.models.step3p7.configuration_step3p7 import Step3p7TextConfig
    from transformers.models.step3p7.modeling_step3p7 import Step3p7TextModel

    raw = step3p7_tiny_config(**overrides)
    text = raw["text_config"]
    with torch.device("meta"):
        model = Step3p7TextModel(Step3p7TextConfig(**{k: v for k, v in text.items() if k != "model_type"}))
    values = {n: p.numel() for n, p in model.named_parameters()}
    values |= {n: b.numel() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")}
    experts = sum(v for n, v in values.items() if ".mlp.experts." in n)
    d, v = text["hidden_size"], text["vocab_size"]
    m = main_model(raw)
    assert m.dense_params - d + v * d == sum(values.values()) - experts
    assert m.moe_layers * m.experts * m.expert_params == experts
    layers = text["num_hidden_layers"]
    full = text["layer_types"][:layers].count("full_attention")
    assert (m.full_attention_layers, m.sliding_attention_layers) == (full, layers - full)
    window = text["sliding_window"]
    kv = verify_terms(m, 1, 100, 2, 2).bytes["main KV cache at 100 tokens"]
    assert kv == 2 * (2 * 2 * 16) * (full * 100 + (layers - full) * min(100, window))  # 2 KV heads x 16, bf16
    assert math.isclose(m.distinct_experts(1), 2)
