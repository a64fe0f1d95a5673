"""`mtp-probe diff REF DUMP --names MAP`: dumps written the way each engine writes them (llama.cpp's cb() names,
SGLang's dumper files with step/rank tags and tensor-parallel shards, vLLM module paths with tuple outputs, a user's
JSON/TOML map) read onto the stages; the twins: a misnamed tensor is listed and its stage not captured (never
passed), a missing step is invalid, a wrong value diverges at its stage."""

import json

import h5py
import numpy as np
import pytest
import torch
from click.testing import CliRunner
from safetensors.numpy import save_file

from oracle.cli import cli as oracle_cli
from probe.cli import cli as probe_cli

from tests.helpers import FIXTURES

TOKENS = "17,42,3,255,100,7,511,64"
LLAMA = {"e": "mtp_enorm-4", "h": "mtp_hnorm-4", "fc_in": "mtp_concat-4", "fc": "mtp_eh_proj-4",
         "ah": "mtp_attn_norm-4", "attn": "mtp_attn_out-4", "res1": "mtp_attn_residual-4",
         "mh": "mtp_attn_post_norm-4", "mlp": "mtp_ffn_out-4", "res2": "mtp_post_ffn-4", "out": "h_nextn"}
VLLM = {"e": "model.pre_fc_norm_embedding", "h": "model.pre_fc_norm_hidden", "fc": "model.fc",
        "ah": "model.layers.0.input_layernorm", "attn": "model.layers.0.self_attn",
        "mh": "model.layers.0.post_attention_layernorm:0", "res1": "model.layers.0.post_attention_layernorm:1",
        "mlp": "model.layers.0.mlp", "out": "model.norm:0", "res2": "model.norm:1"}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("ref") / "ref.h5"
    result = CliRunner().invoke(oracle_cli, ["export", str(FIXTURES / "qwen3_5_tiny"), "--out", str(out), "--tokens",
                                             TOKENS, "--hidden-seed", "0", "-q"])
    assert result.exit_code == 0, result.output
    with h5py.File(out) as f:
        return out, {k: f["stages"][k][()] for k in f["stages"]}


def diff(ref, dump, names, *extra):
    return CliRunner().invoke(probe_cli, ["diff", str(ref), str(dump), "--names", str(names), *extra])


def test_llama_cpp_names_read_onto_the_stages(reference, tmp_path):
    ref, stages = reference
    for stage, name in LLAMA.items():  # ggml's [D, T] as numpy [1, 1, T, D], as the eval callback copies it
        np.save(tmp_path / f"{name}.npy", stages[stage][None, None])
    np.save(tmp_path / "mtp_Qcur_full-4.npy", np.zeros((8, 256), np.float32))  # an intermediate: not "unknown"
    result = diff(ref, tmp_path, "llama.cpp", "--json", str(tmp_path / "r.json"))
    assert result.exit_code == 0, result.output
    assert "PASS" in result.output.splitlines()[-1] and "places on no stage" not in result.output
    assert json.loads((tmp_path / "r.json").read_text())["stages"]["captured"] == list(LLAMA)


def test_a_misnamed_tensor_is_listed_and_its_stage_not_passed(reference, tmp_path):
    ref, stages = reference
    for stage, name in LLAMA.items():
        np.save(tmp_path / f"{(name + 't') if stage == 'attn' else name}.npy", stages[stage])
    result = diff(ref, tmp_path, "llama.cpp")
    assert result.exit_code != 0, result.output  # attn is needed for a pass
    assert "mtp_attn_out-4t" in result.output


def test_sglang_dumper_files_with_steps_and_tensor_parallel_shards(reference, tmp_path):
    ref, stages = reference
    paths = {"e": "pre_fc_norm_embedding", "h": "pre_fc_norm_hidden", "fc": "fc", "attn": "layers.0.self_attn",
             "out": "norm.output.0"}
    index = 0
    for stage, path in paths.items():
        name = f"non_intrusive__model.{path}" + ("" if path.endswith(".0") else ".output")
        for step in range(len(stages[stage])):
            row = torch.from_numpy(stages[stage][step:step + 1].copy())
            shards = row.chunk(2, dim=-1) if stage == "fc" else (row, row)  # fc column-parallel, the rest replicated
            for rank, shard in enumerate(shards):
                index += 1
                file = f"step={step}___rank={rank}___dump_index={index}___name={name}.pt"
                torch.save({"value": shard.clone(), "meta": {"step": step}}, tmp_path / file)
    result = diff(ref, tmp_path, "sglang", "--json", str(tmp_path / "r.json"))
    report = json.loads((tmp_path / "r.json").read_text())
    assert result.exit_code in (0, 3), result.output  # only some stages: the verdict depends on evidence, not 1 or 2
    assert report["first_divergence"] is None
    assert set(report["stages"]["captured"]) == set(paths), report["stages"]
    # twin: one step missing from one stage is invalid, naming the stage and the step count
    (next(tmp_path.glob("step=3___rank=0___*name=non_intrusive__model.fc.output.pt"))).unlink()
    result = diff(ref, tmp_path, "sglang")
    assert result.exit_code == 2 and "fc" in result.output


def test_vllm_module_paths_and_a_wrong_value_diverges_at_its_stage(reference, tmp_path):
    ref, stages = reference
    save_file({path: np.ascontiguousarray(stages[stage]) for stage, path in VLLM.items()}, str(tmp_path / "d.safetensors"))
    result = diff(ref, tmp_path, "vllm")
    assert result.exit_code in (0, 3), result.output
    bad = {path: np.ascontiguousarray(stages[stage]) for stage, path in VLLM.items()}
    bad["model.layers.0.post_attention_layernorm:0"] = bad["model.layers.0.post_attention_layernorm:0"] * 1.01
    save_file(bad, str(tmp_path / "d.safetensors"))
    result = diff(ref, tmp_path, "vllm", "--json", str(tmp_path / "r.json"))
    assert result.exit_code == 1, result.output
    assert json.loads((tmp_path / "r.json").read_text())["first_divergence"]["stage"] == "mh"


@pytest.mark.parametrize("suffix", [".json", ".toml"])
def test_a_user_map_in_json_or_toml(reference, tmp_path, suffix):
    ref, stages = reference
    dump = tmp_path / "dump"
    dump.mkdir()
    names = {f"my.{s}": s for s in stages}
    for name, stage in names.items():
        np.save(dump / f"{name}.npy", stages[stage])
    map_file = tmp_path / f"map{suffix}"
    if suffix == ".json":
        map_file.write_text(json.dumps({"names": names}))
    else:
        map_file.write_text("[names]\n" + "".join(f'"{k}" = "{v}"\n' for k, v in names.items()))
    result = diff(ref, dump, map_file)
    assert result.exit_code == 0, result.output


def test_bad_maps_are_exit_2(reference, tmp_path):
    ref, stages = reference
    np.save(tmp_path / "x.npy", stages["e"])
    assert diff(ref, tmp_path, "no_such_engine").exit_code == 2
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"names": {"x": "not_a_stage"}}))
    result = diff(ref, tmp_path, bad)
    assert result.exit_code == 2 and "not_a_stage" in result.output
    nothing = tmp_path / "m.json"
    nothing.write_text(json.dumps({"names": {"y": "e"}}))
    result = diff(ref, tmp_path, nothing)
    assert result.exit_code == 2 and "x" in result.output
