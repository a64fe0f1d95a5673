"""Round 5 red team (issues 24 + 25): inputs that made the oracle or the probe lie, crash or answer vaguely, each
with its twin showing the correct case still passes. Each finding: the input, what happened, what it does now."""

import json
import shutil
from pathlib import Path

import pytest

from oracle.cli import cli as oracle_cli
from tests.helpers import FIXTURES, run_cli

TOKENS = "17,42,3,25,100,7"


def _copy(tmp_path: Path, fixture: str, name: str = "ckpt") -> Path:
    return Path(shutil.copytree(FIXTURES / fixture, tmp_path / name))


def _edit_config(ckpt: Path, edit) -> Path:
    raw = json.loads((ckpt / "config.json").read_text())
    edit(raw.get("text_config", raw))
    (ckpt / "config.json").write_text(json.dumps(raw))
    return ckpt


def _copy_layer(ckpt: Path, source: str, target: str) -> Path:
    """Add a second MTP layer's tensors: every `source`* tensor again under `target` (the real bytes, bf16 kept)."""
    from safetensors.torch import load_file, save_file

    for shard in ckpt.glob("*.safetensors"):
        tensors = load_file(shard)
        tensors |= {n.replace(source, target): t.clone() for n, t in tensors.items() if n.startswith(source)}
        save_file(tensors, shard, metadata={"format": "pt"})
    return ckpt


def _export(ckpt: Path, *extra):
    return run_cli(oracle_cli, ["export", ckpt, "--out", ckpt.parent / "ref.h5", "--tokens", TOKENS, "--hidden-seed", "0",
                                "-q", *extra])


# --- Finding 1: a DeepSeek-V3 / GLM-4.5 checkpoint with a second MTP layer the config does not count ------------
# input: model.layers.{N+1}.* present (a two-layer head) beside num_nextn_predict_layers = 1, or no count at all
# was: exit 0, the trace written from layer N alone, the second layer's tensors silently ignored (only the
#      model.layers.{N}. prefix was checked for unused tensors)
# now: exit 2 naming the config key and value and the extra layer's tensors; nothing written

@pytest.mark.parametrize("fixture", ["deepseek_v3_tiny", "glm4_moe_tiny"])
def test_extra_mtp_layer_beside_a_count_of_one_is_refused_naming_both(tmp_path, fixture):
    ckpt = _copy_layer(_copy(tmp_path, fixture), "model.layers.2.", "model.layers.3.")
    result = _export(ckpt, "--chain", "2")
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert "num_nextn_predict_layers = 1" in result.output and "model.layers.3.*" in result.output, result.output
    assert "config.json" in result.output and "fix the layer count" in result.output
    assert not (ckpt.parent / "ref.h5").exists()


@pytest.mark.parametrize("fixture", ["deepseek_v3_tiny", "glm4_moe_tiny"])
def test_extra_mtp_layer_with_no_count_in_the_config_is_refused(tmp_path, fixture):
    ckpt = _copy_layer(_copy(tmp_path, fixture), "model.layers.2.", "model.layers.3.")
    _edit_config(ckpt, lambda text: text.pop("num_nextn_predict_layers"))
    result = _export(ckpt)
    assert result.exit_code == 2, result.output
    assert "no MTP layer count" in result.output and "model.layers.3.*" in result.output, result.output


@pytest.mark.parametrize("fixture", ["deepseek_v3_tiny", "glm4_moe_tiny"])
def test_twin_the_one_layer_head_exports_with_or_without_the_count(tmp_path, fixture):
    """The twin: the same checkpoint without the extra layer exports (the count given, or absent: its default 1)."""
    ckpt = _copy(tmp_path, fixture)
    assert _export(ckpt, "--chain", "2").exit_code == 0
    _edit_config(ckpt, lambda text: text.pop("num_nextn_predict_layers"))
    result = _export(ckpt)
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("fixture,source,target,key", [
    ("qwen3_5_tiny", "mtp.layers.0.", "mtp.layers.1.", "mtp_num_hidden_layers = 1"),
    ("deepseek_v4_tiny", "mtp.0.", "mtp.1.", "num_nextn_predict_layers = 1")])
def test_unused_layer_tensors_name_the_config_count_too(tmp_path, fixture, source, target, key):
    """Tensors of a second layer (refused before, as unused head tensors) are now shown beside the config's count,
    so the user sees which of the two disagrees."""
    ckpt = _copy_layer(_copy(tmp_path, fixture), source, target)
    result = _export(ckpt)
    assert result.exit_code == 2, result.output
    assert target in result.output and f"config.json: {key}" in result.output, result.output
