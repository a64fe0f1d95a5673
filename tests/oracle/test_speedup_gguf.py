"""The speed model on a GGUF head counts each tensor's bytes by its GGUF quant type, not the float32 cache the oracle
computes with: checked against a hand computation (values x bytes per value of each ggml type, written out here
and matched against the file's own tensor sizes) on heads written by `mtp-oracle gguf --outtype f32|bf16|q8_0` and
on one with mixed types (gate and up experts in different types included), through `accept --bandwidth` too."""

import json

import numpy as np
import pytest

from oracle import gguf_writer
from oracle.checkpoint import Checkpoint
from oracle.cli import cli
from oracle.errors import CheckpointError
from oracle.speedup import head_draft_terms, main_weight_bytes, stored_nbytes
from tests.helpers import FIXTURES, run_cli

gguf = pytest.importorskip("gguf")
MOE = FIXTURES / "qwen3_5_moe_tiny"  # MTP layer: attention, router, shared expert, 8 routed experts (top 2)
# bytes per value of each ggml type: F32/F16/BF16 plain; Q8_0 32 int8 + an f16 scale; Q4_0 32 nibbles + an f16
# scale; Q5_0 32 nibbles + 4 bytes of high bits + an f16 scale
BYTES_PER_VALUE = {"F32": 4, "F16": 2, "BF16": 2, "Q8_0": 34 / 32, "Q4_0": 18 / 32, "Q5_0": 22 / 32}
EXPERT_STACKS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MTP_PROBE_CACHE", str(tmp_path / "cache"))


def written(tmp_path, outtype: str):
    out = tmp_path / f"head_{outtype}.gguf"
    r = run_cli(cli, ["gguf", MOE, "--out", out, "--outtype", outtype, "-q"])
    assert r.exit_code == 0, r.output
    return out


MIXED = {"attn_q": "Q4_0", "attn_k": "Q5_0", "nextn.eh_proj": "Q4_0", "ffn_gate_exps": "Q8_0", "ffn_up_exps": "BF16",
         "ffn_down_exps": "F16", "output": "Q8_0", "token_embd": "BF16", "ffn_gate_inp": "F16"}


def written_mixed(tmp_path, monkeypatch, extra: dict | None = None):
    """The head with the types of MIXED by tensor (others f32), and `extra` tensors (name -> (type, shape): main
    blocks) beside it."""
    plain = gguf_writer._encoded
    by_name = {name: qtype for name, (qtype, _) in (extra or {}).items()}

    def encoded(module, name, values, outtype):
        short = name.split(".", 2)[-1] if name.startswith("blk.") else name
        qtype = by_name.get(name) or MIXED.get(short.removesuffix(".weight"))
        if qtype is None or np.ndim(values) == 1:
            return plain(module, name, values, "f32")
        values = np.ascontiguousarray(values, dtype=np.float32)
        if qtype == "F16":
            return values.astype(np.float16), {}
        kind = module.GGMLQuantizationType[qtype]
        return module.quants.quantize(values, kind), {"raw_dtype": kind}

    monkeypatch.setattr(gguf_writer, "_encoded", encoded)
    ckpt = Checkpoint(MOE)
    tensors = gguf_writer.head_gguf_tensors(ckpt)
    rng = np.random.default_rng(0)
    tensors |= {name: rng.standard_normal(shape).astype(np.float32) for name, (_, shape) in (extra or {}).items()}
    out = tmp_path / "mixed.gguf"
    gguf_writer.write_gguf(out, ckpt, tensors, "f32")
    return out


def hand_bytes(path) -> dict[str, float]:
    """Every tensor of the GGUF file: its values x the bytes per value of its type (and the file agrees)."""
    out = {}
    for t in gguf.GGUFReader(path).tensors:
        out[t.name] = int(t.n_elements) * BYTES_PER_VALUE[t.tensor_type.name]
        assert out[t.name] == int(t.n_bytes), t.name  # the hand table is the file's own layout
    return out


def hand_draft_step(path, context: int) -> dict[str, float]:
    """The draft step by hand from the file: the MTP block (blk.4.*) but its routed experts, top_k=2 of the 8
    routed experts, output.weight, one token_embd row, and the head's K/V (2 KV heads x 32, bf16) at `context`."""
    sizes = hand_bytes(path)
    block = {n: b for n, b in sizes.items() if n.startswith("blk.4.")}
    routed = sum(b for n, b in block.items() if n.split(".")[2] in EXPERT_STACKS)
    return {"head layer (dense tensors)": sum(block.values()) - routed,
            "head routed experts (top_k=2)": 2 * routed / 8,
            "draft lm_head (V x D)": sizes["output.weight"],
            "embedding row": sizes["token_embd.weight"] / 512,
            f"head KV cache at {context} tokens": 2 * 2 * 32 * context * 2}


def gguf_types(path) -> set[str]:
    return {t.tensor_type.name for t in gguf.GGUFReader(path).tensors}


@pytest.mark.parametrize("outtype, types", [("f32", {"F32"}), ("bf16", {"BF16", "F32"}),
                                            ("q8_0", {"Q8_0", "F16", "F32"})])
def test_draft_step_bytes_are_the_gguf_quant_types(tmp_path, outtype, types):
    """q8_0 is itself mixed: the rows of 48 (experts' down) and 40 (shared expert's down) are no whole Q8_0
    block, so the writer falls back to F16 for them, as llama.cpp's converter does; norms stay F32."""
    path = written(tmp_path, outtype)
    assert gguf_types(path) == types
    terms = head_draft_terms(Checkpoint(path), "lm_head.weight", context=10).bytes
    assert terms == pytest.approx(hand_draft_step(path, 10), rel=1e-12)
    if outtype != "f32":  # what counting the float32 cache would have said instead
        cache_bytes = sum(Checkpoint(path).entry(n).nbytes for n in Checkpoint(path).names() if n.startswith("mtp."))
        assert terms["head layer (dense tensors)"] + terms["head routed experts (top_k=2)"] * 4 < cache_bytes


def test_mixed_types_and_gate_up_experts_of_two_types(tmp_path, monkeypatch):
    path = written_mixed(tmp_path, monkeypatch)
    assert gguf_types(path) >= {"Q4_0", "Q5_0", "Q8_0", "BF16", "F16", "F32"}
    ckpt = Checkpoint(path)
    assert ckpt.source["quant_types"]["mtp.layers.0.mlp.experts.gate_up_proj"] == "BF16+Q8_0"  # half of each
    terms = head_draft_terms(ckpt, "lm_head.weight", context=7).bytes
    assert terms == pytest.approx(hand_draft_step(path, 7), rel=1e-12)
    # the fused gate_up_proj [8, 96, 64]: the gate half Q8_0, the up half BF16
    assert stored_nbytes(ckpt)("mtp.layers.0.mlp.experts.gate_up_proj") == 8 * 48 * 64 * (34 / 32 + 2)


def test_main_blocks_in_the_gguf_set_the_main_weights_bytes(tmp_path, monkeypatch):
    """A GGUF that holds main blocks (blk.0..3; the head is blk.4): main weights at their stored bytes per value;
    one without: the output tensor's type, and the note says so."""
    extra = {"blk.0.attn_qkv.weight": ("Q4_0", (96, 64)), "blk.1.ffn_up.weight": ("Q8_0", (128, 64)),
             "blk.3.attn_norm.weight": ("F32", (64,))}  # a norm: not a matrix, not counted
    weight, lm, note = main_weight_bytes(Checkpoint(written(tmp_path, "bf16")))
    assert weight == lm == 2 and "holds no main blocks" in note
    path = written_mixed(tmp_path, monkeypatch, extra)
    weight, lm, note = main_weight_bytes(Checkpoint(path))
    assert weight == pytest.approx((96 * 64 * 18 / 32 + 128 * 64 * 34 / 32) / (96 * 64 + 128 * 64))
    assert lm == 34 / 32 and "the GGUF's main blocks" in note  # output.weight is Q8_0


def test_accept_on_a_gguf_reports_its_bytes_by_quant_type(tmp_path):
    path = written(tmp_path, "q8_0")
    out = tmp_path / "acc.json"
    r = run_cli(cli, ["accept", path, "--tokens", ",".join(str(i) for i in range(3, 43)), "--hidden-seed", "0",
                      "--k", "2", "--bandwidth", "1TB/s", "--json", out, "-q"],)
    assert r.exit_code == 0, r.output
    speed = json.loads(out.read_text())["speed"]
    assert speed["draft_step"]["bytes"] == pytest.approx(hand_draft_step(path, 40), rel=1e-12)
    assert speed["verify_step"]["1"]["bytes"]["main lm_head"] == pytest.approx(hand_bytes(path)["output.weight"])
    assert any("by their quant types (Q8_0 x" in n for n in speed["notes"])
    assert any("holds no main blocks" in n for n in speed["notes"]) and "holds no main blocks" in r.stdout


def test_a_cache_record_without_a_tensors_type_is_refused(tmp_path):
    """A damaged record (a type missing) is named, not guessed as float32."""
    ckpt = Checkpoint(written(tmp_path, "q8_0"))
    record = ckpt.path / "gguf_source.json"
    data = json.loads(record.read_text())
    del data["quant_types"]["mtp.fc.weight"]
    record.write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match="names no quant type for mtp.fc.weight"):
        head_draft_terms(Checkpoint(ckpt.path), "lm_head.weight", context=1)
