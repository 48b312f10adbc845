"""The report's tables: throughput (mean ± std), best method per GPU count, measured /
published ratios and the "Missing" section, written as summary.md and CSV files."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from harness.report.data import SETTING, _log
from harness.report.style import method_order


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


def gap_tables(
    missing: pd.DataFrame, failed: pd.DataFrame, bad: list[tuple[Path, str]], cells: pd.DataFrame
) -> dict[str, pd.DataFrame]:
    """What is missing, by heading: unreadable shards, missing baselines, empty cells,
    failures (summary.md's "Missing" section and the page's)."""
    cell = [*SETTING, "method", "world_size"]
    tables = {
        "Unreadable shards": pd.DataFrame(bad, columns=["shard", "error"]).astype(str),
        "No ok 1-worker baseline (speedups unknown)": cells.loc[
            cells["baseline"].isna(), SETTING
        ].drop_duplicates(),
        "Cells without data": _sorted(missing[[*cell, "reason"]], cell),
        "Failed runs": _sorted(failed[["run_id", "repeat", *cell, "status", "error"]], cell),
    }
    return {head: t.rename(columns={"world_size": "gpus"}) for head, t in tables.items()}


def missing_section(gaps: dict[str, pd.DataFrame]) -> str:
    """summary.md's "Missing" section of `gap_tables`."""
    parts = [f"### {head}\n\n{_markdown(t)}" for head, t in gaps.items() if len(t)]
    return "\n".join(parts) if parts else "None: every method ran at every size.\n"


def summary_tables(cells: pd.DataFrame, published: pd.DataFrame | None
                   ) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """The throughput table, the best-method table and the latter as shown (speedups as
    1.9x), with the published rows of the measured models."""
    if published is not None:
        cells = pd.concat([cells, published[published["model"].isin(cells["model"])]])
    wide, best = throughput_table(cells), best_table(cells)
    shown = best.assign(speedup=[f"{s:.1f}x" if np.isfinite(s) else "—" for s in best["speedup"]])
    return wide, best, shown


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
    wide, best, shown = summary_tables(cells, published)
    wide.to_csv(out / "summary.csv", index=False)
    best.to_csv(out / "best.csv", index=False)
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
