"""`mtp-probe weights`: one engine dump per load fault, each classified, with an all-ok twin; fused names; bad input."""

import json

import numpy as np
import pytest
from click.testing import CliRunner
from safetensors.numpy import save_file

from oracle.checkpoint import Checkpoint
from oracle.errors import InputError
from probe.cli import cli
from probe.weight_faults import halves_permutation
from probe.weights import audit_weights

from tests.helpers import FIXTURES

DENSE = FIXTURES / "qwen3_5_tiny"
MOE = FIXTURES / "qwen3_5_moe_tiny"
FUSED = FIXTURES / "qwen3_next_tiny_fused"
ATTN, MLP = "mtp.layers.0.self_attn.", "mtp.layers.0.mlp."


def head(checkpoint) -> dict[str, np.ndarray]:
    return {k: v.copy() for k, v in Checkpoint(checkpoint).read_head(digest=False).tensors.items()}


def audit(tmp_path, checkpoint, tensors, name="dump.safetensors") -> dict:
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, tmp_path / name)
    return {t.name: t for t in audit_weights(checkpoint, tmp_path / name).tensors}


def int_quantized(w: np.ndarray, bits: int, group: int) -> np.ndarray:
    """Symmetric per-group integer quantisation and back (what an int8/int4 engine holds, dequantized)."""
    levels = 2 ** (bits - 1) - 1
    g = w.reshape(w.shape[0], -1, group)
    scale = np.abs(g).max(axis=-1, keepdims=True) / levels
    return (np.round(g / scale) * scale).reshape(w.shape).astype(np.float32)


def fp8_quantized(w: np.ndarray) -> np.ndarray:
    import torch  # torch's float8_e4m3fn: the rounding an fp8 engine applies

    scale = np.abs(w).max() / 448.0
    return (torch.from_numpy(w / scale).to(torch.float8_e4m3fn).float().numpy() * scale).astype(np.float32)


def one_fault(name: str, fault):
    return pytest.param(name, fault, id=f"{fault.__name__}-{name.rsplit('.', 2)[-2]}")


def missing(w): return None
def zeros(w): return np.zeros_like(w)
def constant(w): return np.full_like(w, 0.25)
def norm_zeros(w): return np.zeros_like(w)
def norm_ones(w): return np.ones_like(w)
def fresh_linear(w): return np.random.default_rng(7).uniform(-1, 1, w.shape).astype(np.float32) / np.sqrt(w.shape[1])
def fresh_normal(w): return (0.02 * np.random.default_rng(7).standard_normal(w.shape)).astype(np.float32)
def transposed(w): return w.T.copy()
def scaled(w): return w * np.float32(1 / 448)
def int8(w): return int_quantized(w, 8, w.shape[1])
def int4(w): return int_quantized(w, 4, 32)
def fp8(w): return fp8_quantized(w)
def qgate_halves(w): return w[halves_permutation(4, 32)]
def concat_swapped(w): return np.concatenate([w[:, 64:], w[:, :64]], axis=1)
def other_model(w): return 0.6 * w + np.random.default_rng(3).standard_normal(w.shape).astype(np.float32) * w.std()


EXPECTED = {missing: "missing", zeros: "zeros", constant: "constant", norm_zeros: "init_like", norm_ones: "init_like",
            fresh_linear: "init_like", fresh_normal: "init_like", transposed: "transposed", scaled: "scaled",
            int8: "quantized", int4: "quantized", fp8: "quantized", qgate_halves: "permuted_rows",
            concat_swapped: "permuted_rows", other_model: "different"}


@pytest.mark.parametrize("name, fault", [
    one_fault("mtp.fc.weight", missing), one_fault(MLP + "down_proj.weight", zeros),
    one_fault(ATTN + "k_proj.weight", constant), one_fault("mtp.norm.weight", norm_zeros),
    one_fault("mtp.pre_fc_norm_hidden.weight", norm_ones), one_fault(ATTN + "o_proj.weight", fresh_linear),
    one_fault(MLP + "up_proj.weight", fresh_normal), one_fault(MLP + "gate_proj.weight", transposed),
    one_fault(ATTN + "v_proj.weight", scaled), one_fault(MLP + "up_proj.weight", int8),
    one_fault(MLP + "down_proj.weight", int4), one_fault("mtp.fc.weight", fp8),
    one_fault(ATTN + "q_proj.weight", qgate_halves), one_fault("mtp.fc.weight", concat_swapped),
    one_fault(ATTN + "o_proj.weight", other_model),
])
def test_each_fault_is_classified_and_the_rest_stay_ok(tmp_path, name, fault):
    tensors = head(DENSE)
    faulty = fault(tensors[name])
    if faulty is None:
        del tensors[name]
    else:
        tensors[name] = faulty
    found = audit(tmp_path, DENSE, tensors)
    assert found[name].status == EXPECTED[fault], found[name]
    assert {n: t.status for n, t in found.items() if n != name} == {n: "ok" for n in found if n != name}


def test_fault_notes_name_the_pattern(tmp_path):
    tensors = head(DENSE)
    tensors[ATTN + "q_proj.weight"] = qgate_halves(tensors[ATTN + "q_proj.weight"])
    tensors["mtp.fc.weight"] = concat_swapped(tensors["mtp.fc.weight"])
    tensors[ATTN + "v_proj.weight"] = scaled(tensors[ATTN + "v_proj.weight"])
    found = audit(tmp_path, DENSE, tensors)
    assert "q/gate halves" in found[ATTN + "q_proj.weight"].note
    assert "halves swapped" in found["mtp.fc.weight"].note
    assert "0.00223214" in found[ATTN + "v_proj.weight"].note


def test_all_ok_twins_bf16_float32_and_npy_dir(tmp_path):
    tensors = head(DENSE)
    assert {t.status for t in audit(tmp_path, DENSE, tensors).values()} == {"ok"}
    import torch
    from safetensors.torch import save_file as save_torch

    save_torch({k: torch.from_numpy(v).to(torch.bfloat16) for k, v in tensors.items()}, tmp_path / "bf16.safetensors")
    report = audit_weights(DENSE, tmp_path / "bf16.safetensors")
    assert report.verdict == "ok" and report.summary_line().startswith("WEIGHTS OK | 15 of 15")
    npy = tmp_path / "npy"
    npy.mkdir()
    for k, v in tensors.items():
        np.save(npy / f"{k}.npy", v)
    np.save(npy / "model.embed_tokens.weight.npy", np.zeros((4, 4), np.float32))  # not a head tensor: ignored
    report = audit_weights(DENSE, npy)
    assert report.verdict == "ok" and report.ignored == ["model.embed_tokens.weight"]


def test_fused_names_dense(tmp_path):
    tensors = head(DENSE)
    qkv = np.concatenate([tensors.pop(ATTN + p + "_proj.weight") for p in "qkv"])
    gate_up = np.concatenate([tensors.pop(MLP + "gate_proj.weight"), tensors.pop(MLP + "up_proj.weight")])
    found = audit(tmp_path, DENSE, tensors | {ATTN + "qkv_proj.weight": qkv, MLP + "gate_up_proj.weight": gate_up})
    assert {t.status for t in found.values()} == {"ok"} and len(found) == 12
    assert found[ATTN + "qkv_proj.weight"].note.startswith("fused self_attn.q_proj + ")
    swapped = np.concatenate([gate_up[96:], gate_up[:96]])  # up rows first: a fault inside a fusion
    found = audit(tmp_path, DENSE, tensors | {ATTN + "qkv_proj.weight": qkv, MLP + "gate_up_proj.weight": swapped})
    assert found[MLP + "gate_up_proj.weight"].status == "permuted_rows"


def test_fused_names_moe_per_expert_and_fused_checkpoints(tmp_path):
    tensors = head(MOE)
    w13 = np.stack([np.concatenate([tensors.pop(f"{MLP}experts.{e}.{p}_proj.weight") for p in ("gate", "up")])
                    for e in range(8)])
    w2 = np.stack([tensors.pop(f"{MLP}experts.{e}.down_proj.weight") for e in range(8)])
    found = audit(tmp_path, MOE, tensors | {MLP + "experts.w13_weight": w13, MLP + "experts.w2_weight": w2})
    assert {t.status for t in found.values()} == {"ok"}
    w2_scaled = w2.copy()
    w2_scaled[3] *= 16  # one expert's scale applied twice: not a constant factor of the whole tensor
    found = audit(tmp_path, MOE, tensors | {MLP + "experts.w13_weight": w13, MLP + "experts.w2_weight": w2_scaled})
    assert found[MLP + "experts.w2_weight"].status == "different"
    swapped = w13[[1, 0, *range(2, 8)]]
    found = audit(tmp_path, MOE, tensors | {MLP + "experts.w13_weight": swapped, MLP + "experts.w2_weight": w2})
    assert found[MLP + "experts.w13_weight"].status == "permuted_rows"
    assert "expert order" in found[MLP + "experts.w13_weight"].note
    fused = head(FUSED)
    fused[MLP + "experts.w13_weight"] = fused.pop(MLP + "experts.gate_up_proj")
    fused[MLP + "experts.w2_weight"] = fused.pop(MLP + "experts.down_proj")
    assert {t.status for t in audit(tmp_path, FUSED, fused).values()} == {"ok"}


def test_moe_faults(tmp_path):
    tensors = head(MOE)
    tensors[MLP + "experts.5.up_proj.weight"] = np.zeros_like(tensors[MLP + "experts.5.up_proj.weight"])
    tensors[MLP + "shared_expert_gate.weight"] = tensors[MLP + "shared_expert_gate.weight"] * 2
    del tensors[MLP + "gate.weight"]
    found = audit(tmp_path, MOE, tensors)
    bad = {n: t.status for n, t in found.items() if t.status != "ok"}
    assert bad == {MLP + "experts.5.up_proj.weight": "zeros", MLP + "shared_expert_gate.weight": "scaled",
                   MLP + "gate.weight": "missing"}


def test_bad_input_names_the_tensor(tmp_path):
    tensors = head(DENSE)
    tensors["mtp.fc.weight"] = np.zeros((3, 5), np.float32)
    save_file(tensors, tmp_path / "shape.safetensors")
    with pytest.raises(InputError, match=r"mtp.fc.weight has shape \[3, 5\].*matches nothing"):
        audit_weights(DENSE, tmp_path / "shape.safetensors")
    save_file({"model.layers.0.q.weight": np.zeros((2, 2), np.float32)}, tmp_path / "other.safetensors")
    with pytest.raises(InputError, match="none of the 1 tensors"):
        audit_weights(DENSE, tmp_path / "other.safetensors")
    save_file({"mtp.fc.weight": np.zeros((64, 128), np.int8)}, tmp_path / "int8.safetensors")
    with pytest.raises(InputError, match="mtp.fc.weight in int8.safetensors is I8"):
        audit_weights(DENSE, tmp_path / "int8.safetensors")


def test_cli_exit_codes_last_line_and_json(tmp_path):
    tensors = head(DENSE)
    save_file(tensors, tmp_path / "ok.safetensors")
    result = CliRunner().invoke(cli, ["weights", str(DENSE), str(tmp_path / "ok.safetensors")])
    assert result.exit_code == 0 and result.output.splitlines()[-1].startswith("WEIGHTS OK | 15 of 15 tensors")
    del tensors["mtp.fc.weight"]
    tensors["mtp.norm.weight"] = np.zeros_like(tensors["mtp.norm.weight"])
    save_file(tensors, tmp_path / "bad.safetensors")
    result = CliRunner().invoke(cli, ["weights", str(DENSE), str(tmp_path / "bad.safetensors"),
                                      "--json", str(tmp_path / "audit.json")])
    assert result.exit_code == 1
    assert result.output.splitlines()[-1] == ("WEIGHTS DIFFER | 2 of 15 tensors: mtp.fc.weight (missing), "
                                              "mtp.norm.weight (init_like)")
    report = json.loads((tmp_path / "audit.json").read_text())
    assert report["verdict"] == "differ" and len(report["tensors"]) == 15
    assert {t["status"] for t in report["tensors"]} == {"ok", "missing", "init_like"}
    assert all({"name", "status", "max_rel", "note"} <= set(t) for t in report["tensors"])
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    result = CliRunner().invoke(cli, ["weights", str(DENSE), str(tmp_path / "junk.safetensors"),
                                      "--json", str(tmp_path / "bad.json")])
    assert result.exit_code == 2 and result.output.splitlines()[0].startswith("WEIGHTS INVALID | ")
    assert json.loads((tmp_path / "bad.json").read_text())["verdict"] == "invalid"


def square_transposed(w): return w.T.copy()
def last_row_zeroed(w): return np.concatenate([w[:-1], np.zeros_like(w[-1:])])
def some_rows_foreign(w): return np.concatenate([w[:-3], np.random.default_rng(5).standard_normal(w[-3:].shape)
                                                  .astype(np.float32) * w.std()])
def one_row_duplicated(w): return np.concatenate([w[:1], w[:-1]])


@pytest.mark.parametrize("name, fault, status, words", [
    (ATTN + "k_proj.weight", square_transposed, "transposed", "square"),
    ("mtp.fc.weight", last_row_zeroed, "zeros", "1 of 64 rows are all 0"),
    (MLP + "down_proj.weight", some_rows_foreign, "different", "3 of 64 rows differ wholly"),
    (ATTN + "q_proj.weight", one_row_duplicated, "different", ""),
])
def test_red_team_faults_are_named_for_what_they_are(tmp_path, name, fault, status, words):
    """Red team: a square matrix stored transposed was `different`, a zeroed row `quantized`, a duplicated row
    `permuted_rows`. Twin: the same tensors quantized (error spread over every row) stay `quantized`."""
    tensors = head(DENSE)
    assert fault is not square_transposed or tensors[name].shape[0] == tensors[name].shape[1]
    tensors[name] = fault(tensors[name])
    found = audit(tmp_path, DENSE, tensors)[name]
    assert found.status == status and words in found.note, found
    twin = head(DENSE)
    twin[name] = int8(twin[name])
    assert audit(tmp_path, DENSE, twin)[name].status == "quantized"


def half_rows_zeroed(w): return np.concatenate([w[: len(w) // 2], np.zeros_like(w[len(w) // 2:])])
def one_column_zeroed(w): return np.concatenate([w[:, :5], np.zeros_like(w[:, 5:6]), w[:, 6:]], axis=1)
def one_element_flipped(w):
    out = w.copy()
    out[7, int(np.argmax(np.abs(w[7])))] *= -1
    return out
def plus_one(w): return w + np.float32(1.0)


@pytest.mark.parametrize("name, fault, status, words", [
    ("mtp.fc.weight", half_rows_zeroed, "zeros", "32 of 64 rows are all 0"),
    ("mtp.fc.weight", one_column_zeroed, "zeros", "1 of 128 columns are all 0 (columns 5)"),
    ("mtp.fc.weight", one_element_flipped, "different", "1 element(s) in 1 of 64 rows (rows 7)"),
    ("mtp.norm.weight", plus_one, "different", "exactly the checkpoint's + 1: the (1+w)"),
])
def test_partial_loads_and_norm_offsets_are_named(tmp_path, name, fault, status, words):
    """Red team (stop 22): half of fc's rows zeroed was `different` ("correlation +0.706"), one zeroed column
    `quantized` (which reads as harmless), one flipped element "1 of 64 rows differ wholly", and a (1+w) folded into
    a norm a bare `different`. Twin: the same tensors int8-quantized stay `quantized`."""
    tensors = head(DENSE)
    tensors[name] = fault(tensors[name])
    found = audit(tmp_path, DENSE, tensors)[name]
    assert found.status == status and words in found.note, found
    if tensors[name].ndim == 2:
        twin = head(DENSE)
        twin[name] = int8(twin[name])
        assert audit(tmp_path, DENSE, twin)[name].status == "quantized"


# ---- issue 29: notes that must say what the fault is -----------------------------------------------------------

def _bf16(x: np.ndarray) -> np.ndarray:
    import torch

    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).to(torch.bfloat16).float().numpy()


def test_gate_up_halves_swapped_inside_every_expert_is_not_whole_experts_swapped(tmp_path):
    tensors = head(MOE)
    w13 = np.stack([np.concatenate([tensors.pop(f"{MLP}experts.{e}.{p}_proj.weight") for p in ("gate", "up")])
                    for e in range(8)])
    w2 = np.stack([tensors.pop(f"{MLP}experts.{e}.down_proj.weight") for e in range(8)])
    half = w13.shape[1] // 2
    up_gate = np.concatenate([w13[:, half:], w13[:, :half]], axis=1)  # [up | gate] in every expert
    found = audit(tmp_path, MOE, tensors | {MLP + "experts.w13_weight": up_gate, MLP + "experts.w2_weight": w2})
    note = found[MLP + "experts.w13_weight"].note
    assert found[MLP + "experts.w13_weight"].status == "permuted_rows"
    assert "whole experts" not in note and "within each expert" in note and "halves" in note and "every expert" in note
    whole = w13[[1, 0, *range(2, 8)]]  # twin: two experts exchanged, rows intact
    found = audit(tmp_path, MOE, tensors | {MLP + "experts.w13_weight": whole, MLP + "experts.w2_weight": w2})
    assert "whole experts swapped" in found[MLP + "experts.w13_weight"].note
    assert "within each expert" not in found[MLP + "experts.w13_weight"].note


def test_a_uniform_factor_near_1_is_scaled_not_quantized(tmp_path):
    tensors = head(DENSE)
    name = ATTN + "v_proj.weight"
    tensors[name] = tensors[name] * np.float32(1.04)
    found = audit(tmp_path, DENSE, tensors)[name]
    assert found.status == "scaled" and "1.04" in found.note
    twin = head(DENSE)
    twin[name] = int_quantized(twin[name], 8, twin[name].shape[1])
    assert audit(tmp_path, DENSE, twin)[name].status == "quantized"


def test_a_factor_of_1_003_on_a_bf16_tensor_is_not_ok(tmp_path):
    """The tiny checkpoint is stored bf16; an engine holding x1.003 of it in bf16 is NOT loaded correctly (it moves
    stages far past float32 tolerance), though every element is within bf16 rounding size."""
    import torch
    from safetensors.torch import save_file as save_torch

    tensors = head(DENSE)
    name = MLP + "up_proj.weight"
    tensors[name] = _bf16(tensors[name] * np.float32(1.003))
    save_torch({k: torch.from_numpy(v).to(torch.bfloat16) for k, v in tensors.items()}, tmp_path / "bf16.safetensors")
    found = {t.name: t for t in audit_weights(DENSE, tmp_path / "bf16.safetensors").tensors}
    assert found[name].status == "scaled" and "1.003" in found[name].note
    assert {t.status for n, t in found.items() if n != name} == {"ok"}  # twin: the rest, bf16 as stored, ok


def test_an_error_of_rounding_size_that_is_no_rounding_is_not_ok_and_says_the_audit_cannot_judge_it(tmp_path):
    tensors = head(DENSE)
    name = MLP + "down_proj.weight"
    w = tensors[name]
    sign = np.where(np.random.default_rng(1).random(w.shape) < 0.5, -1, 1).astype(np.float32)
    tensors[name] = w * (1 + np.float32(1e-3) * sign)  # 0.1% each way: no factor, no rounding, yet not the weights
    found = audit(tmp_path, DENSE, tensors)[name]
    assert found.status == "different" and "cannot judge" in found.note and "mtp-probe run" in found.note


def test_twin_exact_roundings_of_a_float32_tensor_are_ok():
    from probe.weight_faults import TensorFacts, classify

    e = np.random.default_rng(2).standard_normal((32, 48)).astype(np.float32)
    facts = TensorFacts("w", {})
    assert classify(_bf16(e), e, facts).note == "the checkpoint rounded to bfloat16 (to nearest even)"
    truncated = (e.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)
    assert classify(truncated, e, facts).status == "ok"
    assert classify(e.astype(np.float16).astype(np.float32), e, facts).status == "ok"
    assert classify(np.nextafter(e, np.float32(np.inf)), e, facts).note.startswith("within float32 rounding")
    assert classify(_bf16(e * np.float32(1.003)), e, facts).status == "scaled"  # the same twin, but wrong


def test_a_zeroed_bias_or_plain_norm_is_zeros_not_a_one_plus_w_norms_initial_value(tmp_path):
    from tests.helpers import load_script

    ckpt = load_script("make_fixtures").write_mtp_layer_checkpoint(tmp_path / "ds", "deepseek_v3")
    tensors = head(ckpt)
    bias = next(n for n in tensors if n.endswith("e_score_correction_bias"))
    norm = next(n for n in tensors if n.endswith("enorm.weight"))
    tensors[bias], tensors[norm] = np.zeros_like(tensors[bias]), np.zeros_like(tensors[norm])
    found = audit(tmp_path, ckpt, tensors)
    for name in (bias, norm):
        assert found[name].status == "zeros" and "(1+w)" not in found[name].note, found[name]
    qwen = head(DENSE)  # twin: a (1+w) family's norm at 0 is that norm's initial value
    qwen["mtp.norm.weight"] = np.zeros_like(qwen["mtp.norm.weight"])
    assert audit(tmp_path, DENSE, qwen)["mtp.norm.weight"].note.startswith("all 0: a (1+w) RMSNorm's initial")
