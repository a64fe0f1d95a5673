"""The oracle on GGUF MoE heads (llama.cpp's qwen35moe and qwen3next): the bundled MoE fixtures written as llama.cpp's
converter lays them out (conversion/qwen.py: `mtp.*` remapped to block N = num_hidden_layers, experts stacked into
`ffn_{gate,up,down}_exps` or fused into `ffn_gate_up_exps`, every (1+w) norm stored as 1 + w in F32, the router in
F32) export bit for bit from BF16 and within the quantization error from Q8_0; bad files exit 2 naming the tensor
or the metadata key; a gate/up swap in the stacked experts changes the trace."""

import json

import h5py
import numpy as np
import pytest
from click.testing import CliRunner

from oracle.checkpoint import Checkpoint
from oracle.cli import cli
from oracle.families.registry import head_module
from oracle.gguf_source import LAYER, NORMS, STEM

from tests.helpers import FIXTURES
from tests.probe.tracekit import load_trace

gguf = pytest.importorskip("gguf")
TOKENS = "17,42,3,255,100,7,511,64"
HEADS = {"qwen35moe": FIXTURES / "qwen3_5_moe_tiny", "qwen3next": FIXTURES / "qwen3_next_tiny_fused"}
LLAMA_NAME = {f"mtp.layers.0.{v}.weight": k for k, v in LAYER.items() if k != "ffn_norm"}
LLAMA_NAME |= {f"{v}.weight": k for k, v in STEM.items()}
ALWAYS_F32 = ("ffn_gate_inp",)  # the converter keeps the router in F32 (and llama-quantize leaves it alone)


def write_moe_gguf(path, arch, qtype, fused=False, skip=(), metadata=None, swap_gate_up=False,
                   squeeze_shared_gate=False):
    """The fixture's head as llama.cpp's converter writes it. `metadata` overrides `{arch}.*` keys (None drops one);
    `skip` leaves out GGUF tensors by short name; `fused` writes ffn_gate_up_exps (--fuse-gate-up-exps);
    `squeeze_shared_gate` writes ffn_gate_inp_shexp 1-D, as converter versions that squeeze every tensor do."""
    ckpt = Checkpoint(HEADS[arch])
    raw = ckpt.raw_config
    text = raw.get("text_config", raw)
    block = text["num_hidden_layers"]
    writer = gguf.GGUFWriter(path, arch)
    keys = {"block_count": block + 1, "context_length": text["max_position_embeddings"],
            "embedding_length": text["hidden_size"], "attention.head_count": text["num_attention_heads"],
            "attention.head_count_kv": text["num_key_value_heads"], "attention.key_length": text["head_dim"],
            "attention.value_length": text["head_dim"], "nextn_predict_layers": 1,
            "rope.dimension_count": int(text["head_dim"] * text["rope_parameters"]["partial_rotary_factor"]),
            "expert_count": text["num_experts"], "expert_used_count": text["num_experts_per_tok"],
            "expert_feed_forward_length": text["moe_intermediate_size"],
            "expert_shared_feed_forward_length": text["shared_expert_intermediate_size"]}
    if "intermediate_size" in text:
        keys["feed_forward_length"] = text["intermediate_size"]
    keys |= metadata or {}
    for key, value in keys.items():
        if value is not None:
            writer.add_uint32(f"{arch}.{key}", value)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", text["rms_norm_eps"])
    writer.add_float32(f"{arch}.rope.freq_base", text["rope_parameters"]["rope_theta"])
    if arch == "qwen35moe":
        writer.add_array(f"{arch}.rope.dimension_sections", [*text["rope_parameters"]["mrope_section"], 0])
    out = {}
    for name, values in ckpt.read_head(digest=False).tensors.items():
        if ".mlp.experts." not in name:
            out[LLAMA_NAME[name]] = values
    out |= stacked_experts(ckpt, fused, swap_gate_up)
    if squeeze_shared_gate:
        out["ffn_gate_inp_shexp"] = out["ffn_gate_inp_shexp"].reshape(-1)
    for short, values in out.items():
        if short in skip:
            continue
        if short in NORMS:  # (1+w) stored as 1 + w, F32 as llama.cpp stores norms
            writer.add_tensor(f"blk.{block}.{short}.weight", values + np.float32(1.0))
        elif short in ALWAYS_F32 or values.ndim == 1:
            writer.add_tensor(f"blk.{block}.{short}.weight", np.ascontiguousarray(values, np.float32))
        else:
            add_quantized(writer, f"blk.{block}.{short}.weight", values, qtype)
    embed = "model.language_model.embed_tokens.weight" if arch == "qwen35moe" else "model.embed_tokens.weight"
    add_quantized(writer, "token_embd.weight", ckpt.read(embed), qtype)
    add_quantized(writer, "output.weight", ckpt.read("lm_head.weight"), qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def stacked_experts(ckpt, fused: bool, swap_gate_up: bool) -> dict[str, np.ndarray]:
    """Per-expert (stack) or fused (split on dim 1, gate rows first) checkpoint experts as the converter's
    ffn_gate_exps / ffn_up_exps [E, I, D] and ffn_down_exps [E, D, I] (numpy order; GGUF stores ne reversed)."""
    names = set(ckpt.names())
    prefix = "mtp.layers.0.mlp.experts."
    if prefix + "gate_up_proj" in names:
        gate_up = ckpt.read(prefix + "gate_up_proj")
        half = gate_up.shape[1] // 2
        gate, up, down = gate_up[:, :half], gate_up[:, half:], ckpt.read(prefix + "down_proj")
    else:
        count = ckpt.config.num_experts
        gate, up, down = (np.stack([ckpt.read(f"{prefix}{e}.{p}_proj.weight") for e in range(count)])
                          for p in ("gate", "up", "down"))
    if swap_gate_up:
        gate, up = up, gate
    if fused:  # the converter's --fuse-gate-up-exps: cat([gate, up], dim=1)
        return {"ffn_gate_up_exps": np.concatenate([gate, up], axis=1), "ffn_down_exps": down}
    return {"ffn_gate_exps": gate, "ffn_up_exps": up, "ffn_down_exps": down}


def add_quantized(writer, name: str, values: np.ndarray, qtype) -> None:
    """As the converter: a row length the type's block does not divide falls back to F16."""
    values = np.ascontiguousarray(values, dtype=np.float32)
    try:
        writer.add_tensor(name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
    except gguf.quants.QuantError:
        writer.add_tensor(name, gguf.quants.quantize(values, gguf.GGMLQuantizationType.F16),
                          raw_dtype=gguf.GGMLQuantizationType.F16)


def export(checkpoint, out, cache, expect=0, tokens=TOKENS):
    result = CliRunner().invoke(cli, ["export", str(checkpoint), "--out", str(out), "--tokens", tokens,
                                      "--hidden-seed", "0", "-q"], env={"MTP_PROBE_CACHE": str(cache)})
    assert result.exit_code == expect, result.output
    if expect:
        return result.output
    with h5py.File(out) as f:
        stages = {name: f["stages"][name][:] for name in f["stages"]}
        return stages | {"provenance": json.loads(f.attrs["provenance"]), "experts": json.loads(f.attrs["experts"])
                         if "experts" in f.attrs else None}


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gguf_moe_ref")
    return {arch: export(head, tmp / f"{arch}.h5", tmp / "cache") for arch, head in HEADS.items()}


def stage_errors(stages, reference) -> dict[str, float]:
    return {n: float(np.abs(stages[n].astype(np.float64) - v).max() / max(np.abs(v).max(), 1e-30))
            for n, v in reference.items() if isinstance(v, np.ndarray) and np.issubdtype(v.dtype, np.floating)}


@pytest.mark.parametrize("arch", sorted(HEADS))
@pytest.mark.parametrize("fused", [False, True], ids=["stacked", "fused_gate_up"])
def test_bf16_moe_gguf_exports_bit_for_bit(tmp_path, references, arch, fused):
    path = write_moe_gguf(tmp_path / f"{arch}-bf16.gguf", arch, gguf.GGMLQuantizationType.BF16, fused=fused)
    stages = export(path, tmp_path / "bf16.h5", tmp_path / "cache")
    for name, values in references[arch].items():
        if isinstance(values, np.ndarray):
            np.testing.assert_array_equal(stages[name], values, err_msg=f"{arch} {name}")
    source = stages["provenance"]["source"]
    assert source["format"] == "gguf" and source["architecture"] == arch
    assert set(source["quant_types"].values()) == {"BF16", "F32"}
    assert references[arch]["provenance"]["source"] == {"format": "safetensors"}
    assert stages["experts"]["used"] == references[arch]["experts"]["used"]


@pytest.mark.parametrize("arch", sorted(HEADS))
def test_q8_0_moe_gguf_within_its_quantization_error(tmp_path, references, arch):
    """Every stage within Q8_0's error on the tokens that route to the same experts; a token whose choice flips must
    have been a near tie (its k-th and (k+1)-th router logits closer than the router logits' own error), and from
    the router on its MoE stages differ by more than rounding: that is what quantizing a router input does."""
    path = write_moe_gguf(tmp_path / f"{arch}-q8_0.gguf", arch, gguf.GGMLQuantizationType.Q8_0)
    stages = export(path, tmp_path / "q8.h5", tmp_path / "cache")
    reference = references[arch]
    k = reference["topk_ids"].shape[1]
    flipped = [t for t in range(len(reference["topk_ids"]))
               if set(stages["topk_ids"][t]) != set(reference["topk_ids"][t])]
    logit_error = float(np.abs(stages["router_logits"] - reference["router_logits"]).max())
    for t in flipped:
        ranked = np.sort(reference["router_logits"][t])[::-1]
        assert ranked[k - 1] - ranked[k] < 2 * logit_error, (t, ranked[k - 1] - ranked[k], logit_error)
    kept = [t for t in range(len(reference["topk_ids"])) if t not in flipped]
    errors = stage_errors({n: v[kept] for n, v in stages.items() if isinstance(v, np.ndarray)},
                          {n: v[kept] for n, v in reference.items() if isinstance(v, np.ndarray)})
    print(arch, "Q8_0 flipped tokens", flipped, {n: f"{e:.2e}" for n, e in errors.items()})
    assert len(flipped) <= 1 and max(errors.values()) < 0.03, (flipped, errors)
    assert errors["h"] == 0 and errors["out"] > 0  # F32 norms exact; the quantized matrices really quantized
    types = stages["provenance"]["source"]["quant_types"]
    assert types["mtp.layers.0.mlp.experts.gate_up_proj"] == "Q8_0" and types["mtp.layers.0.mlp.gate.weight"] == "F32"


def test_twin_gate_and_up_swapped_in_the_stacked_experts_changes_the_trace(tmp_path, references):
    path = write_moe_gguf(tmp_path / "swapped.gguf", "qwen35moe", gguf.GGMLQuantizationType.BF16, swap_gate_up=True)
    stages = export(path, tmp_path / "swapped.h5", tmp_path / "cache")
    reference = references["qwen35moe"]
    np.testing.assert_array_equal(stages["topk_ids"], reference["topk_ids"])  # the router does not see experts
    assert not np.array_equal(stages["routed"], reference["routed"])
    assert not np.array_equal(stages["out"], reference["out"])


def test_a_squeezed_shared_expert_gate_reads_as_its_checkpoint_row(tmp_path, references):
    path = write_moe_gguf(tmp_path / "squeezed.gguf", "qwen3next", gguf.GGMLQuantizationType.BF16,
                          squeeze_shared_gate=True)
    stages = export(path, tmp_path / "squeezed.h5", tmp_path / "cache")
    np.testing.assert_array_equal(stages["out"], references["qwen3next"]["out"])


def test_config_from_metadata_equals_config_json(tmp_path, monkeypatch):
    monkeypatch.setenv("MTP_PROBE_CACHE", str(tmp_path / "cache"))
    for arch, head in HEADS.items():
        bare = write_moe_gguf(tmp_path / f"{arch}.gguf", arch, gguf.GGMLQuantizationType.F16)
        assert Checkpoint(bare).config == Checkpoint(head).config, arch


def test_the_streamed_cache_is_a_valid_safetensors_file(tmp_path, monkeypatch):
    """The cache is written tensor by tensor, slice by slice (never the whole head in memory): the safetensors
    package itself reads it back as the dequantized GGUF tensors."""
    from safetensors.numpy import load_file

    from oracle.gguf_source import CHUNK_BYTES

    monkeypatch.setenv("MTP_PROBE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr("oracle.gguf_source.CHUNK_BYTES", 4096)  # many slices per tensor, even at this size
    path = write_moe_gguf(tmp_path / "head.gguf", "qwen3next", gguf.GGMLQuantizationType.Q8_0)
    checkpoint = Checkpoint(path)
    loaded = load_file(checkpoint.path / "model.safetensors")
    assert set(loaded) == set(checkpoint.names()) and CHUNK_BYTES > 4096
    reader = gguf.GGUFReader(path)
    stacked = {t.name.split(".")[2]: gguf.quants.dequantize(t.data, t.tensor_type) for t in reader.tensors
               if "_exps" in t.name}
    np.testing.assert_array_equal(loaded["mtp.layers.0.mlp.experts.gate_up_proj"],
                                  np.concatenate([stacked["ffn_gate_exps"], stacked["ffn_up_exps"]], axis=1))
    np.testing.assert_array_equal(loaded["mtp.layers.0.mlp.experts.down_proj"], stacked["ffn_down_exps"])
    for name, values in loaded.items():
        np.testing.assert_array_equal(checkpoint.read(name), values, err_msg=name)


def test_routed_experts_are_read_only_where_tokens_route(tmp_path, references, monkeypatch):
    """The cache holds every expert dequantized (float32); the trace widens only the experts its tokens route to."""
    monkeypatch.setenv("MTP_PROBE_CACHE", str(tmp_path / "cache"))
    path = write_moe_gguf(tmp_path / "head.gguf", "qwen35moe", gguf.GGMLQuantizationType.Q8_0)
    export(path, tmp_path / "q8.h5", tmp_path / "cache", tokens="17,42")  # 2 tokens x top-2 < 8 experts
    checkpoint = Checkpoint(path)
    impl = head_module(checkpoint.family)
    inputs, stages = load_trace(tmp_path / "q8.h5")
    head, rotary = impl.build_head(checkpoint.config, impl.torch_weights(checkpoint.read_head(widen=False)))
    routed = head.layers[0].mlp.experts.gate_up_proj.experts
    impl.run_batched(head, rotary, inputs)
    used = sorted(set(stages["topk_ids"].ravel().tolist()))
    assert sorted(routed.touched) == used and len(used) < checkpoint.config.num_experts
    assert [tuple(slot.gate_up.shape) for slot in routed._slots] == [(96, 64)] * 2  # two experts widened at a time


@pytest.mark.parametrize("skip, named", [(("ffn_up_exps",), "blk.4.ffn_up_exps.weight"),
                                         (("ffn_down_exps",), "blk.4.ffn_down_exps.weight"),
                                         (("ffn_gate_inp",), "blk.4.ffn_gate_inp.weight")])
def test_a_gguf_missing_an_expert_tensor_exits_2_naming_it(tmp_path, skip, named):
    """Twin: the complete file exports (test_bf16_moe_gguf_exports_bit_for_bit)."""
    path = write_moe_gguf(tmp_path / "missing.gguf", "qwen35moe", gguf.GGMLQuantizationType.F16, skip=skip)
    output = export(path, tmp_path / "x.h5", tmp_path / "cache", expect=2)
    assert named in output and "Traceback" not in output
    assert not (tmp_path / "x.h5").exists()


def test_fused_and_separate_gate_up_experts_together_are_refused(tmp_path):
    """A file with ffn_gate_up_exps beside ffn_gate_exps/ffn_up_exps (the separate file's tensors and metadata plus
    the fused file's ffn_gate_up_exps) is ambiguous: refused, naming the tensor."""
    original = gguf.GGUFReader(write_moe_gguf(tmp_path / "separate.gguf", "qwen35moe", gguf.GGMLQuantizationType.F16))
    fused = gguf.GGUFReader(write_moe_gguf(tmp_path / "fused.gguf", "qwen35moe", gguf.GGMLQuantizationType.F16,
                                           fused=True))
    path = tmp_path / "both.gguf"
    both = gguf.GGUFWriter(path, "qwen35moe")
    for field in original.fields.values():
        if field.name.startswith("qwen35moe."):
            value = field.contents()
            (both.add_array if isinstance(value, list) else both.add_float32 if isinstance(value, float)
             else both.add_uint32)(field.name, value)
    for tensor in [*original.tensors, *(t for t in fused.tensors if t.name.endswith("ffn_gate_up_exps.weight"))]:
        both.add_tensor(tensor.name, np.array(tensor.data), raw_shape=tensor.data.shape, raw_dtype=tensor.tensor_type)
    both.write_header_to_file(), both.write_kv_data_to_file(), both.write_tensors_to_file(), both.close()
    output = export(path, tmp_path / "x.h5", tmp_path / "cache", expect=2)
    assert "blk.4.ffn_gate_up_exps.weight" in output and "ambiguous" in output


@pytest.mark.parametrize("metadata, named", [({"expert_count": 16}, "qwen35moe.expert_count"),
                                             ({"expert_used_count": 9}, "qwen35moe.expert_used_count"),
                                             ({"expert_feed_forward_length": 40},
                                              "qwen35moe.expert_feed_forward_length"),
                                             ({"expert_count": None}, "qwen35moe.expert_count"),
                                             # red team 2: contradictory block metadata was taken silently
                                             ({"nextn_predict_layers": 2}, "qwen35moe.nextn_predict_layers is 2"),
                                             ({"nextn_predict_layers": 0}, "qwen35moe.nextn_predict_layers is 0"),
                                             ({"block_count": 3}, "qwen35moe.block_count is 3")])
def test_wrong_expert_metadata_exits_2_naming_the_key(tmp_path, metadata, named):
    path = write_moe_gguf(tmp_path / "bad.gguf", "qwen35moe", gguf.GGMLQuantizationType.F16, metadata=metadata)
    output = export(path, tmp_path / "x.h5", tmp_path / "cache", expect=2)
    assert named in output and "Traceback" not in output
    # twin: the same file with the right value exports (test_config_from_metadata_equals_config_json)


def test_reading_a_moe_gguf_imports_no_torch(tmp_path):
    """gguf_source is torch-free: opening a MoE GGUF (materializing its cache) loads neither torch nor transformers."""
    import subprocess
    import sys

    path = write_moe_gguf(tmp_path / "head.gguf", "qwen35moe", gguf.GGMLQuantizationType.Q8_0)
    code = ("import sys; from oracle.checkpoint import Checkpoint; c = Checkpoint(sys.argv[1]); c.read_head(); "
            "assert c.source['format'] == 'gguf'; print(sorted({'torch', 'transformers'} & set(sys.modules)))")
    result = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True,
                            env={"MTP_PROBE_CACHE": str(tmp_path / "cache"), "PATH": "/usr/bin:/bin"},
                            cwd=FIXTURES.parent)
    assert result.returncode == 0 and result.stdout.strip() == "[]", result.stderr
