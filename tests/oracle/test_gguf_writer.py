"""`mtp-oracle gguf`: the head written in llama.cpp's MTP layout reads back (oracle/gguf_source.py) to the very
trace the safetensors checkpoint gives, bit for bit in f32 and bf16 (the fixtures are bf16), within Q8_0's error in
q8_0; a defect written into the GGUF changes the trace at its stage (the round trip is no identity by accident)."""

import h5py
import numpy as np
import pytest
from click.testing import CliRunner

from oracle.checkpoint import Checkpoint
from oracle.cli import cli
from oracle.gguf_writer import head_gguf_tensors, write_gguf

from tests.helpers import FIXTURES

gguf = pytest.importorskip("gguf")
TOKENS = "17,42,3,255,100,7,511,64"
FAMILIES = ["qwen3_5_tiny", "qwen3_5_moe_tiny"]


def export(checkpoint, out, cache) -> dict:
    result = CliRunner().invoke(cli, ["export", str(checkpoint), "--out", str(out), "--tokens", TOKENS,
                                      "--hidden-seed", "0", "-q"], env={"MTP_PROBE_CACHE": str(cache)})
    assert result.exit_code == 0, result.output
    with h5py.File(out) as f:
        return {k: f["stages"][k][()] for k in f["stages"]}


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(request.param)
    return request.param, export(FIXTURES / request.param, tmp / "ref.h5", tmp / "cache")


@pytest.mark.parametrize("outtype", ["f32", "bf16"])
def test_the_gguf_exports_bit_for_bit(tmp_path, family, outtype):
    name, reference = family
    result = CliRunner().invoke(cli, ["gguf", str(FIXTURES / name), "--out", str(tmp_path / "h.gguf"),
                                      "--outtype", outtype, "-q"])
    assert result.exit_code == 0, result.output
    got = export(tmp_path / "h.gguf", tmp_path / "g.h5", tmp_path / "cache")
    assert set(got) == set(reference)
    for stage in reference:
        np.testing.assert_array_equal(got[stage], reference[stage], err_msg=stage)


def test_q8_0_is_within_its_quantization_error_and_not_equal(tmp_path, family):
    name, reference = family
    result = CliRunner().invoke(cli, ["gguf", str(FIXTURES / name), "--out", str(tmp_path / "q.gguf"),
                                      "--outtype", "q8_0", "-q"])
    assert result.exit_code == 0, result.output
    got = export(tmp_path / "q.gguf", tmp_path / "g.h5", tmp_path / "cache")
    # quantized: not the same trace, but close where no routing decision flips (the tiny MoE's experts do flip)
    stage = "out" if "router_logits" not in reference else "router_logits"
    rel = np.abs(got[stage] - reference[stage]).max() / np.abs(reference[stage]).max()
    assert 0 < rel < 0.05, rel


def test_a_defect_written_into_the_gguf_shows_at_its_stage(tmp_path, family):
    """The twin of the bit-for-bit test: swapped stem norms in the GGUF change the trace from `e` on."""
    name, reference = family
    ckpt = Checkpoint(FIXTURES / name)
    tensors = head_gguf_tensors(ckpt)
    block = ckpt.raw_config["text_config"]["num_hidden_layers"]
    e, h = f"blk.{block}.nextn.enorm.weight", f"blk.{block}.nextn.hnorm.weight"
    tensors[e], tensors[h] = tensors[h], tensors[e]
    write_gguf(tmp_path / "bad.gguf", ckpt, tensors)
    got = export(tmp_path / "bad.gguf", tmp_path / "g.h5", tmp_path / "cache")
    assert not np.array_equal(got["e"], reference["e"]) and not np.array_equal(got["h"], reference["h"])
    np.testing.assert_array_equal(got["fc_in"].shape, reference["fc_in"].shape)


def test_norms_are_stored_as_one_plus_w_and_the_layout_is_llama_cpps(tmp_path):
    ckpt = Checkpoint(FIXTURES / "qwen3_5_tiny")
    tensors = head_gguf_tensors(ckpt)
    block = 4
    stored = ckpt.read("mtp.pre_fc_norm_embedding.weight")
    np.testing.assert_array_equal(tensors[f"blk.{block}.nextn.enorm.weight"], stored + np.float32(1))
    assert {f"blk.{block}.nextn.{n}.weight" for n in ("eh_proj", "enorm", "hnorm", "shared_head_norm")} <= set(tensors)
    assert {"token_embd.weight", "output_norm.weight", "output.weight"} <= set(tensors)
    write_gguf(tmp_path / "h.gguf", ckpt, tensors)
    reader = gguf.GGUFReader(tmp_path / "h.gguf")
    fields = {k: f.contents() for k, f in reader.fields.items()}
    assert fields["general.architecture"] == "qwen35"
    assert fields["qwen35.block_count"] == 5 and fields["qwen35.nextn_predict_layers"] == 1
    assert fields["tokenizer.ggml.model"] == "none" and fields["qwen35.vocab_size"] == 512
    assert fields["qwen35.attention.recurrent_layers"] == [True, True, True, False, False]


def test_bad_requests_are_exit_2_and_write_nothing(tmp_path):
    runner = CliRunner()
    deepseek = tmp_path / "not_qwen"
    result = runner.invoke(cli, ["gguf", str(FIXTURES / "qwen3_5_tiny"), "--out", str(tmp_path / "x.gguf"),
                                 "--outtype", "q4_k"])
    assert result.exit_code == 2 and "q4_k" in result.output
    result = runner.invoke(cli, ["gguf", str(FIXTURES / "qwen3_5_tiny"), "--out",
                                 str(FIXTURES / "qwen3_5_tiny" / "config.json")])
    assert result.exit_code == 2 and "config.json" in result.output
    assert not (tmp_path / "x.gguf").exists() and not deepseek.exists()
