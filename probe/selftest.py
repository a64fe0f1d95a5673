"""`mtp-probe selftest`: before trusting the probe's verdict on your engine, watch it catch known mistakes.

Builds the plain-C candidate and every compile-time mutant (fixtures/candidates/mtp_step.c), runs each — and the
torch candidates — against the bundled reference (T=8) and against its first step alone (T=1), and checks each
verdict and first divergence against what it must be. Five mutants match perfectly at t=0 (one key: softmax ≡ 1),
so with T=1 they must come out inconclusive, never pass. One mutant must pass: every step at position p+1.
"""

import shutil
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from oracle.output import removed_on_interrupt
from oracle.progress import tracked
from oracle.stages import LEGACY_FAMILY
from oracle.trace import TraceInputs, read_trace, write_trace
from probe.adapters.cabi import CAbiAdapter, build_library
from probe.diff import DiffReport
from probe.errors import ProbeError
from probe.run import adapter_from_spec, run_and_diff
from probe.tolerance import PROFILES, tol_table

ROOT = Path(__file__).resolve().parents[1]
CANDIDATES = ROOT / "fixtures" / "candidates"
BUNDLED_REFERENCE = ROOT / "fixtures" / "qwen3_5_tiny_ref.h5"
BUNDLED_CHECKPOINT = ROOT / "fixtures" / "qwen3_5_tiny"
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
    with tempfile.TemporaryDirectory(prefix="mtp-selftest-") as tmp, removed_on_interrupt(Path(tmp)):
        builds = Path(build_dir or tmp)
        builds.mkdir(parents=True, exist_ok=True)
        one_step = first_step_reference(reference, Path(tmp) / "t1.h5")
        rows = []
        for case in tracked(CASES, "selftest", len(CASES), unit="case"):
            log(f"selftest: {case.name}")
            rows += _run_case(case, reference, one_step, checkpoint, builds)
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


def render_table(rows: list[Row]) -> str:
    """mutant · T · verdict · first divergence · expected · t=0 rows · ok, then a one-line summary."""
    head = f"{'case':<30}{'T':>2}  {'verdict':<13}{'first':<9}{'expected':<23}{'t=0 rows':<10}ok"
    lines = [head, "-" * len(head)]
    for r in rows:
        expect = r.case.expect if r.num_tokens != 1 else r.case.expect_t1
        t0 = {True: "match", False: "differ", None: "-"}[r.t0_matches]
        ok = {True: "ok", False: "FAIL", None: r.note}[r.ok]
        lines.append(f"{r.case.name:<30}{r.num_tokens:>2}  {r.verdict:<13}{r.first:<9}"
                     f"{expect[0] + ' ' + expect[1]:<23}{t0:<10}{ok}")
    failed = [r for r in rows if r.ok is False]
    skipped = [r for r in rows if r.ok is None]
    lines.append("")
    lines += [f"  {r.case.name}: {r.case.why}" for r in rows if r.num_tokens == 8 and r.case.why]
    lines.append("")
    lines.append(("SELFTEST FAILED | " if failed else "SELFTEST PASSED | ")
                 + f"{len(rows) - len(failed) - len(skipped)}/{len(rows)} runs as expected"
                 + (f", {len(failed)} not" if failed else "") + (f", {len(skipped)} skipped" if skipped else ""))
    return "\n".join(lines)
