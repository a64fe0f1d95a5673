"""The --plot heatmap: titled with the verdict and the first divergence, that cell outlined, rows from the
reference's own stage list, a palette that stays readable under colour-vision deficiency, a legend for `~`, and
for long traces the whole trace (max-pooled) plus a zoomed window around the first divergence."""

import numpy as np
import pytest

from probe.diff import diff_traces
from probe.plot import BLIND_NOTE, ZOOM_WIDTH, heatmap_figure, pooled, write_heatmap
from tests.helpers import TINY_REF, load_script, run_cli
from tests.probe.tracekit import copy_stages, load_trace, perturbed_from, synthetic, write_h5

# Machado et al. (2009) simulation matrices, severity 1, applied in linear RGB.
PROTANOPIA = np.array([[0.152286, 1.052583, -0.204868], [0.114503, 0.786281, 0.099216],
                       [-0.003882, -0.048116, 1.051998]])
DEUTERANOPIA = np.array([[0.367322, 0.860646, -0.227968], [0.280085, 0.672501, 0.047413],
                         [-0.011820, 0.042940, 0.968881]])


def _seen_distance(a, b, matrix) -> float:
    """Distance in sRGB between two RGB(A) colours as seen with a colour-vision deficiency."""
    def linear(c):
        c = np.asarray(c[:3], dtype=float)
        return np.where(c <= 0.04045, c / 12.92, ((c + 0.055) / 1.055) ** 2.4)

    def srgb(v):
        v = np.clip(v, 0, 1)
        return np.where(v <= 0.0031308, 12.92 * v, 1.055 * v ** (1 / 2.4) - 0.055)

    return float(np.linalg.norm(srgb(matrix @ linear(a)) - srgb(matrix @ linear(b))))


@pytest.fixture(scope="module")
def diverged(tmp_path_factory):
    """fc wrong from token 3 on (propagating downstream), mlp never written at token 2."""
    inputs, stages = load_trace(TINY_REF)
    cand = perturbed_from(stages, "fc", lambda rows: rows + np.where(np.arange(len(rows))[:, None] >= 3, 0.5, 0))
    cand["mlp"][2] = 0
    return diff_traces(TINY_REF, write_h5(tmp_path_factory.mktemp("plot") / "c.h5", inputs, cand))


def _outlines(ax):
    return [p for p in ax.patches if p.get_linewidth() >= 2.5]


def test_title_names_the_verdict_and_first_divergence_and_that_cell_is_outlined(diverged):
    fig = heatmap_figure(diverged)
    assert diverged.first.stage == "fc" and diverged.first.token == 3
    lines = fig._suptitle.get_text().splitlines()
    assert lines[0].startswith("INVALID") and lines[-2].startswith("first divergence: fc at token 3 (budget")
    ax = fig.axes[0]
    [box] = _outlines(ax)
    row = [t.get_text() for t in ax.get_yticklabels()].index("fc")
    assert box.get_xy() == (2.5, row - 0.5) and box.get_width() == 1 and box.get_height() == 1


def test_twin_a_pass_has_no_outlined_cell():
    report = diff_traces(TINY_REF, TINY_REF)
    fig = heatmap_figure(report)
    assert fig._suptitle.get_text().splitlines()[:2] == ["PASSED", "no divergent row"]
    assert _outlines(fig.axes[0]) == []


def test_the_palette_keeps_pass_and_fail_apart_under_colour_vision_deficiency(diverged):
    import matplotlib

    mesh = heatmap_figure(diverged).axes[0].collections[0]
    ok, bad = (mesh.cmap(mesh.norm(b)) for b in (0.01, 100.0))
    for matrix in (PROTANOPIA, DEUTERANOPIA):
        assert _seen_distance(ok, bad, matrix) > 0.5
    red_green = matplotlib.colormaps["RdYlGn_r"]  # the twin: the old palette collapses for these viewers
    old_ok, old_bad = (red_green(mesh.norm(b)) for b in (0.01, 100.0))
    assert _seen_distance(old_ok, old_bad, DEUTERANOPIA) < 0.5


def test_the_legend_explains_the_tilde_marks_drawn_in_the_cells(diverged):
    fig = heatmap_figure(diverged)
    legend = fig.legends[0]
    assert BLIND_NOTE in [t.get_text() for t in legend.get_texts()] and "not evidence" in BLIND_NOTE
    assert any(getattr(h, "get_marker", lambda: "")() == "$\\sim$" for h in legend.legend_handles)
    assert "~" in [t.get_text() for t in fig.axes[0].texts]  # t=0 attn onwards: one key, never evidence


@pytest.fixture(scope="module")
def moe_report(tmp_path_factory):
    from oracle.cli import cli as oracle_cli

    root = tmp_path_factory.mktemp("plot_moe")
    ckpt = load_script("make_fixtures").write_moe_checkpoint(root / "ckpt", "qwen3_5_moe", "fused", main_model=False)
    result = run_cli(oracle_cli, ["export", ckpt, "--out", root / "m.h5", "--tokens", "5,17,3", "--hidden-seed",
                                  "0", "-q"])
    assert result.exit_code == 0, result.output
    return diff_traces(root / "m.h5", root / "m.h5")


def test_rows_are_the_references_own_stage_list(moe_report):
    labels = [t.get_text() for t in heatmap_figure(moe_report).axes[0].get_yticklabels()]
    assert labels == list(moe_report.stage_names) and "topk_ids" in labels and len(labels) == 17


@pytest.fixture(scope="module")
def long_report(tmp_path_factory):
    root = tmp_path_factory.mktemp("plot_long")
    inputs, stages = synthetic(300, 16)
    cand = copy_stages(stages)
    for name in ("ah", "attn", "res1", "mh", "mlp", "res2", "out"):
        cand[name][217] += 0.3
    return diff_traces(write_h5(root / "ref.h5", inputs, stages), write_h5(root / "c.h5", inputs, cand))


def test_a_long_trace_gets_the_whole_trace_and_a_zoom_on_the_first_divergence(long_report, tmp_path):
    fig = heatmap_figure(long_report)
    overview, zoom = fig.axes[0], fig.axes[1]
    assert overview.get_xlim() == (-0.5, 299.5)
    lo, hi = zoom.get_xlim()
    assert hi - lo == ZOOM_WIDTH and lo < 217 < hi
    assert len(_outlines(overview)) == 1 and len(_outlines(zoom)) == 1
    assert "first divergence: ah at token 217" in fig._suptitle.get_text()
    write_heatmap(long_report, tmp_path / "h.png")
    assert (tmp_path / "h.png").read_bytes()[:4] == b"\x89PNG"


def test_pooling_keeps_one_bad_token_among_thousands_visible():
    budget = np.full((2, 4000), 1e-3)
    budget[1, 3001] = 500.0
    budget[0, :20] = np.nan  # not compared
    marks = np.full(budget.shape, "", dtype=object)
    marks[0, 3999] = "invalid"
    worst, kinds, starts = pooled(budget, marks, 200)
    assert worst.shape == (2, 200) and starts[1] == 20
    assert worst[1, 3001 // 20] == 500.0  # the maximum: a mean would show 25
    assert np.isnan(worst[0, 0]) and kinds[0, -1] == "invalid"


# --- the colour bar as a person reads it ------------------------------------------------------------------------

PLAIN_TICKS = ["0.001", "0.01", "0.1", "1", "10", "100", "1000"]


def _colour_bar(fig):
    return next(ax for ax in fig.axes if ax.get_ylabel().startswith("tolerance budget used"))


def _drawn_tick_labels(fig) -> list:
    """The colour bar's tick labels as drawn: (text, width in pixels), after a real draw on the Agg canvas."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    bar = _colour_bar(fig)
    low, high = sorted(bar.get_ylim())
    return [(t.get_text(), t.get_window_extent(renderer).width)
            for value, t in zip(bar.get_yticks(), bar.get_yticklabels())
            if low <= value <= high and t.get_visible() and t.get_text()]


def _readable(labels: list) -> bool:
    """Each label a plain number (no `$`, no mathtext), drawn about as wide as its few characters (10 px each)."""
    def plain_number(text: str) -> bool:
        try:
            return float(text) > 0 and f"{float(text):g}" == text
        except ValueError:
            return False

    return bool(labels) and all("$" not in text and "mathdefault" not in text and plain_number(text)
                                and width <= 10 * len(text) for text, width in labels)


def test_the_colour_bar_ticks_are_plain_numbers_as_drawn(diverged):
    labels = _drawn_tick_labels(heatmap_figure(diverged))
    assert [text for text, _ in labels] == PLAIN_TICKS and _readable(labels)


def test_twin_the_tick_check_fails_on_matplotlibs_mathtext_labels_drawn_as_plain_text(diverged):
    """Before the fix: LogFormatterSciNotation's mathtext, drawn with parse_math off, reads $\\mathdefault{10^{3}}$."""
    from matplotlib.ticker import LogFormatterSciNotation

    fig = heatmap_figure(diverged)
    _colour_bar(fig).yaxis.set_major_formatter(LogFormatterSciNotation())
    labels = _drawn_tick_labels(fig)
    assert any("mathdefault" in text for text, _ in labels) and not _readable(labels)


def test_an_invalid_runs_title_keeps_its_whole_reason_wrapped(diverged):
    """The INVALID reason is wrapped onto lines that fit the figure, never cut with an ellipsis."""
    fig = heatmap_figure(diverged)
    text = fig._suptitle.get_text()
    reason = diverged.verdict.reasons[0]
    assert "…" not in text and " ".join(text.split()).startswith(" ".join(f"INVALID: {reason}".split()))
    fig.canvas.draw()
    title_box, fig_box = fig._suptitle.get_window_extent(), fig.bbox
    assert title_box.x0 >= fig_box.x0 and title_box.x1 <= fig_box.x1  # wrapped inside the picture
