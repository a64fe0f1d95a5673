"""The `--plot` heatmap: stage x token, colour = tolerance budget used (log scale); matplotlib only when asked.

Rows are the reference's own stages (`report.stage_names`), in its order. The title names the verdict and the
first divergent (stage, token), and that cell is outlined. Colours are colourblind-safe and match the HTML
report: Okabe-Ito blue (within tolerance) through light grey (budget 1, the limit) to vermillion (out of
tolerance); black X = a row never written or of the wrong layout (invalid), reddish purple = NaN/Inf the candidate
computed, grey = not captured or not compared, `~` = compared but not evidence (explained in the legend).

A reference with chains (issue 24) gets one panel per compared depth, stacked (small multiples, the same stage
rows; a depth's columns are its bridge positions), each outlining its own first divergence.

A trace longer than ZOOM_ABOVE tokens gets two panels: the whole trace with its columns max-pooled (so one bad
token among thousands still shows) and a window of ZOOM_WIDTH tokens around the first divergence, at full
resolution with every mark.
"""

import textwrap
from pathlib import Path

import numpy as np

from oracle.output import agg_figure, atomic_output, figure_format

from probe.compare import INVALID_STATUSES
from probe.diff import DiffReport
from probe.evidence import evidential_rows
from probe.report import budget_text, coverage_text

_FLOOR, _CEIL = 1e-3, 1e3  # colour range of the budget; 1 (the limit) sits in the middle
PASS_BLUE, LIMIT_GREY, FAIL_VERMILLION = "#0072B2", "#EEEEEE", "#D55E00"  # Okabe-Ito
INVALID_BLACK, NONFINITE_PURPLE, GAP_GREY = "#000000", "#CC79A7", "#BDBDBD"
ZOOM_ABOVE, ZOOM_WIDTH, OVERVIEW_COLUMNS = 200, 48, 200  # tokens
_TEXT_CELLS = 64  # up to this many tokens in a panel, every mark is written in its cell
TITLE_CHARS_PER_INCH = 13  # 10-point title characters per inch of figure width, with a margin
BLIND_NOTE = "compared, but not evidence: q/k unwitnessed\n(uniform attention would pass too) or a routing near-tie"


def write_heatmap(report: DiffReport, path: Path) -> None:
    """Write the heatmap of `report` to `path` (atomically), in the format its extension names (PNG by default)."""
    picture = figure_format(path, "--plot")
    fig = heatmap_figure(report)
    with atomic_output(path, "--plot") as tmp:
        fig.savefig(tmp, format=picture, dpi=100)


def heatmap_figure(report: DiffReport):
    """The heatmap as a matplotlib Figure (Agg canvas): one panel, or overview + zoom for a long trace. Its labels
    hold paths and names from files: drawn as plain text, never parsed as $math$ (an unbalanced `$` in a folder
    name had crashed the command, exit 4, losing its verdict)."""
    fig = _heatmap_figure(report)
    from matplotlib.text import Text  # imported by agg_figure by now (or it reported that it cannot be)

    for text in fig.findobj(Text):
        text.set_parse_math(False)  # read when drawn, so setting it now covers every label
    return fig


def _heatmap_figure(report: DiffReport):
    """One panel per depth (the bridge step, then each compared chain depth: small multiples, rows = the same
    stages), plus, for a long trace, a zoom at full resolution around the first divergence of its depth."""
    names = row_names(report)
    parts = depth_reports(report)
    long = report.num_tokens > ZOOM_ABOVE
    width = 14 if long else min(5 + 0.4 * report.num_tokens, 24)
    panels = len(parts) + (1 if long else 0)
    fig = agg_figure((width, panels * (1.2 + 0.28 * len(names)) + 1.6))
    fig.set_layout_engine("constrained")
    axes = list(np.atleast_1d(fig.subplots(panels, 1)))
    image = None
    for ax, (depth, part) in zip(axes, parts):
        budget, marks = grids(part, names)
        first = _first_cell(part, names)
        label = "token" if depth == 1 else f"bridge position (depth {depth})"
        if long:
            drawn = _panel(ax, *pooled(budget, marks, OVERVIEW_COLUMNS), names, first, detail="none", xlabel=label)
            if len(parts) > 1:
                ax.set_title(f"depth {depth}: all {part.num_tokens} rows (each column: the worst of its rows)",
                             fontsize=8)
        else:
            drawn = _panel(ax, budget, marks, np.arange(part.num_tokens), names, first,
                           detail="text" if part.num_tokens <= _TEXT_CELLS else "markers", xlabel=label)
            if len(parts) > 1:
                ax.set_title(f"depth {depth}" + ("" if depth == 1 else " (rows: bridge positions)"), fontsize=8)
        image = image or drawn
    if long:
        depth, part = _focus_part(report, parts)
        budget, marks = grids(part, names)
        lo, hi = zoom_window(part.num_tokens, _focus_token(part, budget, marks))
        axes[[d for d, _ in parts].index(depth)].add_patch(_outline(lo - 0.5, -0.5, hi - lo, len(names), "0.3",
                                                                    1.2, "--"))
        _panel(axes[-1], budget[:, lo:hi], marks[:, lo:hi], np.arange(lo, hi), names, _first_cell(part, names),
               detail="text", xlabel="token" if depth == 1 else f"bridge position (depth {depth})")
        if len(parts) > 1:
            axes[-1].set_title(f"depth {depth}, rows {lo}-{hi - 1} (dashed above)", fontsize=8)
        else:
            axes[0].set_title(f"all {report.num_tokens} tokens (each column: the worst of its tokens); dashed: "
                              f"tokens {lo}-{hi - 1}, below", fontsize=8)
    fig.suptitle(title(report, width=int(width * TITLE_CHARS_PER_INCH)), fontsize=10)
    bar = fig.colorbar(image, ax=axes, label="tolerance budget used (1 = limit, log)", shrink=0.9)
    _plain_ticks(bar.ax.yaxis)
    fig.legend(handles=_legend_handles(), loc="outside lower center", ncol=3 if width >= 11 else 2, fontsize=7,
               frameon=False)
    return fig


def _plain_ticks(axis) -> None:
    """Colour-bar ticks as plain numbers (0.001 … 1000). matplotlib's log formatter writes `$\\mathdefault{10^{3}}$`,
    mathtext that the plain-text labels (heatmap_figure) would print as it is."""
    from matplotlib.ticker import FuncFormatter, NullFormatter

    axis.set_major_formatter(FuncFormatter(lambda value, _pos: f"{value:g}"))
    axis.set_minor_formatter(NullFormatter())


def depth_reports(report: DiffReport) -> list[tuple[int, DiffReport]]:
    """(depth, report) for depth 1 and each compared chain depth, in order."""
    return [(1, report)] + [(d.depth, d.report) for d in (report.chain.depths if report.chain is not None else ())]


def _focus_part(report: DiffReport, parts: list[tuple[int, DiffReport]]) -> tuple[int, DiffReport]:
    """The depth to zoom into: the first divergence's; else the first depth that is not a pass; else depth 1."""
    at = report.first_at
    if at is not None:
        return next(p for p in parts if p[0] == at[0])
    return next((p for p in parts if p[1].verdict.name != "pass"), parts[0])


def title(report: DiffReport, width: int = 120) -> str:
    """The verdict (with its whole reason unless pass/diverged, wrapped at `width` characters, never cut), the
    first divergent (stage, token; depth and bridge position at a chain depth) or that there is none, and what was
    compared."""
    verdict = {"pass": "PASSED"}.get(report.verdict.name, report.verdict.name.upper())
    reason = report.verdict.reasons[0] if report.verdict.reasons else ""
    if report.verdict.name not in ("pass", "diverged") and reason:
        verdict = textwrap.fill(f"{verdict}: {reason}", width=max(width, 40), break_long_words=True)
    depth, first = report.first_at or (1, None)
    place = "" if first is None else f"token {first.token}" if depth == 1 else f"depth {depth} bridge {first.token}"
    where = (f"first divergence: {first.stage} at {place} (budget {budget_text(first.diff.budget_used)}, outlined)"
             if first is not None else "no divergent row")
    if report.chain is not None:
        where += f"; depths {', '.join(map(str, report.chain.compared_depths))} of 1-{report.chain.info.depths}"
    names = report.stage_names or tuple(report.rows)
    return f"{verdict}\n{where}\n{Path(report.candidate).name} vs oracle, {coverage_text(report.captured, names)}, " \
           f"T={report.num_tokens}"


def row_names(report: DiffReport) -> list[str]:
    """The reference's stages, in its order (the report's rows where an old report lacks the list)."""
    return list(report.stage_names or report.rows)


def grids(report: DiffReport, names: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Budget [stages, T] (NaN: not compared) and marks ("" | invalid | nonfinite | blind) per cell."""
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


def pooled(budget: np.ndarray, marks: np.ndarray, columns: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """At most `columns` columns, each the worst of a run of tokens: the largest budget (NaN only where no token
    of it was compared), invalid over NaN/Inf; `~` marks are dropped. Returns (budget, marks, first token of each)."""
    span = -(-budget.shape[1] // columns)  # tokens per column, rounded up
    starts = np.arange(0, budget.shape[1], span)
    worst = np.fmax.reduceat(budget, starts, axis=1)  # fmax: NaN only where the whole run is NaN
    out = np.full(worst.shape, "", dtype=object)
    for mark in ("nonfinite", "invalid"):  # invalid last: it wins
        hit = np.logical_or.reduceat(marks == mark, starts, axis=1)
        out[hit] = mark
    return worst, out, starts


def zoom_window(num_tokens: int, token: int) -> tuple[int, int]:
    """Tokens lo..hi-1: ZOOM_WIDTH of them around `token`, a quarter before it, inside 0..T-1."""
    lo = max(0, min(token - ZOOM_WIDTH // 4, num_tokens - ZOOM_WIDTH))
    return lo, min(num_tokens, lo + ZOOM_WIDTH)


def _focus_token(report: DiffReport, budget: np.ndarray, marks: np.ndarray) -> int:
    """The first divergence's token; else the first invalid or non-finite cell's; else the worst budget's; else 0."""
    if report.first is not None:
        return report.first.token
    bad = np.argwhere(np.isin(marks, ["invalid", "nonfinite"]))
    if len(bad):
        return int(bad[:, 1].min())
    if np.isfinite(budget).any():
        return int(np.unravel_index(np.nanargmax(np.where(np.isfinite(budget), budget, -1)), budget.shape)[1])
    return 0


def _first_cell(report: DiffReport, names: list[str]) -> tuple[int, int] | None:
    first = report.first
    return None if first is None or first.stage not in names else (names.index(first.stage), first.token)


def _panel(ax, budget, marks, tokens: np.ndarray, names: list[str], first: tuple[int, int] | None, detail: str,
           xlabel: str = "token"):
    """Draw one heatmap panel; column j covers tokens[j] .. tokens[j+1]-1 (x in token units). `detail`: "text"
    (X, NaN and ~ written in their cells), "markers" (~ as small marks; cells too narrow for text), "none"."""
    from matplotlib.colors import LinearSegmentedColormap, ListedColormap, LogNorm

    edges = np.append(tokens, tokens[-1] + (tokens[1] - tokens[0] if len(tokens) > 1 else 1)) - 0.5
    rows = np.arange(len(names) + 1) - 0.5
    ax.set_facecolor(GAP_GREY)  # not captured / not compared: NaN cells show the background
    cmap = LinearSegmentedColormap.from_list("okabe_ito_budget", [PASS_BLUE, LIMIT_GREY, FAIL_VERMILLION])
    image = ax.pcolormesh(edges, rows, np.ma.masked_invalid(np.clip(budget, _FLOOR, _CEIL)), cmap=cmap,
                          norm=LogNorm(vmin=_FLOOR, vmax=_CEIL))
    for mark, colour in (("invalid", INVALID_BLACK), ("nonfinite", NONFINITE_PURPLE)):
        cells = np.ma.masked_where(marks != mark, np.ones(marks.shape))
        ax.pcolormesh(edges, rows, cells, cmap=ListedColormap([colour]))
    if detail == "text":
        for (row, col), mark in np.ndenumerate(marks):
            shown = {"invalid": ("X", "white"), "nonfinite": ("NaN", "white"), "blind": ("~", "black")}.get(mark)
            if shown:
                ax.text(tokens[col], row, shown[0], ha="center", va="center", color=shown[1], fontsize=8)
    elif detail == "markers":
        rows_at, cols_at = np.nonzero(marks == "blind")
        ax.scatter(tokens[cols_at], rows_at, marker="$\\sim$", s=12, color="black", linewidths=0)
    ax.set_xlim(edges[0], edges[-1])
    ax.set_ylim(rows[-1], rows[0])  # first stage on top
    ax.set_yticks(range(len(names)), names, fontsize=8)
    ax.set_xlabel(xlabel)
    if first is not None and edges[0] <= first[1] < edges[-1]:
        col = int(np.searchsorted(tokens, first[1], side="right")) - 1
        x, w = edges[col], edges[col + 1] - edges[col]
        ax.add_patch(_outline(x, first[0] - 0.5, w, 1, "black", 3.0))
        ax.add_patch(_outline(x, first[0] - 0.5, w, 1, "white", 1.0))
    return image


def _outline(x: float, y: float, width: float, height: float, colour: str, linewidth: float, style: str = "-"):
    from matplotlib.patches import Rectangle

    return Rectangle((x, y), width, height, fill=False, edgecolor=colour, linewidth=linewidth, linestyle=style)


def _legend_handles() -> list:
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    return [Patch(color=PASS_BLUE, label="within tolerance (budget < 1)"),
            Patch(color=FAIL_VERMILLION, label="out of tolerance (budget > 1)"),
            Patch(facecolor="none", edgecolor="black", linewidth=2, label="first divergence"),
            Patch(color=INVALID_BLACK, label="X  never written / wrong layout (invalid)"),
            Patch(color=NONFINITE_PURPLE, label="NaN/Inf computed by the candidate"),
            Patch(color=GAP_GREY, label="not captured / not compared"),
            Line2D([], [], linestyle="none", marker="$\\sim$", markersize=9, color="black", label=BLIND_NOTE)]
