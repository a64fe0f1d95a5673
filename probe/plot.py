"""The `--plot` heatmap: stage x token, colour = tolerance budget used (log scale); matplotlib only when asked."""

from pathlib import Path

import numpy as np

from oracle.stages import STAGE_NAMES

from oracle.output import agg_figure, atomic_output

from probe.compare import INVALID_STATUSES
from probe.diff import DiffReport
from probe.evidence import evidential_rows
from probe.report import coverage_text

_FLOOR, _CEIL = 1e-3, 1e3  # colour range of the budget; 1 (the limit) sits in the middle


def write_heatmap(report: DiffReport, path: Path) -> None:
    """Write a PNG: budget per (stage, token); invalid cells black with an X, computed NaN/Inf red, gaps grey."""
    fig = agg_figure((min(4 + 0.4 * report.num_tokens, 24), 5.5))  # the Agg canvas, without pyplot's state
    from matplotlib.colors import LogNorm  # importable now: agg_figure checked matplotlib

    budget, marks = _grids(report)
    ax = fig.add_subplot()
    ax.set_facecolor("0.85")  # not captured / not compared: NaN cells show the background
    image = ax.imshow(np.clip(budget, _FLOOR, _CEIL), aspect="auto", cmap="RdYlGn_r", interpolation="nearest",
                      norm=LogNorm(vmin=_FLOOR, vmax=_CEIL))
    overlay = np.zeros(budget.shape + (4,))
    overlay[marks == "invalid"] = (0, 0, 0, 1)
    overlay[marks == "nonfinite"] = (0.6, 0, 0, 1)
    ax.imshow(overlay, aspect="auto", interpolation="nearest")
    if report.num_tokens <= 64:
        for (row, col), mark in np.ndenumerate(marks):
            text = {"invalid": "X", "nonfinite": "NaN", "blind": "~"}.get(mark)
            if text:
                ax.text(col, row, text, ha="center", va="center", color="white" if mark != "blind" else "black")
    names = report.stage_names or STAGE_NAMES
    ax.set_yticks(range(len(names)), names)
    ax.set_xlabel("token")
    ax.set_title(f"{report.verdict.name.upper()}: {Path(report.candidate).name} vs oracle "
                 f"({coverage_text(report.captured, report.stage_names or STAGE_NAMES)})", fontsize=9)
    fig.colorbar(image, ax=ax, label="tolerance budget used (1 = limit, log)")
    fig.tight_layout()
    with atomic_output(path, "--plot") as tmp:
        fig.savefig(tmp, format="png", dpi=100)


def _grids(report: DiffReport) -> tuple[np.ndarray, np.ndarray]:
    names = list(report.stage_names or STAGE_NAMES)
    budget = np.full((len(names), report.num_tokens), np.nan)
    marks = np.full(budget.shape, "", dtype=object)
    for name, rows in report.rows.items():
        at, tokens = names.index(name), rows.tokens
        invalid, nonfinite = rows.has_status(INVALID_STATUSES), rows.has_status({"nonfinite"})
        valued = ~invalid & ~nonfinite
        marks[at, tokens[invalid]] = "invalid"
        marks[at, tokens[nonfinite]] = "nonfinite"
        budget[at, tokens[valued]] = rows.budget_used[valued]
        marks[at, tokens[valued & ~evidential_rows(rows)]] = "blind"
    return budget, marks
