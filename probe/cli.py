"""`mtp-probe`: question an implementation of an MTP head against the oracle's reference trace.

numpy, h5py and the diff load inside the commands, not here: `run --impl c:LIB` starts the library's worker process
first (probe/adapters/cabi_process.py), so that its start-up overlaps the probe's own."""

import functools
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click

from oracle.errors import MtpError, MtpGroup, OutputError
from oracle.output import check_writable, figure_format, refuse_overwriting_inputs
from oracle.progress import reporting, say
from oracle.stages import KNOWN_STAGE_NAMES
from oracle.text import printable

from probe.adapters.spec import SPEC_HELP, c_library, needs_checkpoint
from probe.errors import ToleranceError
from probe.tolerance import (DEFAULT, PROFILES, Tol, measured_tol_table, profile_file_spec, reference_facts,
                             tol_table, user_tol)

if TYPE_CHECKING:
    from probe.diff import DiffReport

EXISTING_FILE = click.Path(exists=True, dir_okay=False, path_type=Path)
EXISTING_DIR = click.Path(exists=True, file_okay=False, path_type=Path)
OUTPUT_FILE = click.Path(dir_okay=False, path_type=Path)


@click.group(cls=MtpGroup)
@click.version_option(package_name="mtp-probe", prog_name="mtp-probe", message="%(prog)s %(version)s")
def cli() -> None:
    """Compare an MTP-head implementation with an oracle trace, stage by stage and token by token."""


def diff_options(command):
    """Tolerance and report options shared by `diff` and `run`."""
    options = [
        click.option("--profile", default="float32", show_default=True, metavar="NAME|FILE[:PATH]",
                     help=f"Tolerance profile for the candidate's precision: {' or '.join(sorted(PROFILES))} (fixed "
                          f"numbers), or FILE[:PATH], a measured per-stage profile written by `mtp-oracle noise` "
                          f"(PATH: its computation path, float32, bfloat16 or float16; default bfloat16)."),
        click.option("--rtol", type=float, help=f"Relative tolerance on max_rel = max|a-e| / max|e| per row "
                                                f"[default: {DEFAULT.rtol:g}; give with --atol]."),
        click.option("--atol", type=float, help=f"Absolute tolerance on max|a-e| per row [default: {DEFAULT.atol:g}]."),
        click.option("--stage-tol", multiple=True, metavar="STAGE=RTOL,ATOL", help="Per-stage override, repeatable."),
        click.option("--json", "json_path", type=OUTPUT_FILE, help="Write the report as JSON to this file."),
        click.option("--plot", "plot_path", type=OUTPUT_FILE,
                     help="Write a stage x token heatmap to this file (.png, .jpg, .svg or .pdf, by its extension)."),
        click.option("--html", "html_path", type=OUTPUT_FILE,
                     help="Write the report as one self-contained HTML file (verdict, table, heatmap; no network)."),
        click.option("--fail-fast", is_flag=True, help="Stop after the first token chunk that diverges."),
        click.option("-v", "--verbose", is_flag=True, help="Show the worst elements side by side, for every stage."),
        click.option("-q", "--quiet", is_flag=True, help="No progress on stderr."),
        click.option("--explain", is_flag=True,
                     help="Also say why: local vs inherited error per stage, the known wiring variant that "
                          "reproduces the candidate (DIAGNOSIS line), weight coverage, and (run) whether capturing "
                          "changes the result. Needs the reference's checkpoint; loads torch."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def invalid_line_on_error(command):
    """A user-fixable error in `diff`/`run` (bad reference, crashing candidate, mismatched config) still ends stdout
    with the greppable verdict line, `INVALID | <cause>`; the full message follows on stderr (exit 2)."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except OutputError:
            raise  # an unwritable --json/--plot/--html: the verdict line was already printed (or no work done)
        except MtpError as err:
            click.echo(printable(f"INVALID | {str(err).splitlines()[0] if str(err) else type(err).__name__}"))
            err.verdict_line_printed = True  # oracle/errors.py MtpGroup: not repeated where stderr is stdout
            raise

    return wrapper


@cli.command(epilog="""\b
Examples:
  mtp-probe diff fixtures/qwen3_5_tiny_ref.h5 cand.h5
  mtp-probe diff ref.h5 dump/ --profile bfloat16 --json report.json --plot heat.png --html report.html
  mtp-probe diff ref.h5 dump/ --stage-tol attn=1e-3,1e-5 --fail-fast -v
  mtp-probe diff ref.h5 dump/ --profile noise.json:bfloat16
""")
@click.argument("ref", type=EXISTING_FILE)
@click.argument("candidate", type=click.Path(exists=True, path_type=Path))
@click.option("--checkpoint", type=EXISTING_DIR,
              help="Checkpoint of the reference, for --explain [default: the one it records].")
@click.option("--names", "names_map", metavar="MAP",
              help="CANDIDATE is an engine's dump folder named by the engine: llama.cpp, sglang, vllm, or a JSON/TOML "
                   "map file {\"names\": {\"engine name\": \"stage\"}}.")
@diff_options
@click.pass_context
@invalid_line_on_error
def diff(ctx, ref, candidate, checkpoint, names_map, profile, rtol, atol, stage_tol, json_path, plot_path, fail_fast, verbose,
         html_path, quiet, explain) -> None:
    """Compare CANDIDATE (an mtp-trace/1 file, or a raw dir of <stage>.bin) with the oracle trace REF.

    A (stage, token) row passes iff max_rel < rtol or max_abs < atol. Exit 0 pass, 1 diverged, 2 invalid or bad
    input, 3 inconclusive; the last line is a greppable summary.
    """
    from probe.diff import diff_traces

    tols = _tols(ref, profile, rtol, atol, stage_tol, json_path, plot_path, html_path)
    outputs = {"--json": json_path, "--plot": plot_path, "--html": html_path}
    inputs = {"REF": ref, "CANDIDATE": candidate, "checkpoint": checkpoint if explain else None}
    refuse_overwriting_inputs(outputs, inputs)
    _check_plot_format(plot_path)
    with reporting(enabled=not quiet):
        if names_map is None:
            report = diff_traces(ref, candidate, tols, fail_fast=fail_fast)
        else:
            from probe.adapters.engine_dump import diff_named_dump

            report, unmapped = diff_named_dump(ref, candidate, names_map, tols, fail_fast)
            if unmapped:
                click.echo(f"note: {len(unmapped)} dumped tensor(s) the map places on no stage (not compared): "
                           f"{', '.join(unmapped[:12])}{' …' if len(unmapped) > 12 else ''}")
    explanation = None
    if explain:
        _loading_note(quiet)
        from probe.explain import explain_diff  # torch and transformers load only here
        from probe.run import checkpoint_for

        # the checkpoint --explain reads may be the recorded one or one found by digest: known only now, and it is
        # an input too (a report written over its config.json or a shard destroyed it, exit 0)
        used = checkpoint_for(ref, checkpoint, log=say)
        refuse_overwriting_inputs(outputs, inputs | {"checkpoint": used})
        explanation = explain_diff(report, ref, candidate, used, tols)
    ctx.exit(_render(report, json_path, plot_path, verbose, html_path, explanation))


@cli.command(epilog="""\b
Examples:
  mtp-probe run ref.h5 --impl c:build/mtp_step.so
  PYTHONPATH=fixtures/candidates mtp-probe run fixtures/qwen3_5_tiny_ref.h5 --impl python:numpy_step:make_head
  mtp-probe run ref.h5 --impl torch:cuda:bfloat16 --profile bfloat16 --checkpoint CHECKPOINT --html report.html
""")
@click.argument("ref", type=EXISTING_FILE)
@click.option("--impl", "spec", required=True, metavar="SPEC", help=f"Implementation: {SPEC_HELP}.")
@click.option("--checkpoint", type=EXISTING_DIR, help="Checkpoint of the reference [default: the one it records].")
@click.option("--out", type=OUTPUT_FILE, help="Also write the candidate's trace (mtp-trace/1) here.")
@diff_options
@click.pass_context
@invalid_line_on_error
def run(ctx, ref, spec, checkpoint, out, profile, rtol, atol, stage_tol, json_path, plot_path, fail_fast,
        verbose, html_path, quiet, explain) -> None:
    """Run an implementation on REF's recorded inputs and the reference's weights, then diff it like `diff`.

    \b
    --impl SPEC is one of:
      c:LIB.so   a shared library implementing the C ABI declared in fixtures/candidates/mtp_probe.h
                 (in the mtp-probe repository), built e.g. with
                 gcc -O2 -shared -fPIC -Ifixtures/candidates my_step.c -o my_step.so;
                 it runs in a child process, so a crash is reported (exit 2), not fatal.
      python:MODULE:FACTORY   MODULE importable (e.g. on PYTHONPATH); FACTORY(config, weights) -> impl,
                 called once per run. config: the head config (hidden_size, num_attention_heads, ...);
                 weights: {checkpoint name "mtp.*": float32 array}. impl.step(pos, embed_row, hidden, out,
                 trace) is called for each step t in order: write the head output into out[:] and each
                 captured stage into trace[stage][:] (rows of poison-filled buffers; never rebind them).
                 The optional impl.capture lists the stages it captures; the impl keeps its own KV cache.
                 Against a reference with chains, an impl with draft_step(depth, token, pos, embed_row, out,
                 trace) is driven through its own draft loop: step() for bridge i, then draft_step for
                 depths 2.. of its chain (no hidden: it recycles its own), then bridge i+1. A C ABI v2
                 library does the same through its optional mtp2_draft_step.
                 Example: fixtures/candidates/numpy_step.py.
      llama.cpp:MODEL.gguf[:LIB]   llama.cpp's own MTP graph (LLAMA_CONTEXT_TYPE_MTP) on MODEL.gguf
                 (write one with `mtp-oracle gguf CHECKPOINT --out MODEL.gguf`), through the pinned
                 llama-cpp-python's libllama, or LIB: your build's libllama.so (or its folder); its cb()
                 tensor names are mapped onto the stages. K/V in float32, flash attention off;
                 llama.cpp-fa: flash attention on (K/V in f16: judge with --profile float16). Needs no
                 --checkpoint (the GGUF holds the weights), but --explain does.
      torch[:cpu|cuda[:float32|bfloat16]]   the built-in transcription from raw tensor ops
                 (dense Qwen3.5 heads only; other families: python:, c: with C ABI v2, llama.cpp).

    The checkpoint is the one REF records (or one found beside it by its head digest) unless --checkpoint
    is given; its weights are checked against REF's digests (the head's and, for MoE, the routed experts REF
    used).
    """
    from probe.adapters.cabi_process import early_worker

    # absolute now: a candidate's chdir must not move where the outputs land (it runs in a child process anyway)
    out, json_path, plot_path, html_path = (p and p.absolute() for p in (out, json_path, plot_path, html_path))
    library = c_library(spec)
    # A C library's worker starts now, on the reference's inputs (killed if a check below fails): its start-up,
    # mapping and steps overlap the imports and checks that follow.
    early = ctx.with_resource(early_worker(library, checkpoint, ref))
    from probe.run import adapter_from_spec, adapter_notes, checkpoint_for, reference_conventions, run_and_diff

    tols = _tols(ref, profile, rtol, atol, stage_tol, json_path, plot_path, html_path)
    if needs_checkpoint(spec) or explain:
        checkpoint = checkpoint_for(ref, checkpoint, log=lambda msg: click.echo(msg, err=True))
    refuse_overwriting_inputs({"--out": out, "--json": json_path, "--plot": plot_path, "--html": html_path},
                              {"REF": ref, "checkpoint": checkpoint, "--impl library": library})
    _check_plot_format(plot_path)
    if out:
        check_output(out, "--out")
    adapter = adapter_from_spec(spec, checkpoint, reference_conventions(ref), early)
    with reporting(enabled=not quiet):
        result = run_and_diff(ref, adapter, tols, out=out, fail_fast=fail_fast,
                              command=shlex.join(["mtp-probe", *sys.argv[1:]]))
    # Determinism is not measured here (one run), so it is not claimed; an adapter that knows it is not
    # deterministic (e.g. torch on a GPU) says so.
    determinism = "" if result.deterministic else " (declares itself NOT deterministic: two runs may differ)"
    click.echo(f"ran {result.adapter}{determinism}"
               + (f"; candidate trace written to {result.written}" if result.written else ""))
    for note in adapter_notes(adapter):
        click.echo(note)
    _echo_candidate_output(getattr(adapter, "output", ""))
    report, explanation = result.report, None
    if explain:
        _loading_note(quiet)
        from probe.explain import explain_run  # torch and transformers load only here

        report, explanation = explain_run(report, ref, result.stages, checkpoint, tols, adapter, result.depths)
    ctx.exit(_render(report, json_path, plot_path, verbose, html_path, explanation))


@cli.command(epilog="""\b
Examples:
  mtp-probe weights fixtures/qwen3_5_tiny engine_dump.safetensors
  mtp-probe weights CHECKPOINT dump_dir/ --json audit.json -v
""")
@click.argument("checkpoint", type=click.Path(exists=True, path_type=Path))
@click.argument("dump", type=click.Path(exists=True, path_type=Path))
@click.option("--json", "json_path", type=OUTPUT_FILE, help="Write verdict and every head tensor's audit as JSON.")
@click.option("-v", "--verbose", is_flag=True, help="List the ok tensors too.")
@click.pass_context
def weights(ctx, checkpoint, dump, json_path, verbose) -> None:
    """Audit the weights an engine loaded (DUMP: .safetensors, or a dir of .safetensors/.npy) against CHECKPOINT.

    Each head tensor is ok, missing, zeros, constant, init_like, transposed, scaled, quantized, permuted_rows or
    different. Exit 0 all ok, 1 any not, 2 unreadable input; the last line is WEIGHTS OK | … or WEIGHTS DIFFER | ….
    """
    from probe.weights import audit_weights, render_weights, write_weights_json

    refuse_overwriting_inputs({"--json": json_path}, {"CHECKPOINT": checkpoint, "DUMP": dump})
    if json_path:
        check_output(json_path, "--json")
    try:
        report = audit_weights(checkpoint, dump)
    except MtpError as err:
        if json_path:
            write_weights_json({"schema": "mtp-probe-weights/1", "verdict": "invalid", "error": str(err),
                                "tensors": []}, json_path)
        click.echo(f"WEIGHTS INVALID | {str(err).splitlines()[0]}")
        raise
    if json_path:
        write_weights_json(report.to_json(), json_path)
    click.echo(render_weights(report, verbose))
    click.echo(report.summary_line())
    ctx.exit(report.exit_code)


@cli.command(epilog="""\b
Examples:
  mtp-probe selftest
  mtp-probe selftest --build-dir build -q
  mtp-probe selftest --reference ref.h5 --checkpoint CHECKPOINT
""")
@click.option("--reference", type=EXISTING_FILE, help="Reference trace [default: the bundled fixture].")
@click.option("--checkpoint", type=EXISTING_DIR, help="Its checkpoint [default: the bundled fixture].")
@click.option("--build-dir", type=click.Path(file_okay=False, path_type=Path),
              help="Keep the built libraries here [default: a temporary directory].")
@click.option("-q", "--quiet", is_flag=True, help="No progress on stderr.")
@click.pass_context
def selftest(ctx, reference, checkpoint, build_dir, quiet) -> None:
    """Prove the probe on itself: every mutant caught and localised, every correct candidate passing."""
    from probe.selftest import render_table, run_selftest

    with reporting(enabled=not quiet):
        rows = run_selftest(reference, checkpoint, build_dir, log=(lambda msg: None) if quiet else say)
    click.echo(render_table(rows))
    ctx.exit(0 if all(r.ok is not False for r in rows) else 1)


def _echo_candidate_output(output: str) -> None:
    """What the candidate printed (captured by its worker, cut and escaped: probe/adapters/cabi.py _printed), each
    line behind `  | `, so that none of it can pass for the verdict line, which comes last."""
    if output:
        click.echo("candidate output:\n" + "\n".join(f"  | {line}" for line in output.splitlines()))


def _loading_note(quiet: bool) -> None:
    """--explain imports torch and transformers (seconds, silent otherwise): say so first."""
    if not quiet:
        say("--explain: loading torch and transformers to rerun the oracle on the candidate's stages …")


def _check_plot_format(plot_path: Path | None) -> None:
    """x.gif: refused before the work (after the input checks), never written as PNG bytes under that name."""
    if plot_path:
        figure_format(plot_path, "--plot")


def check_output(path: Path, option: str) -> None:
    """oracle/output.py check_writable: every output checked before the work (so a verdict is never followed by
    exit 2)."""
    check_writable(path, option)


def _tols(ref: Path, profile: str, rtol, atol, stage_tol, json_path, plot_path, html_path=None) -> dict[str, Tol]:
    if (rtol is None) != (atol is None):
        given, missing = ("--rtol", "--atol") if atol is None else ("--atol", "--rtol")
        raise click.UsageError(f"{given} without {missing}: give both (e.g. --rtol 1e-3 --atol 1e-5; a row passes if "
                               f"either holds) or neither (default --rtol {DEFAULT.rtol:g} --atol {DEFAULT.atol:g}).")
    measured = profile_file_spec(profile)  # None: a named profile
    if measured is not None and rtol is not None:
        raise click.UsageError(f"--profile {profile} gives every stage its measured tolerance; --rtol/--atol would "
                               f"replace all of them. Drop --rtol/--atol (override single stages with --stage-tol "
                               f"STAGE=RTOL,ATOL), or use a named --profile.")
    for option, path in (("--json", json_path), ("--plot", plot_path), ("--html", html_path)):
        if path:
            check_output(path, option)  # before the diff, not after minutes of work
    _stage_tol_stages_exist(ref, stage_tol)
    if measured is not None:  # the profile is an input too: no report may overwrite it
        refuse_overwriting_inputs({"--json": json_path, "--plot": plot_path, "--html": html_path},
                                  {"--profile": measured[0]})
        return tol_table(overrides=stage_tol, measured=measured_tol_table(*measured, reference_facts(ref)))
    return tol_table(PROFILES[profile] if rtol is None else user_tol(rtol, atol, "--rtol/--atol"), stage_tol)


def _stage_tol_stages_exist(ref: Path, stage_tol) -> None:
    """A --stage-tol for a stage the reference does not have would silently do nothing: refuse it (red team)."""
    if not stage_tol:
        return
    stages = reference_facts(ref)["stages"]
    for text in stage_tol:
        name = text.partition("=")[0].strip()
        if name not in stages:  # a typo or another family's stage: the reference's own list, not every family's
            other = " (another family's stage)" if name in KNOWN_STAGE_NAMES else ""
            raise ToleranceError(f"--stage-tol {text}: '{name}' is not a stage of the reference {ref}{other}; its "
                                 f"stages: {', '.join(stages)}. Drop it or name one of those.")


def _render(report: "DiffReport", json_path: Path | None, plot_path: Path | None, verbose: bool,
            html_path: Path | None = None, explanation=None) -> int:
    from probe.report import render_text, summary_line, write_json
    from probe.rowdiff import kernel_note

    if kernel_note():
        click.echo(kernel_note(), err=True)
    unwritten, written = [], []  # a report that cannot be written must not cost the verdict: printed, then exit 2
    if json_path:
        try:
            write_json(report, json_path, {"explain": explanation.to_json()} if explanation else None)
            written.append(f"--json {json_path}")
        except MtpError as err:
            unwritten.append(err)
    if plot_path:
        try:
            from probe.plot import write_heatmap  # matplotlib only when a plot is asked for

            write_heatmap(report, plot_path)
            written.append(f"--plot {plot_path}")
        except MtpError as err:
            unwritten.append(err)
    if html_path:
        try:
            from probe.html_report import write_html  # matplotlib for its heatmap, only when asked for

            write_html(report, html_path, explanation)
            written.append(f"--html {html_path}")
        except MtpError as err:
            unwritten.append(err)
    if written:
        click.echo(f"wrote {', '.join(written)}")
    click.echo(render_text(report, verbose=verbose))
    if explanation is not None:
        click.echo("\n" + explanation.text())
        click.echo(explanation.diagnosis_line())  # just before the summary line
    click.echo(summary_line(report))
    if unwritten:
        raise OutputError(" ".join(str(err) for err in unwritten))
    return report.verdict.exit_code


def main(args=None, standalone_mode: bool = True):
    return cli.main(args=args, prog_name="mtp-probe", standalone_mode=standalone_mode)
