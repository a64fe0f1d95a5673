"""C ABI v2 (fixtures/candidates/mtp_probe_v2.h): weights and stages as named tables, for any family.

The v2 candidate (mtp_step_v2.c, mtp_step.c's math behind the tables) passes on the bundled reference, bit for bit
as v1 does, and its mutants diverge where their mistakes are; a recording library shows what a v2 library is handed
(every head tensor under its checkpoint name, stored bf16 bytes, never widened; the family's stage table with
int64 index sets for a MoE head; the config entries with the reference's conventions); and every failure of
foreign code (unknown capture names, NULL from mtp2_create, error codes, crashes, exit mid-run, a v1 library on a
head v1 cannot describe) is an AdapterError that says what happened and where."""

import json
import re
import subprocess
from ctypes import POINTER, c_char_p, c_double, c_int32, c_int64, c_void_p

import numpy as np
import pytest

from oracle.checkpoint import Checkpoint
from oracle.stages import STAGE_NAMES
from oracle.trace import TraceInputs, read_trace
from probe.adapters import cabi_v2
from probe.adapters.cabi import CAbiAdapter, build_library
from probe.cli import cli
from probe.errors import AdapterError
from probe.poison import is_poison
from tests.helpers import FIXTURES, ROOT, TINY, TINY_REF, run_cli

CANDIDATES = ROOT / "fixtures" / "candidates"
MOE = FIXTURES / "qwen3_5_moe_tiny"
MATCH = 1e-5  # what a correct candidate must reach: 10x inside the probe's default rtol
RTOL, ATOL = 1e-4, 1e-5  # the probe's default rule
FIRST_DIVERGENCE = {  # mutant -> first divergent (stage, token), as under v1 (tests/probe/test_cabi.py)
    "CONCAT_SWAP": ("fc_in", 0), "W_NORM": ("e", 0), "QGATE_HALVES": ("attn", 0), "NO_GATE": ("attn", 0),
    "NO_QK_NORM": ("attn", 1), "ROPE_ALL_DIMS": ("attn", 1), "ROPE_GPTJ": ("attn", 1),
    "POS_FROZEN": ("attn", 1), "NO_KV_APPEND": ("attn", 1),
}

# A v2 library that records what it is handed into $MTP2_RECORD (one JSON object per line) and writes recognisable
# values: every float row element of step t = t + 0.5, index-set row = 0, 1, ..., k-1, out = -t.
RECORDER_SOURCE = r"""
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "mtp_probe_v2.h"
static int steps;
static float *volatile nowhere = NULL; /* volatile: the compiler cannot turn the store into a trap */
static FILE *rec(void) { return fopen(getenv("MTP2_RECORD") ? getenv("MTP2_RECORD") : "/dev/null", "a"); }
static size_t itemsize(int dtype) { return dtype == MTP2_F32 ? 4 : dtype == MTP2_I64 ? 8 : dtype >= 4 ? 1 : 2; }
static unsigned long long fnv1a(const unsigned char *p, size_t n) {
    unsigned long long h = 1469598103934665603ULL;
    for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 1099511628211ULL;
    return h;
}
#ifndef NO_VERSION
int mtp2_abi_version(void) { return VERSION; }
#endif
#ifdef CAPTURE
const char *mtp2_capture(void) { return CAPTURE; }
#endif
void *mtp2_create(const mtp2_config *cfg, const mtp2_tensor *w, int n, char *err, size_t err_len) {
#ifdef REFUSE
    snprintf(err, err_len, "no thanks: %s", cfg->family);
    return NULL;
#endif
    FILE *f = rec();
    fprintf(f, "{\"family\": \"%s\", \"abi\": %d, \"json\": %s, \"entries\": {", cfg->family, cfg->abi_version,
            cfg->json);
    for (int i = 0; i < cfg->n_entries; i++) {
        const mtp2_config_entry *e = &cfg->entries[i];
        if (e->type == MTP2_INT) fprintf(f, "%s\"%s\": [%lld, %.17g]", i ? ", " : "", e->key, (long long)e->i, e->d);
        else fprintf(f, "%s\"%s\": %.17g", i ? ", " : "", e->key, e->d);
    }
    fprintf(f, "}, \"tensors\": [");
    for (int i = 0; i < n; i++) {
        size_t count = 1;
        fprintf(f, "%s{\"name\": \"%s\", \"dtype\": %d, \"shape\": [", i ? ", " : "", w[i].name, w[i].dtype);
        for (int d = 0; d < w[i].ndim; d++) fprintf(f, "%s%lld", d ? ", " : "", (long long)w[i].shape[d]),
                                            count *= (size_t)w[i].shape[d];
        fprintf(f, "], \"fnv\": \"%016llx\", \"aligned\": %d}", fnv1a(w[i].data, count * itemsize(w[i].dtype)),
                (int)((size_t)w[i].data % itemsize(w[i].dtype) == 0));
    }
    fprintf(f, "]}\n");
    fclose(f);
    return &steps;
}
int mtp2_step(void *ctx, int64_t pos, const float *embed, const float *hidden, float *out, const mtp2_stage *st,
              int n) {
    (void)ctx, (void)pos, (void)embed, (void)hidden;
    int t = steps++;
#ifdef CRASH_AT
    if (t == CRASH_AT) *nowhere = 1.0f;
#endif
#ifdef EXIT_AT
    if (t == EXIT_AT) exit(0);
#endif
#ifdef STAGE_ERROR_AT
    if (t == STAGE_ERROR_AT) return MTP2_ERR_STAGE;
#endif
    if (t == 0) {
        FILE *f = rec();
        fprintf(f, "{\"stages\": [");
        for (int i = 0; i < n; i++)
            fprintf(f, "%s[\"%s\", %d, %d]", i ? ", " : "", st[i].name, st[i].dtype, st[i].width);
        fprintf(f, "]}\n");
        fclose(f);
    }
    for (int i = 0; i < n; i++)
        for (int j = 0; j < st[i].width; j++) {
            if (st[i].dtype == MTP2_I64) ((int64_t *)st[i].data)[j] = j;
            else ((float *)st[i].data)[j] = (float)t + 0.5f;
        }
    out[0] = (float)-t;
    for (int64_t j = 1; j < 64; j++) out[j] = 0.0f;
    return MTP2_OK;
}
const char *mtp2_last_error(void *ctx) { (void)ctx; return "stage 'fc' is not wired in this build"; }
#ifndef NO_DESTROY
void mtp2_destroy(void *ctx) { (void)ctx; }
#endif
"""


def load_reference(path):
    with read_trace(path) as ref:
        return ref.inputs(), {name: ref.stage_rows(name) for name in STAGE_NAMES}


@pytest.fixture(scope="session")
def build(tmp_path_factory):
    """build(source, defines) -> library path, compiled once per (source, define set) per session."""
    out, built = tmp_path_factory.mktemp("cabi2"), {}

    def _build(source=CANDIDATES / "mtp_step_v2.c", defines=()):
        if (source, defines) not in built:
            built[source, defines] = build_library(source, out, defines)
        return built[source, defines]

    return _build


@pytest.fixture(scope="session")
def recorder_source(tmp_path_factory):
    source = tmp_path_factory.mktemp("recorder") / "recorder_v2.c"
    source.write_text(RECORDER_SOURCE)
    return source


@pytest.fixture(scope="session")
def recorder(recorder_source, build):
    """recorder(*defines) -> the recording library built with VERSION=2 and `defines`."""
    return lambda *defines: build(recorder_source, ("VERSION=2", *defines))


@pytest.fixture
def record(tmp_path, monkeypatch):
    """Where the recorder writes (the worker inherits the environment); record() -> its JSON lines."""
    path = tmp_path / "record.jsonl"
    monkeypatch.setenv("MTP2_RECORD", str(path))
    return lambda: [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="session")
def tiny_ref():
    return load_reference(TINY_REF)


def moe_inputs(num_tokens=3) -> TraceInputs:
    ckpt = Checkpoint(MOE)
    ids = np.array([5, 17, 3][:num_tokens], dtype=np.int64)
    hidden = np.random.default_rng(0).standard_normal((num_tokens, ckpt.config.hidden_size), dtype=np.float32)
    return TraceInputs(ids, np.arange(num_tokens, dtype=np.int64), hidden, ckpt.embedding_rows(ids))


def divergent_cells(result, ref):
    """(stage, token) cells out of tolerance or never written, stages then tokens."""
    cells = []
    for stage in (s for s in STAGE_NAMES if s in result):
        a, e = result[stage].astype(np.float64), ref[stage].astype(np.float64)
        abs_err = np.abs(a - e).max(axis=1)
        rel, poisoned = abs_err / np.abs(e).max(axis=1), is_poison(result[stage]).any(axis=1)
        cells += [(stage, t) for t in range(len(rel)) if poisoned[t] or (rel[t] >= RTOL and abs_err[t] >= ATOL)]
    return cells


def fnv1a(data: bytes) -> str:
    h = 1469598103934665603
    for byte in data:
        h = ((h ^ byte) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    return f"{h:016x}"


# ---- the v2 candidate -----------------------------------------------------------------------------------------


def test_v2_candidate_passes_on_the_bundled_reference(build):
    result = run_cli(cli, ["run", TINY_REF, "--impl", f"c:{build()}", "--checkpoint", TINY])
    assert result.exit_code == 0, result.output
    assert result.output.strip().splitlines()[-1].startswith("PASSED | 11 stages x 8 tokens within tolerance")


def test_v2_candidate_is_bit_identical_to_the_v1_candidate(build, tiny_ref):
    """Same math, weights read as stored bf16 (v2) or widened by the probe (v1): widening bf16 is exact."""
    v2 = CAbiAdapter(build(), TINY).run(tiny_ref[0])
    v1 = CAbiAdapter(build(CANDIDATES / "mtp_step.c"), TINY).run(tiny_ref[0])
    assert list(v2) == list(v1) == list(STAGE_NAMES)
    assert all(np.array_equal(v2[s].view(np.uint32), v1[s].view(np.uint32)) for s in STAGE_NAMES)


def test_twin_a_v2_mutant_is_diverged_at_its_stage(build):
    result = run_cli(cli, ["run", TINY_REF, "--impl", f"c:{build(defines=('MTP_MUTANT_CONCAT_SWAP',))}",
                           "--checkpoint", TINY])
    assert result.exit_code == 1, result.output
    assert result.output.strip().splitlines()[-1].startswith("DIVERGED | first divergent stage: fc_in at token 0")


@pytest.mark.parametrize("mutant", sorted(FIRST_DIVERGENCE))
def test_v2_mutant_diverges_first_where_its_mistake_is(build, tiny_ref, mutant):
    inputs, ref = tiny_ref
    result = CAbiAdapter(build(defines=(f"MTP_MUTANT_{mutant}",)), TINY).run(inputs)
    assert divergent_cells(result, ref)[:1] == [FIRST_DIVERGENCE[mutant]]


def test_v2_capture_mutants_not_captured_and_row0(build, tiny_ref):
    inputs, ref = tiny_ref
    no_mh = CAbiAdapter(build(defines=("MTP_MUTANT_NOT_CAPTURED_MH",)), TINY).run(inputs)
    assert "mh" not in no_mh and divergent_cells(no_mh, ref) == []
    row0 = CAbiAdapter(build(defines=("MTP_MUTANT_ROW0_TRACE",)), TINY).run(inputs)
    assert is_poison(row0["attn"][1:]).all() and not is_poison(row0["out"]).any()


def test_v2_candidate_compiles_warning_free(tmp_path):
    for source in ("mtp_step_v2.c", "mtp_step.c"):
        cmd = ["gcc", "-std=c11", "-O2", "-Wall", "-Wextra", "-Werror", "-pedantic", "-shared", "-fPIC",
               f"-I{CANDIDATES}", str(CANDIDATES / source), "-o", str(tmp_path / "x.so"), "-lm"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr


def test_v2_candidate_refuses_another_family_with_its_own_reason(build):
    with pytest.raises(AdapterError, match=r"mtp2_create returned NULL .*qwen3_5_moe.*dense qwen3_5 head, not "
                                           r"qwen3_5_moe"):
        CAbiAdapter(build(), MOE).run(moe_inputs())


# ---- what a v2 library is handed ------------------------------------------------------------------------------


def test_weights_arrive_as_stored_bf16_under_their_checkpoint_names(recorder, record, tiny_ref):
    CAbiAdapter(recorder(), TINY).run(tiny_ref[0])
    created, step0 = record()
    ckpt = Checkpoint(TINY)
    stored = ckpt.read_head(widen=False, digest=False)
    assert [t["name"] for t in created["tensors"]] == sorted(stored.tensors)  # all 15, by checkpoint name
    for t in created["tensors"]:
        arr = stored.tensors[t["name"]]
        assert (t["dtype"], tuple(t["shape"]), t["aligned"]) == (cabi_v2.DTYPES["BF16"], arr.shape, 1), t
        assert t["fnv"] == fnv1a(arr.tobytes()), t["name"]  # the checkpoint's own bytes, not a widened copy
    entries, cfg = created["entries"], ckpt.config
    assert (created["family"], created["abi"]) == ("qwen3_5", 2)
    assert entries["hidden_size"] == [cfg.hidden_size, cfg.hidden_size] and entries["rope_theta"] == cfg.rope_theta
    assert entries["max_steps"][0] == 8 and entries["hidden_width"][0] == cfg.hidden_size
    assert "mrope_section" not in entries and created["json"]["mrope_section"] == list(cfg.mrope_section)
    # every stage of the family but `out` (the step's own output), the draft last as an int64 index set
    assert step0["stages"] == [[n, 0, 128 if n == "fc_in" else 64] for n in STAGE_NAMES if n != "out"] + [
        ["draft", cabi_v2.DTYPES["I64"], 1]]


def test_a_moe_head_is_driven_from_c_with_index_set_stages(recorder, record):
    """Any family: the MoE head's 41 tensors, its stage table with topk_ids as int64, the reference's
    norm_topk_prob convention in the config."""
    inputs = moe_inputs()
    result = CAbiAdapter(recorder(), MOE, {"norm_topk_prob": False}).run(inputs)
    created, step0 = record()
    ckpt = Checkpoint(MOE)
    assert [t["name"] for t in created["tensors"]] == sorted(ckpt.layout().shapes())
    assert any(".experts.7." in t["name"] for t in created["tensors"])  # routed experts, per-expert layout
    assert created["family"] == "qwen3_5_moe" and created["entries"]["norm_topk_prob"] == [0, 0.0]
    stages = {name: (dtype, width) for name, dtype, width in step0["stages"]}
    assert stages["router_logits"] == (0, 8) and stages["topk_ids"] == (cabi_v2.DTYPES["I64"], 2)
    names = ckpt.family.stages(ckpt.config).names
    assert list(result) == [n for n in names if n != "out"] + ["out"]  # family order, the step's `out` last
    assert result["topk_ids"].dtype == np.int64 and result["topk_ids"].tolist() == [[0, 1]] * 3
    assert result["routed"].dtype == np.float32 and (result["routed"][:, 0] == [0.5, 1.5, 2.5]).all()
    assert result["out"][:, 0].tolist() == [0.0, -1.0, -2.0]


def test_capture_subset_leaves_the_others_absent_and_unwritten_index_sets_hold_minus_one(recorder, record):
    result = CAbiAdapter(recorder('CAPTURE="topk_ids,e"'), MOE).run(moe_inputs())
    assert list(result) == ["e", "topk_ids", "out"]  # the family's order, whatever the library's
    assert record()[1]["stages"] == [["e", 0, 64], ["topk_ids", 3, 2]]


def test_explain_observer_narrowing_reaches_the_v2_stage_table(recorder, record, tiny_ref):
    adapter = CAbiAdapter(recorder(), TINY)
    adapter.capture_only = ("attn",)
    assert list(adapter.run(tiny_ref[0])) == ["attn", "out"]


def _ctype_key(t):
    """Comparable identity of a ctypes type: arrays by (element, length), pointers by their target."""
    if hasattr(t, "_length_"):
        return ("array", _ctype_key(t._type_), t._length_)
    if hasattr(t, "contents"):
        return ("pointer", t._type_)
    return t


def test_v2_header_structs_are_mirrored_by_the_worker():
    text = re.sub(r"/\*.*?\*/", "", (CANDIDATES / "mtp_probe_v2.h").read_text(), flags=re.S)
    mirrors = {"mtp2_tensor": cabi_v2.Mtp2Tensor, "mtp2_stage": cabi_v2.Mtp2Stage,
               "mtp2_config_entry": cabi_v2.Mtp2ConfigEntry, "mtp2_config": cabi_v2.Mtp2Config}
    c_types = {"int32_t": c_int32, "int64_t": c_int64, "double": c_double, "const char *": c_char_p,
               "const void *": c_void_p, "void *": c_void_p,
               "const mtp2_config_entry *": POINTER(cabi_v2.Mtp2ConfigEntry)}
    for body, name in re.findall(r"typedef struct \{(.*?)\} (\w+);", text, re.S):
        fields = []
        for decl in filter(str.strip, body.split(";")):
            base = re.match(r"\s*((?:const )?\w+)", decl).group(1)
            ctype = c_types[base + (" *" if "*" in decl else "")]
            if "[" in decl:  # int64_t shape[MTP2_MAX_DIMS]
                ctype = ctype * cabi_v2.MAX_DIMS
            fields.append((re.findall(r"\w+", decl.split("[")[0])[-1], _ctype_key(ctype)))
        assert fields == [(f, _ctype_key(t)) for f, t in mirrors.pop(name)._fields_], name
    assert not mirrors
    assert f"#define MTP2_ABI_VERSION {cabi_v2.ABI_VERSION}" in text
    assert f"#define MTP2_MAX_DIMS {cabi_v2.MAX_DIMS}" in text
    enum = {k: int(v) for k, v in re.findall(r"MTP2_(\w+) = (\d+)", text)}
    assert {k: enum[k] for k in cabi_v2.DTYPES} == cabi_v2.DTYPES
    assert {enum[name.removeprefix("MTP2_")]: name for name, _ in cabi_v2.RETURN_CODES.values()} == {
        code: name for code, (name, _) in cabi_v2.RETURN_CODES.items()}


# ---- failures of foreign code ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("capture", "words"), [
    ('CAPTURE="e,h,resid1"', r"'resid1', which the qwen3_5 head does not have.*stages a library can capture are: "
                             r"e, h, fc_in"),
    ('CAPTURE="e,router_logits"', r"'router_logits', which the qwen3_5 head does not have"),
    ('CAPTURE="e,out"', r"'out'.*mtp2_step's own argument"),
    ('CAPTURE="e,h,e"', r"'e' more than once"),
], ids=["typo", "another-family", "out", "repeated"])
def test_unknown_stage_names_the_library_asks_for_are_an_error(recorder, tiny_ref, capture, words):
    with pytest.raises(AdapterError, match=r"(?s)mtp2_capture\(\) returned .*" + words):
        CAbiAdapter(recorder(capture), TINY).run(tiny_ref[0])


def test_crash_names_the_signal_the_step_and_the_v2_call(recorder, tiny_ref):
    with pytest.raises(AdapterError, match=r"SIGSEGV.*step 1 \(the mtp2_step call for token row 1\)"):
        CAbiAdapter(recorder("CRASH_AT=1"), TINY).run(tiny_ref[0])


def test_exit_0_mid_run_is_an_error(recorder, tiny_ref):
    with pytest.raises(AdapterError, match=r"exited with status 0 in step 2 \(the mtp2_step call.*exit\(\)"):
        CAbiAdapter(recorder("EXIT_AT=2"), TINY).run(tiny_ref[0])


def test_error_code_names_the_code_the_step_and_the_librarys_reason(recorder, tiny_ref):
    with pytest.raises(AdapterError, match=r"mtp2_step returned 5 \(MTP2_ERR_STAGE\) at step 3.*library says: "
                                           r"stage 'fc' is not wired"):
        CAbiAdapter(recorder("STAGE_ERROR_AT=3"), TINY).run(tiny_ref[0])


def test_create_failure_shows_the_librarys_reason(recorder, tiny_ref):
    with pytest.raises(AdapterError, match=r"mtp2_create returned NULL for the qwen3_5 head.*no thanks: qwen3_5"):
        CAbiAdapter(recorder("REFUSE"), TINY).run(tiny_ref[0])


def test_wrong_version_and_missing_symbols_are_named(build, recorder, recorder_source, tiny_ref):
    with pytest.raises(AdapterError, match=r"mtp2_abi_version\(\) returned 3; this probe speaks C ABI version 2"):
        CAbiAdapter(build(recorder_source, ("VERSION=3",)), TINY).run(tiny_ref[0])
    with pytest.raises(AdapterError, match=r"v2 library, but not mtp2_destroy"):
        CAbiAdapter(recorder("NO_DESTROY"), TINY).run(tiny_ref[0])
    with pytest.raises(AdapterError, match=r"exports mtp2_create, mtp2_step, mtp2_destroy but not mtp2_abi_version"):
        CAbiAdapter(recorder("NO_VERSION"), TINY).run(tiny_ref[0])


def test_a_v1_library_on_a_moe_head_points_to_v2(build):
    with pytest.raises(AdapterError, match=r"C ABI v1 .*dense Qwen3.5 head only.*qwen3_5_moe head.*"
                                           r"mtp_probe_v2.h"):
        CAbiAdapter(build(CANDIDATES / "mtp_step.c"), MOE).run(moe_inputs())


HUGE_REASON_SOURCE = r"""
#include <stdlib.h>
#include <string.h>
#include "mtp_probe_v2.h"
static char *reason;
int mtp2_abi_version(void) { return MTP2_ABI_VERSION; }
void *mtp2_create(const mtp2_config *c, const mtp2_tensor *w, int n, char *err, size_t len) {
    (void)c, (void)w, (void)n, (void)err, (void)len;
    reason = malloc(5 << 20);
    memset(reason, 'x', (5 << 20) - 1);
    reason[(5 << 20) - 1] = 0;
    return reason;
}
int mtp2_step(void *c, int64_t pos, const float *e, const float *h, float *o, const mtp2_stage *s, int n) {
    (void)c, (void)pos, (void)e, (void)h, (void)o, (void)s, (void)n;
    return MTP2_ERR_ARG;
}
const char *mtp2_last_error(void *c) { (void)c; return reason; }
void mtp2_destroy(void *c) { free(c); }
"""


def test_a_huge_reason_from_the_library_is_quoted_cut_to_a_readable_length(tmp_path, tiny_ref):
    """Red team: a 5 MB mtp2_last_error (or mtp2_capture) string was printed whole, twice (10 MB of output)."""
    source = tmp_path / "huge_reason.c"
    source.write_text(HUGE_REASON_SOURCE)
    with pytest.raises(AdapterError) as raised:
        CAbiAdapter(build_library(source, tmp_path), TINY).run(tiny_ref[0])
    message = str(raised.value)
    assert "library says: xxxx" in message and f"({(5 << 20) - 1 - cabi_v2.LIBRARY_TEXT_CHARS} more characters)" in \
        message and len(message) < 4 * cabi_v2.LIBRARY_TEXT_CHARS
    assert cabi_v2.library_text(b"short reason") == "short reason"  # twin: a normal reason is quoted whole
