"""The report's numbers: result rows and published numbers -> cells.

A *setting* is (model, local_batch_size, network, source); a *cell* is a setting's
(method, world_size), with mean and std of ok throughput, baseline, speedup and efficiency.
Also the validated reference, failed runs, missing cells and `ReportError` (a problem the
user can fix), which the command turns into one line and exit code 2.
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from harness.config import tables
from harness.config.frozen import leaves
from harness.measure import results

SETTING = ["model", "local_batch_size", "network", "source"]
CELL = [*SETTING, "method", "world_size"]
PHASES = ["forward_s", "backward_s", "comm_s", "update_s"]
REF_COLUMNS = ["model", "local_batch_size", "network", "method", "gpus"] + (
    "throughput_mean throughput_std single_gpu_throughput".split()
)
# What each numeric column of a reference must hold: (in words, the test).
POSITIVE = ("a positive, finite number", lambda v: np.isfinite(v) & (v > 0))
WHOLE = (f"a positive whole number up to {tables.MAX_GPUS}",
         lambda v: (v > 0) & (v % 1 == 0) & (v <= tables.MAX_GPUS))
VALID = {"throughput_std": ("a finite number >= 0", lambda v: np.isfinite(v) & (v >= 0)),
         "gpus": WHOLE, "local_batch_size": WHOLE}
OPTIONAL = ("local_batch_size", "throughput_std")  # may be empty in a reference
# Published columns -> the names of `aggregate`'s output.
_REF_RENAME = {
    "gpus": "world_size",
    "throughput_mean": "mean",
    "throughput_std": "std",
    "single_gpu_throughput": "baseline",
}


class ReportError(Exception):
    """A problem the user can fix: `main` prints it as one line and exits with 2."""


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _setting_id(frame: pd.DataFrame) -> pd.Series:
    """One string per row naming its setting (NA-safe, vectorized)."""
    parts = [frame[c].astype("string").fillna("?") for c in SETTING]
    return parts[0].str.cat(parts[1:], sep="|")


def normalize(frame: pd.DataFrame) -> pd.DataFrame:
    """The columns the report uses, typed; null network/source become 'n/a'. A method's
    runs of another configuration are a series of their own (`series`): on another
    engine `wfbp_a2a@horovod`, with other settings `bsp_a2a [sync_each_step=device]`."""
    out = frame[
        [*CELL, "repeat", "run_id", "status", "error", "throughput", "model_intensity", *PHASES]
    ].copy()
    out["method"] = series(frame)
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
    """Read a published-numbers CSV and validate it; ReportError names the problem, the file
    and its line (the header is line 1)."""
    fix = f"pass reference=<csv with columns {','.join(REF_COLUMNS)}>"
    try:
        ref = tables.read_csv(path)
    except FileNotFoundError:
        raise ReportError(f"reference file '{path}' not found; {fix}") from None
    except (OSError, ValueError) as exc:  # parser errors and decode errors are ValueErrors
        raise ReportError(f"reference file '{path}' is unreadable ({exc}); {fix}") from None
    missing = [c for c in REF_COLUMNS if c not in ref.columns]
    if missing or ref.empty:
        what = f"lacks columns {', '.join(missing)}" if missing else "has no rows"
        raise ReportError(f"reference file '{path}' {what}; {fix}")
    for col in ("model", "method"):
        empty = ref[col].isna()
        if empty.any():
            raise ReportError(f"reference file '{path}': column {col} has an empty value "
                              f"(line {empty.idxmax() + 2}); fill it in or drop the row")
    for col in REF_COLUMNS[1:2] + REF_COLUMNS[4:]:
        ref[col] = _numbers(ref, col, path)
    twice = tables.duplicate(ref, REF_COLUMNS[:5], where=f"reference file '{path}'",
                             first_row=2, unit="line")
    if twice:
        raise ReportError(twice)
    return ref


def _numbers(ref: pd.DataFrame, col: str, path: str | Path) -> pd.Series:
    """Column `col` of a reference as numbers, each holding VALID's rule (empty only where
    OPTIONAL); ReportError names the first that does not."""
    values = pd.to_numeric(ref[col], errors="coerce")
    bad = values.isna() & (ref[col].notna() | (col not in OPTIONAL))
    if bad.any():
        value = ref[col][bad].iloc[0]
        what = "an empty value" if pd.isna(value) else f"non-numeric value {tables.shown(value)}"
        raise ReportError(f"reference file '{path}': column {col} has {what} (line "
                          f"{bad.idxmax() + 2}); fix it")
    must, holds = VALID.get(col, POSITIVE)
    wrong = values.notna() & ~holds(values)
    if wrong.any():
        raise ReportError(
            f"reference file '{path}': column {col} has value "
            f"{tables.shown(values[wrong].iloc[0])} (line {wrong.idxmax() + 2}); it must be {must}")
    return values


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



def series(rows: pd.DataFrame) -> pd.Series:
    """Each row's series: its method, `@engine` when not native (`wfbp_a2a@horovod`), and
    in brackets the settings that tell it from the setting's other runs of that method
    (`bsp_a2a [optimizer.name=sgd, sync_each_step=device]`): any key of the model, method
    or network section, the clock (run.sync_each_step) or the rate (run.rate). Runs of
    different configurations are never averaged into one bar: each is a series of its own."""
    if rows.empty:
        return rows["method"].astype("string")
    engine = rows["engine"].fillna("native").astype(str)
    label = rows["method"].astype("string") + ("@" + engine).where(engine.ne("native"), "")
    keys = pd.Series([_settings(c, e, r) for c, e, r in zip(
        rows["config_json"], rows["sync_each_step"], rows["rate"])], index=rows.index)
    group = _setting_id(rows) + "|" + label.fillna("?")
    for _, same in keys.groupby(group):
        variants = list({json.dumps(v, sort_keys=True, default=str): v for v in same}.values())
        differ = sorted(k for k in set().union(*variants)
                        if len({repr(v.get(k)) for v in variants}) > 1)
        if differ:
            label[same.index] = label[same.index] + pd.Series(
                [" [" + ", ".join(f"{k.split('.', 1)[-1]}={v.get(k)}" for k in differ) + "]"
                 for v in same], index=same.index, dtype="string")
    return label


@functools.lru_cache(maxsize=4096)
def _sections(config_json: str | None) -> tuple:
    """A run's model, method and network keys (dotted), from its configuration."""
    tree = json.loads(config_json or "{}")
    return tuple(leaves({k: tree.get(k) for k in ("model", "method", "network")}))


def _settings(config_json: str | None, ending, rate) -> dict[str, object]:
    """What makes a run's configuration: its sections' keys, its clock and its rate."""
    text = config_json if isinstance(config_json, str) else None
    return {**dict(_sections(text)), "run.sync_each_step": ending, "run.rate": rate}


def load_rows(results_dir: str | Path) -> tuple[pd.DataFrame, list[tuple[Path, str]], int]:
    """(the shards' rows as written, unreadable shards, number of shard files)."""
    path = Path(results_dir)
    files = results.shard_files(path) if path.exists() else []
    return (*results.load_report(files), len(files))


def load_results(results_dir: str | Path) -> tuple[pd.DataFrame, list[tuple[Path, str]], int]:
    """(normalized frame, unreadable shards, number of shard files)."""
    rows, bad, n = load_rows(results_dir)
    return normalize(rows), bad, n
