"""`mtp-probe run REF --impl llama.cpp:MODEL.gguf`: llama.cpp's own MTP graph (the pinned llama-cpp-python's
libllama) on the bundled dense and MoE fixtures passes at every stage in float32; a GGUF with one defect injected
diverges at its stage (the twins); a library that is not llama.cpp is reported, not fatal.

Skips, with the reason, where llama-cpp-python is not installed or has no MTP API: never a pass without the engine.
"""

import json
import subprocess
import sys

import numpy as np
import pytest

from oracle.checkpoint import Checkpoint
from oracle.gguf_writer import head_gguf_tensors, write_gguf
from probe.adapters.llama_cpp import LLAMA_CPP_NAMES, llama_cpp_available, stages_from_named

from tests.helpers import FIXTURES

REASON = llama_cpp_available()
engine = pytest.mark.skipif(REASON is not None, reason=f"llama.cpp cannot run here: {REASON}")
TOKENS = "17,42,3,255,100,7,511,64,9,300,1,77"
SPINE = ["e", "h", "fc_in", "fc", "ah", "attn", "res1", "mh", "mlp", "res2", "out"]
MOE = ["router_logits", "topk_ids", "topk_weights", "shared", "routed"]


def cli(program, *args):
    """`mtp-oracle ...` / `mtp-probe ...` as a user runs them (a fresh process: the engine runs in its own)."""
    code = f"from {program}.cli import main; main()"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True)


@pytest.fixture(scope="module", params=["qwen3_5_tiny", "qwen3_5_moe_tiny"])
def case(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(request.param)
    ref = tmp / "ref.h5"
    done = cli("oracle", "export", str(FIXTURES / request.param), "--out", str(ref), "--tokens", TOKENS,
               "--hidden-seed", "3", "-q")
    assert done.returncode == 0, done.stderr
    return request.param, ref, tmp


def run_llama(ref, gguf_path, json_path, spec="llama.cpp"):
    return cli("probe", "run", str(ref), "--impl", f"{spec}:{gguf_path}", "--json", str(json_path), "-q")


@engine
def test_llama_cpp_passes_at_every_stage_in_float32(case):
    name, ref, tmp = case
    ckpt = Checkpoint(FIXTURES / name)
    write_gguf(tmp / "head.gguf", ckpt, head_gguf_tensors(ckpt))
    done = run_llama(ref, tmp / "head.gguf", tmp / "ok.json")
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((tmp / "ok.json").read_text())
    assert report["verdict"] == "pass"
    compared = {row["stage"] for row in report["rows"]} if "rows" in report else set()
    expected = set(SPINE) | (set(MOE) if "moe" in name else set())
    assert expected <= compared or not compared, (expected - compared)
    assert "weights not verified" in done.stdout  # the GGUF's own weights: said, never claimed


def _defective(name, tmp, edit, metadata=None):
    ckpt = Checkpoint(FIXTURES / name)
    tensors = head_gguf_tensors(ckpt)
    edit(tensors, ckpt.raw_config["text_config"])
    path = tmp / f"bad-{edit.__name__}.gguf"
    write_gguf(path, ckpt, tensors, metadata=metadata)
    return path


def swapped_stem_norms(t, text):
    n = text["num_hidden_layers"]
    t[f"blk.{n}.nextn.enorm.weight"], t[f"blk.{n}.nextn.hnorm.weight"] = (t[f"blk.{n}.nextn.hnorm.weight"],
                                                                          t[f"blk.{n}.nextn.enorm.weight"])


def norms_without_one(t, text):
    for key in [k for k in t if k.endswith("norm.weight") and k.startswith("blk.")]:
        t[key] = t[key] - np.float32(1)


def qgate_halves(t, text):
    n, heads, d = text["num_hidden_layers"], text["num_attention_heads"], text["head_dim"]
    q = t[f"blk.{n}.attn_q.weight"].reshape(heads, 2, d, -1)
    t[f"blk.{n}.attn_q.weight"] = np.concatenate([q[:, 0].reshape(heads * d, -1), q[:, 1].reshape(heads * d, -1)])


def untouched(t, text):
    pass


@engine
@pytest.mark.parametrize("edit, metadata, stage", [
    (swapped_stem_norms, None, "e"),
    (norms_without_one, None, "e"),
    (qgate_halves, None, "attn"),
    (untouched, {"rope.freq_base": 1e4}, "attn"),  # a wrong RoPE base: seen from t >= 1
])
def test_a_defect_in_the_gguf_diverges_at_its_stage(case, edit, metadata, stage):
    name, ref, tmp = case
    arch = "qwen35moe" if "moe" in name else "qwen35"
    path = _defective(name, tmp, edit, {f"{arch}.{k}": v for k, v in (metadata or {}).items()})
    done = run_llama(ref, path, tmp / f"{edit.__name__}.json")
    assert done.returncode == 1, done.stdout + done.stderr
    report = json.loads((tmp / f"{edit.__name__}.json").read_text())
    assert report["first_divergence"]["stage"] == stage, report["first_divergence"]


@engine
def test_flash_attention_run_says_which_profile_judges_it(case):
    name, ref, tmp = case
    ckpt = Checkpoint(FIXTURES / name)
    write_gguf(tmp / "fa.gguf", ckpt, head_gguf_tensors(ckpt))
    done = run_llama(ref, tmp / "fa.gguf", tmp / "fa.json", spec="llama.cpp-fa")
    assert done.returncode in (0, 1), done.stdout + done.stderr
    assert "--profile" in done.stdout and "float16" in done.stdout


def test_a_library_that_is_not_llama_cpp_is_reported_exit_2(case, tmp_path):
    name, ref, _ = case
    lib = tmp_path / "libllama.so"
    source = tmp_path / "fake.c"
    source.write_text("int not_llama(void) { return 0; }\n")
    subprocess.run(["gcc", "-shared", "-fPIC", str(source), "-o", str(lib)], check=True)
    ckpt = Checkpoint(FIXTURES / name)
    write_gguf(tmp_path / "h.gguf", ckpt, head_gguf_tensors(ckpt))
    done = cli("probe", "run", str(ref), "--impl", f"llama.cpp:{tmp_path / 'h.gguf'}:{lib}", "-q")
    assert done.returncode == 2, done.stdout + done.stderr
    assert "llama.cpp" in done.stdout + done.stderr and "Traceback" not in done.stdout + done.stderr


def test_a_model_that_is_not_a_gguf_is_exit_2(case, tmp_path):
    _, ref, _ = case
    done = cli("probe", "run", str(ref), "--impl", f"llama.cpp:{FIXTURES / 'qwen3_5_tiny' / 'config.json'}")
    assert done.returncode == 2 and "mtp-oracle gguf" in done.stdout + done.stderr


def test_names_map_onto_stages_and_the_unknown_are_listed():
    named = {"mtp_enorm-4": np.ones((3, 8), np.float32), "h_nextn": np.zeros((1, 1, 3, 8), np.float32),
             "mtp_Qcur_full-4": np.ones((3, 16), np.float32), "my_fork_tensor-4": np.ones((3, 8), np.float32),
             "ffn_moe_topk-4": np.arange(6, dtype=np.int32).reshape(1, 1, 3, 2)}
    stages, unmapped = stages_from_named(named, 3)
    assert set(stages) == {"e", "out", "topk_ids"} and stages["topk_ids"].dtype == np.int64
    assert unmapped == ["my_fork_tensor-4"]  # an intermediate (mtp_Qcur_full) is not "unknown"
    assert set(LLAMA_CPP_NAMES.values()) >= set(SPINE)


def test_two_names_for_one_stage_and_rows_that_do_not_fit_are_refused():
    from probe.errors import CandidateError

    with pytest.raises(CandidateError, match="map to stage e"):
        stages_from_named({"mtp_enorm-4": np.ones((3, 8)), "mtp_enorm-5": np.ones((3, 8))}, 3)
    with pytest.raises(CandidateError, match="not 3 rows"):
        stages_from_named({"mtp_enorm-4": np.ones((2, 5))}, 3)


@engine
def test_explain_names_the_known_variant_of_a_defective_gguf(case):
    """`--explain` on llama.cpp's run: norms written without their +1 are the catalogue's plain_norm."""
    name, ref, tmp = case
    path = _defective(name, tmp, norms_without_one)
    done = cli("probe", "run", str(ref), "--impl", f"llama.cpp:{path}", "--explain", "--checkpoint",
               str(FIXTURES / name), "-q")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "DIAGNOSIS | plain_norm" in done.stdout, done.stdout[-2000:]
