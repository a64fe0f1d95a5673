"""Issue 29, finished (round 4): what round 3 left open, and one NEW case per numbered cause that the earlier tests
(tests/test_faults_round3.py, tests/test_red_team_fixes.py, tests/probe/*) do not use.

A shard cut short while `accept` (or the draft stage) reads the lm_head: the chunks were views of a mapped shard,
so a page past the new end killed the process with SIGBUS (exit -7); now every lm_head read is a pread, a short read
is exit 2 naming the shard, and a shard rewritten in place meanwhile is refused (its drafts may mix old and new
weights), as export does. Each fault is made by ANOTHER process (`truncate`, a Python child) on the real file, at a
named moment of the real CLI run (a hook around Checkpoint.stored_rows), and each has its intact twin."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import FIXTURES, ROOT
from tests.test_bad_inputs import checkpoint_copy, digests, leftovers

ACCEPT_TOKENS = ",".join(str(t) for t in [17, 42, 3, 255, 100, 7, 511, 64, 9, 33, 12, 5])

# The mtp-oracle CLI as the program; on the `at`-th lm_head read (Checkpoint.stored_rows, a vocabulary chunk) a
# separate process truncates the shard to half ("truncate") or rewrites its lm_head bytes in place ("rewrite").
_LM_HEAD_FAULT = """
import subprocess, sys
from pathlib import Path
import oracle.checkpoint
shard, how, at = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
real, calls = oracle.checkpoint.Checkpoint.stored_rows, []
def hooked(self, name, *a, **k):
    calls.append(name)
    if len(calls) == at and how == "truncate":
        subprocess.run(["truncate", "-s", str(shard.stat().st_size // 2), str(shard)], check=True)
    if len(calls) == at and how == "rewrite":
        entry = self.entry(name)
        code = (f"f = open({str(shard)!r}, 'r+b'); f.seek({entry.offset}); f.write(bytes({entry.nbytes})); "
                f"f.close()")
        subprocess.run([sys.executable, "-c", code], check=True)
    return real(self, name, *a, **k)
oracle.checkpoint.Checkpoint.stored_rows = hooked
from oracle.cli import main
main(sys.argv[4:])
"""


def _accept_with_fault(ckpt: Path, out: Path, how: str, at: int, *extra) -> subprocess.CompletedProcess:
    args = [ckpt / "model.safetensors", how, at, "accept", ckpt, "--tokens", ACCEPT_TOKENS, "--hidden-seed", "0",
            "--k", "3", "--chunk-rows", "100", "--json", out, "-q", *extra]
    return subprocess.run([sys.executable, "-c", _LM_HEAD_FAULT, *map(str, args)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


def _assert_refused(result, pattern: str, tmp_path: Path, out: Path, before: str | None):
    text = result.stdout + result.stderr
    assert result.returncode != -7, "SIGBUS: a mapped lm_head page past the new end of the shard was read"
    assert result.returncode == 2, text
    assert "Traceback" not in text, text
    assert pattern in text, text
    assert not leftovers(tmp_path), leftovers(tmp_path)
    assert (out.read_text() if out.exists() else None) == before, "the previous --json output changed"


@pytest.mark.parametrize("at", [2, 5], ids=["between-sweeps", "mid-sweep"])
def test_a_shard_cut_short_while_accept_reads_the_lm_head_is_exit_2_naming_it(tmp_path, at):
    ckpt = checkpoint_copy(tmp_path)
    out = tmp_path / "acc.json"
    out.write_text('{"previous": true}\n')  # an earlier result: kept as it was
    result = _accept_with_fault(ckpt, out, "truncate", at)
    _assert_refused(result, str(ckpt / "model.safetensors"), tmp_path, out, '{"previous": true}\n')


def test_a_shard_rewritten_in_place_while_accept_reads_the_lm_head_is_refused(tmp_path):
    ckpt = checkpoint_copy(tmp_path)
    out = tmp_path / "acc.json"
    result = _accept_with_fault(ckpt, out, "rewrite", 3)
    _assert_refused(result, "changed while it was being read", tmp_path, out, None)


def test_twin_an_undisturbed_accept_reads_every_chunk_and_writes_its_result(tmp_path):
    ckpt = checkpoint_copy(tmp_path)
    out = tmp_path / "acc.json"
    before = digests([ckpt])
    result = _accept_with_fault(ckpt, out, "none", 0)
    assert result.returncode == 0, result.stdout + result.stderr
    assert json.loads(out.read_text())["chains"] == 8, out.read_text()
    assert digests([ckpt]) == before


def test_twin_the_pread_lm_head_argmax_equals_the_float64_argmax_over_the_whole_vocabulary(tmp_path):
    """The chunks read with pread into one reused buffer (and the rows rescored read one by one) give the exact
    argmax: against a float64 product over the whole table, read independently with safetensors."""
    import torch
    from safetensors.torch import load_file

    from oracle.checkpoint import Checkpoint
    from oracle.lm_head import lm_head_of

    torch.set_float32_matmul_precision("highest")
    ckpt = Checkpoint(FIXTURES / "qwen3_5_tiny")
    head = lm_head_of(ckpt, chunk_rows=37)  # ragged last chunk: 512 = 13 x 37 + 31
    w = load_file(FIXTURES / "qwen3_5_tiny" / "model.safetensors")["lm_head.weight"].double().numpy()
    rows = np.random.default_rng(0).standard_normal((9, ckpt.config.hidden_size)).astype(np.float32)
    np.testing.assert_array_equal(head.argmax(rows), np.argmax(rows.astype(np.float64) @ w.T, axis=1))


# --- claim 7: a 3-D per-expert tensor with gate/up halves swapped inside every expert (a NEW case: the checkpoint is
# itself fused, qwen3_next's gate_up_proj [E, 2I, D], and the dump uses vLLM's FusedMoE name) ----------------------

def test_gate_up_halves_swapped_in_each_expert_of_a_fused_checkpoint_is_named_so(tmp_path):
    from tests.probe.test_weights import audit, head

    fused, mlp = FIXTURES / "qwen3_next_tiny_fused", "mtp.layers.0.mlp."
    tensors = head(fused)
    w13, w2 = tensors.pop(mlp + "experts.gate_up_proj"), tensors.pop(mlp + "experts.down_proj")
    half = w13.shape[1] // 2
    swapped = np.concatenate([w13[:, half:], w13[:, :half]], axis=1)  # [up | gate] inside every expert
    cases = {"every": swapped, "some": np.concatenate([swapped[:3], w13[3:]]), "whole": w13[[1, 0, *range(2, 8)]]}
    notes = {}
    for case, value in cases.items():
        (tmp_path / case).mkdir()
        found = audit(tmp_path / case, fused, tensors | {mlp + "experts.w13_weight": value,
                                                         mlp + "experts.w2_weight": w2})
        assert found[mlp + "experts.w13_weight"].status == "permuted_rows", (case, found)
        notes[case] = found[mlp + "experts.w13_weight"].note
    for case in ("every", "some"):
        assert "halves of each expert's rows swapped" in notes[case] and "whole experts" not in notes[case], notes
    assert "in every expert" in notes["every"] and "in 3 of 8 experts" in notes["some"], notes
    # twin: two experts exchanged whole, rows intact, is said so, and not as halves
    assert "whole experts swapped" in notes["whole"] and "halves" not in notes["whole"], notes


# --- fault 2, the load audit: a dump .npy cut short by another process while `weights` audits it ------------------

_WEIGHTS_FAULT = """
import subprocess, sys
from pathlib import Path
import probe.weights
cut, real, seen = sys.argv[1] == "truncate", probe.weights.classify, []
def hooked(array, ref, facts):
    seen.append(1)
    if cut and len(seen) == 1:  # the first tensor's file, after it was loaded and before its values are read
        for f in sorted(Path(sys.argv[3]).glob("*.npy")):
            subprocess.run(["truncate", "-s", "128", str(f)], check=True)
    return real(array, ref, facts)
probe.weights.classify = hooked
from probe.cli import main
main(["weights", sys.argv[2], sys.argv[3]])
"""


@pytest.mark.parametrize("how", ["truncate", "none"], ids=["cut-short-while-audited", "twin-intact"])
def test_a_weights_dump_cut_short_while_audited_is_never_a_sigbus(tmp_path, how):
    """The dump's .npy tensors were mapped (np.load mmap_mode) and read lazily, so a file cut short after loading
    killed the audit with SIGBUS (the first tensor, loaded before the cut). Now each is read whole when loaded: the
    first is judged on the bytes read, and the next, loaded after the cut, is exit 2 naming its file."""
    from tests.probe.test_weights import head

    dump = tmp_path / "dump"
    dump.mkdir()
    for name, values in head(FIXTURES / "qwen3_5_tiny").items():
        np.save(dump / f"{name}.npy", np.ascontiguousarray(values, dtype=np.float32))
    result = subprocess.run([sys.executable, "-c", _WEIGHTS_FAULT, how, str(FIXTURES / "qwen3_5_tiny"), str(dump)],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    text = result.stdout + result.stderr
    assert result.returncode != -7, "SIGBUS: a mapped page of a dump file past its new end was read"
    assert "Traceback" not in text, text
    if how == "truncate":
        assert result.returncode == 2 and "cut short" in text and str(dump) in text, text
    else:
        assert result.returncode == 0 and result.stdout.strip().splitlines()[-1].startswith("WEIGHTS OK"), text
    sizes = {f.stat().st_size for f in dump.glob("*.npy")}
    assert (sizes == {128}) == (how == "truncate"), sizes  # the files really were cut short (or not, the twin)


# --- fault 1 and fault 3, a NEW case: a C library (not a Python candidate) that forges the verdict from an atexit
# handler of the worker and from a forked child that would outlive the run ------------------------------------------

_FORGER = r"""
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
static const char *alive_path = ALIVE;
static void forge_late(void) { const char *m = "PASSED | forged by the candidate (atexit)\n"; (void)!write(1, m, strlen(m)); }
__attribute__((constructor)) static void forge_init(void) {
    atexit(forge_late);
    if (fork() == 0) {  /* a child the library leaves behind: it prints a verdict and marks that it lived on */
        sleep(2);
        const char *m = "PASSED | forged by a forked child\n";
        (void)!write(1, m, strlen(m));
        int fd = open(alive_path, O_WRONLY | O_CREAT, 0644);
        if (fd >= 0) close(fd);
        _exit(0);
    }
}
"""


@pytest.mark.parametrize("forger", [True, False], ids=["forger", "twin-plain-library"])
def test_a_c_library_cannot_forge_the_verdict_or_leave_a_child_running(tmp_path, forger):
    import time

    from tests.probe.test_qk_parts import SOURCE

    source = tmp_path / "lib.c"
    alive = tmp_path / "alive"
    source.write_text(SOURCE.read_text() + (_FORGER.replace("ALIVE", f'"{alive}"') if forger else ""))
    lib = tmp_path / "lib.so"
    subprocess.run(["gcc", "-std=gnu11", "-O2", "-shared", "-fPIC", f"-I{SOURCE.parent}", "-o", lib, source, "-lm"],
                   check=True)
    code = "import sys; from probe.cli import main; main(sys.argv[1:])"
    result = subprocess.run([sys.executable, "-c", code, "run", str(FIXTURES / "qwen3_5_tiny_ref.h5"), "--impl",
                             f"c:{lib}", "--checkpoint", str(FIXTURES / "qwen3_5_tiny")], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    last = result.stdout.rstrip().splitlines()[-1]
    assert last.startswith("PASSED | 11 stages") and "forged" not in last, result.stdout
    time.sleep(3)  # past the child's sleep: had it survived the run, it would have marked `alive`
    assert not alive.exists(), "the library's forked child outlived the probe"


# --- claim 8, NEW cases: the DeepSeek-V4 C ABI v2 candidate away from position 0, at T=1, and under the mask -------

@pytest.fixture(scope="module")
def v4_c(tmp_path_factory):
    from probe.adapters.cabi import build_library
    from tests.helpers import load_script

    root = tmp_path_factory.mktemp("v4-c")
    ckpt = load_script("make_fixtures").write_deepseek_v4_checkpoint(root / "v4")
    source = ROOT / "fixtures" / "candidates" / "mtp_step_v4.c"
    return ckpt, root, {m: build_library(source, root, (f"MTP_MUTANT_{m}",) if m else ()) for m in ("", "HIDDEN_D_WIDE")}


def _v4_run(v4_c, name: str, *export_args, lib: str = ""):
    from oracle.cli import cli as oracle_cli
    from probe.cli import cli as probe_cli
    from tests.helpers import run_cli

    ckpt, root, libs = v4_c
    ref = root / f"{name}.h5"
    if not ref.exists():
        made = run_cli(oracle_cli, ["export", ckpt, "--out", ref, "--hidden-seed", "0", "-q", *export_args])
        assert made.exit_code == 0, made.output
    return run_cli(probe_cli, ["run", ref, "--impl", f"c:{libs[lib]}", "--checkpoint", ckpt])


@pytest.mark.parametrize("name, args", [("start7", ("--tokens", "5,17,3,99,4,250", "--start-pos", "7")),
                                        ("masked", ("--tokens", "5,17,3,99,4,250", "--mask-pos0-embedding"))])
def test_the_v4_c_candidate_passes_away_from_position_0_and_under_the_mask(v4_c, name, args):
    result = _v4_run(v4_c, name, *args)
    assert result.exit_code == 0 and result.output.rstrip().splitlines()[-1].startswith("PASSED |"), result.output
    twin = _v4_run(v4_c, name, *args, lib="HIDDEN_D_WIDE")  # its mutant still diverges there, at h
    assert twin.exit_code == 1 and "first divergent stage: h" in twin.output.rstrip().splitlines()[-1], twin.output


def test_the_v4_c_candidate_at_t_1_is_inconclusive_not_passed(v4_c):
    """One step: attention sees one key, so no q/k-path part can be evidenced; exit 3 naming them, never PASSED."""
    result = _v4_run(v4_c, "t1", "--tokens", "5")
    last = result.output.rstrip().splitlines()[-1]
    assert result.exit_code == 3 and last.startswith("INCONCLUSIVE |") and "RoPE" in last, result.output


# --- messages, NEW cases: the position-0 mask convention named for DeepSeek-V4 and GLM-4.5 raw dumps, both ways -----

@pytest.mark.parametrize("family", ["deepseek_v4", "glm4_moe"])
def test_a_raw_dump_with_the_other_position_0_convention_names_the_flag(tmp_path, family, v4_c):
    from oracle.cli import cli as oracle_cli
    from tests.helpers import run_cli
    from tests.probe.tracekit import diff_cli, load_trace, write_raw

    ckpt = v4_c[0] if family == "deepseek_v4" else FIXTURES / "glm4_moe_tiny"
    stem = ("e", "h", "x_in") if family == "deepseek_v4" else ("e", "h", "fc_in", "fc")
    refs = {}
    for kind, extra in (("plain", ()), ("masked", ("--mask-pos0-embedding",))):
        refs[kind] = tmp_path / f"{kind}.h5"
        made = run_cli(oracle_cli, ["export", ckpt, "--out", refs[kind], "--tokens", "5,17,3,99,200,7",
                                    "--hidden-seed", "0", "-q", *extra])
        assert made.exit_code == 0, made.output
    for dump_kind, ref_kind in (("masked", "plain"), ("plain", "masked")):
        inputs, stages = load_trace(refs[dump_kind])
        dump = write_raw(tmp_path / f"dump_{dump_kind}", {n: stages[n].copy() for n in stem}, inputs)
        result = diff_cli(refs[ref_kind], dump)
        assert result.exit_code in (1, 2) and "--mask-pos0-embedding" in result.output, result.output
        assert "check the row offset" not in result.output, result.output
        twin = diff_cli(refs[dump_kind], dump)  # the same dump against its own convention passes its stages
        assert twin.exit_code in (0, 3) and "--mask-pos0-embedding" not in twin.output.splitlines()[-1], twin.output


# --- fault 4, NEW case: a FIFO given as --profile is named as a FIFO, never opened (it would block) --------------

def test_a_fifo_as_the_profile_is_refused_naming_it(tmp_path):
    from probe.cli import cli as probe_cli
    from tests.helpers import TINY_REF, run_cli

    fifo = tmp_path / "profile.json"
    os.mkfifo(fifo)
    result = run_cli(probe_cli, ["diff", TINY_REF, TINY_REF, "--profile", str(fifo)])
    assert result.exit_code == 2 and "FIFO" in result.output and "Traceback" not in result.output, result.output
    twin = run_cli(probe_cli, ["diff", TINY_REF, TINY_REF, "--profile", "float32"])
    assert twin.exit_code == 0, twin.output


# --- claim 9, a NEW case: GLM-4.5 whose main lm_head is TIED to the embedding (no lm_head.weight), through the CLI --

def test_greedy_targets_of_a_tied_glm_head_come_from_the_embedding_not_the_mtp_copy(tmp_path):
    """A GLM-4.5 checkpoint with tie_word_embeddings and no lm_head.weight, whose MTP layer's shared_head.head differs
    (rows rolled): accept --target greedy scores drafts against argmax(embed_tokens @ H), the main model's own
    head; the JSON names both tables. Twin: the MTP copy would have given other targets at every chain."""
    import torch
    from safetensors.torch import load_file, save_file

    from oracle.cli import cli as oracle_cli
    from oracle.checkpoint import Checkpoint
    from oracle.inputs import hidden_from_seed
    from tests.helpers import load_script, run_cli

    ckpt_dir = load_script("make_fixtures").write_mtp_layer_checkpoint(tmp_path / "glm", "glm4_moe")
    tensors = load_file(ckpt_dir / "model.safetensors")
    embed = tensors["model.embed_tokens.weight"]
    tensors.pop("lm_head.weight")
    own = next(n for n in tensors if n.endswith("shared_head.head.weight"))
    tensors[own] = torch.roll(embed, 1, dims=0).contiguous()
    save_file(tensors, ckpt_dir / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((ckpt_dir / "config.json").read_text())
    config["tie_word_embeddings"] = True
    (ckpt_dir / "config.json").write_text(json.dumps(config))
    ckpt = Checkpoint(ckpt_dir)
    x = np.random.default_rng(3).integers(0, ckpt.config.vocab_size, 26)
    h = hidden_from_seed(0, len(x), ckpt.config.hidden_size)
    np.save(tmp_path / "h.npy", h)
    out = tmp_path / "acc.json"
    result = run_cli(oracle_cli, ["accept", ckpt_dir, "--tokens", ",".join(map(str, x)), "--hidden",
                                  tmp_path / "h.npy", "--k", "2", "--target", "greedy", "--json", out, "-q"])
    assert result.exit_code == 0, result.output
    record = json.loads(out.read_text())
    assert record["source"]["target_lm_head"] == "model.embed_tokens.weight" and record["source"]["lm_head"] == own
    main = (h.astype(np.float64) @ ckpt.read("model.embed_tokens.weight").astype(np.float64).T).argmax(axis=1)
    copy = (h.astype(np.float64) @ ckpt.read(own).astype(np.float64).T).argmax(axis=1)
    chains, k = len(x) - 1 - 2, 2
    i, j = np.meshgrid(np.arange(chains), np.arange(1, k + 1), indexing="ij")
    targets = np.array([[c["targets"][d] for d in range(k)] for c in record["per_chain"]])
    np.testing.assert_array_equal(targets, main[i + j])
    assert (targets != copy[i + j]).all()


# --- claim 4, a NEW case: a C candidate (the concat order swapped) whose buggy stage fc_in is not captured -------

@pytest.fixture(scope="module")
def concat_swap_stages(tmp_path_factory):
    from probe.adapters.cabi import CAbiAdapter, build_library
    from probe.run import run_and_diff
    from probe.tolerance import tol_table
    from tests.helpers import TINY, TINY_REF
    from tests.probe.test_qk_parts import SOURCE

    lib = build_library(SOURCE, tmp_path_factory.mktemp("concat"), ("MTP_MUTANT_CONCAT_SWAP",))
    result = run_and_diff(TINY_REF, CAbiAdapter(lib, TINY), tol_table())
    assert result.report.first.stage == "fc_in", result.report.first
    return dict(result.stages)


def test_a_c_candidates_bug_in_an_uncaptured_fc_in_is_said_to_be_at_fc_or_before_it(concat_swap_stages):
    from tests.helpers import TINY, TINY_REF
    from tests.probe.test_explain_claims import explained, reference

    inputs, _ = reference()
    cand = {n: a for n, a in concat_swap_stages.items() if n != "fc_in"}
    report, ex = explained(TINY_REF, TINY, cand, inputs)
    assert report.first.stage == "fc"
    assert ex.bug["stage"] == "fc" and ex.bug["or_uncaptured"] == ["fc_in"], ex.bug
    assert "the bug is at stage fc or at an uncaptured stage before it (fc_in" in ex.text()


def test_twin_with_fc_in_captured_the_c_candidates_bug_is_named_at_fc_in_alone(concat_swap_stages):
    from tests.helpers import TINY, TINY_REF
    from tests.probe.test_explain_claims import explained, reference

    inputs, _ = reference()
    report, ex = explained(TINY_REF, TINY, dict(concat_swap_stages), inputs)
    assert ex.bug["stage"] == "fc_in" and "or_uncaptured" not in ex.bug, ex.bug


# --- claims 5 and 2, NEW cases: DeepSeek-V3 (sigmoid routing, group limit, normalised top-k) ----------------------

@pytest.fixture(scope="module")
def deepseek_ref(tmp_path_factory):
    from oracle.cli import cli as oracle_cli
    from tests.helpers import run_cli

    ref = tmp_path_factory.mktemp("ds-explain") / "ref.h5"
    made = run_cli(oracle_cli, ["export", FIXTURES / "deepseek_v3_tiny", "--out", ref, "--tokens",
                                "5,17,3,99,200,7,42,11,250,64", "--hidden-seed", "0", "-q"])
    assert made.exit_code == 0, made.output
    return ref


def _explained_deepseek(ref, change):
    from tests.probe.test_explain_claims import explained, reference

    inputs, stages = reference(ref)
    cand = {n: a.copy() for n, a in stages.items()}
    change(cand, stages)
    return explained(ref, FIXTURES / "deepseek_v3_tiny", cand, inputs)


def test_deepseek_weights_given_to_the_wrong_experts_fail_topk_weights_in_diff_and_explain(deepseek_ref):
    def reverse_weights(cand, ref):
        assert (np.abs(np.diff(ref["topk_weights"], axis=1)) > 1e-3).any()
        cand["topk_weights"] = ref["topk_weights"][:, ::-1].copy()

    report, ex = _explained_deepseek(deepseek_ref, reverse_weights)
    assert report.first.stage == "topk_weights" and ex.bug["stage"] == "topk_weights", (report.first, ex.bug)
    bad = [r for r in ex.local if r["stage"] == "topk_weights" and r["kind"] == "local"]
    diverged = set(np.flatnonzero(~report.rows["topk_weights"].has_status({"ok"})).tolist())
    assert bad and diverged, ex.local
    assert {r["token"] for r in bad} <= diverged  # the two agree about which rows are wrong


def test_twin_deepseek_top_k_listed_in_another_order_agrees_in_diff_and_explain(deepseek_ref):
    def reverse_both(cand, ref):
        cand["topk_weights"] = ref["topk_weights"][:, ::-1].copy()
        cand["topk_ids"] = ref["topk_ids"][:, ::-1].copy()
        cand["out"][3] *= np.float32(1.01)  # something to explain downstream

    report, ex = _explained_deepseek(deepseek_ref, reverse_both)
    assert report.first.stage == "out", report.first
    weights = [r for r in ex.local if r["stage"] == "topk_weights"]
    assert weights and all(r["kind"] == "ok" for r in weights)


def test_deepseek_experts_of_diverging_routed_rows_are_not_counted_as_seen(deepseek_ref):
    from tests.probe.test_explain_claims import _experts_of

    def break_two_rows(cand, ref):
        cand["routed"][[1, 6]] *= np.float32(1.5)

    report, ex = _explained_deepseek(deepseek_ref, break_two_rows)
    experts = ex.coverage["experts"]
    from tests.probe.test_explain_claims import reference

    ids = reference(deepseek_ref)[1]["topk_ids"]
    passing = [t for t in range(len(ids)) if t not in (1, 6)]
    assert set(experts["evidenced"]) == _experts_of(ids, passing)
    assert set(experts["not_evidenced"]) == _experts_of(ids, range(len(ids))) - _experts_of(ids, passing)


# --- claim 1, a NEW case: the saturated head away from position 0 (--start-pos 50), through the CLI ---------------

def test_saturated_head_at_start_pos_50_a_rope_less_c_candidate_is_inconclusive_naming_rope(tmp_path):
    from oracle.cli import cli as oracle_cli
    from probe.adapters.cabi import build_library
    from probe.cli import cli as probe_cli
    from tests.helpers import TINY, run_cli
    from tests.probe.test_qk_parts import SOURCE, saturated_checkpoint

    tokens = "17,42,3,255,100,7,511,64"
    libs = {m: build_library(SOURCE, tmp_path, (f"MTP_MUTANT_{m}",) if m else ()) for m in ("", "NO_ROPE")}
    for name, ckpt in (("saturated", saturated_checkpoint(tmp_path / "sat")), ("normal", TINY)):
        ref = tmp_path / f"{name}.h5"
        made = run_cli(oracle_cli, ["export", ckpt, "--out", ref, "--tokens", tokens, "--hidden-seed", "0",
                                    "--start-pos", "50", "-q"])
        assert made.exit_code == 0, made.output
        result = run_cli(probe_cli, ["run", ref, "--impl", f"c:{libs['NO_ROPE']}", "--checkpoint", ckpt])
        last = result.output.rstrip().splitlines()[-1]
        if name == "saturated":
            assert result.exit_code == 3 and "RoPE" in last and not last.startswith("PASSED"), result.output
            assert "q/k path, RoPE: NOT evidenced" in result.output
        else:  # twin: where RoPE moves rows, the same candidate diverges at attn
            assert result.exit_code == 1 and "first divergent stage: attn" in last, result.output


# --- claim 10, a NEW case: a MoE family (qwen3_5_moe), period-3 tokens --------------------------------------------

def test_moe_rows_shifted_by_one_are_named_and_a_repeating_trace_names_no_shift(tmp_path):
    from oracle.cli import cli as oracle_cli
    from oracle.trace import read_trace, write_trace
    from tests.helpers import run_cli
    from tests.probe.tracekit import copy_stages, diff_cli, last_line, load_trace

    def export(tokens):
        out = tmp_path / f"ref_{tokens.replace(',', '_')}.h5"
        made = run_cli(oracle_cli, ["export", FIXTURES / "qwen3_5_moe_tiny", "--out", out, "--tokens", tokens,
                                    "--hidden-seed", "0", "-q"])
        assert made.exit_code == 0, made.output
        return out

    def candidate(ref, change, name):
        inputs, stages = load_trace(ref)
        stages = copy_stages(stages)
        stages.pop("draft", None)
        change(stages)
        path = tmp_path / f"{name}.h5"
        with read_trace(ref) as r:
            stage_list, dims = r.stage_list, r.dims
        write_trace(path, inputs, stages, {"producer": "my engine"}, stage_list=stage_list, dims=dims)
        return path

    def shifted(stages):
        for name in stages:
            stages[name][:-1] = stages[name][1:].copy()

    varied = export("5,17,3,99,200,7,42,11,250")
    result = diff_cli(varied, candidate(varied, shifted, "shifted"))
    assert result.exit_code == 1 and "rows shifted by one token" in last_line(result), result.output
    same = export("5,5,5,5,5,5,5,5,5")  # e repeats: a shift cannot show at e

    def one_row(stages):
        stages["e"][4] = -stages["e"][4]

    result = diff_cli(same, candidate(same, one_row, "one_row"))
    assert result.exit_code == 1 and "first divergent stage: e" in last_line(result), result.output
    assert "rows shifted" not in result.output


# --- fault 3, NEW commands interrupted at many points: the load audit with --json, and a chain export -----------

def _signal_commands(tmp_path):
    from safetensors.numpy import save_file

    from tests import signal_trials as trials
    from tests.probe.test_weights import head

    dump = tmp_path / "dump.safetensors"
    save_file({k: np.ascontiguousarray(v) for k, v in head(FIXTURES / "qwen3_5_tiny").items()}, dump)
    tiny = str(FIXTURES / "qwen3_5_tiny")
    return {"weights": trials.Command("weights", "probe", ["weights", tiny, str(dump), "--json", "{dir}/w.json"],
                                      ["w.json"]),
            "export_chain": trials.Command("export_chain", "oracle", ["export", tiny, "--tokens", trials.TOKENS,
                                                                      "--hidden-seed", "0", "--chain", "3", "--out",
                                                                      "{dir}/ref.h5"], ["ref.h5"])}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["weights", "export_chain"])
def test_an_interrupt_of_the_audit_or_a_chain_export_leaves_the_previous_outputs(tmp_path, name):
    import signal

    from tests import signal_trials as trials

    command = _signal_commands(tmp_path)[name]
    whole = trials.run_trial(command, signal.SIGINT, 600, tmp_path / "whole")  # never signalled: the twin
    assert whole.status in (0, 1) and whole.problems == [], whole
    assert all((tmp_path / "whole" / "out" / n).read_bytes() != trials.PREVIOUS for n in command.outputs)
    interrupted = []
    for signum, fraction in ((signal.SIGTERM, 0.2), (signal.SIGINT, 0.6), (signal.SIGTERM, 0.9)):
        trial = trials.run_trial(command, signum, fraction * whole.elapsed, tmp_path / f"t{fraction}")
        assert trial.problems == [], trial
        interrupted.append(trial.interrupted)
    assert sum(interrupted) >= 2, f"too few trials were interrupted before {name} ended: {interrupted}"


# --- fault 5, a NEW case: a token id of 5000 digits in a tokens file (int() of over 4300 digits raised) ----------

@pytest.mark.parametrize("where", ["file", "option"])
def test_a_token_id_of_5000_digits_is_exit_2_not_pythons_own_error(tmp_path, where):
    from oracle.cli import cli as oracle_cli
    from tests.helpers import run_cli

    huge = "7" * 5000
    source = ["--tokens-file", tmp_path / "t.txt"] if where == "file" else ["--tokens", f"5,{huge}"]
    (tmp_path / "t.txt").write_text(f"5 17\n{huge}\n")
    result = run_cli(oracle_cli, ["export", FIXTURES / "qwen3_5_tiny", *source, "--hidden-seed", "0", "--out",
                                  tmp_path / "ref.h5", "-q"])
    assert result.exit_code == 2 and "does not fit in int64" in result.output, result.output
    assert "Traceback" not in result.output and not (tmp_path / "ref.h5").exists()
    (tmp_path / "t.txt").write_text("5 17 " + "0" * 40 + "3\n")  # twin: leading zeros are no large number
    twin = run_cli(oracle_cli, ["export", FIXTURES / "qwen3_5_tiny", "--tokens-file", tmp_path / "t.txt",
                                "--hidden-seed", "0", "--out", tmp_path / "ref.h5", "-q"])
    assert twin.exit_code == 0, twin.output


# --- fault 6, a NEW case: a C library (not a Python factory) that changes directory when loaded -----------------

def test_outputs_do_not_follow_a_c_librarys_chdir(tmp_path):
    from tests.probe.test_qk_parts import SOURCE

    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    work.mkdir()
    elsewhere.mkdir()
    source = tmp_path / "lib.c"
    source.write_text(SOURCE.read_text() + "\n#include <fcntl.h>\n#include <unistd.h>\n__attribute__((constructor)) "
                      f"static void wander(void) {{ if (chdir(\"{elsewhere}\") == 0) close(open(\"here\", O_WRONLY | "
                      f"O_CREAT, 0644)); }}\n")
    lib = tmp_path / "lib.so"
    subprocess.run(["gcc", "-std=gnu11", "-O2", "-shared", "-fPIC", f"-I{SOURCE.parent}", "-o", lib, source, "-lm"],
                   check=True)
    code = "import sys; from probe.cli import main; main(sys.argv[1:])"
    result = subprocess.run([sys.executable, "-c", code, "run", str(FIXTURES / "qwen3_5_tiny_ref.h5"), "--impl",
                             f"c:{lib}", "--checkpoint", str(FIXTURES / "qwen3_5_tiny"), "--json", "r.json",
                             "--html", "r.html", "--out", "c.h5"], cwd=work, capture_output=True, text=True,
                            timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stdout + result.stderr
    assert sorted(p.name for p in work.iterdir()) == ["c.h5", "r.html", "r.json"]
    assert [p.name for p in elsewhere.iterdir()] == ["here"]  # the library did change directory (its marker)
