"""The oracle on GGUF weights: a GGUF written with the gguf package (llama.cpp's names and norm convention) from the
tiny fixture exports to within its quantization error of the safetensors export; a BF16 twin exports bit for bit."""

import json
import os

import h5py
import numpy as np
import pytest
from click.testing import CliRunner

from oracle.checkpoint import Checkpoint
from oracle.cli import cli
from oracle.errors import CheckpointError
from oracle.gguf_source import LAYER, NORMS, STEM

from tests.helpers import FIXTURES

gguf = pytest.importorskip("gguf")
DENSE = FIXTURES / "qwen3_5_tiny"
TOKENS = "17,42,3,255,100,7,511,64"
LLAMA_NAME = {f"mtp.layers.0.{v}.weight": k for k, v in LAYER.items() if k != "ffn_norm"}
LLAMA_NAME |= {f"{v}.weight": k for k, v in STEM.items()}


def write_gguf(path, checkpoint, qtype, metadata=True, skip=()):
    """The fixture's head as llama.cpp's converter lays it out: MTP block N = num_hidden_layers, (1+w) norms stored
    as 1 + w in F32, every matrix in `qtype`."""
    ckpt = Checkpoint(checkpoint)
    text = ckpt.raw_config["text_config"]
    block = text["num_hidden_layers"]
    writer = gguf.GGUFWriter(path, "qwen35")
    if metadata:
        for key, value in (("block_count", block + 1), ("embedding_length", text["hidden_size"]),
                           ("attention.head_count", text["num_attention_heads"]),
                           ("attention.head_count_kv", text["num_key_value_heads"]),
                           ("attention.key_length", text["head_dim"]),
                           ("feed_forward_length", text["intermediate_size"]),
                           ("context_length", text["max_position_embeddings"]), ("nextn_predict_layers", 1),
                           ("rope.dimension_count", int(text["head_dim"] * 0.25))):
            writer.add_uint32(f"qwen35.{key}", value)
        writer.add_float32("qwen35.attention.layer_norm_rms_epsilon", text["rms_norm_eps"])
        writer.add_float32("qwen35.rope.freq_base", text["rope_parameters"]["rope_theta"])
        writer.add_array("qwen35.rope.dimension_sections", [2, 1, 1, 0])
    head = ckpt.read_head(digest=False).tensors
    main = {"token_embd": ckpt.read("model.language_model.embed_tokens.weight"), "output": ckpt.read("lm_head.weight")}
    for name, values in head.items():
        short = LLAMA_NAME[name]
        if short in skip:
            continue
        if short in NORMS:  # F32, as llama.cpp stores norms
            writer.add_tensor(f"blk.{block}.{short}.weight", values + np.float32(1.0))
        else:
            writer.add_tensor(f"blk.{block}.{short}.weight", quantized(values, qtype), raw_dtype=qtype)
    for short, values in main.items():
        writer.add_tensor(f"{short}.weight", quantized(values, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def quantized(values: np.ndarray, qtype) -> np.ndarray:
    return gguf.quants.quantize(np.ascontiguousarray(values, dtype=np.float32), qtype)


def export(checkpoint, out, cache) -> dict:
    result = CliRunner().invoke(cli, ["export", str(checkpoint), "--out", str(out), "--tokens", TOKENS,
                                      "--hidden-seed", "0", "-q"], env={"MTP_PROBE_CACHE": str(cache)})
    assert result.exit_code == 0, result.output
    with h5py.File(out) as f:
        return {name: f["stages"][name][:] for name in f["stages"]} | {"provenance": json.loads(f.attrs["provenance"])}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gguf_ref")
    return export(DENSE, tmp / "ref.h5", tmp / "cache")


def test_bf16_gguf_exports_bit_for_bit(tmp_path, reference):
    path = write_gguf(tmp_path / "head-bf16.gguf", DENSE, gguf.GGMLQuantizationType.BF16)
    stages = export(path, tmp_path / "bf16.h5", tmp_path / "cache")
    for name, values in reference.items():
        if name != "provenance":
            np.testing.assert_array_equal(stages[name], values, err_msg=name)
    source = stages["provenance"]["source"]
    assert source["format"] == "gguf" and set(source["quant_types"].values()) == {"BF16", "F32"}


@pytest.mark.parametrize("qtype, within", [("Q8_0", 0.03), ("F16", 2e-3)])
def test_quantized_gguf_within_its_quantization_error(tmp_path, reference, qtype, within):
    path = write_gguf(tmp_path / f"head-{qtype}.gguf", DENSE, gguf.GGMLQuantizationType[qtype])
    stages = export(path, tmp_path / "q.h5", tmp_path / "cache")
    errors = {n: float(np.abs(stages[n] - v).max() / np.abs(v).max()) for n, v in reference.items()
              if n != "provenance"}
    print(qtype, {n: f"{e:.2e}" for n, e in errors.items()})
    assert max(errors.values()) < within, errors
    assert errors["h"] == 0 and errors["out"] > 0  # F32 norms exact; the quantized matrices really quantized
    assert qtype in stages["provenance"]["source"]["quant_types"].values()


def test_config_from_metadata_equals_config_json(tmp_path):
    folder = tmp_path / "with_config"
    folder.mkdir()
    (folder / "config.json").write_text((DENSE / "config.json").read_text())
    write_gguf(folder / "head.gguf", DENSE, gguf.GGMLQuantizationType.F16)
    bare = write_gguf(tmp_path / "bare.gguf", DENSE, gguf.GGMLQuantizationType.F16)
    import os

    os.environ["MTP_PROBE_CACHE"] = str(tmp_path / "cache")
    try:
        assert Checkpoint(folder).config == Checkpoint(bare).config == Checkpoint(DENSE).config
    finally:
        del os.environ["MTP_PROBE_CACHE"]


def test_k_quants_dequantized_by_the_gguf_package(tmp_path, monkeypatch):
    """Q4_K/Q5_K/Q6_K need rows of 256: valid random blocks in a 256-wide tensor read as gguf.quants says."""
    from oracle.gguf_source import _dequantized

    rng = np.random.default_rng(0)
    for name in ("Q4_K", "Q5_K", "Q6_K"):
        qtype = gguf.GGMLQuantizationType[name]
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, (4, size), dtype=np.uint8)
        raw[:, :4] = np.frombuffer(np.full(2, 0.01, np.float16).tobytes(), np.uint8)  # sane d/dmin (Q6_K: scales)
        writer = gguf.GGUFWriter(tmp_path / f"{name}.gguf", "qwen35")
        writer.add_tensor("t.weight", raw, raw_dtype=qtype)
        writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()
        tensor = gguf.GGUFReader(tmp_path / f"{name}.gguf").tensors[0]
        values = _dequantized(tensor, tmp_path / f"{name}.gguf")
        assert values.shape == (4, block)
        np.testing.assert_array_equal(values, gguf.quants.dequantize(raw, qtype).reshape(4, block))


def test_bad_gguf_names_the_problem(tmp_path, monkeypatch):
    monkeypatch.setenv("MTP_PROBE_CACHE", str(tmp_path / "cache"))
    no_head = tmp_path / "no_head.gguf"
    writer = gguf.GGUFWriter(no_head, "qwen35")
    writer.add_tensor("token_embd.weight", np.zeros((8, 64), np.float32))
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()
    with pytest.raises(CheckpointError, match="no MTP block"):
        Checkpoint(no_head)
    (tmp_path / "junk.gguf").write_bytes(b"GGUF not really")
    with pytest.raises(CheckpointError, match="not a readable GGUF"):
        Checkpoint(tmp_path / "junk.gguf")
    missing = write_gguf(tmp_path / "missing.gguf", DENSE, gguf.GGMLQuantizationType.F16, skip=("attn_k",))
    with pytest.raises(CheckpointError, match="self_attn.k_proj.weight is missing"):
        Checkpoint(missing).read_head()


def test_a_replaced_gguf_or_a_new_config_beside_it_is_not_served_from_the_stale_cache(tmp_path, monkeypatch):
    """Red team: the cache was keyed by path, size and mtime only, so a GGUF replaced by another of the same size with
    its mtime copied (cp -p, rsync -t), or a config.json added beside it, exported the OLD head (exit 0). Twin: the
    same file untouched is served from the cache (one folder)."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("MTP_PROBE_CACHE", str(cache))
    folder = tmp_path / "m"
    folder.mkdir()
    path = write_gguf(folder / "head.gguf", DENSE, gguf.GGMLQuantizationType.F16)
    first = Checkpoint(path).path
    assert Checkpoint(path).path == first and len(list((cache / "gguf").iterdir())) == 1  # twin: reused
    stat = path.stat()
    other = write_gguf(tmp_path / "other.gguf", DENSE, gguf.GGMLQuantizationType.BF16)
    assert other.stat().st_size == stat.st_size
    os.replace(other, path)  # same path and size
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # mtime copied back
    replaced = Checkpoint(path).path
    assert replaced != first and json.loads((replaced / "gguf_source.json").read_text())["quant_types"][
        "mtp.fc.weight"] == "BF16"
    (folder / "config.json").write_text((DENSE / "config.json").read_text())
    assert Checkpoint(path).path not in (first, replaced)  # a config.json beside it: a new cache


def test_gguf_inputs_that_are_not_readable_are_exit_2(tmp_path, monkeypatch):
    """Red team: a config.json beside the GGUF that is not JSON, an unwritable cache location, non-numeric metadata
    and a zero-sized tensor had been tracebacks (exit 4); --out onto the config.json beside the GGUF destroyed it."""
    from tests.test_bad_inputs import assert_refused

    monkeypatch.setenv("MTP_PROBE_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "m"
    folder.mkdir()
    path = write_gguf(folder / "head.gguf", DENSE, gguf.GGMLQuantizationType.F16)
    (folder / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"config.json \(beside head.gguf\) is not readable JSON"):
        Checkpoint(path)
    (folder / "config.json").write_text((DENSE / "config.json").read_text())
    args = ["export", path, "--out", folder / "config.json", "--tokens", TOKENS, "--hidden-seed", "0"]
    assert_refused(cli, args, "is the config.json beside the GGUF", [folder / "config.json"], tmp_path)
    (folder / "config.json").unlink()
    (tmp_path / "afile").write_text("x")
    monkeypatch.setenv("MTP_PROBE_CACHE", str(tmp_path / "afile"))
    with pytest.raises(CheckpointError, match="cache folder .* cannot be created"):
        Checkpoint(path)
    monkeypatch.setenv("MTP_PROBE_CACHE", str(tmp_path / "cache"))
    writer = gguf.GGUFWriter(tmp_path / "bad_meta.gguf", "qwen35")
    writer.add_string("qwen35.block_count", "5")
    writer.add_tensor("blk.4.nextn.eh_proj.weight", np.zeros((64, 128), np.float32))
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()
    with pytest.raises(CheckpointError, match="qwen35.block_count is '5'; it must be a number|is missing"):
        Checkpoint(tmp_path / "bad_meta.gguf").read_head()
    raw = path.read_bytes()
    (tmp_path / "cut.gguf").write_bytes(raw[:200])
    with pytest.raises(CheckpointError, match="not a readable GGUF"):
        Checkpoint(tmp_path / "cut.gguf")
