"""Paper-style report: the study's figures and tables, computed from result rows only.

Usage: ``python -m harness.report [results_dir=results] [out_dir=plots] [reference=<csv>]``

* Input: every parquet shard under ``results_dir`` (``results.load_report``; unreadable
  shards are listed, never dropped silently) and optionally a published CSV (REF_COLUMNS).
* A *setting* is (model, local_batch_size, network, source): measured, simulated and
  published numbers are never mixed. Per (setting, method, world_size) *cell*: mean and
  std of throughput over the repeats with status "ok".
* Speedup = mean / the model's 1-worker baseline (mean ok throughput at world_size 1, any
  method, preferring the same network and source); published speedups divide by the
  reference's ``single_gpu_throughput``. No number is typed into the code.
* ``out_dir`` gets per setting ``fig_*`` (grouped bars with std error bars, ideal linear
  scaling, best speedup per group, a hatched published panel when the reference has the
  model), ``efficiency_*`` and ``breakdown_*`` (PNG + PDF), and ``summary.md``,
  ``summary.csv``, ``best.csv``, ``ratios.csv`` (with both inputs). With a reference and
  no results, the reference alone is drawn (the study's own figures).
* Missing cells and failed runs get no bar; they are noted in the figure and listed in
  summary.md's "Missing" section.
* User errors (no data, bad reference, unknown argument, an out_dir that cannot be written):
  one line on stderr, exit code 2, nothing written.
"""

from __future__ import annotations

import sys
import time
import zlib
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib import colormaps
from matplotlib.axes import Axes
from matplotlib.figure import Figure  # Figure objects render with Agg; no pyplot state
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from harness import checks, results
from harness.config import ConfigError

METHOD_ORDER = (
    "bsp_ps bsp_a2a wfbp_ps wfbp_a2a mgwfbp bytescheduler_ps bytescheduler_a2a priority_ps "
    "ddp".split()
)
# tab20 index per method: a PS/A2A pair shares a hue (PS light, A2A dark); ddp is gray.
_TAB20 = dict(zip(METHOD_ORDER, [1, 0, 3, 2, 4, 7, 6, 5, 14]))
_TAB20_SPARE = [8, 10, 12, 16, 18, 9, 11, 13, 17, 19]
SETTING = ["model", "local_batch_size", "network", "source"]
CELL = [*SETTING, "method", "world_size"]
PHASES = ["forward_s", "backward_s", "comm_s", "update_s"]
REF_COLUMNS = ["model", "local_batch_size", "network", "method", "gpus"] + (
    "throughput_mean throughput_std single_gpu_throughput".split()
)
# Published columns -> the names of `aggregate`'s output.
_REF_RENAME = {
    "gpus": "world_size",
    "throughput_mean": "mean",
    "throughput_std": "std",
    "single_gpu_throughput": "baseline",
}
ARGS = {"results_dir": "results", "out_dir": "plots", "reference": None}


class ReportError(Exception):
    """A problem the user can fix: `main` prints it as one line and exits with 2."""


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def method_order(methods: Iterable[str]) -> list[str]:
    """The study's method order, then ddp, then any other names alphabetically; a method on
    another engine (`wfbp_a2a@horovod`) right after the method itself."""
    names = set(methods)
    native = {m.partition("@")[0] for m in names}
    order = [m for m in METHOD_ORDER if m in native] + sorted(native - set(METHOD_ORDER))
    return [n for m in order for n in sorted(names) if n.partition("@")[0] == m]


def method_hatch(method: str) -> str | None:
    """The bars of a method on another engine are hatched (in its native method's color)."""
    return "xx" if "@" in method else None


def method_color(method: str) -> tuple[float, ...]:
    """A fixed color per method name (the same in every figure; on any engine)."""
    method = method.partition("@")[0]
    index = _TAB20.get(method)
    if index is None:
        index = _TAB20_SPARE[zlib.crc32(method.encode()) % len(_TAB20_SPARE)]
    return colormaps["tab20"](index)


def _setting_id(frame: pd.DataFrame) -> pd.Series:
    """One string per row naming its setting (NA-safe, vectorized)."""
    parts = [frame[c].astype("string").fillna("?") for c in SETTING]
    return parts[0].str.cat(parts[1:], sep="|")


def normalize(frame: pd.DataFrame) -> pd.DataFrame:
    """The columns the report uses, typed; null network/source become 'n/a'. A method run
    on another engine than the native one is a method of its own (`wfbp_a2a@horovod`)."""
    out = frame[
        [*CELL, "repeat", "run_id", "status", "error", "throughput", "model_intensity", *PHASES]
    ].copy()
    other = frame["engine"].ne("native")  # results.load_report names every row's engine
    out.loc[other, "method"] = out["method"][other] + "@" + frame["engine"][other]
    for col in ("model", "method", "network", "source", "status", "error", "run_id"):
        out[col] = out[col].astype("string")
    out[["network", "source"]] = out[["network", "source"]].fillna("n/a")
    for col in ("world_size", "local_batch_size", "repeat"):
        out[col] = pd.to_numeric(out[col]).astype("Int64")
    for col in ("throughput", "model_intensity", *PHASES):
        out[col] = pd.to_numeric(out[col], errors="coerce").astype(float)
    return out.assign(
        sid=_setting_id(out), ok=out["status"].eq("ok").fillna(False) & out["throughput"].notna()
    )


def baselines(ok: pd.DataFrame, cells: pd.DataFrame) -> np.ndarray:
    """Each cell's 1-worker baseline: mean ok throughput at world_size 1 (any method),
    from the same network and source if there is one, else the same source, else any."""
    single = ok[ok["world_size"] == 1]
    base = pd.Series(np.nan, index=cells.index)
    for keys in (SETTING, ["model", "local_batch_size", "source"], ["model", "local_batch_size"]):
        means = single.groupby(keys, dropna=False)["throughput"].mean().rename("_base")
        found = cells[keys].merge(means, left_on=keys, right_index=True, how="left")
        base = base.fillna(pd.Series(found["_base"].to_numpy(float), index=cells.index))
    return base.to_numpy(float)


def _with_speedup(cells: pd.DataFrame) -> pd.DataFrame:
    speedup = cells["mean"] / cells["baseline"]
    return cells.assign(
        speedup=speedup,
        efficiency=speedup / cells["world_size"].astype(float),
        sid=_setting_id(cells),
    )


def aggregate(frame: pd.DataFrame) -> pd.DataFrame:
    """Per cell of a normalized frame: mean, std and count of ok throughput, mean model
    intensity and phase times, baseline, speedup and efficiency (speedup / world_size)."""
    ok = frame[frame["ok"]]
    stats = {
        "mean": ("throughput", "mean"),
        "std": ("throughput", "std"),
        "repeats": ("throughput", "size"),
        "intensity": ("model_intensity", "mean"),
        **{p: (p, "mean") for p in PHASES},
    }
    cells = ok.groupby(CELL, dropna=False, sort=False).agg(**stats).reset_index()
    return _with_speedup(cells.assign(baseline=baselines(ok, cells)))


def read_reference(path: str | Path) -> pd.DataFrame:
    """Read a published-numbers CSV and validate it; ReportError names the problem."""
    fix = f"pass reference=<csv with columns {','.join(REF_COLUMNS)}>"
    try:
        ref = pd.read_csv(path)
    except FileNotFoundError:
        raise ReportError(f"reference file '{path}' not found; {fix}") from None
    except (OSError, ValueError) as exc:  # parser errors and decode errors are ValueErrors
        raise ReportError(f"reference file '{path}' is unreadable ({exc}); {fix}") from None
    missing = [c for c in REF_COLUMNS if c not in ref.columns]
    if missing or ref.empty:
        what = f"lacks columns {missing}" if missing else "has no rows"
        raise ReportError(f"reference file '{path}' {what}; {fix}")
    for col in REF_COLUMNS[4:]:
        values = pd.to_numeric(ref[col], errors="coerce")
        bad = values.isna() & (ref[col].notna() | (col != "throughput_std"))
        if bad.any():
            raise ReportError(
                f"reference file '{path}': column {col} has non-numeric value "
                f"'{ref[col][bad].iloc[0]}' (line {bad.idxmax() + 2}); fix it"
            )
        ref[col] = values
    return ref


def reference_cells(ref: pd.DataFrame) -> pd.DataFrame:
    """A validated reference in the shape of `aggregate`'s output (source 'published')."""
    cells = (
        ref[REF_COLUMNS]
        .rename(columns=_REF_RENAME)
        .astype({"model": "string", "method": "string", "network": "string"})
    )
    cells = cells.astype({"local_batch_size": "Int64", "world_size": "Int64"}).assign(
        network=cells["network"].fillna("n/a"),
        source="published",
        repeats=pd.NA,
        intensity=np.nan,
        **{p: np.nan for p in PHASES},
    )
    dup = cells.duplicated(CELL)
    if dup.any():
        raise ReportError(
            f"reference has duplicate rows for {cells[CELL][dup].iloc[0].tolist()}"
            "; keep one row per model, network, method and gpus"
        )
    return _with_speedup(cells)


def failed_runs(frame: pd.DataFrame) -> pd.DataFrame:
    """Rows that did not produce a throughput, with their error text (truncated)."""
    failed = frame[~frame["ok"]]
    error = failed["error"].fillna("status " + failed["status"].fillna("missing"))
    return failed.assign(error=error.str.replace(r"\s+", " ", regex=True).str.slice(0, 120))


def missing_cells(frame: pd.DataFrame, cells: pd.DataFrame) -> pd.DataFrame:
    """Cells of each setting's (method x world_size > 1) grid with no ok run, and why."""
    multi = frame[frame["world_size"] > 1]
    grid = (
        multi[["sid", *SETTING, "method"]]
        .drop_duplicates()
        .merge(multi[["sid", "world_size"]].drop_duplicates(), on="sid")
    )
    have = cells[["sid", "method", "world_size"]].assign(_have=True)
    grid = grid.merge(have, on=["sid", "method", "world_size"], how="left")
    grid = grid[grid["_have"].isna()].drop(columns="_have")
    fails = failed_runs(frame).groupby(["sid", "method", "world_size"])["error"].first()
    grid = grid.merge(fails, left_on=["sid", "method", "world_size"], right_index=True, how="left")
    reason = ("failed: " + grid["error"].str.slice(0, 80)).fillna("not run")
    return grid.drop(columns="error").assign(reason=reason).reset_index(drop=True)


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


def _save(fig: Figure, stem: Path) -> None:
    fig.savefig(f"{stem}.png", dpi=130)
    fig.savefig(f"{stem}.pdf")
    _log(f"wrote {stem}.png and .pdf")


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
) -> None:
    """Throughput, efficiency and breakdown figures for every setting in `attempted`."""
    keys = attempted[["sid", *SETTING]].drop_duplicates("sid")
    for sid, name in _names(keys).items():
        rows = cells[cells["sid"] == sid]
        grid = attempted[attempted["sid"] == sid]
        sizes = sorted(grid.loc[grid["world_size"] > 1, "world_size"].unique())
        notes = _notes(missing[missing["sid"] == sid], rows) if missing is not None else []
        ref = None if reference is None else _first_setting(reference, grid["model"].iloc[0])
        title = None if len(rows) else _title(grid.assign(intensity=np.nan))
        methods = grid.loc[grid["world_size"] > 1, "method"]
        kw = {"sizes": sizes, "methods": methods, "notes": notes, "title": title}
        _save(plot_throughput(rows, reference=ref, **kw), out / f"fig_{name}")
        for kind, plot, lack in (
            ("efficiency", plot_efficiency, "1-worker baseline"),
            ("breakdown", plot_breakdown, "phase times (forward_s, ...)"),
        ):
            extra = plot(rows)
            if extra is not None:
                _save(extra, out / f"{kind}_{name}")
            else:
                _log(f"skipped {kind}_{name}: no {lack} in the data")


def _fmt(value: object) -> str:
    if value is None or value is pd.NA or (isinstance(value, float) and np.isnan(value)):
        return "—"
    if isinstance(value, float):
        return f"{value:.1f}" if abs(value) >= 10 else f"{value:.3g}"
    return str(value).replace("|", "\\|")


def _markdown(table: pd.DataFrame) -> str:
    if table.empty:
        return "None.\n"
    lines = ["| " + " | ".join(map(str, table.columns)) + " |", "|" + "---|" * table.shape[1]]
    lines += ["| " + " | ".join(map(_fmt, r)) + " |" for r in table.itertuples(index=False)]
    return "\n".join(lines) + "\n"


def _sorted(table: pd.DataFrame, by: list[str]) -> pd.DataFrame:
    rank = {m: i for i, m in enumerate(method_order(table["method"]))}
    table = table.assign(_rank=table["method"].map(rank)) if "method" in table else table
    keys = [("_rank" if c == "method" else c) for c in by]
    return table.sort_values(keys, kind="stable").drop(columns="_rank", errors="ignore")


def throughput_table(cells: pd.DataFrame) -> pd.DataFrame:
    """The study's layout: setting, method, then 'mean ± std' per GPU count."""
    digits = np.where(cells["mean"].abs() >= 10, 1, 3)
    text = [
        f"{m:.{d}f}" + (f" ± {s:.{d}f}" if np.isfinite(s) else "")
        for m, s, d in zip(cells["mean"], cells["std"].astype(float), digits)
    ]
    wide = cells.assign(cell=text).pivot(
        index=[*SETTING, "method"], columns="world_size", values="cell"
    )
    wide.columns = [f"{c} GPU{'s' if c > 1 else ''}" for c in wide.columns]
    return _sorted(wide.reset_index(), [*SETTING, "method"])


def best_table(cells: pd.DataFrame) -> pd.DataFrame:
    """Best method (highest mean throughput) and its speedup per setting and GPU count."""
    multi = cells[(cells["world_size"] > 1) & cells["mean"].notna()]
    best = multi.sort_values("mean", ascending=False, kind="stable")
    best = best.drop_duplicates(["sid", "world_size"]).sort_values([*SETTING, "world_size"])
    return best[[*SETTING, "world_size", "method", "mean", "speedup"]].rename(
        columns={"world_size": "gpus", "method": "best_method", "mean": "throughput"}
    )


def ratio_table(measured: pd.DataFrame, published: pd.DataFrame) -> pd.DataFrame:
    """Measured / published throughput and speedup per model, method and GPU count."""
    pub = published[["model", "method", "world_size", "mean", "speedup"]]
    r = measured[measured["world_size"] > 1].merge(
        pub, on=["model", "method", "world_size"], suffixes=("", "_published")
    )
    table = (
        r[["model", "network", "source", "method", "world_size"]]
        .assign(
            measured=r["mean"],
            published=r["mean_published"],
            throughput_ratio=r["mean"] / r["mean_published"],
            speedup_ratio=r["speedup"] / r["speedup_published"],
        )
        .rename(columns={"world_size": "gpus"})
    )
    return _sorted(table, ["model", "network", "source", "method", "gpus"])


def _missing_section(
    missing: pd.DataFrame, failed: pd.DataFrame, bad: list[tuple[Path, str]], cells: pd.DataFrame
) -> str:
    """summary.md's "Missing": unreadable shards, missing baselines, empty cells, failures."""
    cell = [*SETTING, "method", "world_size"]
    sections = {
        "Unreadable shards": pd.DataFrame(bad, columns=["shard", "error"]).astype(str),
        "No ok 1-worker baseline (speedups unknown)": cells.loc[
            cells["baseline"].isna(), SETTING
        ].drop_duplicates(),
        "Cells without data": _sorted(missing[[*cell, "reason"]], cell),
        "Failed runs": _sorted(failed[["run_id", "repeat", *cell, "status", "error"]], cell),
    }
    parts = [
        f"### {head}\n\n{_markdown(t.rename(columns={'world_size': 'gpus'}))}"
        for head, t in sections.items()
        if len(t)
    ]
    return "\n".join(parts) if parts else "None: every method ran at every size.\n"


def write_tables(
    cells: pd.DataFrame,
    out: Path,
    *,
    header: str,
    published: pd.DataFrame | None = None,
    missing: str = "None.\n",
) -> None:
    """summary.md (throughput, best method, ratios, missing), summary.csv, best.csv and,
    with `published` cells, ratios.csv; published rows of the measured models are listed too."""
    ratios = None if published is None else ratio_table(cells, published)
    if published is not None:
        cells = pd.concat([cells, published[published["model"].isin(cells["model"])]])
    wide, best = throughput_table(cells), best_table(cells)
    wide.to_csv(out / "summary.csv", index=False)
    best.to_csv(out / "best.csv", index=False)
    shown = best.assign(speedup=[f"{s:.1f}x" if np.isfinite(s) else "—" for s in best["speedup"]])
    text = [
        header,
        "## Throughput (samples/s, mean ± std over repeats)\n",
        _markdown(wide),
        "## Best method and its speedup per GPU count\n",
        _markdown(shown),
    ]
    if ratios is not None:
        ratios.to_csv(out / "ratios.csv", index=False)
        text += ["## Measured / published\n", _markdown(ratios)]
    (out / "summary.md").write_text("\n".join([*text, "## Missing\n", missing]).rstrip() + "\n")
    _log(f"wrote {out / 'summary.md'}, summary.csv, best.csv")


def load_results(results_dir: str | Path) -> tuple[pd.DataFrame, list[tuple[Path, str]], int]:
    """(normalized frame, unreadable shards, number of shard files)."""
    path = Path(results_dir)
    files = results.shard_files(path) if path.exists() else []
    frame, bad = results.load_report(files)
    return normalize(frame), bad, len(files)


def _no_data(results_dir: str | Path, bad: list[tuple[Path, str]], n: int) -> ReportError:
    hint = "run a benchmark first or pass reference=<csv> to draw the published numbers alone"
    if not Path(results_dir).exists():
        return ReportError(f"results_dir '{results_dir}' does not exist; {hint}")
    if bad and len(bad) == n:
        return ReportError(
            f"none of the {n} shards under '{results_dir}' could be read (first: "
            f"{bad[0][0]}: {bad[0][1]}); re-run them or move them away"
        )
    return ReportError(f"no result rows in shards (*.parquet) under '{results_dir}'; {hint}")


def report(results_dir: str, out_dir: str, reference: str | None = None) -> None:
    """Load, aggregate and write every figure and table (see the module docstring)."""
    checks.output_dir("out_dir", out_dir)
    published = reference_cells(read_reference(reference)) if reference else None
    start = time.perf_counter()
    frame, bad, n = load_results(results_dir)
    if frame.empty and published is None:
        raise _no_data(results_dir, bad, n)
    _log(
        f"loaded {n} shards ({len(frame)} rows, {len(bad)} unreadable) from '{results_dir}' "
        f"in {time.perf_counter() - start:.1f}s"
    )
    results.warn(bad)
    if frame.empty:  # the reference alone: the study's own figures and numbers
        data, attempted, published = published, published, None
    else:
        data, attempted = aggregate(frame), frame
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    missing = missing_cells(frame, data)
    write_figures(data, out, attempted=attempted, reference=published, missing=missing)
    header = (
        f"# ddlbench report\n\nresults_dir `{results_dir}`: {n} shards, {len(frame)} rows, "
        f"{len(bad)} unreadable; reference `{reference or 'none'}`.\n"
    )
    gaps = _missing_section(missing, failed_runs(frame), bad, data)
    write_tables(data, out, header=header, published=published, missing=gaps)


def parse_args(argv: Sequence[str]) -> dict[str, str | None]:
    """key=value arguments over ARGS' defaults; an unknown key is a ReportError."""
    args = dict(ARGS)
    for item in argv:
        key, sep, value = item.partition("=")
        if not sep or key not in ARGS:
            raise ReportError(
                f"unknown argument '{item}'; use key=value with keys "
                f"{', '.join(ARGS)}, e.g. results_dir=results out_dir=plots"
            )
        args[key] = value or None
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit code."""
    argv = sys.argv[1:] if argv is None else argv
    if {"-h", "--help"} & set(argv):
        print(__doc__)
        return 0
    try:
        report(**parse_args(argv))
    except (ReportError, ConfigError) as exc:
        print(f"ddlbench: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
