"""The what-if page: of a folder of `python -m harness.simulate experiment=whatif` (its
`<run_id>_best.csv`: the best method per model, GPU, fabric and GPU count), per model and
GPU a heatmap of the best method by fabric (rows) and GPU count (columns), each cell in
the method's colour with its margin over the runner-up in %, saved as PNG and PDF, and
index.html with them, the methods' share of the cells and the rows' provenance.

A folder is a what-if folder when its best.csv files name more than one GPU of the table:
then its rows mix GPUs, which the per-setting bars would average, so only this page is
drawn."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.colors import to_rgba
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from harness.report.data import _log
from harness.report.page import _figures_html, _provenance_html, document, html_table
from harness.report.style import method_color, method_order

TIED = (0.85, 0.85, 0.85, 1.0)  # a cell where three or more methods tie (e.g. one GPU)
BEST_COLUMNS = {"model", "compute", "network", "gpus", "method", "tied", "margin_pct"}


def read_best(results_dir: str | Path) -> pd.DataFrame | None:
    """Every what-if best.csv under `results_dir`, newest last (a cell predicted twice keeps
    its newest), or None where they name fewer than two GPUs of the table (not a what-if
    folder: e.g. measured profiles of one and two processes)."""
    files = sorted(Path(results_dir).rglob("*_best.csv"), key=lambda p: p.stat().st_mtime)
    frames = [pd.read_csv(f) for f in files]
    frames = [f for f in frames if BEST_COLUMNS <= set(f.columns)]
    if not frames:
        return None
    best = pd.concat(frames, ignore_index=True).drop_duplicates(
        ["model", "compute", "network", "gpus"], keep="last")
    gpus = {c.split(":")[1] for c in best.compute.astype(str) if c.startswith("counted:")}
    return best if len(gpus) > 1 else None


def gpu_name(compute: str) -> str:
    """`counted:h100_sxm:fp32` -> `h100_sxm fp32`; other computes as they are."""
    parts = compute.split(":")
    return " ".join(parts[1:]) if parts[0] == "counted" else compute


def draw(best: pd.DataFrame, out: Path) -> dict[str, list[Path]]:
    """One heatmap per model and GPU (`whatif_<model>_<gpu>`), grouped by model."""
    drawn: dict[str, list[Path]] = {}
    for (model, compute), cells in best.groupby(["model", "compute"], sort=True):
        stem = out / f"whatif_{model}_{re.sub(r'[^A-Za-z0-9_.-]+', '_', gpu_name(compute))}"
        drawn.setdefault(f"What if: {model}", []).append(heatmap(cells, model, compute, stem))
        _log(f"wrote {stem}.png and .pdf")
    return drawn


def heatmap(cells: pd.DataFrame, model: str, compute: str, stem: Path) -> Path:
    """The best method of each fabric and GPU count, its margin over the runner-up written
    in the cell ("=": tied; blank on grey: three or more tie)."""
    fabrics, counts = sorted(cells.network.unique()), sorted(cells.gpus.unique())
    grid, texts = marks(cells, fabrics, counts)
    fig = Figure(figsize=(max(7.0, 0.42 * len(counts) + 2.2), 0.42 * len(fabrics) + 2.2))
    ax = fig.add_subplot()
    for (i, j), text in np.ndenumerate(texts):
        dark = sum(grid[i, j][:3]) < 1.3
        ax.text(j, i, text, ha="center", va="center", fontsize=6.5,
                color="white" if dark else "black")
    ax.imshow(grid, aspect="auto", interpolation="nearest")
    ax.set_xticks(range(len(counts)), [str(g) for g in counts], fontsize=7, rotation=90)
    ax.set_yticks(range(len(fabrics)), fabrics, fontsize=8)
    ax.set_xlabel("GPUs (the best of the sweep's shapes at each count)")
    calibrated = "calibrated" if (cells.get("calibrated", "no") == "yes").all() else \
        "not calibrated (spec sheets)"
    ax.set_title(f"{model} on {gpu_name(compute)}, {calibrated}: best method by fabric and "
                 "GPU count;\nin each cell its margin over the runner-up (%), = tied, "
                 "grey: three or more tie", fontsize=9)
    shown = method_order(m for m in cells.method[cells.tied.str.count("=") < 2])
    handles = [Patch(color=method_color(m), label=m) for m in shown]
    handles.append(Patch(color=TIED, label="3+ tie"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7,
              frameon=False)
    fig.tight_layout()
    fig.savefig(f"{stem}.png", dpi=130)
    fig.savefig(f"{stem}.pdf")
    return Path(f"{stem}.png")


def marks(cells: pd.DataFrame, fabrics: list[str], counts: list[int]
          ) -> tuple[np.ndarray, np.ndarray]:
    """Per fabric (row) and GPU count (column): the cell's colour (RGBA: its best method's,
    grey where three or more tie, white where the sweep has no such cell) and its text
    (the margin in %, "<1" below 1%, "=" tied with one other, blank otherwise)."""
    grid = np.ones((len(fabrics), len(counts), 4))
    texts = np.full((len(fabrics), len(counts)), "", dtype=object)
    at = {(f, g): (i, j) for i, f in enumerate(fabrics) for j, g in enumerate(counts)}
    for row in cells.itertuples(index=False):
        i, j = at[row.network, row.gpus]
        ties = str(row.tied).count("=")
        grid[i, j] = TIED if ties >= 2 else to_rgba(method_color(row.method))
        texts[i, j] = "" if ties >= 2 else "=" if ties else _margin(row.margin_pct)
    return grid, texts


def _margin(pct: float) -> str:
    if pct != pct:  # no runner-up: one method in the cell
        return ""
    return "<1" if pct < 1 else f"{pct:.0f}"


def shares(best: pd.DataFrame) -> pd.DataFrame:
    """Per model and GPU, how many of its cells each method wins alone or in a tie of two
    (ties of three or more apart), and the median margin of the cells won alone."""
    lone = best.tied.str.count("=") < 2
    table = (best[lone].groupby(["model", "compute", "method"])
             .agg(cells=("gpus", "size"), median_margin_pct=("margin_pct", "median"))
             .reset_index())
    table["compute"] = table.compute.map(gpu_name)
    return table.sort_values(["model", "compute", "cells"], ascending=[True, True, False])


def render(intro: str, best: pd.DataFrame, figures: dict[str, list[Path]],
           rows: pd.DataFrame) -> str:
    """The what-if page's HTML (self-contained, as page.render's)."""
    body = [
        ("figures", "Best method by fabric and GPU count", _figures_html(figures)),
        ("shares", "Cells each method wins, per model and GPU", html_table(shares(best))),
        ("provenance", "Provenance", _provenance_html(rows)),
    ]
    return document("ddlbench what-if report", intro, body)
