"""`mtp-probe selftest`: before trusting the probe's verdict on your engine, watch it catch known mistakes.

Builds the plain-C candidate and every compile-time mutant (fixtures/candidates/mtp_step.c), runs each — and the
torch candidates — against the bundled reference (T=8) and against its first step alone (T=1), and checks each
verdict and first divergence against what it must be. Five mutants match perfectly at t=0 (one key: softmax ≡ 1),
so with T=1 they must come out inconclusive, never pass. One mutant must pass: every step at position p+1.

The draft loop (issue 24, LOOP_CASES): from the reference's inputs it exports a chained reference (`mtp-oracle export
--chain 4`, in a child process: the probe never imports transformers) and drives the C ABI v2 candidate
(mtp_step_v2.c, mtp2_draft_step) and the Python one (numpy_step.py, draft_step) through their own loops: each loop
variant (numpy_loop_mutants.py, -DMTP_MUTANT_<VARIANT>) must be caught at the (stage, depth, bridge) where its
mistake first shows, the correct candidates must pass at every depth with every stage captured (the draft too: they
draft through their own lm_head, from the tables file MTP_DRAFT_TABLES names, written here from the checkpoint), and
a bfloat16 engine must pass under the bfloat16 profile at every depth and not under float32's. Each loop case's
candidate trace then goes through `mtp-probe diff --explain` (the CLI's own command, all cases in one child process:
--explain loads torch and transformers, which the probe's process never imports): its DIAGNOSIS must name the case's
variant first, and a correct candidate must get none; anything else fails the case, shown in the table's diagnosis
column.

Heads with several MTP layers (LAYERED_CASES): the same two candidates on the bundled 3-layer Qwen3.5 fixture
(fixtures/qwen3_5_tiny_3layer, `--chain 3` of the reference's inputs): run correctly (depth j on layer j-1, each
layer its own cache) they pass at every depth, and their layer0_reused mutants (layer 0 at every depth, vllm#52688)
are caught at depth 2 `ah` (the stem is shared; layer 0's input_layernorm is not layer 1's) and named.
"""

import dataclasses
import importlib.util
import io
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager, redirect_stdout
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from oracle.checkpoint import Checkpoint
from oracle.families.spec import MAIN_LM_HEAD
from oracle.output import run_ended_with_us, scratch_directory
from oracle.progress import tracked
from oracle.stages import LEGACY_FAMILY
from oracle.trace import ChainDepthReader, TraceInputs, chain_info, read_trace, write_trace
from probe.adapters.cabi import CAbiAdapter, build_library
from probe.diff import DiffReport
from probe.errors import ProbeError
from probe.run import adapter_from_spec, run_and_diff
from probe.tolerance import PROFILES, tol_table

ROOT = Path(__file__).resolve().parents[1]
CANDIDATES = ROOT / "fixtures" / "candidates"
BUNDLED_REFERENCE = ROOT / "fixtures" / "qwen3_5_tiny_ref.h5"
BUNDLED_CHECKPOINT = ROOT / "fixtures" / "qwen3_5_tiny"
BUNDLED_LAYERED = ROOT / "fixtures" / "qwen3_5_tiny_3layer"  # 3 MTP layers: LAYERED_CASES
QK_BLIND = "inconclusive"  # what a mutant that only shows at t >= 1 must give on a T=1 trace


@dataclass(frozen=True)
class Case:
    name: str
    impl: str  # "c", "cuda" or an --impl spec
    expect: tuple[str, str]  # (verdict, first) at T=8, T=1; first is "stage@token" or "-"
    expect_t1: tuple[str, str]
    mutant: str = ""
    profile: str = "float32"
    why: str = ""


def _m(mutant: str, t8: tuple[str, str], t1: tuple[str, str], why: str) -> Case:
    return Case(mutant, "c", t8, t1, mutant=mutant, why=why)


CASES = (
    Case("C reference", "c", ("pass", "-"), ("inconclusive", "-"), why="the correct plain-C step"),
    Case("torch float32", "torch:cpu:float32", ("pass", "-"), ("inconclusive", "-"), why="raw-op transcription"),
    Case("torch bfloat16", "torch:cpu:bfloat16", ("diverged", "e@0"), ("diverged", "e@0"),
         why="bf16 rounding exceeds the float32 tolerance"),
    Case("torch bfloat16, bf16 profile", "torch:cpu:bfloat16", ("pass", "-"), ("inconclusive", "-"),
         profile="bfloat16", why="within the documented bfloat16 profile"),
    Case("CUDA twin", "cuda", ("pass", "-"), ("inconclusive", "-"), why="mtp_step.cu on a GPU"),
    _m("CONCAT_SWAP", ("diverged", "fc_in@0"), ("diverged", "fc_in@0"), "[h, e] instead of [e, h]"),
    _m("W_NORM", ("diverged", "e@0"), ("diverged", "e@0"), "w instead of (1 + w) in every RMSNorm"),
    _m("QGATE_HALVES", ("diverged", "attn@0"), ("diverged", "attn@0"), "q/gate split as halves, not per head"),
    _m("NO_GATE", ("diverged", "attn@0"), ("diverged", "attn@0"), "sigmoid gate not applied"),
    _m("NO_QK_NORM", ("diverged", "attn@1"), (QK_BLIND, "-"), "q_norm/k_norm skipped (invisible at t=0)"),
    _m("ROPE_ALL_DIMS", ("diverged", "attn@1"), (QK_BLIND, "-"), "rotary over all dims (invisible at t=0)"),
    _m("ROPE_GPTJ", ("diverged", "attn@1"), (QK_BLIND, "-"), "GPT-J interleaved rotary (invisible at t=0)"),
    _m("POS_FROZEN", ("diverged", "attn@1"), (QK_BLIND, "-"), "every step at position 0 (invisible at t=0)"),
    _m("NO_KV_APPEND", ("diverged", "attn@1"), (QK_BLIND, "-"), "attends only to itself (invisible at t=0)"),
    _m("ROW0_TRACE", ("invalid", "e@1"), (QK_BLIND, "-"), "harness writes every token into row 0"),
    _m("SKIP_STAGE_MH", ("invalid", "mh@0"), ("invalid", "mh@0"), "never writes the mh row"),
    _m("NOT_CAPTURED_MH", ("pass", "-"), (QK_BLIND, "-"), "declares mh not captured: reported, not passed"),
    _m("POS_PLUS_ONE", ("pass", "-"), (QK_BLIND, "-"),
       "every step at p+1: RoPE is relative, so a uniform offset is invisible to any diff of this head"),
)


# --- the draft loop (issue 24) ----------------------------------------------------------------------------------

CHAIN_DEPTHS = 4  # K of the chained reference the loop cases run on (K <= T)
DRAFT_TABLES_ENV = "MTP_DRAFT_TABLES"  # the candidates' own lm_head and embed_tokens (fixtures/candidates/*)
EMBED_DRAFT = "embed-draft"  # LoopCase.expect's `first` for draft_embed_tokens: worked out from the reference


@dataclass(frozen=True)
class LoopCase:
    """One candidate driven through its own draft loop on the chained reference. `first` is "stage@d<depth>:<row>"
    (row = token at depth 1, bridge position at depth j), "-" for none, or EMBED_DRAFT (the first row where
    argmax(out . embed_tokens) differs from the reference's draft, computed from the reference: `embed_draft_first`).
    `variant` is the loop variant's name, as --explain's DIAGNOSIS names it ("" for a correct candidate)."""

    name: str
    impl: str  # "c" (mtp_step_v2.c) or a python:MODULE:FACTORY spec
    variant: str
    expect: tuple[str, str]
    mutant: str = ""  # -DMTP_MUTANT_<mutant> (C); MTP_NO_DRAFT_STEP as given
    profile: str = "float32"
    why: str = ""


def _loop(variant: str, first: str, why: str) -> tuple[LoopCase, LoopCase]:
    """The variant's C mutant and its Python twin, which must be caught at the same place."""
    return (LoopCase(f"{variant} (C)", "c", variant, ("diverged", first), mutant=variant.upper(), why=why),
            LoopCase(f"{variant} (python)", f"python:numpy_loop_mutants:{variant}", variant, ("diverged", first)))


LOOP_CASES = (
    LoopCase("C draft loop", "c", "", ("pass", "-"), why="mtp2_draft_step, every stage and the draft at every depth"),
    LoopCase("python draft loop", "python:numpy_step:make_head", "", ("pass", "-"), why="draft_step, the same"),
    LoopCase("python bfloat16, bf16 profile", "python:numpy_step:make_bf16_head", "", ("pass", "-"),
             profile="bfloat16", why="every stage stored in bf16: within the bfloat16 profile at every depth"),
    LoopCase("python bfloat16", "python:numpy_step:make_bf16_head", "", ("diverged", "e@d1:0"),
             why="the same bf16 rounding exceeds the float32 tolerance"),
    # depth 2 is the first to read a recycled hidden, and h its first stage that does
    *_loop("recycle_prenorm", "h@d2:0", "res2 recycled instead of out = norm(res2): h at depth 2 sees it"),
    *_loop("recycle_main_hidden", "h@d2:0", "H_i recycled at every depth instead of the previous depth's out"),
    # depth 2 of bridge 0 attends to bridge 0 (position 0) and itself: its query at 0 instead of 1 moves its score
    *_loop("position_frozen", "attn@d2:0", "every depth at the bridge's position: attn at depth 2 sees two keys"),
    # bridge 0's chain runs before bridge 1, which then attends to its 3 stale entries: depth 1 (the bridge) at 1
    *_loop("chain_kv_kept", "attn@d1:1", "the chain's K/V entries kept: the next bridge step attends to them"),
    # every float stage right at every depth: only the draft stage can show it, at depth 1 already
    *_loop("draft_embed_tokens", EMBED_DRAFT, "draft through embed_tokens: only the draft stage diverges"),
    LoopCase("C without mtp2_draft_step", "c", "", ("inconclusive", "-"), mutant="MTP_NO_DRAFT_STEP",
             why="a v2 library from before the loop: the loop was not checked, never a pass about it"),
)
# On a one-layer head layer 0 at every depth is right; layer0_reused needs a head with several MTP layers:
LAYERED_DEPTHS = 3  # the 3-layer fixture's chain: depth j on layer j-1
LAYERED_CASES = (
    LoopCase("C draft loop, 3 layers", "c", "", ("pass", "-"),
             why="num_mtp_layers 3: the bridge on layer 0, depth j on layer j-1, each layer its own cache"),
    LoopCase("python draft loop, 3 layers", "python:numpy_step:make_head", "", ("pass", "-"), why="the same"),
    # the stem (e, h, fc_in, fc) is shared by every layer; layer 0's input_layernorm gives another ah
    *_loop("layer0_reused", "ah@d2:0", "layer 0 at every depth of the 3-layer head: ah at depth 2 differs"),
)
ONLY_DRAFT = "draft_embed_tokens"  # its every other stage must match at every depth


@dataclass(frozen=True)
class Row:
    case: Case
    num_tokens: int
    verdict: str
    first: str
    t0_matches: bool | None  # every token-0 row within tolerance (None: not run)
    ok: bool | None  # None: skipped, with the reason in `note`
    note: str = ""


def run_selftest(reference: Path | None = None, checkpoint: Path | None = None, build_dir: Path | None = None,
                 log: Callable[[str], None] = lambda msg: None) -> list[Row]:
    """Run every case on the reference (default: the bundled fixture) and on its first step alone."""
    reference, checkpoint = Path(reference or BUNDLED_REFERENCE), Path(checkpoint or BUNDLED_CHECKPOINT)
    if not reference.is_file() or not checkpoint.is_dir() or not (CANDIDATES / "mtp_step.c").is_file():
        raise ProbeError(f"selftest needs the bundled fixtures and candidates ({BUNDLED_REFERENCE}, "
                         f"{CANDIDATES}); run it from a checkout, or pass --reference and --checkpoint.")
    _check_family(reference)
    with scratch_directory("mtp-selftest-") as tmp:
        builds = Path(build_dir or tmp)
        builds.mkdir(parents=True, exist_ok=True)
        one_step = first_step_reference(reference, Path(tmp) / "t1.h5")
        rows = []
        for case in tracked(CASES, "selftest", len(CASES), unit="case"):
            log(f"selftest: {case.name}")
            rows += _run_case(case, reference, one_step, checkpoint, builds)
        rows += run_loop_cases(reference, checkpoint, builds, Path(tmp), log)
        rows += run_layered_cases(reference, builds, Path(tmp) / "layered", log)
    return rows


def _check_family(reference: Path) -> None:
    """The bundled candidates (mtp_step.c, the torch transcription's dense path) implement the bundled reference's
    head: a reference of another family (a MoE head) or stage list is refused, not run into a crash."""
    with read_trace(BUNDLED_REFERENCE) as bundled, read_trace(reference) as ref:
        want, got = bundled.attrs.get("family", LEGACY_FAMILY), ref.attrs.get("family", LEGACY_FAMILY)
        same_stages = ref.stages == bundled.stages
    if got != want or not same_stages:
        raise ProbeError(f"selftest --reference {reference}: a {got} trace; the selftest's candidates implement the "
                         f"{want} head ({BUNDLED_REFERENCE.name}), so they can only be run on a {want} reference. "
                         f"Use mtp-probe run --impl on it instead.")


def first_step_reference(reference: Path, out: Path) -> Path:
    """A T=1 reference cut from step 0 of `reference` (valid: step 0 depends on nothing later)."""
    with read_trace(reference) as ref:
        inputs = ref.inputs()
        stages = {n: ref.stage_rows(n, 0, 1) for n in ref.stages}
        attrs = {k: ref.attrs[k] for k in ("family", "producer", "checkpoint_digest", "config") if k in ref.attrs}
    attrs["provenance"] = {"command": f"first step of {reference} (mtp-probe selftest)"}
    cut = TraceInputs(*(getattr(inputs, n)[:1] for n in ("token_ids", "positions", "hidden", "embed")))
    write_trace(out, cut, stages, attrs)
    return out


def _run_case(case: Case, reference: Path, one_step: Path, checkpoint: Path, builds: Path) -> list[Row]:
    skip = _skip_reason(case)
    if skip:
        return [Row(case, t, "-", "-", None, None, skip) for t in (8, 1)]
    adapter = _adapter(case, checkpoint, builds)
    tols = tol_table(PROFILES[case.profile])
    rows = []
    for ref, expect in ((reference, case.expect), (one_step, case.expect_t1)):
        report = run_and_diff(ref, adapter, tols).report
        verdict, first = report.verdict.name, _first(report)
        rows.append(Row(case, report.num_tokens, verdict, first, _t0_matches(report), (verdict, first) == expect))
    return rows


def _adapter(case: Case, checkpoint: Path, builds: Path):
    if case.impl in ("c", "cuda"):
        source = CANDIDATES / ("mtp_step.c" if case.impl == "c" else "mtp_step.cu")
        defines = (f"MTP_MUTANT_{case.mutant}",) if case.mutant else ()
        return CAbiAdapter(build_library(source, builds, defines), checkpoint)
    return adapter_from_spec(case.impl, checkpoint)


def _skip_reason(case: Case) -> str:
    if case.impl != "cuda":
        return ""
    if shutil.which("nvcc") is None:
        return "skipped: nvcc not found"
    try:
        found = subprocess.run(["nvidia-smi", "-L"], capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        found = False
    return "" if found else "skipped: no CUDA device"


def _first(report: DiffReport) -> str:
    if report.verdict.name == "invalid" and report.issues:
        issue = report.issues[0]
        return f"{issue.where}@{issue.tokens[0]}" if issue.tokens else issue.where
    return f"{report.first.stage}@{report.first.token}" if report.first else "-"


def _t0_matches(report: DiffReport) -> bool:
    return all(bool(rows.diff(0)) for rows in report.rows.values() if len(rows))


@dataclass(frozen=True)
class LoopRow:
    case: LoopCase
    verdict: str
    first: str
    expected: str  # the case's `first`, worked out (EMBED_DRAFT resolved against the reference)
    depths: str  # the depths compared, e.g. "1-4"
    ok: bool | None
    note: str = ""
    diagnosis: str = "-"  # what --explain's DIAGNOSIS named first ("none": no variant), or why it did not run


def run_loop_cases(reference: Path, checkpoint: Path, builds: Path, tmp: Path,
                   log: Callable[[str], None] = lambda msg: None) -> list[LoopRow]:
    """Every LOOP_CASES candidate on a chained reference exported from `reference`'s inputs."""
    skip = _loop_skip_reason(reference)
    if skip:
        return [LoopRow(c, "-", "-", c.expect[1], "-", None, skip, diagnosis="skipped") for c in LOOP_CASES]
    log("selftest: exporting the chained reference (mtp-oracle export --chain)")
    chained = chained_reference(reference, checkpoint, tmp / "chain.h5")
    return _loop_rows(LOOP_CASES, chained, checkpoint, builds, tmp, log)


def run_layered_cases(reference: Path, builds: Path, tmp: Path,
                      log: Callable[[str], None] = lambda msg: None) -> list[LoopRow]:
    """Every LAYERED_CASES candidate on the 3-layer fixture's chained reference (`reference`'s inputs)."""
    skip = _loop_skip_reason(reference) or _layered_skip_reason(reference)
    if skip:
        return [LoopRow(c, "-", "-", c.expect[1], "-", None, skip, diagnosis="skipped") for c in LAYERED_CASES]
    tmp.mkdir(parents=True, exist_ok=True)
    log("selftest: exporting the 3-layer head's chained reference (mtp-oracle export --chain 3)")
    chained = chained_reference(reference, BUNDLED_LAYERED, tmp / "chain.h5", LAYERED_DEPTHS)
    return _loop_rows(LAYERED_CASES, chained, BUNDLED_LAYERED, builds, tmp, log)


def _layered_skip_reason(reference: Path) -> str:
    if not (BUNDLED_LAYERED / "config.json").is_file():
        return f"skipped: the 3-layer fixture {BUNDLED_LAYERED} is missing (python scripts/make_fixtures.py)"
    with read_trace(reference) as ref:
        width = ref.inputs().hidden.shape[-1]
    wanted = Checkpoint(BUNDLED_LAYERED).config.hidden_size
    if width != wanted:
        return (f"skipped: the reference's hidden is {width} wide, the bundled 3-layer fixture's {wanted}; run "
                f"selftest on the bundled reference to check layer0_reused")
    return ""


def _loop_rows(cases, chained: Path, checkpoint: Path, builds: Path, tmp: Path,
               log: Callable[[str], None]) -> list[LoopRow]:
    """Each case driven on `chained`, then its trace through --explain."""
    tables = write_draft_tables(checkpoint, tmp / "draft_tables.bin")
    embed_first = embed_draft_first(chained, checkpoint)
    rows, traces = [], []
    with _candidates_see(tables):
        for i, case in enumerate(tracked(cases, "selftest loop", len(cases), unit="case")):
            log(f"selftest: {case.name}")
            row, written = _run_loop_case(case, chained, checkpoint, builds, embed_first, tmp / f"loop{i}.h5")
            rows.append(row)
            traces.append(written)
    log("selftest: --explain on every loop case's trace (mtp-probe diff --explain, in a child process)")
    diagnoses = explain_loop_traces(chained, checkpoint, traces, [r.case.profile for r in rows], tmp)
    return [_with_diagnosis(row, found) for row, found in zip(rows, diagnoses)]


def _loop_skip_reason(reference: Path) -> str:
    if importlib.util.find_spec("transformers") is None:
        return "skipped: the oracle's transformers is not installed (mtp-oracle export --chain needs it)"
    with read_trace(reference) as ref:
        if ref.num_tokens < 2:
            return f"skipped: the reference has {ref.num_tokens} step, so no bridge step has a chain"
    return ""


def chained_reference(reference: Path, checkpoint: Path, out: Path, chain_depths: int = CHAIN_DEPTHS) -> Path:
    """`mtp-oracle export --chain K` on `reference`'s own tokens, H and start position (K = min(chain_depths, T)),
    in a child process; ProbeError with its message when the export fails."""
    with read_trace(reference) as ref:
        inputs = ref.inputs()
    positions = np.asarray(inputs.positions)
    if not np.array_equal(positions, positions[0] + np.arange(len(positions))):
        raise ProbeError(f"selftest --reference {reference}: its positions are not p_0, p_0 + 1, ...; the loop "
                         f"cases re-export its inputs with --start-pos, which needs consecutive positions. Use a "
                         f"reference from mtp-oracle export.")
    np.save(out.with_name("tokens.npy"), np.asarray(inputs.token_ids, dtype=np.int64))
    np.save(out.with_name("hidden.npy"), np.ascontiguousarray(inputs.hidden, dtype=np.float32))
    depths = min(chain_depths, len(positions))
    cmd = [sys.executable, "-m", "oracle", "export", str(checkpoint), "--out", str(out), "--tokens-file",
           str(out.with_name("tokens.npy")), "--hidden", str(out.with_name("hidden.npy")), "--start-pos",
           str(int(positions[0])), "--chain", str(depths), "-q"]
    proc = run_ended_with_us(cmd, 2.0)  # an interrupted selftest ends its export with it
    if proc.returncode != 0:
        said = (proc.stderr.strip().splitlines() or ["(no message)"])[-1]
        raise ProbeError(f"selftest: exporting the chained reference failed (exit {proc.returncode}): {said}. Run "
                         f"mtp-oracle export {checkpoint} --chain {depths} ... by hand to see why.")
    return out


def draft_tables(checkpoint: Path) -> tuple[np.ndarray, np.ndarray]:
    """(lm_head, embed_tokens) float32 [V, D] of the checkpoint: what an engine drafts through, and the matrix a
    draft_embed_tokens engine uses instead."""
    ckpt = Checkpoint(checkpoint)
    own = ckpt.family.lm_head.format(num_hidden_layers=getattr(ckpt.config, "num_hidden_layers", None))
    name = own if own in ckpt.names() else MAIN_LM_HEAD
    return ckpt.read(name), ckpt.read(ckpt.main_model_prefix() + "embed_tokens.weight")


def write_draft_tables(checkpoint: Path, out: Path) -> Path:
    """The file MTP_DRAFT_TABLES names (fixtures/candidates/mtp_step_v2.c): int64 V, int64 D, float32 lm_head
    [V, D], float32 embed_tokens [V, D]."""
    lm_head, embed = draft_tables(checkpoint)
    with open(out, "wb") as f:
        f.write(np.array(lm_head.shape, dtype=np.int64).tobytes())
        f.write(np.ascontiguousarray(lm_head, dtype=np.float32).tobytes())
        f.write(np.ascontiguousarray(embed, dtype=np.float32).tobytes())
    return out


def embed_draft_first(chained: Path, checkpoint: Path) -> str:
    """Where drafting through embed_tokens first shows: the first depth, then the first row in it, where
    argmax(out . embed_tokens) of the reference's own `out` differs from its recorded draft ("-": nowhere)."""
    _, embed = draft_tables(checkpoint)
    embed = embed.astype(np.float64)
    with read_trace(chained) as ref:
        info = chain_info(ref)
        parts = [(1, ref)] + [(j, ChainDepthReader(ref, j)) for j in (info.chain_depths if info else ())]
        for depth, part in parts:
            rows = part.num_tokens
            out, draft = part.stage_rows("out", 0, rows), part.stage_rows("draft", 0, rows)
            wrong = np.flatnonzero((np.asarray(out, np.float64) @ embed.T).argmax(axis=1) != draft[:, 0])
            if len(wrong):
                return f"draft@d{depth}:{int(wrong[0])}"
    return "-"


@contextmanager
def _candidates_see(tables: Path) -> Iterator[None]:
    """While the loop cases run: MTP_DRAFT_TABLES set (their workers inherit it) and fixtures/candidates importable
    (Python candidates import from the probe's sys.path); both as they were afterwards."""
    before, path = os.environ.get(DRAFT_TABLES_ENV), str(CANDIDATES)
    os.environ[DRAFT_TABLES_ENV] = str(tables)
    added = path not in sys.path
    if added:
        sys.path.insert(0, path)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(DRAFT_TABLES_ENV, None)
        else:
            os.environ[DRAFT_TABLES_ENV] = before
        if added and path in sys.path:
            sys.path.remove(path)


def _run_loop_case(case: LoopCase, chained: Path, checkpoint: Path, builds: Path, embed_first: str,
                   out: Path) -> tuple[LoopRow, Path | None]:
    """The case's row and its candidate trace (written to `out` for --explain; None where none was written)."""
    if case.impl == "c":
        defines = (case.mutant if case.mutant.startswith("MTP_NO_") else f"MTP_MUTANT_{case.mutant}",) \
            if case.mutant else ()
        adapter = CAbiAdapter(build_library(CANDIDATES / "mtp_step_v2.c", builds, defines), checkpoint)
    else:
        adapter = adapter_from_spec(case.impl, checkpoint)
    result = run_and_diff(chained, adapter, tol_table(PROFILES[case.profile]), out=out)
    report = result.report
    expected = embed_first if case.expect[1] == EMBED_DRAFT else case.expect[1]
    verdict, first, depths = report.verdict.name, _loop_first(report), _depths(report)
    ok, note = (verdict, first) == (case.expect[0], expected), ""
    if ok and verdict == "pass":  # at every depth the reference records, with every stage (the draft too)
        ok, note = _everything_compared(report)
    if ok and case.variant == ONLY_DRAFT:
        ok, note = _only_draft_diverged(report)
    return LoopRow(case, verdict, first, expected, depths, ok, note), result.written


# --- --explain on the loop cases --------------------------------------------------------------------------------

EXPLAIN_CHILD = "from probe.selftest import explain_child; explain_child()"


@dataclass(frozen=True)
class Diagnosis:
    """What `mtp-probe diff --explain` said about one candidate trace: the variants its DIAGNOSIS names, best first
    (empty: none reproduces, or nothing diverged), its DIAGNOSIS line, or the error that kept it from saying."""

    named: tuple[str, ...] = ()
    line: str = ""
    error: str = ""


def explain_loop_traces(chained: Path, checkpoint: Path, traces: list[Path | None], profiles: list[str],
                        tmp: Path) -> list[Diagnosis]:
    """`mtp-probe diff CHAINED TRACE --explain --checkpoint CHECKPOINT --profile P` for every trace, in one child
    process (one torch/transformers import for all; the probe's own process never loads them). A trace that was
    not written, or a child that failed, gives a Diagnosis with its error: never an empty, passing one."""
    jobs = [{"ref": str(chained), "candidate": str(t), "checkpoint": str(checkpoint), "profile": p,
             "json": str(tmp / f"explain{i}.json")} for i, (t, p) in enumerate(zip(traces, profiles)) if t]
    jobs_file, answers = tmp / "explain_jobs.json", tmp / "explain_answers.json"
    jobs_file.write_text(json.dumps(jobs))
    proc = run_ended_with_us([sys.executable, "-c", EXPLAIN_CHILD, str(jobs_file), str(answers)], 2.0)
    if proc.returncode != 0 or not answers.is_file():
        said = (proc.stderr.strip().splitlines() or ["(no message)"])[-1]
        failed = Diagnosis(error=f"the --explain child failed (exit {proc.returncode}): {said}")
        return [failed for _ in traces]
    by_candidate = {a["candidate"]: Diagnosis(tuple(a["named"]), a["line"], a["error"])
                    for a in json.loads(answers.read_text())}
    return [by_candidate.get(str(t), Diagnosis(error="no answer for this trace")) if t else
            Diagnosis(error="no candidate trace was written") for t in traces]


def explain_child(argv: list[str] | None = None) -> None:
    """The child's side (EXPLAIN_CHILD): each job through the CLI's own `diff --explain` (probe/cli.py), stdout kept
    for its DIAGNOSIS line and the --json report for the variants it names; one job's error is its answer, the
    others still run."""
    from probe.cli import main

    jobs_file, answers = argv or sys.argv[1:3]
    out = []
    for job in json.loads(Path(jobs_file).read_text()):
        args = ["diff", job["ref"], job["candidate"], "--explain", "--checkpoint", job["checkpoint"], "--profile",
                job["profile"], "--json", job["json"], "-q"]
        printed, error, named = io.StringIO(), "", []
        try:
            with redirect_stdout(printed):
                code = main(args, standalone_mode=False)
            if code not in (0, 1, 3):  # pass, diverged, inconclusive: the explain ran; anything else did not
                error = f"mtp-probe diff --explain exited {code}"
        except Exception as err:  # noqa: BLE001  (any failure is this job's answer, reported as a failure)
            error = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        lines = [line for line in printed.getvalue().splitlines() if line.startswith("DIAGNOSIS |")]
        if not error:
            report = json.loads(Path(job["json"]).read_text())
            named = [d["variant"] for d in (report.get("explain") or {}).get("diagnosis", [])]
            if not lines:
                error = "no DIAGNOSIS line printed"
        out.append({"candidate": job["candidate"], "named": named, "line": lines[-1] if lines else "",
                    "error": error})
    Path(answers).write_text(json.dumps(out))


def _with_diagnosis(row: LoopRow, found: Diagnosis) -> LoopRow:
    """The row with what --explain named: a variant case must be diagnosed as its variant first, a correct
    candidate (or one whose loop was not checked) with no variant; a mismatch or an explain that did not run fails
    the case. A row that is already skipped stays skipped."""
    if row.ok is None:
        return row
    if found.error:
        return dataclasses.replace(row, ok=False, diagnosis="error", note=_joined(row.note, found.error))
    shown = found.named[0] if found.named else "none"
    if row.case.variant:
        right = found.named[:1] == (row.case.variant,)
        why = "" if right else f"DIAGNOSIS names {', '.join(found.named) or 'no variant'}, not {row.case.variant}"
    else:
        right = not found.named
        why = "" if right else f"DIAGNOSIS names {', '.join(found.named)} for a correct loop"
    return dataclasses.replace(row, ok=row.ok and right, diagnosis=shown, note=_joined(row.note, why))


def _joined(*notes: str) -> str:
    return "; ".join(n for n in notes if n)


def _loop_first(report: DiffReport) -> str:
    if report.verdict.name == "invalid":
        return "-"
    at = report.first_at
    return f"{at[1].stage}@d{at[0]}:{at[1].token}" if at else "-"


def _depth_reports(report: DiffReport) -> list[tuple[int, DiffReport]]:
    return [(1, report)] + [(d.depth, d.report) for d in (report.chain.depths if report.chain else ())]


def _depths(report: DiffReport) -> str:
    compared = report.chain.compared_depths if report.chain is not None else (1,)
    return f"1-{max(compared)}" if compared == tuple(range(1, max(compared) + 1)) else ",".join(map(str, compared))


def _everything_compared(report: DiffReport) -> tuple[bool, str]:
    chain = report.chain
    if chain is None or chain.not_captured or chain.compared_depths != (1, *chain.info.chain_depths):
        return False, "not every depth compared"
    missing = {j: part.not_captured for j, part in _depth_reports(report) if part.not_captured}
    if missing:
        return False, "not captured: " + "; ".join(f"d{j} {', '.join(names)}" for j, names in missing.items())
    return True, ""


def _only_draft_diverged(report: DiffReport) -> tuple[bool, str]:
    """Every stage but the draft within tolerance at every depth (the point of the variant: a stage diff that ends
    at `out` cannot see it)."""
    for depth, part in _depth_reports(report):
        for name, rows in part.rows.items():
            if name != "draft" and not rows.has_status({"ok"}).all():
                return False, f"{name} at depth {depth} diverged too"
    return True, ""


def render_table(rows: list) -> str:
    """mutant · T · verdict · first divergence · expected · t=0 rows · ok, then a one-line summary."""
    loop = [r for r in rows if isinstance(r, LoopRow)]
    rows = [r for r in rows if not isinstance(r, LoopRow)]
    head = f"{'case':<30}{'T':>2}  {'verdict':<13}{'first':<9}{'expected':<23}{'t=0 rows':<10}ok"
    lines = [head, "-" * len(head)]
    for r in rows:
        expect = r.case.expect if r.num_tokens != 1 else r.case.expect_t1
        t0 = {True: "match", False: "differ", None: "-"}[r.t0_matches]
        ok = {True: "ok", False: "FAIL", None: r.note}[r.ok]
        lines.append(f"{r.case.name:<30}{r.num_tokens:>2}  {r.verdict:<13}{r.first:<9}"
                     f"{expect[0] + ' ' + expect[1]:<23}{t0:<10}{ok}")
    lines.append("")
    lines += [f"  {r.case.name}: {r.case.why}" for r in rows if r.num_tokens == 8 and r.case.why]
    lines += _loop_table(loop) if loop else []
    rows = rows + loop
    failed = [r for r in rows if r.ok is False]
    skipped = [r for r in rows if r.ok is None]
    lines.append("")
    lines.append(("SELFTEST FAILED | " if failed else "SELFTEST PASSED | ")
                 + f"{len(rows) - len(failed) - len(skipped)}/{len(rows)} runs as expected"
                 + (f", {len(failed)} not" if failed else "") + (f", {len(skipped)} skipped" if skipped else ""))
    return "\n".join(lines)


def _loop_table(rows: list[LoopRow]) -> list[str]:
    """The draft loop's cases: first divergence as stage@d<depth>:<row> (row: token at depth 1, bridge after)."""
    head = (f"{'draft loop case':<32}{'verdict':<13}{'first':<13}{'expected':<26}{'depths':<8}"
            f"{'diagnosis':<20}ok")
    lines = ["", head, "-" * len(head)]
    for r in rows:
        ok = {True: "ok", False: "FAIL" + (f" ({r.note})" if r.note else ""), None: r.note}[r.ok]
        lines.append(f"{r.case.name:<32}{r.verdict:<13}{r.first:<13}{r.case.expect[0] + ' ' + r.expected:<26}"
                     f"{r.depths:<8}{r.diagnosis:<20}{ok}")
    lines.append("")
    lines.append("  diagnosis: the variant mtp-probe diff --explain's DIAGNOSIS names first (none: no variant; a "
                 "variant case must get its own, a correct loop none)")
    lines += [f"  {r.case.name}: {r.case.why}" for r in rows if r.case.why]
    return lines
