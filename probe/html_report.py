"""`--html F.html`: the diff report as one self-contained HTML file, readable in a browser as a CI artifact.

Everything is inline — CSS, and the heatmap as a base64 PNG drawn by probe/plot.py (the `--plot` picture) — so the
file opens with no network access and can be archived alone. It holds, top to bottom: a verdict banner (the
summary line), the first divergence, a per-stage table, the heatmap, the self-checks and the evidence, and the
whole text report; a reference with chains adds a per-depth table (and the heatmap a panel per depth). Every
sentence comes from probe/report.py (summary_line, cell_detail, render_text, budget_text,
coverage_text); this module only lays them out. Banner colours are the Okabe-Ito palette, which stays
distinguishable under the common colour-vision deficiencies, and the verdict is always written out as well.
"""

import base64
import html
from pathlib import Path

import numpy as np

from oracle.output import atomic_output, scratch_directory
from oracle.stages import STAGE_BY_NAME, STAGE_NAMES

from probe.compare import DIVERGENT_STATUSES, INVALID_STATUSES, most_severe
from probe.diff import DiffReport
from probe.rule import RULE
from probe.report import budget_text, cell_detail, coverage_text, render_text, summary_line

NOT_COMPARED_STATUSES = frozenset({"tie"})  # a routing near-tie excuses the row: compared neither way

# Okabe-Ito (Okabe & Ito 2008): blue / vermillion / reddish purple / orange, with the text colour that reads on it.
VERDICT_COLOURS = {"pass": ("#0072B2", "#ffffff"), "diverged": ("#D55E00", "#ffffff"),
                   "invalid": ("#CC79A7", "#000000"), "inconclusive": ("#E69F00", "#000000")}
VERDICT_WORDS = {"pass": "PASSED", "diverged": "DIVERGED", "invalid": "INVALID", "inconclusive": "INCONCLUSIVE"}

_CSS = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; margin: 0; color: #1a1a1a; background: #fff; }
main { padding: 0 24px 24px; max-width: 1400px; }
.banner { padding: 18px 24px; }
.banner h1 { margin: 0 0 6px; font-size: 28px; letter-spacing: .04em; }
.banner p { margin: 0; font-family: ui-monospace, monospace; font-size: 13px; word-break: break-all; }
h2 { font-size: 17px; margin: 26px 0 8px; border-bottom: 1px solid #ddd; padding-bottom: 4px; }
pre { background: #f6f6f6; padding: 10px 12px; overflow-x: auto; font-size: 12.5px; line-height: 1.35; margin: 0; }
pre.wrap { white-space: pre-wrap; }
table { border-collapse: collapse; font-size: 13px; }
th, td { border: 1px solid #d0d0d0; padding: 3px 8px; text-align: left; vertical-align: top; }
th { background: #eee; }
td.num { text-align: right; font-variant-numeric: tabular-nums; font-family: ui-monospace, monospace; }
td.bad { background: #D55E00; color: #fff; }
td.invalid { background: #CC79A7; color: #000; }
tr.missing td { color: #777; }
img.heatmap { max-width: 100%; border: 1px solid #ddd; }
.meta { color: #555; font-size: 12.5px; }
"""


def render_html(report: DiffReport, heatmap_png: bytes | None = None, explanation=None) -> str:
    """The whole page as a string; `heatmap_png` (probe/plot.py's PNG) is embedded as a data: URI when given;
    `explanation` (probe/explain.py, under --explain) adds what --explain found."""
    background, foreground = VERDICT_COLOURS[report.verdict.name]
    word = VERDICT_WORDS[report.verdict.name]
    text = render_text(report, verbose=True)
    sections = [
        ("First divergence", _pre(_first_divergence(report), wrap=True)),
        ("Why it diverges (--explain)", _explain(explanation)),
        ("Per stage", _stage_table(report)),
        *([("Depths", _depth_table(report))] if report.chain is not None else []),
        ("Heatmap", _heatmap(heatmap_png)),
        ("Self-checks", _pre(_block(text, "self-checks"), wrap=True)),
        ("Evidence", _pre(_block(text, "evidence:"), wrap=True)),
        ("Full report", _pre(text)),
    ]
    body = "\n".join(f'<section id="{_anchor(title)}"><h2>{title}</h2>\n{content}</section>'
                     for title, content in sections)
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{_e(word)}: {_e(Path(report.candidate).name)} vs oracle — mtp-probe</title>
<style>{_CSS}</style>
</head>
<body>
<header class="banner" id="verdict" data-verdict="{report.verdict.name}" style="background:{background};color:{foreground}">
<h1>{_e(word)}</h1>
<p>{_e(summary_line(report))}</p>
</header>
<main>
<p class="meta">oracle {_e(report.reference)} &middot; candidate {_e(report.candidate)} ({_e(report.candidate_kind)})
&middot; T={report.num_tokens}, D={report.hidden_size} &middot; {_e(coverage_text(report.captured))}
&middot; exit code {report.verdict.exit_code}</p>
{body}
</main>
</body>
</html>
"""


def write_html(report: DiffReport, path: Path, explanation=None) -> None:
    """Write render_html(report, …, explanation), with the heatmap, to `path` atomically (oracle/output.py)."""
    from probe.plot import write_heatmap  # matplotlib only when a picture is asked for

    with scratch_directory("mtp-probe-html-") as tmp:
        png = Path(tmp) / "heatmap.png"
        write_heatmap(report, png)
        page = render_html(report, png.read_bytes(), explanation)
    with atomic_output(path, "--html") as tmp_path:
        tmp_path.write_text(page, encoding="utf-8")


def _first_divergence(report: DiffReport) -> str:
    if report.first_at is None:
        return "no divergence: every compared row is within tolerance or failed a self-check (see Self-checks)"
    depth, first = report.first_at
    place = f"token {first.token}" if depth == 1 else f"depth {depth} bridge position {first.token}"
    return (f"first divergence: stage {first.stage} at {place}\n\n"
            + cell_detail(first, verbose=True, names=report.stage_names or STAGE_NAMES))


def _explain(explanation) -> str:
    """The DIAGNOSIS line, local vs inherited error (a table of the divergent tokens' rows) and weight coverage:
    what --explain prints and writes to the JSON's `explain`."""
    if explanation is None:
        return ("<p>not run: add <code>--explain</code> for the wiring variant that reproduces the candidate, "
                "local vs inherited error per stage and weight coverage (needs the reference's checkpoint).</p>")
    parts = [f'<p class="diagnosis"><strong>{_e(explanation.diagnosis_line())}</strong></p>',
             _pre(explanation.text(), wrap=True)]
    if explanation.local:
        parts += ["<table>", "<tr><th>stage</th><th>token</th><th>local max_rel (vs the oracle run on the "
                  "candidate's own inputs)</th><th>cumulative max_rel (vs the reference)</th><th>error</th></tr>"]
        for row in explanation.local:
            kind = {"local": "num bad"}.get(row["kind"], "num")
            parts.append(f'<tr><td>{_e(row["stage"])}</td><td class="num">{row["token"]}</td>'
                         f'<td class="num">{row["local_max_rel"]:.3g}</td>'
                         f'<td class="num">{row["cumulative_max_rel"]:.3g}</td>'
                         f'<td class="{kind}">{_e(row["kind"])}</td></tr>')
        parts.append("</table>")
    return "\n".join(parts)
def _depth_table(report: DiffReport) -> str:
    """One row per depth of the draft loop: rows (bridge positions), verdict, first divergence, recycle evidence."""
    chain = report.chain
    lines = ["<table>", "<tr><th>depth</th><th>rows</th><th>verdict</th><th>first divergence</th>"
                        "<th>out of tolerance</th><th>recycle evidence</th></tr>"]
    parts = {1: (report, chain.bridge_verdict, None)} | {d.depth: (d.report, d.report.verdict, d) for d in chain.depths}
    for depth in (1, *chain.info.chain_depths):
        if depth not in parts:
            why = "not captured (never counted as passed)" if depth in chain.not_captured else chain.not_compared
            lines.append(f'<tr class="missing"><td>{depth}</td><td colspan="5">{_e(why)}</td></tr>')
            continue
        part, verdict, diff = parts[depth]
        first = f"{part.first.stage} at {'token' if depth == 1 else 'bridge'} {part.first.token}" if part.first else "-"
        bad = sum(int(r.has_status(DIVERGENT_STATUSES).sum()) for r in part.rows.values())
        recycle = "bridge step (consumes H_i)" if diff is None else "; ".join(
            f"vs {e.alt}: {int(e.evidencing.sum())}/{len(e.sensitive)} rows" for e in diff.recycle) or "none recorded"
        if diff is not None and diff.recycle_note:
            recycle += f" ({diff.recycle_note})"
        colour = ' class="bad"' if verdict.name == "diverged" else (' class="invalid"' if verdict.name == "invalid"
                                                                     else "")
        lines.append(f'<tr><td>{depth}</td><td class="num">{part.num_tokens}</td><td{colour}>'
                     f'{_e(VERDICT_WORDS[verdict.name])}</td><td>{_e(first)}</td><td class="num">{bad}</td>'
                     f'<td>{_e(recycle)}</td></tr>')
    lines.append("</table>")
    info = chain.info
    lines.append(f"<p>chain: tokens {_e(info.tokens)}, recycle {_e(info.recycle)}, layers "
                 f"{_e(', '.join(map(str, info.layers)))}, kv {_e(info.kv)}</p>")
    return "\n".join(lines)


def _stage_table(report: DiffReport) -> str:
    head = ("<tr><th>stage</th><th>what it is</th><th>rows compared</th><th>out of tolerance</th>"
            "<th>never written / wrong layout</th><th>worst budget (token)</th><th>first divergent token</th>"
            "<th>tolerance</th></tr>")
    lines = ["<table>", head]
    docs = report.stage_docs or {n: STAGE_BY_NAME[n].doc for n in STAGE_NAMES}
    for name in report.stage_names or STAGE_NAMES:
        doc, tol = _e(docs.get(name, "")), report.tols[name]
        tol_text = f"rtol {tol.rtol:g}, atol {tol.atol:g}"
        rows = report.rows.get(name)
        if rows is None:
            lines.append(f'<tr class="missing"><td>{_e(name)}</td><td>{doc}</td><td colspan="5">'
                         f'not captured (never counted as passed)</td><td>{tol_text}</td></tr>')
            continue
        divergent, invalid = rows.has_status(DIVERGENT_STATUSES), rows.has_status(INVALID_STATUSES)
        compared = int((~invalid & ~rows.has_status(NOT_COMPARED_STATUSES)).sum())  # an unwritten row is not compared
        worst = most_severe(rows, valid_only=True)
        worst_text = "-"
        if worst is not None:
            token = rows.start + worst[0]
            worst_text = f"{budget_text(rows.diff(token).budget_used)} (t{token})"
        first = f"t{rows.start + int(np.flatnonzero(divergent)[0])}" if divergent.any() else "-"
        bad, broken = ("num bad" if divergent.any() else "num"), ("num invalid" if invalid.any() else "num")
        lines.append(f'<tr><td>{_e(name)}</td><td>{doc}</td><td class="num">{compared}</td>'
                     f'<td class="{bad}">{int(divergent.sum())}</td><td class="{broken}">{int(invalid.sum())}</td>'
                     f'<td class="num">{_e(worst_text)}</td><td class="num">{first}</td><td>{tol_text}</td></tr>')
    lines.append("</table>")
    lines.append(f"<p>tolerance rule: {_e(RULE.text)}</p>")
    return "\n".join(lines)


def _heatmap(png: bytes | None) -> str:
    if png is None:
        return "<p>(no heatmap)</p>"
    data = base64.b64encode(png).decode("ascii")
    return (f'<img class="heatmap" alt="tolerance budget per (stage, token)" '
            f'src="data:image/png;base64,{data}">')


def _block(text: str, first_word: str) -> str:
    """The paragraph of render_text's output that starts with `first_word` (its blocks are blank-line separated)."""
    for block in text.split("\n\n"):
        if block.startswith(first_word):
            return block
    return f"(the text report has no '{first_word}' section)"


def _pre(text: str, wrap: bool = False) -> str:
    return f'<pre class="wrap">{_e(text)}</pre>' if wrap else f"<pre>{_e(text)}</pre>"


def _anchor(title: str) -> str:
    return title.lower().replace(" ", "-")


def _e(text: str) -> str:
    return html.escape(str(text), quote=True)
