"""llama.cpp's own draft loop (issue 24): `mtp-probe run REF --impl llama.cpp:MODEL.gguf` against a reference
exported with `--chain 3` drives llama.cpp's MTP context in the engine's order (bridge i, its chain, bridge i+1),
the probe saying only token and position; the hidden each depth gets is the engine's own
(llama_get_embeddings_nextn_ith, as common/speculative.cpp's MTP driver recycles it) and the chain's KV is removed
with llama_memory_seq_rm, as the server does after drafting.

qwen35 (dense) and qwen35moe pass at every depth and stage, the draft included. Twins, driver loop bugs
(llama_cpp_worker.LOOP_MUTANTS): a chain position one too far diverges at attn of depth 2, recycling H_i or the
pre-norm residual at h of depth 2; a kept chain KV or a frozen chain position is refused by llama.cpp itself (its
M-RoPE batch check wants every new position past the cache's last: exit 2 with llama.cpp's own words). A build
that cannot hand the hidden on runs depth 1 only: inconclusive, never a pass.

Skips, with the reason, where llama-cpp-python is not installed or has no MTP API.
"""

import json
import subprocess
import sys

import h5py
import numpy as np
import pytest

from oracle.checkpoint import Checkpoint
from oracle.gguf_writer import head_gguf_tensors, write_gguf
from probe.adapters.llama_cpp import LlamaCppAdapter, llama_cpp_available
from probe.errors import CandidateError
from probe.run import run_and_diff
from probe.tolerance import tol_table

from tests.helpers import FIXTURES

REASON = llama_cpp_available()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"llama.cpp cannot run here: {REASON}")
TOKENS = "17,42,3,255,100,7,511,64,9,300,1,77"


def cli(program, *args):
    code = f"from {program}.cli import main; main()"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True)


@pytest.fixture(scope="module", params=["qwen3_5_tiny", "qwen3_5_moe_tiny"])
def case(request, tmp_path_factory):
    """(fixture name, a reference exported with --chain 3, the fixture's GGUF, a folder)."""
    tmp = tmp_path_factory.mktemp(request.param)
    ref = tmp / "ref.h5"
    done = cli("oracle", "export", str(FIXTURES / request.param), "--out", str(ref), "--tokens", TOKENS,
               "--hidden-seed", "3", "--chain", "3", "-q")
    assert done.returncode == 0, done.stderr
    ckpt = Checkpoint(FIXTURES / request.param)
    write_gguf(tmp / "head.gguf", ckpt, head_gguf_tensors(ckpt))
    return request.param, ref, tmp / "head.gguf", tmp


def test_llama_cpp_passes_at_every_depth_and_stage(case):
    name, ref, gguf, tmp = case
    done = cli("probe", "run", str(ref), "--impl", f"llama.cpp:{gguf}", "--json", str(tmp / "ok.json"), "-q")
    assert done.returncode == 0, done.stdout + done.stderr
    stages = 17 if "moe" in name else 12  # the spine, the draft, and the MoE stages
    assert done.stdout.strip().splitlines()[-1].startswith(
        f"PASSED | {stages} stages x 12 tokens within tolerance at depths 1-3"), done.stdout
    report = json.loads((tmp / "ok.json").read_text())
    assert report["verdict"] == "pass"


def _diff(ref, gguf, mutant):
    return run_and_diff(ref, LlamaCppAdapter(str(gguf), mutant=mutant), tol_table()).report


@pytest.mark.parametrize("mutant, stage", [
    ("chain_position_skips", "attn"),  # depth j at p_i + j: RoPE sees the wrong distance
    ("recycle_main", "h"),  # H_i at every depth
    ("recycle_prenorm", "h"),  # depth 1's mtp_post_ffn (res2) handed on
])
def test_a_driver_loop_bug_diverges_at_depth_two(case, mutant, stage):
    _, ref, gguf, _ = case
    report = _diff(ref, gguf, mutant)
    assert report.verdict.name == "diverged"
    depth, cell = report.first_at
    assert (depth, cell.stage, cell.token) == (2, stage, 0), (depth, cell.stage, cell.token)


@pytest.mark.parametrize("mutant, where", [
    ("chain_kv_kept", "at depth 1 of bridge 1"),  # bridge 1 at p_1 after bridge 0's chain left p_1, p_2 behind
    ("chain_position_frozen", "at depth 2 of bridge 0"),  # depth 2 at p_0, where bridge 0 already is
])
def test_llama_cpp_refuses_kept_chain_kv_and_a_frozen_position_itself(case, mutant, where):
    _, ref, gguf, _ = case
    with pytest.raises(CandidateError) as raised:
        _diff(ref, gguf, mutant)
    said = str(raised.value)
    assert where in said and "inconsistent sequence positions" in said and "X < Y" in said, said


def test_a_build_that_cannot_hand_the_hidden_on_is_inconclusive(case, tmp_path):
    """Twin of the pass above: the same GGUF and reference, the chain not run (as with a libllama that exports no
    llama_get_embeddings_nextn_ith): depth 1 passes, the loop is not checked."""
    _, ref, gguf, _ = case
    adapter = LlamaCppAdapter(str(gguf), mutant="no_nextn_api")
    report = run_and_diff(ref, adapter, tol_table()).report
    assert report.verdict.name == "inconclusive"
    assert any("the draft loop was not checked" in r for r in report.verdict.reasons), report.verdict.reasons
    assert report.chain.not_captured == (2, 3) and report.chain.bridge_verdict.name == "pass"
    assert "nextn API" in adapter.chain_skipped


def test_out_writes_every_depth_llama_cpp_ran_and_diff_passes_it_again(case):
    _, ref, gguf, tmp = case
    out = tmp / "cand.h5"
    done = cli("probe", "run", str(ref), "--impl", f"llama.cpp:{gguf}", "--out", str(out), "-q")
    assert done.returncode == 0 and f"candidate trace written to {out}" in done.stdout, done.stdout + done.stderr
    with h5py.File(out) as f:
        assert sorted(f["chain"]) == ["d2", "d3"] and "draft" in f["chain/d3/stages"]
        with h5py.File(ref) as r:  # the engine's own drafts, as the reference's at every depth
            assert np.array_equal(f["chain/d2/stages/draft"][()], r["chain/d2/stages/draft"][()])
    again = cli("probe", "diff", str(ref), str(out), "-q")
    assert again.returncode == 0, again.stdout + again.stderr
