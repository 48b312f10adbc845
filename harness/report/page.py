"""The report as one self-contained page, index.html: this call's PNG figures embedded
(base64) per setting, the throughput and best-method tables, the measured / published
comparison, what is missing and where the rows come from. No external resource, no
script; every text is escaped."""

from __future__ import annotations

import base64
import html
import re
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pandas as pd

from harness.measure import results
from harness.report.data import _log
from harness.report.tables import _fmt, ratio_table, summary_tables

# Provenance shown on the page: what the rows say of where and with what they ran. The
# configuration and plan JSON (one document per row) stay in the shards.
PROVENANCE = ["network"] + [
    c for c in results.PROVENANCE + results.ENGINE if c not in ("config_json", "plan_json")
]
KINDS = {"fig": "throughput", "efficiency": "scaling efficiency", "breakdown": "time per phase",
         "whatif": "best method by fabric and GPU count"}
STYLE = """
body { font-family: system-ui, sans-serif; max-width: 1180px; margin: 1.5em auto;
       padding: 0 1em; color: #222; line-height: 1.4; }
h1 { margin-bottom: .2em; } h2 { border-bottom: 1px solid #ccc; margin-top: 1.8em; }
nav a { margin-right: 1em; }
code, td.n { font-family: ui-monospace, Menlo, Consolas, "DejaVu Sans Mono", monospace; }
.scroll { overflow-x: auto; margin: .5em 0 1em; }
table { border-collapse: collapse; font-size: .9em; }
th, td { border: 1px solid #bbb; padding: .25em .55em; vertical-align: top; }
th { background: #f0f0f0; text-align: left; }
td.n { text-align: right; white-space: nowrap; }
td.t { white-space: nowrap; } td.w { min-width: 18em; max-width: 46em; overflow-wrap: anywhere; }
figure { margin: 1em 0 2em; } img { max-width: 100%; height: auto; border: 1px solid #eee; }
figcaption { font-size: .9em; color: #444; } .muted { color: #777; }
"""
_NUMBER = re.compile(r"^[-+]?[\d.]+(e[-+]?\d+)?( ± [\d.]+(e[-+]?\d+)?|x)?$|^—$")


def provenance(rows: pd.DataFrame, limit: int = 8) -> dict[str, list[tuple[str, int]]]:
    """Per provenance column the rows fill: its distinct values and how many rows hold
    each, most common first (at most `limit`, then ("… N more", 0)); a list column
    (hostnames, devices) counts the rows holding each element; started_at is shown as
    first … last."""
    shown: dict[str, list[tuple[str, int]]] = {}
    for col in [c for c in PROVENANCE if c in rows]:
        values = rows[col].explode().dropna()
        values = values[values.astype(str).str.strip() != ""]
        if values.empty:
            continue
        if col == "started_at":
            shown[col] = [(f"{values.min()} … {values.max()}", len(values))]
            continue
        pairs = pd.DataFrame({"row": values.index, "value": values.astype(str)})
        counts = pairs.drop_duplicates()["value"].value_counts()  # rows, not list elements
        more = [(f"… {len(counts) - limit} more", 0)] if len(counts) > limit else []
        shown[col] = [*counts.head(limit).items(), *more]
    return shown


def _esc(value: object) -> str:
    return html.escape(str(value))


def _cell(value: object) -> str:
    text = value if isinstance(value, str) else _fmt(value)
    kind = "n" if _NUMBER.match(text) or isinstance(value, (int, float, np.number)) else "t"
    kind = "w" if kind == "t" and len(text) > 40 else kind  # long text wraps: errors, paths
    return f'<td class="{kind}">{_esc(text)}</td>'


def html_table(frame: pd.DataFrame) -> str:
    """A plain HTML table; numbers formatted as in summary.md; "none" for no rows."""
    if frame.empty:
        return "<p>none</p>"
    head = "".join(f"<th>{_esc(c)}</th>" for c in frame.columns)
    body = "".join(
        "<tr>" + "".join(map(_cell, r)) + "</tr>\n" for r in frame.itertuples(index=False)
    )
    return f'<div class="scroll"><table>\n<tr>{head}</tr>\n{body}</table></div>'


def _figures_html(groups: Mapping[str, list[Path]]) -> str:
    if not groups:
        return "<p>none</p>"
    parts = []
    for label, paths in groups.items():
        parts.append(f"<h3>{_esc(label)}</h3>")
        for path in paths:
            data = base64.b64encode(path.read_bytes()).decode("ascii")
            what = KINDS.get(path.stem.partition("_")[0], "")
            caption = f"{path.name}" + (f": {what}" if what else "")
            parts.append(f'<figure><img src="data:image/png;base64,{data}" alt="{_esc(caption)}">'
                         f"<figcaption>{_esc(caption)}</figcaption></figure>")
    return "\n".join(parts)


def _comparison(cells: pd.DataFrame, published: pd.DataFrame | None) -> str:
    if published is None:
        alone = cells["source"].eq("published").all()
        why = "the reference alone is drawn (no measured rows)" if alone else "no reference="
        return f"<p>none: {why}</p>"
    ratios = ratio_table(cells, published)
    if ratios.empty:
        return "<p>none: no measured cell (model, method, gpus) is in the reference</p>"
    return html_table(ratios)


def _gaps_html(gaps: Mapping[str, pd.DataFrame]) -> str:
    parts = [f"<h3>{_esc(head)}</h3>\n{html_table(t)}" for head, t in gaps.items() if len(t)]
    return "\n".join(parts) if parts else "<p>none: every method ran at every size</p>"


def _provenance_html(rows: pd.DataFrame) -> str:
    shown = provenance(rows)
    if not shown:
        return "<p>none (no result rows)</p>"
    lines = []
    for col, values in shown.items():
        items = ", ".join(
            f"<code>{_esc(v)}</code>" + (f' <span class="muted">×{n}</span>' if n else "")
            for v, n in values
        )
        lines.append(f'<tr><th>{_esc(col)}</th><td class="w">{items}</td></tr>')
    note = f'<p class="muted">Distinct values over {len(rows)} rows (×: rows holding it).</p>'
    return note + '<div class="scroll"><table>\n' + "\n".join(lines) + "\n</table></div>"


def _section(anchor: str, title: str, body: str) -> str:
    return f'<h2 id="{anchor}">{_esc(title)}</h2>\n{body}'


def render(
    *,
    intro: str,
    cells: pd.DataFrame,
    figures: Mapping[str, list[Path]],
    published: pd.DataFrame | None,
    gaps: Mapping[str, pd.DataFrame],
    rows: pd.DataFrame,
) -> str:
    """The page's HTML. `intro`: one line (`code` in backticks); `cells`: aggregated cells;
    `figures`: PNGs per setting (`write_figures`); `published`: reference cells or None;
    `gaps`: `tables.gap_tables`; `rows`: the raw result rows (their provenance columns)."""
    wide, _, best = summary_tables(cells, published)
    sections = [
        ("figures", "Figures", _figures_html(figures)),
        ("throughput", "Throughput (samples/s, mean ± std over repeats)", html_table(wide)),
        ("best", "Best method and its speedup per GPU count", html_table(best)),
        ("published", "Measured / published", _comparison(cells, published)),
        ("missing", "Missing and failed", _gaps_html(gaps)),
        ("provenance", "Provenance", _provenance_html(rows)),
    ]
    return document("ddlbench report", intro, sections)


def document(title: str, intro: str, sections: list[tuple[str, str, str]]) -> str:
    """A self-contained page: `title`, `intro` (`code` in backticks) and a navigation bar
    over `sections` (anchor, heading, HTML body; the heading up to " (" in the bar)."""
    intro_html = re.sub(r"`([^`]*)`", r"<code>\1</code>", _esc(intro))
    nav = "".join(f'<a href="#{a}">{_esc(t.split(" (")[0])}</a>' for a, t, _ in sections)
    return "\n".join([
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">',
        f"<title>{_esc(title)}</title>\n<style>{STYLE}</style>\n</head>\n<body>",
        f"<h1>{_esc(title)}</h1>\n<p>{intro_html}</p>\n<nav>{nav}</nav>",
        *(_section(*s) for s in sections),
        "</body>\n</html>\n",
    ])


def write_page(out: Path, text: str) -> Path:
    """Write the page `text` (`render`) to out/index.html and say so; returns its path."""
    path = out / "index.html"
    path.write_text(text, encoding="utf-8")
    _log(f"wrote {path}")
    return path
