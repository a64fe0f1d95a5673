"""Checkpoint reading: layouts, exact bf16 widening, rows-only embedding reads, and errors that name the culprit."""

import json
import os
import shutil

import numpy as np
import pytest
import torch
from safetensors import safe_open

from oracle.checkpoint import Checkpoint
from oracle.errors import CheckpointError, InputError
from oracle.families.qwen3_5_layout import head_config_from_json, head_tensor_shapes
from tests.helpers import TINY, TINY_SHARDED


def _copy(src, tmp_path):
    return shutil.copytree(src, tmp_path / src.name)


def test_single_and_sharded_read_the_same_head():
    single, sharded = Checkpoint(TINY).read_head(), Checkpoint(TINY_SHARDED).read_head()
    assert single.digest == sharded.digest
    assert set(single.tensors) == set(head_tensor_shapes(Checkpoint(TINY).config)) and len(single.tensors) == 15
    for name, arr in single.tensors.items():
        np.testing.assert_array_equal(arr, sharded.tensors[name])


def test_sharded_fixture_really_splits_the_head_across_shards():
    index = json.loads((TINY_SHARDED / "model.safetensors.index.json").read_text())["weight_map"]
    assert len({f for n, f in index.items() if n.startswith("mtp.")}) == 2


def test_bf16_widening_equals_safetensors_and_torch():
    ckpt = Checkpoint(TINY)
    with safe_open(TINY / "model.safetensors", framework="pt") as f:
        for name in f.keys():
            assert f.get_tensor(name).dtype == torch.bfloat16
            np.testing.assert_array_equal(ckpt.read(name), f.get_tensor(name).float().numpy(), err_msg=name)


def test_embedding_rows_read_only_the_rows_asked_for(monkeypatch):
    ckpt = Checkpoint(TINY)
    ids = np.array([5, 17, 5, 511], dtype=np.int64)
    table = ckpt.read("model.language_model.embed_tokens.weight")  # (read with pread too: before counting)
    reads = []
    real_preadv = os.preadv
    monkeypatch.setattr(os, "preadv", lambda fd, bufs, off: reads.append(sum(len(b) for b in bufs))
                        or real_preadv(fd, bufs, off))
    rows = ckpt.embedding_rows(ids)
    np.testing.assert_array_equal(rows, table[ids])
    assert sum(reads) == 3 * ckpt.config.hidden_size * 2  # three distinct bf16 rows, nothing else


def test_flat_and_nested_config_give_the_same_head_config():
    raw = json.loads((TINY / "config.json").read_text())
    assert head_config_from_json(raw["text_config"], "flat") == head_config_from_json(raw, "nested")


def test_legacy_top_level_rope_theta_is_read():
    text = json.loads((TINY / "config.json").read_text())["text_config"]
    rope = text.pop("rope_parameters")
    text.update(rope_theta=rope["rope_theta"], partial_rotary_factor=rope["partial_rotary_factor"])
    assert head_config_from_json(text, "legacy").rope_theta == 1e7


def test_missing_rope_theta_is_refused_not_defaulted():
    raw = json.loads((TINY / "config.json").read_text())
    del raw["text_config"]["rope_parameters"]["rope_theta"]
    with pytest.raises(CheckpointError, match="no rope_theta.*10000"):
        head_config_from_json(raw, "config.json")


def test_missing_tensor_is_named(tmp_path):
    ckpt_dir = _copy(TINY_SHARDED, tmp_path)
    index_path = ckpt_dir / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    del index["weight_map"]["mtp.layers.0.self_attn.k_norm.weight"]
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"mtp\.layers\.0\.self_attn\.k_norm\.weight is missing"):
        Checkpoint(ckpt_dir).read_head()


def test_missing_shard_is_named(tmp_path):
    ckpt_dir = _copy(TINY_SHARDED, tmp_path)
    (ckpt_dir / "model-00003-of-00003.safetensors").unlink()
    with pytest.raises(CheckpointError, match="shard model-00003-of-00003.safetensors is missing"):
        Checkpoint(ckpt_dir).read_head()


def test_shape_inconsistent_with_config_names_tensor_and_shapes(tmp_path):
    ckpt_dir = _copy(TINY, tmp_path)
    raw = json.loads((ckpt_dir / "config.json").read_text())
    raw["text_config"]["intermediate_size"] = 128
    (ckpt_dir / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=r"mtp\.layers\.0\.mlp\.\w+_proj\.weight .* has shape \[\d+, \d+\], "
                                              r"but config\.json implies"):
        Checkpoint(ckpt_dir).read_head()


def test_truncated_shard_is_reported(tmp_path):
    ckpt_dir = _copy(TINY_SHARDED, tmp_path)
    shard = ckpt_dir / "model-00003-of-00003.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match="truncated"):
        Checkpoint(ckpt_dir).read_head()


def test_unused_head_tensor_is_refused(tmp_path, make_fixtures):
    ckpt_dir = _copy(TINY_SHARDED, tmp_path)
    from safetensors.torch import save_file

    save_file({"mtp.layers.0.mlp.shared_expert_gate.weight": torch.zeros(1, 64, dtype=torch.bfloat16)},
              ckpt_dir / "extra.safetensors")
    index_path = ckpt_dir / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["mtp.layers.0.mlp.shared_expert_gate.weight"] = "extra.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="shared_expert_gate.*Refusing to ignore"):
        Checkpoint(ckpt_dir).read_head()


@pytest.mark.parametrize("bad", [-1, 512, 10**9])
def test_token_id_out_of_range_names_the_row(bad):
    with pytest.raises(InputError, match=f"token id {bad} at row 2 is out of range.*vocab_size is 512"):
        Checkpoint(TINY).embedding_rows(np.array([1, 2, bad], dtype=np.int64))


def test_not_a_checkpoint_directory(tmp_path):
    with pytest.raises(CheckpointError, match="config.json is missing"):
        Checkpoint(tmp_path)
    (tmp_path / "config.json").write_text((TINY / "config.json").read_text())
    with pytest.raises(CheckpointError, match="neither model.safetensors nor model.safetensors.index.json"):
        Checkpoint(tmp_path)


def test_read_rows_reads_a_row_range():
    ckpt = Checkpoint(TINY_SHARDED)
    np.testing.assert_array_equal(ckpt.read_rows("lm_head.weight", 100, 228), ckpt.read("lm_head.weight")[100:228])
    with pytest.raises(CheckpointError, match="rows 500..600 are not in it"):
        ckpt.read_rows("lm_head.weight", 500, 600)


def _rewrite_header(path, edit):
    """Rewrite a safetensors file's JSON header text through `edit(text) -> text`, keeping its data bytes."""
    raw = path.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    text = edit(raw[8:8 + length].decode())
    header = text.encode().ljust(length) if len(text.encode()) <= length else text.encode()
    path.write_bytes(len(header).to_bytes(8, "little") + header + raw[8 + length:])


def _header_json(path) -> dict:
    raw = path.read_bytes()
    return json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])


@pytest.mark.parametrize("damage, words", [
    ("overlap", r"tensors mtp\.(pre_fc_)?norm(_hidden)?\.weight and mtp\.(pre_fc_)?norm(_hidden)?\.weight share"),
    ("repeated_key", "lists 'mtp.norm.weight' twice"),
    ("trailing", "bytes follow the last tensor"),
], ids=["overlap", "repeated_key", "trailing"])
def test_a_header_the_safetensors_format_forbids_is_refused(tmp_path, damage, words):
    """Red team: data_offsets pointing mtp.norm.weight at another norm's bytes (or a second "mtp.norm.weight" key,
    which JSON resolves to the last) exported a trace computed with the wrong norm, exit 0; the safetensors library
    refuses both. Tensors must tile the data exactly. Twin: the file as written reads, and equals safetensors'."""
    ckpt_dir = _copy(TINY, tmp_path)
    path = ckpt_dir / "model.safetensors"
    header = _header_json(path)
    other = header["mtp.pre_fc_norm_hidden.weight"]["data_offsets"]
    if damage == "overlap":
        offsets = json.dumps(header["mtp.norm.weight"]["data_offsets"]).replace(" ", "")
        _rewrite_header(path, lambda t: t.replace(offsets, json.dumps(other).replace(" ", ""), 1))
    elif damage == "repeated_key":
        entry = dict(header["mtp.norm.weight"], data_offsets=other)
        _rewrite_header(path, lambda t: t.rstrip()[:-1] + ',"mtp.norm.weight":' + json.dumps(entry) + "}")
    else:
        path.write_bytes(path.read_bytes() + b"\0" * 16)
    with pytest.raises(CheckpointError, match=words):
        Checkpoint(ckpt_dir).read_head()
    untouched = Checkpoint(TINY).read_head(digest=False).tensors["mtp.norm.weight"]
    with safe_open(TINY / "model.safetensors", "pt") as f:
        np.testing.assert_array_equal(untouched, f.get_tensor("mtp.norm.weight").float().numpy())


def test_a_tensor_stored_in_two_shards_is_refused(tmp_path):
    """Red team: a second copy of mtp.fc.weight (zeros) in another shard than the index names was silently ignored.
    Twin: the sharded fixture as written reads."""
    from safetensors.torch import load_file, save_file

    ckpt_dir = _copy(TINY_SHARDED, tmp_path)
    index = json.loads((ckpt_dir / "model.safetensors.index.json").read_text())["weight_map"]
    home = index["mtp.fc.weight"]
    other = next(s for s in sorted(set(index.values())) if s != home and any(
        n.startswith("mtp.") and index[n] == s for n in index))
    tensors = load_file(ckpt_dir / other)
    tensors["mtp.fc.weight"] = torch.zeros_like(load_file(ckpt_dir / home)["mtp.fc.weight"])
    save_file(tensors, ckpt_dir / other)
    with pytest.raises(CheckpointError, match=f"mtp.fc.weight is in two shards .*: {other} and {home}"):
        Checkpoint(ckpt_dir).read_head()
    Checkpoint(TINY_SHARDED).read_head(digest=False)


def test_an_overlap_behind_an_empty_tensor_is_still_found(tmp_path):
    """A zero-sized tensor between two that overlap must not hide the overlap (an adjacent-pairs check missed it)."""
    from safetensors.numpy import save_file

    path = tmp_path / "t.safetensors"
    save_file({"a": np.zeros(16, np.float32), "b": np.zeros(0, np.float32), "c": np.ones(4, np.float32)}, path)
    header = _header_json(path)
    _rewrite_header(path, lambda t: t.replace(json.dumps(header["b"]["data_offsets"]).replace(" ", ""), "[8,8]", 1)
                    .replace(json.dumps(header["c"]["data_offsets"]).replace(" ", ""), "[16,32]", 1))
    from oracle.checkpoint import _read_safetensors_header

    with pytest.raises(CheckpointError, match="tensors a and c share bytes"):
        _read_safetensors_header(path)
    save_file({"a": np.zeros(16, np.float32), "b": np.zeros(0, np.float32), "c": np.ones(4, np.float32)}, path)
    assert set(_read_safetensors_header(path)) == {"a", "b", "c"}  # twin: the file as written
