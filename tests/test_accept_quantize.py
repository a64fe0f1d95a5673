"""`mtp-oracle accept --quantize GLOB=SCHEME`: the quantizers against straightforward independent computations, the
glob plan, and the twin runs on the trained fixture (int8 costs nothing measurable, ternary costs a lot), with the
refusals (exit 2, the glob named, nothing written)."""

import json
import re
import sys

import numpy as np
import pytest
import torch

from oracle.accept import measure_acceptance
from oracle.accept_report import e_len_change_se, render_report
from oracle.checkpoint import Checkpoint
from oracle.cli import cli
from oracle.errors import InputError
from oracle.export import HiddenSource
from oracle.fp8 import E4M3_TABLE, dequantize
from oracle.inputs import token_ids_from_file
from oracle.quantize_sim import (QuantSpec, fp8_blocks, int_groups, parse_spec, plan, quantize_dequantize,
                                 relative_error)
from tests.helpers import FIXTURES, ROOT, run_cli

TRAINED = FIXTURES / "qwen3_5_trained"
HELDOUT = TRAINED / "heldout_tokens.txt"
FINITE_E4M3 = np.unique(E4M3_TABLE[np.isfinite(E4M3_TABLE)].astype(np.float64))


def weights(shape, seed=0) -> np.ndarray:
    """Rows of very different magnitudes, one all-zero row: per-row/group/block scales must each do their job."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(shape) * np.exp(rng.uniform(-4, 2, size=(*shape[:-1], 1)))
    w[..., 1, :] = 0.0
    return w.astype(np.float32)


# --- integer schemes: an element-by-element loop in plain Python -----------------------------------------------


def int_reference(w: np.ndarray, bits: int, group: int) -> np.ndarray:
    """Symmetric absmax quantization written out per group: Python's round() is ties-to-even, the scale a float32,
    the dequantized value the float32 product (a double product of an int and a float32 is exact, rounded once)."""
    qmax = 2 ** (bits - 1) - 1
    out = np.empty(w.shape, dtype=np.float32)
    for index in np.ndindex(*w.shape[:-1]):
        row = w[index]
        for start in range(0, len(row), group):
            part = row[start:start + group]
            scale = np.float32(float(max(abs(float(v)) for v in part)) / qmax)
            for i, v in enumerate(part):
                q = 0 if scale == 0 else max(-qmax, min(qmax, round(float(v) / float(scale))))
                out[index + (start + i,)] = np.float32(q * float(scale))
    return out


@pytest.mark.parametrize("scheme, bits, group", [("int8", 8, 40), ("int4", 4, 32), ("int4g64", 4, 64),
                                                 ("int4g128", 4, 128), ("int2", 2, 32)])
def test_integer_schemes_equal_an_element_by_element_reference(scheme, bits, group):
    w = weights((2, 5, 40) if scheme == "int8" else (6, 80))  # [E, out, in] too; 80 = 2 groups of 32 + a partial
    wq = quantize_dequantize(w, scheme)
    assert wq.dtype == np.float32 and wq.shape == w.shape
    np.testing.assert_array_equal(wq, int_reference(w, bits, group if scheme != "int8" else w.shape[-1]))
    assert not wq[..., 1, :].any()  # an all-zero row stays zero (scale 0, no division by it)


def test_int8_error_is_at_most_half_a_step_per_element_and_values_are_on_the_grid():
    w = weights((64, 96))
    wq = quantize_dequantize(w, "int8")
    step = np.abs(w).max(axis=1, keepdims=True).astype(np.float64) / 127  # (out, 1)
    err = np.abs(wq.astype(np.float64) - w)
    slack = np.spacing(np.abs(wq)).astype(np.float64)  # the one float32 rounding of q * scale
    assert (err <= step / 2 + slack).all()
    q = np.divide(wq, step, out=np.zeros_like(err), where=step > 0)
    assert np.abs(q - np.rint(q)).max() < 1e-4 and np.abs(np.rint(q)).max() == 127


def test_the_half_step_check_catches_a_quantizer_that_truncates():
    """Twin: rounding toward zero (a classic int kernel bug) breaks the half-step bound the test above checks."""
    w = weights((64, 96))
    step = np.abs(w).max(axis=1, keepdims=True) / 127
    truncated = np.trunc(w / np.where(step > 0, step, 1)) * step
    assert (np.abs(truncated - w) > step / 2 + np.spacing(np.abs(w))).any()


def test_integer_ties_round_to_even():
    w = np.array([[127.0, 2.5, 3.5, -2.5, 0.5, 1.5]], dtype=np.float32)  # absmax 127: scale exactly 1
    assert quantize_dequantize(w, "int8").tolist() == [[127.0, 2.0, 4.0, -2.0, 0.0, 2.0]]
    coarse = int_groups(np.array([[7.0, 2.5, 3.5, 0.5]], dtype=np.float32), bits=4, group=4)  # scale 1 again
    assert coarse.tolist() == [[7.0, 2.0, 4.0, 0.0]]


# --- fp8: the nearest e4m3 value found by brute force -----------------------------------------------------------


def fp8_reference(w: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """Per block: scale = float32(absmax / 448); each w / scale (float32) to the nearest finite e4m3 value by
    searching all of them, an exact tie to the one with an even mantissa; times the scale in float32."""
    out = np.empty(w.shape, dtype=np.float32)
    even = {float(v): int(np.flatnonzero(E4M3_TABLE == v)[0]) % 2 == 0 for v in FINITE_E4M3}
    for r in range(0, w.shape[0], block[0]):
        for c in range(0, w.shape[1], block[1]):
            part = w[r:r + block[0], c:c + block[1]]
            scale = np.float32(np.abs(part).max()) / np.float32(448)
            for (i, j), v in np.ndenumerate(part):
                x = float(np.float32(v) / scale) if scale else 0.0
                dist = np.abs(FINITE_E4M3 - x)
                nearest = FINITE_E4M3[dist == dist.min()]
                pick = nearest[0] if len(nearest) == 1 else next(n for n in nearest if even[float(n)])
                out[r + i, c + j] = np.float32(pick) * scale
    return out


def test_fp8_equals_a_brute_force_nearest_e4m3_per_128x128_block():
    w = weights((136, 200))  # partial blocks on both edges
    wq = quantize_dequantize(w, "fp8")
    np.testing.assert_array_equal(wq, fp8_reference(w, (128, 128)))


def test_fp8_values_are_exact_e4m3_times_their_block_scale():
    w = weights((136, 200), seed=1)
    wq = fp8_blocks(w, (128, 128))
    for r, c in ((0, 0), (0, 128), (128, 0), (128, 128)):
        part, got = w[r:r + 128, c:c + 128], wq[r:r + 128, c:c + 128]
        scale = np.float32(np.abs(part).max()) / np.float32(448)
        assert scale > 0
        nearest = FINITE_E4M3[np.abs(FINITE_E4M3[:, None] - (got / scale).ravel()[None]).argmin(axis=0)]
        np.testing.assert_array_equal(nearest.astype(np.float32).reshape(got.shape) * scale, got)


def test_fp8_equals_the_fixture_writers_release_quantization():
    """scripts/make_fixtures.py quantizes FP8 checkpoints as the releases do (written separately); dequantized by
    the checkpoint reader's oracle/fp8.py, it gives the same values."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from make_fixtures import fp8_quantize

    w = weights((96, 160), seed=2)
    stored, scale = fp8_quantize(torch.from_numpy(w), [32, 64])
    released = dequantize(stored.view(torch.uint8).numpy(), scale.numpy(), (32, 64))
    np.testing.assert_array_equal(fp8_blocks(w, (32, 64)), released)


def test_fp8_ties_round_to_even():
    w = np.array([[448.0, 1.0625, 1.1875, -1.0625, 3.0 * 2**-10]], dtype=np.float32)  # absmax 448: scale 1
    # 1.0625 lies halfway between 1.0 (mantissa 000) and 1.125 (001); 1.1875 between 1.125 and 1.25 (010);
    # 3 * 2^-10 halfway between the subnormals 2^-9 (001) and 2^-8 (010); rounding half away would give 1.125
    assert fp8_blocks(w, (128, 128)).tolist() == [[448.0, 1.0, 1.25, -1.0, 2**-8]]


@pytest.mark.parametrize("scheme", ["int8", "int4", "fp8", "int2"])
def test_stacked_experts_are_quantized_as_independent_matrices(scheme):
    """Fused experts [E, out, in]: each expert's scales are its own, as if it were stored alone."""
    w = weights((3, 136, 72), seed=3) * np.array([1e-3, 1.0, 30.0], dtype=np.float32)[:, None, None]
    alone = np.stack([quantize_dequantize(m, scheme) for m in w])
    np.testing.assert_array_equal(quantize_dequantize(w, scheme), alone)


def test_relative_error_is_the_frobenius_ratio():
    w = np.array([[3.0, 4.0]], dtype=np.float32)
    assert relative_error(w, np.array([[3.0, 3.0]])) == pytest.approx(1 / 5)
    assert relative_error(np.zeros((2, 2)), np.zeros((2, 2))) == 0.0


# --- the spec and the plan -------------------------------------------------------------------------------------


def test_specs_parse_and_bad_ones_say_how_to_write_them():
    assert parse_spec("*.mlp.*=int4") == QuantSpec("*.mlp.*", "int4") and str(parse_spec("a=b=fp8")) == "a=b=fp8"
    with pytest.raises(InputError, match="write GLOB=SCHEME"):
        parse_spec("mtp.fc.weight")
    with pytest.raises(InputError, match="write GLOB=SCHEME"):
        parse_spec("=int8")
    with pytest.raises(InputError, match="unknown scheme 'int3'; use one of int8 .*fp8"):
        parse_spec("mtp.fc.weight=int3")


SHAPES = {"mtp.fc.weight": (4, 8), "mtp.norm.weight": (4,), "mtp.layers.0.mlp.up_proj.weight": (8, 4),
          "mtp.layers.0.mlp.up_proj.weight_scale_inv": (1, 1)}
SCALES = {"mtp.layers.0.mlp.up_proj.weight_scale_inv": "the block scale of mtp.layers.0.mlp.up_proj.weight"}


def test_plan_later_spec_wins_and_only_matrices_are_chosen():
    chosen = plan((parse_spec("*=int8"), parse_spec("*.mlp.*=int4")), SHAPES, SCALES)
    assert chosen == {"mtp.fc.weight": QuantSpec("*", "int8"),
                      "mtp.layers.0.mlp.up_proj.weight": QuantSpec("*.mlp.*", "int4")}


@pytest.mark.parametrize("spec, message", [
    ("*q_proj*=int8", "'\\*q_proj\\*' matches no head tensor. Matrix weights of this head include mtp.fc.weight"),
    ("*norm*=int8", "matches only tensors this simulation does not quantize: mtp.norm.weight \\(1-D\\)"),
    ("*scale_inv=int8", "scale_inv \\(the block scale of mtp.layers.0.mlp.up_proj.weight\\)"),
])
def test_plan_refuses_a_spec_that_quantizes_nothing(spec, message):
    with pytest.raises(InputError, match=message):
        plan((parse_spec("*=int8"), parse_spec(spec)), SHAPES, SCALES)


# --- the twin runs on the trained fixture ----------------------------------------------------------------------


def quantized_run(*specs: str, k: int = 4):
    x = token_ids_from_file(HELDOUT)
    return measure_acceptance(TRAINED, x, HiddenSource(main_model=True), k=k,
                              quantize=tuple(parse_spec(s) for s in specs))


def test_the_baseline_is_the_plain_run_and_float32_weights_draft_exactly_as_the_stored_ones():
    """The comparison measures quantization only: the head run on float32 copies of its weights (the path the
    quantized tensors take) drafts exactly what the stored bf16 head drafts."""
    x = token_ids_from_file(HELDOUT)
    plain = measure_acceptance(TRAINED, x, HiddenSource(main_model=True), k=4)
    widened = measure_acceptance(TRAINED, x, HiddenSource(main_model=True), k=4,
                                 head_weights=Checkpoint(TRAINED).read_head().tensors)
    q = quantized_run("*=int8")
    np.testing.assert_array_equal(widened.drafts, plain.drafts)
    np.testing.assert_array_equal(q.quantize.baseline_drafts, plain.drafts)
    assert q.quantize.baseline == plain.metrics and (q.targets == plain.targets).all()


def test_int8_on_every_matrix_costs_nothing_measurable():
    r = quantized_run("*=int8")
    q = r.quantize
    stored = Checkpoint(TRAINED).read_head().tensors
    assert [t.name for t in q.head.tensors] == [n for n in sorted(stored) if n not in q.head.kept]
    assert len(q.head.tensors) == 8 and all(stored[n].ndim == 1 for n in q.head.kept)
    assert all(0 < t.rel_error < 0.01 for t in q.head.tensors)
    same = (r.drafts == q.baseline_drafts).mean()
    assert same > 0.95 and abs(r.metrics.e_len - q.baseline.e_len) < 0.02, render_report(r)


def test_ternary_on_every_matrix_shows_a_loss_and_int4_changes_drafts():
    """Twin of the int8 run: the comparison does show a cost where there is one (beyond 4 paired s.e.)."""
    harsh = quantized_run("*=int2")
    loss = harsh.quantize.baseline.e_len - harsh.metrics.e_len
    assert loss > 0.3 and loss > 4 * e_len_change_se(harsh), render_report(harsh)
    assert (harsh.drafts != harsh.quantize.baseline_drafts).mean() > 0.5
    assert all(t.rel_error > 0.3 for t in harsh.quantize.head.tensors)
    int4 = quantized_run("*=int4")
    assert (int4.drafts != int4.quantize.baseline_drafts).mean() > 0.1
    assert all(0.05 < t.rel_error < 0.15 for t in int4.quantize.head.tensors)


def test_quantizing_one_tensor_touches_only_it():
    r = quantized_run("mtp.fc.weight=int2", k=2)
    assert [t.name for t in r.quantize.head.tensors] == ["mtp.fc.weight"]
    assert "mtp.layers.0.self_attn.q_proj.weight" in r.quantize.head.kept
    assert (r.drafts != r.quantize.baseline_drafts).any()


def test_fp8_checkpoints_requantize_from_their_dequantized_values(tmp_path):
    """An FP8 head (block scales beside the weights): the weights are dequantized with their scales, quantized,
    and their scales dropped; a glob matching only scales is refused with the reason."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from make_fixtures import write_mtp_layer_checkpoint

    ckpt = write_mtp_layer_checkpoint(tmp_path / "fp8", fp8_block=[16, 32])
    x = np.arange(3, 30, dtype=np.int64)
    r = measure_acceptance(ckpt, x, HiddenSource(seed=0), k=2, quantize=(parse_spec("*self_attn*=int4"),))
    names = [t.name for t in r.quantize.head.tensors]
    assert names and all("self_attn" in n and n.endswith(".weight") for n in names)
    assert all(0.01 < t.rel_error < 0.2 for t in r.quantize.head.tensors)
    assert not any(n.endswith("weight_scale_inv") and "self_attn" in n for n in r.quantize.head.kept)
    with pytest.raises(InputError, match="block scale of .*kv_b_proj.weight"):
        measure_acceptance(ckpt, x, HiddenSource(seed=0), k=2, quantize=(parse_spec("*kv_b*scale_inv=int8"),))
    with pytest.raises(InputError, match="shared_head.head.weight \\(a vocabulary table accept reads"):
        measure_acceptance(ckpt, x, HiddenSource(seed=0), k=2, quantize=(parse_spec("*shared_head.head*=fp8"),))


# --- the command -----------------------------------------------------------------------------------------------


def accept_cli(*args):
    return run_cli(cli, ["accept", TRAINED, "--tokens-file", HELDOUT, "--main-model", *args, "-q"])


def test_accept_quantize_end_to_end(tmp_path):
    out = tmp_path / "acc.json"
    png = tmp_path / "acc.png"
    result = accept_cli("--quantize", "*=int8", "--quantize", "mtp.fc.weight=int4", "--json", out, "--plot", png)
    assert result.exit_code == 0, result.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    last = result.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"ACCEPT \| k=4 chains=195 \| E\[len\]=\d\.\d{3} .* \| target=greedy \| 95% E\[len\] "
                        r"\[\d\.\d{3}, \d\.\d{3}\] \| quantized: "
                        r"\*=int8 mtp\.fc\.weight=int4 \| unquantized E\[len\]=2\.267 \| drafts changed \d+/780", last)
    assert "alpha_j unquantized" in result.stdout and "paired s.e." in result.stdout
    assert re.search(r"mtp\.fc\.weight +int4 +\d\.\d\de-0\d", result.stdout)
    data = json.loads(out.read_text())
    q = data["quantize"]
    assert data["schema"] == "mtp-accept/1" and [s["scheme"] for s in q["specs"]] == ["int8", "int4"]
    errors = {t["name"]: (t["scheme"], t["rel_error"]) for t in q["tensors"]}
    assert errors["mtp.fc.weight"][0] == "int4" and errors["mtp.layers.0.mlp.up_proj.weight"][0] == "int8"
    assert errors["mtp.fc.weight"][1] > 5 * errors["mtp.layers.0.mlp.up_proj.weight"][1]
    assert q["baseline"]["e_len"] == pytest.approx(2.2667, abs=1e-4) and len(q["baseline"]["drafts"]) == 195
    assert q["e_len_change"] == pytest.approx(data["e_len"] - q["baseline"]["e_len"])
    changed = sum(a != b for c, base in zip(data["per_chain"], q["baseline"]["drafts"])
                  for a, b in zip(c["drafts"], base))
    assert changed == q["drafts_changed"] and last.endswith(f"drafts changed {changed}/780")
    assert "quantized: *=int8 mtp.fc.weight=int4" in data["source"]["head"]


@pytest.mark.parametrize("fixture, spec, rows", [
    ("qwen3_5_moe_tiny", "*experts.*=fp8", ["mtp.layers.*.mlp.experts.*.down_proj.weight x8  fp8"]),
    ("qwen3_next_tiny_fused", "*experts*=int4", ["mtp.layers.0.mlp.experts.down_proj     int4",
                                                 "mtp.layers.0.mlp.experts.gate_up_proj  int4"]),
])
def test_moe_experts_per_expert_and_fused(tmp_path, fixture, spec, rows):
    """Per-expert tensors share one report row (the JSON lists each); fused [E, out, in] ones are quantized too."""
    out = tmp_path / "acc.json"
    result = run_cli(cli, ["accept", FIXTURES / fixture, "--tokens", "1,5,9,3,22,7,8,40,2,11,13,17,19,23,29",
                           "--hidden-seed", "0", "--quantize", spec, "--json", out, "-q"])
    assert result.exit_code == 0, result.output
    assert all(row in result.stdout for row in rows), result.stdout
    tensors = json.loads(out.read_text())["quantize"]["tensors"]
    assert len(tensors) == (24 if fixture == "qwen3_5_moe_tiny" else 2)
    assert all("experts" in t["name"] and 0.01 < t["rel_error"] < 0.15 for t in tensors)
    assert fixture == "qwen3_5_moe_tiny" or all(len(t["shape"]) == 3 for t in tensors)


def test_without_quantize_the_output_has_no_quantization_section():
    result = accept_cli("--k", "2")
    assert result.exit_code == 0 and "quantiz" not in result.stdout
    assert "| target=greedy |" in result.stdout.strip().splitlines()[-1]
    assert "quantized" not in result.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize("spec, message", [
    ("nothing*=int8", "'nothing\\*' matches no head tensor. Matrix weights of this head include mtp.fc.weight"),
    ("*norm*=int8", "'\\*norm\\*' matches only tensors this simulation does not quantize: .*norm.weight \\(1-D\\)"),
    ("mtp.fc.weight=int3", "unknown scheme 'int3'"),
    ("mtp.fc.weight", "write GLOB=SCHEME"),
])
def test_bad_quantize_exits_2_naming_the_spec_and_writes_nothing(tmp_path, spec, message):
    out = tmp_path / "acc.json"
    result = accept_cli("--quantize", "*=int8", "--quantize", spec, "--json", out, "--plot", tmp_path / "a.png")
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
    assert re.search(message, result.output) and "--quantize" in result.output, result.output
    assert "Traceback" not in result.output
    assert list(tmp_path.iterdir()) == []


def test_a_bad_scheme_is_refused_before_torch_is_loaded():
    """The spec is parsed with the other arguments, before the heavy imports (seconds at real scale)."""
    from tests.test_dependencies import HEAVY, _modules_after_cli

    code, loaded, stderr = _modules_after_cli("oracle", "accept", TRAINED, "--tokens", "1,2,3,4,5,6,7",
                                              "--main-model", "--quantize", "*=int3")
    assert code == 2 and "unknown scheme 'int3'" in stderr and not HEAVY & loaded, stderr
