"""The report's figures per setting: throughput bars (with a published panel), scaling
efficiency and the phase breakdown, saved as PNG and PDF."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.figure import Figure  # Figure objects render with Agg; no pyplot state
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from harness.report.data import PHASES, SETTING, _log
from harness.report.style import method_color, method_hatch, method_order


def _notes(missing: pd.DataFrame, rows: pd.DataFrame, limit: int = 6) -> list[str]:
    """Lines listing one setting's missing cells (and a missing baseline) for a figure."""
    lines = [
        f"missing {m} @ {w} workers: {r}"
        for m, w, r in missing[["method", "world_size", "reason"]].itertuples(index=False)
    ]
    if not rows.empty and rows["baseline"].isna().all():
        lines.insert(0, "no ok 1-worker run: speedups and ideal scaling unknown")
    more = [f"... and {len(lines) - limit} more (see summary.md)"] if len(lines) > limit else []
    return lines[:limit] + more


def _draw_bars(
    ax: Axes, rows: pd.DataFrame, methods: list[str], sizes: list[int], *, hatch: str | None = None
) -> None:
    """A bar per method and size with data (none where missing), in fixed method slots."""
    slot = {ws: i for i, ws in enumerate(sizes)}
    width = 0.84 / max(len(methods), 1)
    rows = rows[rows["world_size"].isin(sizes) & rows["mean"].notna()]
    for i, method in enumerate(methods):
        r = rows[rows["method"] == method]
        if not r.empty:
            x = r["world_size"].map(slot).to_numpy(float) + (i - (len(methods) - 1) / 2) * width
            own = method_hatch(method)  # another engine: white hatching on its color
            style = {"color": method_color(method), "hatch": hatch or own, "capsize": 2,
                     **({"edgecolor": "white"} if own and not hatch else {})}
            ax.bar(x, r["mean"], width, yerr=r["std"].to_numpy(float), label=method, **style)
    _mark_groups(ax, rows, slot)
    ax.set_xlim(-0.6, len(sizes) - 0.4)
    ax.set_xticks(range(len(sizes)), [str(s) for s in sizes])
    ax.set(xlabel="number of workers (GPUs or CPU processes)", ylabel="throughput (samples/s)")


def _mark_groups(ax: Axes, rows: pd.DataFrame, slot: dict[int, int]) -> None:
    """Ideal linear scaling (baseline x workers) and the best speedup over each group."""
    groups = (
        rows.assign(top=rows["mean"] + rows["std"].fillna(0))
        .groupby("world_size")
        .agg(top=("top", "max"), speedup=("speedup", "max"), baseline=("baseline", "first"))
    )
    x = groups.index.map(slot).to_numpy(float)
    ideal = groups["baseline"].to_numpy(float) * groups.index.to_numpy(float)
    top = groups["top"].to_numpy(float)
    ymax = np.nanmax(np.fmax(top, ideal), initial=1.0)
    if np.nanmax(ideal, initial=0) > 3 * np.nanmax(top, initial=0) > 0:
        ymax = 1.3 * np.nanmax(top)  # far above every bar: show the bars, name the ideal
    shown = ideal <= ymax
    ax.hlines(ideal[shown], x[shown] - 0.45, x[shown] + 0.45, colors="black", linestyles="--",
              linewidth=1.2)
    for xi, yi in zip(x[~shown], ideal[~shown]):
        ax.text(xi, ymax * 1.12, f"ideal {yi:.3g} ↑", ha="center", va="top", fontsize=8)
    # Label just above the bars; above the ideal mark only when that is close to the bars.
    label_y = np.where((ideal - top > 0.07 * ymax) | ~shown, top, np.fmax(top, ideal))
    for xi, yi, s in zip(x, label_y, groups["speedup"]):
        if np.isfinite(s):
            label = f"{s:.1f}x"
            ax.text(xi, yi + 0.01 * ymax, label, ha="center", va="bottom", weight="bold")
    ax.set_ylim(0, ymax * 1.14)


def _subtitle(rows: pd.DataFrame, *, batch: bool = False) -> str:
    """Source, network, (local batch,) 1-worker baseline: whichever are known."""
    first, base = rows.iloc[0], rows["baseline"].dropna()
    parts = [] if first["source"] == "n/a" else [first["source"]]
    parts += [] if first["network"] == "n/a" else [f"network {first['network']}"]
    if batch and pd.notna(first["local_batch_size"]):
        parts.append(f"local batch {first['local_batch_size']}")
    return ", ".join(parts + [f"1-worker {b:.4g} samples/s" for b in base.iloc[:1]])


def _title(rows: pd.DataFrame) -> str:
    """Model, local batch size and model intensity (each omitted when unknown)."""
    first, intensity = rows.iloc[0], rows["intensity"].dropna()
    batch = first["local_batch_size"]
    return (
        first["model"]
        + (f": local batch size {batch}" if pd.notna(batch) else "")
        + (f", model intensity {intensity.mean():.0f}" if len(intensity) else "")
    )


def plot_throughput(
    rows: pd.DataFrame,
    *,
    reference: pd.DataFrame | None = None,
    sizes: Sequence[int] | None = None,
    methods: Iterable[str] = (),
    notes: Sequence[str] = (),
    title: str | None = None,
) -> Figure:
    """Grouped throughput bars of one setting (x = workers, a bar per method, in the
    study's style); `reference` (published cells of the model) adds a hatched panel.
    `sizes` and `methods` add empty groups and slots for attempted cells without data."""
    panels = [rows] if reference is None or reference.empty else [rows, reference]
    fig = Figure(figsize=(11, 0.5 + 4 * len(panels) + 0.18 * len(notes)), layout="constrained")
    axes = fig.subplots(len(panels), 1, squeeze=False)[:, 0]
    shown: list[str] = []
    for k, (ax, cells) in enumerate(zip(axes, panels)):
        multi = cells[cells["world_size"] > 1]
        slots = method_order([*(methods if k == 0 else ()), *multi["method"]])
        own = sorted(multi["world_size"].unique())
        _draw_bars(
            ax, cells, slots, list(sizes) if sizes and k == 0 else own, hatch="///" if k else None
        )
        ax.set_title(
            _subtitle(cells, batch=k > 0) if len(cells) else "no successful runs", fontsize=10
        )
        shown += slots
    fig.suptitle(title or _title(pd.concat(panels)), fontsize=12)
    handles = [Patch(facecolor=method_color(m), label=m, **(
        {"hatch": method_hatch(m), "edgecolor": "white"} if method_hatch(m) else {}))
        for m in method_order(shown)]
    if pd.concat(panels)["baseline"].notna().any():
        handles.append(Line2D([], [], color="black", ls="--", label="ideal linear scaling"))
    if len(panels) > 1:
        handles.append(Patch(facecolor="white", edgecolor="gray", hatch="///", label="published"))
    fig.legend(handles=handles, loc="outside right upper", fontsize=9)
    if notes:
        fig.supxlabel("\n".join(notes), x=0.01, ha="left", fontsize=8, color="darkred")
    return fig


def plot_efficiency(rows: pd.DataFrame) -> Figure | None:
    """Scaling efficiency (speedup / world_size) vs world size, a line per method."""
    rows = rows[rows["efficiency"].notna()].sort_values("world_size")
    if rows.empty:
        return None
    fig = Figure(figsize=(8, 4.2), layout="constrained")
    ax = fig.subplots()
    sizes = sorted(rows["world_size"].unique())
    for method in method_order(rows["method"]):  # NaN at a missing size breaks the line
        r = rows[rows["method"] == method].set_index("world_size")["efficiency"].reindex(sizes)
        ax.plot(sizes, r.to_numpy(float), marker="o", label=method, color=method_color(method),
                ls=":" if method_hatch(method) else "-")
    ax.axhline(1.0, color="black", ls="--", lw=1, label="ideal")
    ax.set_xscale("log", base=2)
    ax.set_xticks([float(s) for s in sizes], [str(s) for s in sizes])
    ax.set_ylim(0, max(1.1, rows["efficiency"].max() * 1.08))
    ax.set(xlabel="number of workers (GPUs or CPU processes)",
           ylabel="scaling efficiency (speedup / workers)")
    ax.set_title(f"{_title(rows)}\n{_subtitle(rows)}", fontsize=11)  # centred on the axes
    fig.legend(loc="outside right upper", fontsize=9)
    return fig


PHASE_LABELS = dict(zip(PHASES, ["forward", "backward", "exposed comm", "update"]))
PHASE_COLORS = dict(zip(PHASES, ["#4c72b0", "#55a868", "#c44e52", "#8172b2"]))


def plot_breakdown(rows: pd.DataFrame) -> Figure | None:
    """Stacked forward/backward/exposed-comm/update time vs workers, a panel per method
    (wrapped four to a row); a size a method did not run at has no bar."""
    rows = rows.dropna(subset=PHASES, how="all")
    if rows.empty:
        return None
    methods, sizes = method_order(rows["method"]), sorted(rows["world_size"].unique())
    ncols = min(4, len(methods))
    nrows = -(-len(methods) // ncols)
    fig = Figure(
        figsize=(max(7.0, 1.5 + 0.5 * ncols * (len(sizes) + 1)), 1.4 + 2.6 * nrows),
        layout="constrained",
    )
    axes = fig.subplots(nrows, ncols, sharey=True, squeeze=False).ravel()
    for ax, method in zip(axes, methods):
        r = rows[rows["method"] == method]
        x, bottom = r["world_size"].map(sizes.index).to_numpy(float), np.zeros(len(r))
        for phase in PHASES:
            height = r[phase].fillna(0).to_numpy(float)
            ax.bar(x, height, 0.7, bottom, color=PHASE_COLORS[phase], label=PHASE_LABELS[phase])
            bottom += height
        ax.set_xticks(range(len(sizes)), [str(s) for s in sizes])
        ax.set_xlim(-0.6, len(sizes) - 0.4)
        ax.set_title(method.replace("@", "\n@"), fontsize=10)  # the engine on a line of its own
    for ax in axes[len(methods) :]:
        ax.set_visible(False)
    fig.supylabel("time per iteration (s)")
    fig.supxlabel("number of workers (GPUs or CPU processes)")
    fig.suptitle(f"{_title(rows)}\n{_subtitle(rows)}", fontsize=11)
    fig.legend(
        *axes[0].get_legend_handles_labels(),
        loc="outside right center",
        fontsize=9,
    )
    return fig


def _save(fig: Figure, stem: Path) -> Path:
    fig.savefig(f"{stem}.png", dpi=130)
    fig.savefig(f"{stem}.pdf")
    _log(f"wrote {stem}.png and .pdf")
    return stem.with_name(f"{stem.name}.png")


def setting_label(setting: pd.Series) -> str:
    """`resnet50: local batch 64, network loopback, measured`."""
    return (f"{setting['model']}: local batch {setting['local_batch_size']}, "
            f"network {setting['network']}, {setting['source']}")


def _names(keys: pd.DataFrame) -> dict[str, str]:
    """File name per setting id: the model alone when it has a single setting."""
    alone = keys["model"].map(keys["model"].value_counts()) == 1
    long = keys[SETTING].astype("string").fillna("na").agg("_".join, axis=1)  # one per figure
    name = long.where(~alone, keys["model"]).str.replace(r"[^\w.-]+", "-", regex=True)
    return dict(zip(keys["sid"], name))


def _first_setting(cells: pd.DataFrame, model: str) -> pd.DataFrame:
    """The cells of `model`'s first setting (a reference may list several networks)."""
    sids = cells.loc[cells["model"] == model, "sid"]
    return cells[cells["sid"] == sids.min()] if len(sids) else cells.iloc[:0]


def write_figures(
    cells: pd.DataFrame,
    out: Path,
    *,
    attempted: pd.DataFrame,
    reference: pd.DataFrame | None = None,
    missing: pd.DataFrame | None = None,
) -> dict[str, list[Path]]:
    """Throughput, efficiency and breakdown figures for every setting in `attempted`;
    returns the PNGs written per setting (`setting_label`)."""
    keys = attempted[["sid", *SETTING]].drop_duplicates("sid")
    written: dict[str, list[Path]] = {}
    for sid, name in _names(keys).items():
        pngs = written.setdefault(setting_label(keys[keys["sid"] == sid].iloc[0]), [])
        rows = cells[cells["sid"] == sid]
        grid = attempted[attempted["sid"] == sid]
        sizes = sorted(grid.loc[grid["world_size"] > 1, "world_size"].unique())
        notes = _notes(missing[missing["sid"] == sid], rows) if missing is not None else []
        ref = None if reference is None else _first_setting(reference, grid["model"].iloc[0])
        title = None if len(rows) else _title(grid.assign(intensity=np.nan))
        methods = grid.loc[grid["world_size"] > 1, "method"]
        kw = {"sizes": sizes, "methods": methods, "notes": notes, "title": title}
        pngs.append(_save(plot_throughput(rows, reference=ref, **kw), out / f"fig_{name}"))
        for kind, plot, lack in (
            ("efficiency", plot_efficiency, "1-worker baseline"),
            ("breakdown", plot_breakdown, "phase times (forward_s, ...)"),
        ):
            extra = plot(rows)
            if extra is not None:
                pngs.append(_save(extra, out / f"{kind}_{name}"))
            else:
                _log(f"skipped {kind}_{name}: no {lack} in the data")
    return written
