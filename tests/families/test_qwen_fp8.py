"""FP8 block-scaled Qwen checkpoints (the `-FP8` releases): F8_E4M3 linears with a `weight_scale_inv` block scale
beside each, `quantization_config` at the top level or inside `text_config`.

Every checkpoint here is made in the test from the tiny fixtures: an FP8 copy (block scales computed per block,
stored F32 or BF16 as Qwen's releases store them) and a `_deq` twin holding the same weights exactly dequantized to
float32 by plain torch ops (never oracle/fp8.py). The oracle's trace of the FP8 copy must equal the `_deq` trace bit
for bit; twins show the equality can fail (a transposed square scale grid) and that inconsistent checkpoints and
unsupported quantisation configs are refused with exit 2, naming the tensor or key."""

import json
import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from oracle.cli import cli as oracle_cli
from oracle.errors import CheckpointError
from oracle.families.registry import detect
from probe.cli import cli as probe_cli
from tests.helpers import FIXTURES, ROOT, load_script, run_cli

MAKE = load_script("make_fixtures")
TOKENS = "5,17,3,99,200,7,42,5,300,11"
QUANT = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
# kept bf16 as the releases keep them (besides norms, embeddings and lm_head, which are never quantised)
ROUTER_GATES = ("mlp.gate.weight", "shared_expert_gate.weight")
ATTN = "mtp.layers.0.self_attn."


# ---- writing FP8 checkpoints ---------------------------------------------------------------------------------------

def quantize(w: torch.Tensor, block, scale_dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(e4m3 weight, block scale as stored, the exact float32 dequantization): absmax scale per (bo, bi) block,
    partial blocks at the edges; dequantized as e4m3 -> float32 times the stored scale widened to float32."""
    w = w.float()
    (r, c), (bo, bi) = w.shape, block
    grid = (-(-r // bo), -(-c // bi))
    padded = torch.zeros(grid[0] * bo, grid[1] * bi)
    padded[:r, :c] = w
    amax = padded.view(grid[0], bo, grid[1], bi).abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale = (amax / 448).to(scale_dtype)
    full = scale.float().repeat_interleave(bo, 0).repeat_interleave(bi, 1)[:r, :c]
    q = (w / full).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q, scale, q.float() * full


def read_all(src: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(src.glob("*.safetensors")):
        out |= load_file(file)
    return out


def write_tensors(tensors: dict, dst: Path, shards: int) -> None:
    if shards == 1:
        save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
        return
    names = sorted(tensors)
    files = [f"model-{k + 1:05d}-of-{shards:05d}.safetensors" for k in range(shards)]
    where = {n: files[j % shards] for j, n in enumerate(names)}  # a weight and its scale often in different shards
    for file in files:
        save_file({n: tensors[n] for n in names if where[n] == file}, dst / file, metadata={"format": "pt"})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": where}))


def fp8_copy(src: Path, dst: Path, block, scale_dtype=torch.float32, shards: int = 1, keep=ROUTER_GATES,
             quant_in_text: bool = False, edit=None, main: bool = False) -> tuple[Path, Path]:
    """`dst` (FP8: every 2-D `mtp.*` linear but `keep`; with `main`, the main model's 2-D linears too) and
    `dst`_deq (those linears as float32, exactly dequantized; no quantization_config). `edit(tensors)` may alter
    the FP8 tensors before they are written."""
    deq_dst = dst.with_name(dst.name + "_deq")
    fp8, deq = {}, {}
    for name, w in read_all(src).items():
        head = name.startswith("mtp.") or (main and name.startswith("model.") and "embed_tokens" not in name
                                          and "visual" not in name)
        if head and w.ndim == 2 and name.endswith(".weight") and not name.endswith(keep):
            q, scale, value = quantize(w, block, scale_dtype)
            fp8[name], fp8[name.removesuffix("weight") + "weight_scale_inv"], deq[name] = q, scale, value
        else:
            fp8[name] = deq[name] = w
    if edit is not None:
        edit(fp8)
    config = json.loads((src / "config.json").read_text())
    for out, tensors in ((dst, fp8), (deq_dst, deq)):
        out.mkdir(parents=True)
        write_tensors(tensors, out, shards)
        (out / "config.json").write_text(json.dumps(config))
    quant = QUANT | {"weight_block_size": list(block)}
    (config["text_config"] if quant_in_text else config)["quantization_config"] = quant
    (dst / "config.json").write_text(json.dumps(config))
    return dst, deq_dst


def export(ckpt: Path, out: Path, hidden=("--hidden-seed", "0")):
    return run_cli(oracle_cli, ["export", ckpt, "--out", out, "--tokens", TOKENS, *hidden, "-q"])


def datasets(trace: Path) -> dict[str, np.ndarray]:
    found = {}
    with h5py.File(trace) as f:
        f.visititems(lambda name, obj: found.__setitem__(name, obj[()]) if isinstance(obj, h5py.Dataset) else None)
        config = json.loads(f.attrs["config"])
    return found | {"config": config}


def exported_pair(fp8: Path, deq: Path, hidden=("--hidden-seed", "0")) -> tuple[dict, dict]:
    traces = []
    for ckpt in (fp8, deq):
        result = export(ckpt, ckpt.with_suffix(".h5"), hidden)
        assert result.exit_code == 0, result.output
        traces.append(datasets(ckpt.with_suffix(".h5")))
    return traces[0], traces[1]


# ---- FP8 export == dequantized export ------------------------------------------------------------------------------

def _next_source(root: Path, layout: str) -> Path:
    return MAKE.write_moe_checkpoint(root / f"next_{layout}_src", "qwen3_next", layout, main_model=False)


CASES = {
    # dense, 24 x 40 blocks: every grid ragged (64 = 2x24+16, 128 = 3x40+8), BF16 scales as Qwen3 FP8 releases store
    "dense": lambda root: fp8_copy(FIXTURES / "qwen3_5_tiny", root / "dense", (24, 40), torch.bfloat16),
    # MoE, release block size (every tiny dim < 128: one partial block), per-expert FP8 experts, 3 shards,
    # quantization_config inside text_config
    "moe_sharded": lambda root: fp8_copy(FIXTURES / "qwen3_5_moe_tiny", root / "moe", (128, 128), shards=3,
                                         quant_in_text=True),
    # Qwen3-Next (flat config), per-expert, 16 x 32 blocks, router and shared-expert gates quantised too
    "next": lambda root: fp8_copy(_next_source(root, "per_expert"), root / "next", (16, 32), torch.bfloat16,
                                  keep=()),
    # Qwen3-Next with fused experts left bf16 (no fused FP8 layout is released) beside FP8 linears; F16 scales
    "next_fused_bf16_experts": lambda root: fp8_copy(_next_source(root, "fused"), root / "next_fused", (32, 32),
                                                     torch.float16),
}


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> dict[str, tuple[dict, dict]]:
    root = tmp_path_factory.mktemp("fp8")
    return {case: exported_pair(*make(root)) for case, make in CASES.items()}


@pytest.mark.parametrize("case", CASES)
def test_fp8_trace_equals_the_dequantized_checkpoint_trace_bit_for_bit(pairs, case):
    fp8, deq = pairs[case]
    blocks = {"dense": [24, 40], "moe_sharded": [128, 128], "next": [16, 32], "next_fused_bf16_experts": [32, 32]}
    assert fp8["config"].pop("weight_block_size") == blocks[case]
    assert "weight_block_size" not in deq["config"]  # unquantised traces keep their config
    assert set(fp8) == set(deq) and any(n.startswith("stages/") for n in fp8)
    for name in fp8:
        if name != "config":
            np.testing.assert_array_equal(fp8[name], deq[name], err_msg=f"{case}: {name}")
    assert fp8["config"] == deq["config"]


def test_the_fp8_copies_really_are_fp8_and_ragged(tmp_path):
    """What the equality test stands on: F8_E4M3 weights, BF16/F32 scales, partial blocks, sharded scales."""
    fp8, _ = fp8_copy(FIXTURES / "qwen3_5_moe_tiny", tmp_path / "m", (24, 40), torch.bfloat16, shards=3)
    tensors = read_all(fp8)
    assert tensors["mtp.fc.weight"].dtype == torch.float8_e4m3fn
    assert tensors["mtp.fc.weight_scale_inv"].dtype == torch.bfloat16
    assert tuple(tensors["mtp.fc.weight_scale_inv"].shape) == (3, 4)  # [64, 128] in 24 x 40 blocks
    assert tensors["mtp.layers.0.mlp.experts.3.down_proj.weight"].dtype == torch.float8_e4m3fn
    assert tensors["mtp.layers.0.mlp.gate.weight"].dtype == torch.bfloat16  # the router stays bf16
    index = json.loads((fp8 / "model.safetensors.index.json").read_text())["weight_map"]
    assert index["mtp.fc.weight"] != index["mtp.fc.weight_scale_inv"]
    # and it exports (ragged blocks of a MoE head, scales in other shards than their weights)
    assert export(fp8, tmp_path / "m.h5").exit_code == 0


MAIN_MODEL = ("--main-model", "--first-token", "1")


def test_main_model_fp8_linears_are_dequantized_for_the_hidden(tmp_path):
    """--main-model on a checkpoint whose main model is FP8 too: H from the dequantized main model, bit for bit."""
    fp8, deq = fp8_copy(FIXTURES / "qwen3_5_moe_tiny", tmp_path / "m", (24, 40), torch.bfloat16, main=True,
                        quant_in_text=True)
    assert read_all(fp8)["model.language_model.layers.3.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn
    a, b = exported_pair(fp8, deq, MAIN_MODEL)
    for name in a:
        if name != "config":
            np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    # twin: a main-model FP8 weight without its scale is refused by name, never decoded unscaled
    o_proj = "model.language_model.layers.3.self_attn.o_proj.weight"
    bad, _ = fp8_copy(FIXTURES / "qwen3_5_moe_tiny", tmp_path / "b", (24, 40), main=True,
                      edit=lambda t: t.pop(o_proj.removesuffix("weight") + "weight_scale_inv"))
    result = export(bad, tmp_path / "b.h5", MAIN_MODEL)
    assert result.exit_code == 2 and o_proj in result.output and "Traceback" not in result.output, result.output


# ---- twins: the equality can fail; inconsistent checkpoints are refused --------------------------------------------

def _transpose(name: str):
    return lambda t: t.__setitem__(name, t[name].T.contiguous())


def test_twin_a_transposed_square_scale_grid_runs_and_changes_the_trace(tmp_path):
    # [64, 128] in 32 x 64 blocks: a 2 x 2 grid, so the transposed grid passes the shape check
    fp8, deq = fp8_copy(FIXTURES / "qwen3_5_tiny", tmp_path / "t", (32, 64),
                        edit=_transpose("mtp.fc.weight_scale_inv"))
    bad, good = exported_pair(fp8, deq)
    np.testing.assert_array_equal(bad["stages/fc_in"], good["stages/fc_in"])
    assert not np.array_equal(bad["stages/fc"], good["stages/fc"])


def test_a_transposed_ragged_scale_grid_is_refused_by_shape(tmp_path):
    fp8, _ = fp8_copy(FIXTURES / "qwen3_5_tiny", tmp_path / "t", (24, 40), edit=_transpose("mtp.fc.weight_scale_inv"))
    result = export(fp8, tmp_path / "t.h5")
    assert result.exit_code == 2 and "mtp.fc.weight_scale_inv" in result.output and "[4, 3]" in result.output
    assert not (tmp_path / "t.h5").exists() and "Traceback" not in result.output


def test_an_fp8_weight_without_its_scale_is_refused_naming_it(tmp_path):
    o_proj = ATTN + "o_proj.weight"
    fp8, deq = fp8_copy(FIXTURES / "qwen3_5_moe_tiny", tmp_path / "t", (128, 128),
                        edit=lambda t: t.pop(o_proj.removesuffix("weight") + "weight_scale_inv"))
    result = export(fp8, tmp_path / "t.h5")
    assert result.exit_code == 2 and o_proj in result.output and "weight_scale_inv" in result.output, result.output
    assert not (tmp_path / "t.h5").exists()
    # the load audit reads the head dequantized: it refuses too, never decodes the weight unscaled
    dump = tmp_path / "engine_dump.safetensors"  # any dump: the checkpoint side is refused first
    shutil.copy(deq / "model.safetensors", dump)
    audit = run_cli(probe_cli, ["weights", fp8, dump])
    assert audit.exit_code == 2 and o_proj in audit.output, audit.output


def test_an_expert_without_its_scale_is_refused_naming_it(tmp_path):
    expert = "mtp.layers.0.mlp.experts.5.up_proj.weight"
    fp8, _ = fp8_copy(FIXTURES / "qwen3_5_moe_tiny", tmp_path / "t", (128, 128),
                      edit=lambda t: t.pop(expert.removesuffix("weight") + "weight_scale_inv"))
    result = export(fp8, tmp_path / "t.h5")
    assert result.exit_code == 2 and expert in result.output, result.output


def test_a_scale_beside_a_weight_that_is_not_fp8_is_refused(tmp_path):
    k_proj = ATTN + "k_proj.weight"
    fp8, _ = fp8_copy(FIXTURES / "qwen3_5_tiny", tmp_path / "t", (32, 32),
                      edit=lambda t: t.__setitem__(k_proj, t[k_proj].float()))
    result = export(fp8, tmp_path / "t.h5")
    assert result.exit_code == 2 and k_proj.removesuffix("weight") + "weight_scale_inv" in result.output, result.output


def test_scales_without_a_quantization_config_are_refused(tmp_path):
    fp8, _ = fp8_copy(FIXTURES / "qwen3_5_tiny", tmp_path / "t", (32, 32))
    config = json.loads((fp8 / "config.json").read_text())
    del config["quantization_config"]
    (fp8 / "config.json").write_text(json.dumps(config))
    result = export(fp8, tmp_path / "t.h5")
    assert result.exit_code == 2 and "quantization_config" in result.output and "weight_scale_inv" in result.output


# ---- fused experts: no confirmed FP8 scale layout -----------------------------------------------------------------

FUSED = "mtp.layers.0.mlp.experts."


def _fused_fp8(t: dict, with_scales: bool) -> None:
    for part in ("gate_up_proj", "down_proj"):
        w = t[FUSED + part]
        t[FUSED + part] = (w.float() / w.float().abs().amax() * 448).to(torch.float8_e4m3fn)
        if with_scales:
            t[FUSED + part + "_scale_inv"] = torch.ones(w.shape[0], 1, 1)


@pytest.mark.parametrize("with_scales", [True, False])
def test_fused_fp8_experts_are_refused(tmp_path, with_scales):
    fp8, _ = fp8_copy(_next_source(tmp_path, "fused"), tmp_path / "f", (32, 32),
                      edit=lambda t: _fused_fp8(t, with_scales))
    result = export(fp8, tmp_path / "f.h5")
    assert result.exit_code == 2 and FUSED + "gate_up_proj" in result.output, result.output
    assert ("fused" in result.output) if with_scales else ("weight_scale_inv" in result.output)
    assert not (tmp_path / "f.h5").exists() and "Traceback" not in result.output


# ---- quantization_config ----------------------------------------------------------------------------------------

def _parse(config: dict):
    spec = detect(config, "config.json")
    return spec.parse_config(config, "config.json")


def _tiny(family: str) -> dict:
    return json.loads((FIXTURES / {"dense": "qwen3_5_tiny", "moe": "qwen3_5_moe_tiny"}[family] / "config.json")
                      .read_text())


def test_quantization_config_is_read_at_the_top_level_or_in_text_config():
    block = QUANT | {"weight_block_size": [128, 64]}
    top, nested, both = _tiny("moe"), _tiny("moe"), _tiny("moe")
    top["quantization_config"] = nested["text_config"]["quantization_config"] = block
    both["quantization_config"] = both["text_config"]["quantization_config"] = block
    for config in (top, nested, both):
        cfg = _parse(config)
        assert cfg.weight_block_size == (128, 64) and cfg.to_dict()["weight_block_size"] == [128, 64]
    plain = _parse(_tiny("dense"))
    assert plain.weight_block_size is None and "weight_block_size" not in plain.to_dict()
    flat = MAKE.moe_release_config("qwen3_next", MAKE.MOE_TINY) | {"quantization_config": block}
    assert _parse(flat).weight_block_size == (128, 64)


@pytest.mark.parametrize("quant, key", [
    (QUANT | {"quant_method": "gptq", "weight_block_size": [128, 128]}, "quantization_config.quant_method"),
    ({"weight_block_size": [128, 128]}, "quantization_config.quant_method"),
    (QUANT | {"fmt": "e5m2", "weight_block_size": [128, 128]}, "quantization_config.fmt"),
    (QUANT | {"activation_scheme": "static", "weight_block_size": [128, 128]}, "quantization_config.activation_scheme"),
    (QUANT, "quantization_config.weight_block_size"),  # per-tensor FP8
    (QUANT | {"weight_block_size": [128]}, "quantization_config.weight_block_size"),
    (QUANT | {"weight_block_size": [128, 0]}, "quantization_config.weight_block_size"),
    (QUANT | {"weight_block_size": [128.0, 128]}, "quantization_config.weight_block_size"),
    ("fp8", "quantization_config"),
])
def test_an_unsupported_quantization_config_is_refused_naming_the_key(quant, key):
    config = _tiny("dense")
    config["quantization_config"] = quant
    with pytest.raises(CheckpointError, match=key.replace(".", r"\.")):
        _parse(config)


def test_quantization_configs_that_disagree_are_refused():
    config = _tiny("moe")
    config["quantization_config"] = QUANT | {"weight_block_size": [128, 128]}
    config["text_config"]["quantization_config"] = QUANT | {"weight_block_size": [64, 64]}
    with pytest.raises(CheckpointError, match="disagree"):
        _parse(config)


def test_the_cli_refuses_an_unsupported_quantization_config_with_exit_2(tmp_path):
    ckpt = tmp_path / "c"
    shutil.copytree(FIXTURES / "qwen3_5_tiny", ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (ckpt / "config.json").write_text(json.dumps(config))
    result = export(ckpt, tmp_path / "t.h5")
    assert result.exit_code == 2 and "quantization_config.quant_method" in result.output and "awq" in result.output
    assert "Traceback" not in result.output


# ---- the load audit and --explain on an FP8 checkpoint ------------------------------------------------------------

def test_the_load_audit_compares_a_dequantized_dump_with_the_dequantized_checkpoint(tmp_path):
    fp8, deq = fp8_copy(FIXTURES / "qwen3_5_moe_tiny", tmp_path / "m", (24, 40), torch.bfloat16)
    ok = run_cli(probe_cli, ["weights", fp8, deq / "model.safetensors"])
    assert ok.exit_code == 0 and ok.output.rstrip().splitlines()[-1].startswith("WEIGHTS OK"), ok.output
    # twin: an engine that forgot one block scale (decoded the e4m3 values unscaled) is caught on that tensor
    dump = load_file(deq / "model.safetensors")
    dump[ATTN + "v_proj.weight"] = read_all(fp8)[ATTN + "v_proj.weight"].float()
    save_file(dump, tmp_path / "bad.safetensors")
    bad = run_cli(probe_cli, ["weights", fp8, tmp_path / "bad.safetensors"])
    last = bad.output.rstrip().splitlines()[-1]
    assert bad.exit_code == 1 and last.startswith("WEIGHTS DIFFER | 1 of") and ATTN + "v_proj.weight" in last


def test_explain_diagnoses_a_candidate_against_an_fp8_trace(tmp_path, monkeypatch):
    fp8, _ = fp8_copy(FIXTURES / "qwen3_5_moe_tiny", tmp_path / "m", (128, 128))
    assert export(fp8, tmp_path / "m.h5").exit_code == 0
    (tmp_path / "unnormed.py").write_text(
        "import dataclasses, numpy_moe_step\n"
        "def make(config, weights):\n"
        "    return numpy_moe_step.NumpyMoeHead(dataclasses.replace(config, norm_topk_prob=False), weights)\n")
    monkeypatch.syspath_prepend(str(ROOT / "fixtures" / "candidates"))
    monkeypatch.syspath_prepend(str(tmp_path))
    result = run_cli(probe_cli, ["run", tmp_path / "m.h5", "--impl", "python:unnormed:make", "--checkpoint", fp8,
                                 "--explain", "-q"])
    lines = result.output.rstrip().splitlines()
    assert result.exit_code == 1 and lines[-2].startswith("DIAGNOSIS | topk_not_renormalised"), result.output
