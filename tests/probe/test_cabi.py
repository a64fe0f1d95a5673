"""The C ABI adapter and the candidates in fixtures/candidates: the reference C step matches the oracle, each
compile-time mutant diverges exactly where its mistake is, and every failure of foreign code (error code, crash,
missing symbol, bad build) becomes an AdapterError that says what happened and where."""

import re
import shutil
import subprocess
import sys
from ctypes import c_double, c_int32, c_void_p

import numpy as np
import pytest

from oracle.stages import STAGE_NAMES, TRACE_STAGE_NAMES
from oracle.trace import read_trace
from probe.adapters import cabi, cabi_worker
from probe.adapters.cabi import CAbiAdapter, build_library
from probe.errors import AdapterError
from probe.poison import is_poison
from tests.helpers import ROOT, TINY, TINY_REF, TINY_SHARDED

CANDIDATES = ROOT / "fixtures" / "candidates"
MATCH = 1e-5  # what a correct candidate must reach: 10x inside the probe's default rtol
RTOL, ATOL = 1e-4, 1e-5  # the probe's default rule: a (stage, token) diverges iff rel >= RTOL and abs >= ATOL
FIRST_DIVERGENCE = {  # mutant -> first divergent (stage, token), stages then tokens
    "CONCAT_SWAP": ("fc_in", 0), "W_NORM": ("e", 0), "QGATE_HALVES": ("attn", 0), "NO_GATE": ("attn", 0),
    # At t = 0 attention sees one key (softmax = 1): q, k, their norms and RoPE are invisible until t = 1.
    "NO_QK_NORM": ("attn", 1), "ROPE_ALL_DIMS": ("attn", 1), "ROPE_GPTJ": ("attn", 1),
    "POS_FROZEN": ("attn", 1), "NO_KV_APPEND": ("attn", 1), "NO_ROPE": ("attn", 1),
}
FAKE_SOURCE = r"""
#include <stddef.h>
#include "mtp_probe.h"
static int steps;
static float *volatile nowhere = NULL; /* volatile: the compiler cannot turn the store into a trap (SIGILL) */
int mtp_create(const mtp_config *cfg, const mtp_weights *w, void **ctx) { (void)cfg, (void)w; *ctx = &steps; return 0; }
int mtp_step(void *ctx, int pos, const float *e, const float *h, float *out, const mtp_trace *tr) {
    (void)ctx, (void)pos, (void)e, (void)h, (void)out, (void)tr;
    int t = steps++;
#ifdef CAPACITY_AT
    if (t == CAPACITY_AT) return MTP_ERR_CAPACITY;
#endif
#ifdef CRASH_AT
    if (t == CRASH_AT) *nowhere = 1.0f;
#endif
    return MTP_OK;
}
#ifndef NO_DESTROY
void mtp_destroy(void *ctx) { (void)ctx; }
#endif
"""


def load_reference(path):
    with read_trace(path) as ref:
        return ref.inputs(), {name: ref.stage_rows(name) for name in STAGE_NAMES}


@pytest.fixture(scope="session")
def build(tmp_path_factory):
    """build(source, defines) -> library path, compiled once per (source, define set) per session."""
    out, built = tmp_path_factory.mktemp("cabi"), {}

    def _build(source=CANDIDATES / "mtp_step.c", defines=()):
        if (source, defines) not in built:
            built[source, defines] = build_library(source, out, defines)
        return built[source, defines]

    return _build


@pytest.fixture(scope="session")
def fake_source(tmp_path_factory):
    path = tmp_path_factory.mktemp("fake") / "fake_step.c"
    path.write_text(FAKE_SOURCE)
    return path


@pytest.fixture(scope="session")
def tiny_ref():
    return load_reference(TINY_REF)


@pytest.fixture(scope="session")
def shifted_ref(tmp_path_factory):
    """Other tokens, positions 5..10: absolute positions differ from the fixture's 0..7."""
    from oracle.cli import main  # imports torch: only this fixture's tests pay for it

    path = tmp_path_factory.mktemp("ref") / "shifted.h5"
    main(["export", str(TINY), "--out", str(path), "--tokens", "17,42,3,99,5,260", "--hidden-seed", "0",
          "--start-pos", "5", "-q"], standalone_mode=False)
    return load_reference(path)


def run_mutant(build, tiny_ref, mutant):
    inputs, _ = tiny_ref
    return CAbiAdapter(build(defines=(f"MTP_MUTANT_{mutant}",)), TINY).run(inputs)


def row_errors(actual, expected):
    """Per token row: (max|a-e| / max|e|, max|a-e|, row holds poison)."""
    a, e = actual.astype(np.float64), expected.astype(np.float64)
    abs_err = np.abs(a - e).max(axis=1)
    return abs_err / np.abs(e).max(axis=1), abs_err, is_poison(actual).any(axis=1)


def divergent_cells(result, ref):
    """(stage, token) cells out of tolerance or never written, stages then tokens."""
    cells = []
    for stage in (s for s in STAGE_NAMES if s in result):
        rel, abs_err, poisoned = row_errors(result[stage], ref[stage])
        cells += [(stage, t) for t in range(len(rel)) if poisoned[t] or (rel[t] >= RTOL and abs_err[t] >= ATOL)]
    return cells


def max_rel(result, ref, stages=STAGE_NAMES):
    return {s: float(np.max(row_errors(result[s], ref[s])[0], initial=0.0)) for s in stages}


def assert_matches(result, ref, stages=STAGE_NAMES):
    assert sorted(result) == sorted(stages)
    assert all(not is_poison(result[s]).any() for s in stages)
    worst = max_rel(result, ref, stages)
    assert max(worst.values()) <= MATCH, worst


# ---- the correct candidate ------------------------------------------------------------------------------------


@pytest.mark.parametrize("checkpoint", [TINY, TINY_SHARDED], ids=["single-file", "sharded"])
def test_c_reference_matches_the_oracle_on_every_stage(build, tiny_ref, checkpoint):
    inputs, ref = tiny_ref
    adapter = CAbiAdapter(build(), checkpoint)
    assert (adapter.name, adapter.deterministic) == ("c:mtp_step.so", True)
    assert_matches(adapter.run(inputs), ref)


def test_c_reference_matches_at_other_tokens_and_positions(build, shifted_ref):
    inputs, ref = shifted_ref
    assert inputs.positions.tolist() == [5, 6, 7, 8, 9, 10]
    assert_matches(CAbiAdapter(build(), TINY).run(inputs), ref)


def test_two_runs_are_bit_identical(build, tiny_ref):
    adapter = CAbiAdapter(build(), TINY)
    first, second = adapter.run(tiny_ref[0]), adapter.run(tiny_ref[0])
    assert all(np.array_equal(first[s].view(np.uint32), second[s].view(np.uint32)) for s in STAGE_NAMES)


def test_ctypes_structs_mirror_the_header():
    text = re.sub(r"/\*.*?\*/", "", (CANDIDATES / "mtp_probe.h").read_text(), flags=re.S)
    c_types = {"int32_t": c_int32, "double": c_double, "const float *": c_void_p, "float *": c_void_p}
    mirrors = {"mtp_config": cabi_worker.MtpConfig, "mtp_weights": cabi_worker.MtpWeights,
               "mtp_trace": cabi_worker.MtpTrace}
    for body, name in re.findall(r"typedef struct \{(.*?)\} (\w+);", text, re.S):
        fields = []
        for decl in filter(str.strip, body.split(";")):
            base = re.match(r"\s*((?:const )?\w+)", decl).group(1)
            fields += [(re.findall(r"\w+", d)[-1], c_types[base + (" *" if "*" in d else "")])
                       for d in decl.split(",")]
        assert fields == list(mirrors.pop(name)._fields_), name
    assert not mirrors


# ---- mutants --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mutant", sorted(FIRST_DIVERGENCE))
def test_mutant_diverges_first_where_its_mistake_is(build, tiny_ref, mutant):
    result, ref = run_mutant(build, tiny_ref, mutant), tiny_ref[1]
    cells = divergent_cells(result, ref)
    assert cells[:1] == [FIRST_DIVERGENCE[mutant]]
    if FIRST_DIVERGENCE[mutant][1] == 1:  # the t >= 1 mutants are perfect at t = 0
        assert [c for c in cells if c[1] == 0] == []
        assert max(float(row_errors(result[s][:1], ref[s][:1])[0][0]) for s in STAGE_NAMES) <= MATCH


def test_row0_trace_mutant_leaves_every_later_row_unwritten(build, tiny_ref):
    result, ref = run_mutant(build, tiny_ref, "ROW0_TRACE"), tiny_ref[1]
    for stage in TRACE_STAGE_NAMES:
        assert is_poison(result[stage][1:]).all(), stage
        assert max_rel({stage: result[stage][:1]}, {stage: ref[stage][-1:]}, [stage])[stage] <= MATCH  # last step
    assert_matches({"out": result["out"]}, ref, ["out"])  # `out` is an argument, not a trace row


def test_skip_stage_mh_mutant_never_writes_mh(build, tiny_ref):
    result, ref = run_mutant(build, tiny_ref, "SKIP_STAGE_MH"), tiny_ref[1]
    assert is_poison(result["mh"]).all()
    assert_matches({s: a for s, a in result.items() if s != "mh"}, ref, [s for s in STAGE_NAMES if s != "mh"])


def test_not_captured_mh_is_absent_and_everything_else_matches(build, tiny_ref):
    result = run_mutant(build, tiny_ref, "NOT_CAPTURED_MH")
    assert "mh" not in result
    assert_matches(result, tiny_ref[1], [s for s in STAGE_NAMES if s != "mh"])


def test_pos_plus_one_matches_because_rope_scores_are_relative(build, tiny_ref):
    assert_matches(run_mutant(build, tiny_ref, "POS_PLUS_ONE"), tiny_ref[1])


# ---- failures of foreign code ---------------------------------------------------------------------------------


def test_error_code_names_the_code_and_the_step(build, fake_source, tiny_ref):
    adapter = CAbiAdapter(build(fake_source, ("CAPACITY_AT=2",)), TINY)
    with pytest.raises(AdapterError, match=r"MTP_ERR_CAPACITY.*step 2"):
        adapter.run(tiny_ref[0])


def test_crash_names_the_signal_and_the_step(build, fake_source, tiny_ref):
    adapter = CAbiAdapter(build(fake_source, ("CRASH_AT=1",)), TINY)
    with pytest.raises(AdapterError, match=r"SIGSEGV.*step 1"):
        adapter.run(tiny_ref[0])


def test_missing_symbol_is_named(build, fake_source, tiny_ref):
    adapter = CAbiAdapter(build(fake_source, ("NO_DESTROY",)), TINY)
    with pytest.raises(AdapterError, match=r"mtp_destroy.*C linkage"):
        adapter.run(tiny_ref[0])


def test_library_that_does_not_exist(tmp_path):
    with pytest.raises(AdapterError, match="does not exist"):
        CAbiAdapter(tmp_path / "nope.so", TINY)


def test_file_that_is_not_a_library(tmp_path, tiny_ref):
    (tmp_path / "junk.so").write_text("not an ELF file")
    with pytest.raises(AdapterError, match="cannot load"):
        CAbiAdapter(tmp_path / "junk.so", TINY).run(tiny_ref[0])


def test_build_failure_shows_the_compiler_message_and_command(tmp_path):
    (tmp_path / "broken.c").write_text("int mtp_create(void) { return 0 }\n")
    with pytest.raises(AdapterError, match=r"(?s)building broken\.c failed.*gcc .*broken\.c.*error"):
        build_library(tmp_path / "broken.c", tmp_path)
    assert not list(tmp_path.glob("*.so*"))


def test_build_without_the_compiler_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(cabi.shutil, "which", lambda name: None)
    with pytest.raises(AdapterError, match="gcc is not on PATH"):
        build_library(CANDIDATES / "mtp_step.c", tmp_path)


# ---- CUDA twin, imports ---------------------------------------------------------------------------------------


def has_cuda_device() -> bool:
    """nvidia-smi -L lists a GPU (not torch: the probe's tests must not need it)."""
    if shutil.which("nvidia-smi") is None:
        return False
    return subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode == 0


@pytest.fixture(scope="session")
def cuda_library(build):
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not found")
    return build(CANDIDATES / "mtp_step.cu")


def test_cuda_twin_compiles(cuda_library):
    assert cuda_library.name == "mtp_step_cuda.so" and cuda_library.stat().st_size > 0


@pytest.mark.gpu
def test_cuda_twin_matches_the_oracle(cuda_library, tiny_ref):
    if not has_cuda_device():
        pytest.skip("no CUDA device")
    assert_matches(CAbiAdapter(cuda_library, TINY).run(tiny_ref[0]), tiny_ref[1])


def test_adapter_imports_neither_torch_nor_transformers():
    code = "import probe.adapters.cabi, sys; print('torch' in sys.modules, 'transformers' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["False", "False"]
