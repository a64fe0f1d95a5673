"""`--html F.html` (probe/html_report.py): one self-contained file with the verdict, the first divergence, the
per-stage table, the heatmap and the evidence; checked as text, and as a page in headless Chromium (skipped where
no Chromium is installed; .ci/run installs it)."""

import base64
import io
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from oracle.stages import STAGE_NAMES
from probe.cli import cli
from probe.html_report import VERDICT_COLOURS
from probe.poison import poison
from tests.helpers import FIXTURES, TINY, TINY_REF, run_cli
from tests.probe.tracekit import copy_stages, ref_data, write_raw  # noqa: F401 (fixture)


def _off_by_one_percent_from_attn_t3(stages):
    out = copy_stages(stages)
    for name in STAGE_NAMES[STAGE_NAMES.index("attn"):]:
        out[name][3:] *= np.float32(1.01)
    return out


@pytest.fixture
def candidates(ref_data, tmp_path):
    inputs, stages = ref_data
    unwritten = copy_stages(stages)
    unwritten["mh"][2] = poison(inputs.hidden_size)
    return {"pass": write_raw(tmp_path / "pass", copy_stages(stages), inputs),
            "diverged": write_raw(tmp_path / "diverged", _off_by_one_percent_from_attn_t3(stages), inputs),
            "invalid": write_raw(tmp_path / "invalid", unwritten, inputs)}


def _html(tmp_path: Path, candidate: Path, expect_exit: int) -> str:
    page = tmp_path / f"{candidate.name}.html"
    result = run_cli(cli, ["diff", TINY_REF, candidate, "--html", page])
    assert result.exit_code == expect_exit, result.output
    return page.read_text()


def _external_references(page: str) -> list[str]:
    """Anything a browser would fetch from elsewhere: src/href not a data: URI or #anchor, CSS url()/@import."""
    links = re.findall(r"""(?:src|href)\s*=\s*["']([^"']*)["']""", page)
    outside = [link for link in links if not link.startswith(("data:", "#"))]
    return outside + re.findall(r"url\(\s*['\"]?(?!data:)[^)]*\)|@import", page)


def test_pass_page_holds_verdict_table_heatmap_and_evidence(candidates, tmp_path):
    page = _html(tmp_path, candidates["pass"], 0)
    assert 'data-verdict="pass"' in page and VERDICT_COLOURS["pass"][0] in page
    assert "<h1>PASSED</h1>" in page and "PASSED | 11 stages x 8 tokens within tolerance" in page
    assert "no divergence" in page
    table = page.split('id="per-stage"', 1)[1].split("</table>", 1)[0]
    assert all(f"<td>{name}</td>" in table for name in STAGE_NAMES)
    assert "evidence:" in page and "absolute positions are not evidenced" in page
    png = base64.b64decode(re.search(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page).group(1))
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert _external_references(page) == []


def test_twin_diverged_page_names_the_first_divergence(candidates, tmp_path):
    page = _html(tmp_path, candidates["diverged"], 1)
    assert 'data-verdict="diverged"' in page and "<h1>DIVERGED</h1>" in page
    assert "first divergence: stage attn at token 3" in page
    assert "FAILED | stage 6/11 &#x27;attn&#x27; token 3" in page
    assert re.search(r"<td>attn</td>.*?<td class=\"num bad\">5</td>", page)  # 5 rows out of tolerance, flagged
    assert 'data-verdict="pass"' not in page and _external_references(page) == []


def test_twin_unwritten_row_page_is_invalid(candidates, tmp_path):
    page = _html(tmp_path, candidates["invalid"], 2)
    assert 'data-verdict="invalid"' in page and "<h1>INVALID</h1>" in page
    assert "self-checks FAILED" in page and "0x7FDEAD00" in page
    assert re.search(r"<td>mh</td>.*?<td class=\"num invalid\">1</td>", page)


def test_external_reference_check_sees_a_link():
    """Twin of the self-containment assertions: the checker does catch what a browser would fetch."""
    assert _external_references('<img src="https://example.org/x.png">') == ["https://example.org/x.png"]
    assert _external_references("<style>@import 'x.css';</style>") == ["@import"]
    assert _external_references('<img src="data:image/png;base64,AAAA"><a href="#top">') == []


def test_run_writes_html_too(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(FIXTURES / "candidates"))
    page = tmp_path / "run.html"
    result = run_cli(cli, ["run", TINY_REF, "--impl", "python:numpy_step:make_head", "--checkpoint", TINY,
                           "--html", page])
    assert result.exit_code == 0, result.output
    assert 'data-verdict="pass"' in page.read_text()


def test_unwritable_html_fails_before_the_diff(candidates, tmp_path):
    result = run_cli(cli, ["diff", TINY_REF, candidates["pass"], "--html", tmp_path / "missing" / "r.html"])
    assert result.exit_code == 2 and "--html" in result.output and "does not exist" in result.output
    assert "PASSED |" not in result.output  # refused before any work


def test_html_never_replaces_the_reference(candidates, tmp_path):
    ref = tmp_path / "ref.h5"
    shutil.copy(TINY_REF, ref)
    before = ref.read_bytes()
    result = run_cli(cli, ["diff", ref, candidates["pass"], "--html", ref])
    assert result.exit_code == 2 and ref.read_bytes() == before


# --- in a real browser ----------------------------------------------------------------------------------------

BROWSER = shutil.which("chromium") or shutil.which("chromium-browser")


def _screenshot(page: Path, out: Path, size=(1280, 1000)) -> np.ndarray:
    """Render `page` in headless Chromium with the network off; the screenshot as an RGB array."""
    from PIL import Image

    cmd = [BROWSER, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
           f"--user-data-dir={out.parent / 'chromium-profile'}", "--host-resolver-rules=MAP * ~NOTFOUND",
           f"--window-size={size[0]},{size[1]}", f"--screenshot={out}", page.resolve().as_uri()]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and out.is_file(), proc.stderr[-2000:]
    return np.asarray(Image.open(io.BytesIO(out.read_bytes())).convert("RGB")).astype(int)


def _hex_rgb(colour: str) -> np.ndarray:
    return np.array([int(colour[i:i + 2], 16) for i in (1, 3, 5)])


def _share(pixels: np.ndarray, colour: str, tolerance: int = 8) -> float:
    """The fraction of `pixels` within `tolerance` of `colour` in every channel."""
    return float((np.abs(pixels - _hex_rgb(colour)).max(axis=-1) <= tolerance).mean())


@pytest.mark.skipif(BROWSER is None, reason="no Chromium installed (apt-get install chromium; .ci/run does)")
@pytest.mark.parametrize("verdict, exit_code", [("pass", 0), ("diverged", 1), ("invalid", 2)])
def test_page_renders_in_chromium_with_the_verdict_colour(candidates, tmp_path, verdict, exit_code):
    _html(tmp_path, candidates[verdict], exit_code)
    shot = _screenshot(tmp_path / f"{verdict}.html", tmp_path / f"{verdict}.png")
    assert shot.shape[:2] == (1000, 1280)
    banner, below = shot[5:60, :, :], shot[120:, :, :]
    assert _share(banner, VERDICT_COLOURS[verdict][0]) > 0.8  # the banner is drawn, in its verdict's colour
    for other, (colour, _) in VERDICT_COLOURS.items():
        if other != verdict:
            assert _share(banner, colour) < 0.05
    # Not blank: the page has a body (text, table rules, the heatmap) below the banner.
    assert _share(below, "#ffffff", tolerance=0) < 0.97 and len(np.unique(below.reshape(-1, 3), axis=0)) > 50


@pytest.mark.skipif(BROWSER is None, reason="no Chromium installed (apt-get install chromium; .ci/run does)")
def test_twin_screenshot_check_fails_on_a_blank_page(tmp_path):
    """The screenshot assertions are not vacuous: an empty page fails them."""
    page = tmp_path / "blank.html"
    page.write_text("<!DOCTYPE html><html><body></body></html>")
    shot = _screenshot(page, tmp_path / "blank.png")
    assert _share(shot[5:60], VERDICT_COLOURS["pass"][0]) < 0.8
    assert _share(shot[120:], "#ffffff", tolerance=0) >= 0.97


# --- the heatmap as Chromium shows it: the picture drawn, with colour-bar ticks a person reads ---------------------

def _heatmap_in_chromium(page: Path, tmp_path: Path) -> np.ndarray:
    """The page's embedded heatmap PNG, shown alone at 1:1 in headless Chromium: the screenshot's picture area."""
    from PIL import Image

    data = re.search(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page.read_text()).group(1)
    width, height = Image.open(io.BytesIO(base64.b64decode(data))).size
    alone = tmp_path / "heatmap_alone.html"
    alone.write_text(f'<!DOCTYPE html><html><body style="margin:0;background:#fff">'
                     f'<img style="display:block" src="data:image/png;base64,{data}"></body></html>')
    return _screenshot(alone, tmp_path / "heatmap_alone.png", size=(width + 40, height + 40))[:height, :width]


def _drawn(fig) -> np.ndarray:
    fig.canvas.draw()
    return np.asarray(fig.canvas.buffer_rgba())[..., :3].astype(int)


def _tick_region(fig) -> tuple[slice, slice]:
    """Pixel rows and columns (top-left origin) of the colour bar's tick labels, as drawn."""
    from tests.probe.test_plot import _colour_bar

    fig.canvas.draw()
    boxes = [t.get_window_extent() for t in _colour_bar(fig).get_yticklabels() if t.get_text()]
    height = int(fig.bbox.height)
    x0, x1 = int(min(b.x0 for b in boxes)), int(max(b.x1 for b in boxes)) + 1
    y0, y1 = int(min(b.y0 for b in boxes)), int(max(b.y1 for b in boxes)) + 1
    return slice(max(0, height - y1), height - y0), slice(x0, x1)


@pytest.mark.skipif(BROWSER is None, reason="no Chromium installed (apt-get install chromium; .ci/run does)")
def test_chromium_shows_the_heatmap_with_plain_colour_bar_ticks(candidates, tmp_path):
    """What a reader sees in the browser is the figure whose colour-bar tick labels read 0.001 … 1000 (checked as
    drawn text in tests/probe/test_plot.py): the screenshot equals that drawing, tick labels included."""
    from probe.diff import diff_traces
    from probe.plot import heatmap_figure
    from tests.probe.test_plot import PLAIN_TICKS, _drawn_tick_labels, _readable

    _html(tmp_path, candidates["diverged"], 1)
    shot = _heatmap_in_chromium(tmp_path / "diverged.html", tmp_path)
    fig = heatmap_figure(diff_traces(TINY_REF, candidates["diverged"]))
    labels = _drawn_tick_labels(fig)
    assert [text for text, _ in labels] == PLAIN_TICKS and _readable(labels)
    drawn = _drawn(fig)
    assert shot.shape == drawn.shape and np.abs(shot - drawn).mean() < 2
    rows, cols = _tick_region(fig)
    assert (np.abs(shot[rows, cols] - drawn[rows, cols]).max(axis=-1) > 48).mean() < 0.01
    assert (shot[rows, cols].max(axis=-1) < 100).any()  # the labels are there, in ink


@pytest.mark.skipif(BROWSER is None, reason="no Chromium installed (apt-get install chromium; .ci/run does)")
def test_twin_chromium_check_sees_mathtext_tick_labels(candidates, tmp_path):
    """The comparison has power: the same figure with matplotlib's mathtext ticks (drawn as raw text, the bug)
    differs from what Chromium shows in the tick-label region."""
    from matplotlib.ticker import LogFormatterSciNotation

    from probe.diff import diff_traces
    from probe.plot import heatmap_figure
    from tests.probe.test_plot import _colour_bar

    _html(tmp_path, candidates["diverged"], 1)
    shot = _heatmap_in_chromium(tmp_path / "diverged.html", tmp_path)
    broken = heatmap_figure(diff_traces(TINY_REF, candidates["diverged"]))
    _colour_bar(broken).yaxis.set_major_formatter(LogFormatterSciNotation())
    drawn = _drawn(broken)
    rows, cols = _tick_region(broken)
    differs = shot.shape != drawn.shape or (np.abs(shot[rows, cols] - drawn[rows, cols]).max(axis=-1) > 48).mean() > 0.01
    assert differs


# --- what --explain found, and the per-stage counts ------------------------------------------------------------

def test_explain_findings_are_in_the_page_as_in_the_json(candidates, tmp_path):
    import json

    page, js = tmp_path / "explain.html", tmp_path / "explain.json"
    result = run_cli(cli, ["diff", TINY_REF, candidates["diverged"], "--checkpoint", TINY, "--explain", "-q",
                           "--html", page, "--json", js])
    assert result.exit_code == 1, result.output
    explain, text = json.loads(js.read_text())["explain"], page.read_text()
    section = text.split('id="why-it-diverges-(--explain)"', 1)[1].split("</section>", 1)[0]
    diagnosis = next(line for line in result.output.splitlines() if line.startswith("DIAGNOSIS | "))
    assert html_escape(diagnosis) in section
    assert "local error" in section and "weight coverage" in section
    assert all(html_escape(line) in section for line in explain["coverage"]["lines"])
    assert explain["local"] and all(
        re.search(rf"<td>{row['stage']}</td><td class=\"num\">{row['token']}</td>.*?>{row['kind']}</td>", section)
        for row in explain["local"])
    assert "not run" not in section


def test_twin_without_explain_the_page_says_it_was_not_run(candidates, tmp_path):
    section = _html(tmp_path, candidates["diverged"], 1).split('id="why-it-diverges-(--explain)"', 1)[1]
    section = section.split("</section>", 1)[0]
    assert "not run" in section and "--explain" in section and "DIAGNOSIS" not in section


def test_a_stage_never_written_has_no_rows_compared(ref_data, tmp_path):
    inputs, stages = ref_data
    never = copy_stages(stages)
    never["mlp"][:] = poison(inputs.hidden_size)  # every row of the stage still holds the poison
    page = _html(tmp_path, write_raw(tmp_path / "never", never, inputs), 2)
    assert re.search(r"<td>mlp</td><td>[^<]*</td><td class=\"num\">0</td><td class=\"num\">0</td>"
                     r"<td class=\"num invalid\">8</td>", page)
    # twin: a stage written in full counts every row as compared
    assert re.search(r"<td>mh</td><td>[^<]*</td><td class=\"num\">8</td>", page)


def html_escape(text: str) -> str:
    import html

    return html.escape(text, quote=True)
