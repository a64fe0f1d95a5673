"""A config.json may spell a key by its official alias (the config class's attribute_map): Step-3.5/3.7 releases
write `num_attention_groups` for num_key_value_heads. The torch-free parse reads what the official class reads.

Before: the parse read num_key_value_heads only and fell back to the attention head count, so a release spelled
with the alias was parsed with the wrong KV head count (the strict load then refused its k/v shapes)."""

import importlib
import json
import shutil

import h5py
import numpy as np
import pytest

from oracle.checkpoint import Checkpoint
from oracle.cli import cli as oracle_cli
from oracle.families import mtp_model_layout
from tests.helpers import ROOT as REPO, run_cli

TEXT_CONFIG_CLASSES = {"step3p7": ("transformers.models.step3p7.configuration_step3p7", "Step3p7TextConfig"),
                       "inkling": ("transformers.models.inkling.configuration_inkling", "InklingTextConfig")}
DECLARED = {d.name: d for d in (mtp_model_layout.STEP3P7, mtp_model_layout.INKLING)}


@pytest.mark.parametrize("family", sorted(TEXT_CONFIG_CLASSES))
def test_the_declared_aliases_are_the_official_text_config_classs(family):
    module, name = TEXT_CONFIG_CLASSES[family]
    official = getattr(importlib.import_module(module), name).attribute_map
    assert DECLARED[family].aliases == dict(official)


def aliased_copy(tmp_path, renames: dict[str, str]):
    """fixtures/step3p7_tiny with text_config keys renamed to their aliases."""
    ckpt = tmp_path / "aliased"
    shutil.copytree(REPO / "fixtures" / "step3p7_tiny", ckpt)
    raw = json.loads((ckpt / "config.json").read_text())
    for key, alias in renames.items():
        raw["text_config"][alias] = raw["text_config"].pop(key)
    (ckpt / "config.json").write_text(json.dumps(raw))
    return ckpt


def test_a_step3p7_release_spelling_kv_heads_and_layers_by_alias_exports_the_same_trace(tmp_path):
    ckpt = aliased_copy(tmp_path, {"num_key_value_heads": "num_attention_groups"})
    assert Checkpoint(ckpt).config.num_key_value_heads == 2 and Checkpoint(ckpt).config.num_mtp_layers == 3
    traces = {}
    for name, source in (("canonical", REPO / "fixtures" / "step3p7_tiny"), ("aliased", ckpt)):
        traces[name] = tmp_path / f"{name}.h5"
        result = run_cli(oracle_cli, ["export", source, "--out", traces[name], "--tokens", "5,17,3,99,200,7",
                                      "--hidden-seed", "0", "--chain", "3", "-q"])
        assert result.exit_code == 0, result.output
    with h5py.File(traces["canonical"]) as a, h5py.File(traces["aliased"]) as b:
        for group in ("stages", "chain/d2/stages", "chain/d3/stages"):
            assert sorted(a[group]) == sorted(b[group])
            for stage in a[group]:
                np.testing.assert_array_equal(a[group][stage][:], b[group][stage][:], err_msg=f"{group}/{stage}")


def test_twin_without_the_aliases_the_kv_head_count_falls_back_to_the_attention_heads(tmp_path):
    ckpt = aliased_copy(tmp_path, {"num_key_value_heads": "num_attention_groups"})
    raw = json.loads((ckpt / "config.json").read_text())
    bare = mtp_model_layout.MtpModelFamily(**{**vars(DECLARED["step3p7"]), "aliases": {}})
    assert mtp_model_layout.head_config_from_json(bare, raw, "config.json").num_key_value_heads == 4
    assert mtp_model_layout.head_config_from_json(DECLARED["step3p7"], raw, "config.json").num_key_value_heads == 2


def test_the_key_itself_wins_over_its_alias():
    assert mtp_model_layout.with_aliases({"num_attention_groups": 8, "num_key_value_heads": 2},
                                         DECLARED["step3p7"].aliases)["num_key_value_heads"] == 2


def test_a_config_the_official_class_itself_refuses_exits_2_quoting_it(tmp_path):
    """num_mtp_layers (Step3p7TextConfig's alias of num_nextn_predict_layers) with per-layer lists: transformers
    5.24's Step3p7Config validates the per-layer lists before the alias applies and raises ValueError. Before: an
    internal error (exit 4); the parse itself reads the alias (3 layers)."""
    ckpt = aliased_copy(tmp_path, {"num_nextn_predict_layers": "num_mtp_layers"})
    assert Checkpoint(ckpt).config.num_mtp_layers == 3
    result = run_cli(oracle_cli, ["export", ckpt, "--out", tmp_path / "t.h5", "--tokens", "5,17,3", "--hidden-seed",
                                  "0", "-q"])
    assert result.exit_code == 2, result.output
    assert "Step3p7Config refuses this config" in result.output and "per_layer_config" in result.output
    assert "Traceback" not in result.output and not (tmp_path / "t.h5").exists()
