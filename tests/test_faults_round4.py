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
