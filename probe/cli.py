"""`mtp-probe`: question an implementation of an MTP head against the oracle's reference trace."""

from pathlib import Path

import click

from oracle.errors import MtpGroup
from oracle.output import check_writable

from probe.diff import diff_traces
from probe.report import render_text, summary_line, write_json
from probe.tolerance import DEFAULT, Tol, tol_table

EXISTING_FILE = click.Path(exists=True, dir_okay=False, path_type=Path)
OUTPUT_FILE = click.Path(dir_okay=False, path_type=Path)


@click.group(cls=MtpGroup)
def cli() -> None:
    """Compare an MTP-head implementation with an oracle trace, stage by stage and token by token."""


@cli.command()
@click.argument("ref", type=EXISTING_FILE)
@click.argument("candidate", type=click.Path(exists=True, path_type=Path))
@click.option("--rtol", type=float, help=f"Relative tolerance on max_rel = max|a-e| / max|e| per row "
                                         f"[default: {DEFAULT.rtol:g}; give with --atol].")
@click.option("--atol", type=float, help=f"Absolute tolerance on max|a-e| per row [default: {DEFAULT.atol:g}].")
@click.option("--stage-tol", multiple=True, metavar="STAGE=RTOL,ATOL", help="Per-stage override, repeatable.")
@click.option("--json", "json_path", type=OUTPUT_FILE, help="Write the report as JSON to this file.")
@click.option("--plot", "plot_path", type=OUTPUT_FILE, help="Write a stage x token heatmap PNG to this file.")
@click.option("--fail-fast", is_flag=True, help="Stop after the first token chunk that diverges.")
@click.option("-v", "--verbose", is_flag=True, help="Show the worst elements side by side, for every stage.")
@click.pass_context
def diff(ctx, ref, candidate, rtol, atol, stage_tol, json_path, plot_path, fail_fast, verbose) -> None:
    """Compare CANDIDATE (an mtp-trace/1 file, or a raw dir of <stage>.bin) with the oracle trace REF.

    A (stage, token) row passes iff max_rel < rtol or max_abs < atol. Exit 0 pass, 1 diverged, 2 invalid or bad
    input, 3 inconclusive; the last line is a greppable summary.
    """
    if (rtol is None) != (atol is None):
        raise click.UsageError("give both --rtol and --atol, or neither (API: Tol(rtol, atol, why)).")
    tols = tol_table(DEFAULT if rtol is None else Tol(rtol, atol, "--rtol/--atol"), stage_tol)
    for option, path in (("--json", json_path), ("--plot", plot_path)):
        if path:
            check_writable(path, option)  # before the diff, not after minutes of work
    report = diff_traces(ref, candidate, tols, fail_fast=fail_fast)
    if json_path:
        write_json(report, json_path)
    if plot_path:
        from probe.plot import write_heatmap  # matplotlib only when a plot is asked for

        write_heatmap(report, plot_path)
    click.echo(render_text(report, verbose=verbose))
    click.echo(summary_line(report))
    ctx.exit(report.verdict.exit_code)


def main(args=None, standalone_mode: bool = True):
    return cli.main(args=args, prog_name="mtp-probe", standalone_mode=standalone_mode)
