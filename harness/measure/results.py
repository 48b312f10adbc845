"""Results are data: one parquet shard per run and repeat, merged by `load`.

A shard is written once with exclusive create and never overwritten, so
concurrent writers (array tasks, ranks reporting a failure) cannot clobber
each other's rows.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
from omegaconf import DictConfig

from harness.config.ranks import num_workers
from harness.config.schema import ending, first_line

# Column groups of a result row. Every shard carries all of them (missing
# values are null), so frames from different runs concatenate cleanly.
IDENTITY = [
    "run_id", "model", "method", "network", "nodes", "workers_per_node", "world_size",
    "servers", "repeat", "local_batch_size", "source",
]
MODEL_INFO = ["model_params", "model_tensors", "model_intensity"]
PARAMETERS = ["warmup_iters", "timed_iters", "seed", "sync_each_step", "rate"]
# throughput: the statistic run.rate names (its value in `rate`), each beside it: window,
# samples over the slowest rank's window; study, the mean of 10-step rates on rank 0
METRICS = [
    "throughput", "throughput_window", "throughput_study", "timed_s", "iter_times_s",
    "rank_iter_times_s",
    "forward_s", "backward_s", "comm_s", "update_s", "peak_memory_bytes",
    "method_host_s", "method_wait_s", "machine_cpu_s",
]
STATUS = ["status", "error"]
PROVENANCE = [
    "git_commit", "torch_version", "backend", "device", "hostnames", "slurm_job_id",
    "slurm_array_task_id", "started_at", "config_json", "plan_json", "devices",
    "cuda_version", "cudnn_version", "nccl_version", "tf32_matmul", "tf32_cudnn",
    "cudnn_benchmark", "comm_env_json",
]
# What ran the collectives: engine=native (torch.distributed) or horovod, with Horovod's
# version and settings (null on native). Shards written before these columns load with
# engine "native".
ENGINE = ["engine", "horovod_version", "horovod_fusion_threshold_bytes", "horovod_cycle_time_s",
          "horovod_cache_capacity"]
# What carried the PS messages (cluster.ps_wire: gloo or ucx) and the transports it picked
# on the row's rank (UCX's per endpoint: "tcp/lo", "rc_mlx5/mlx5_0:1", ...; Gloo: tcp).
# Shards written before these columns load with wire "gloo".
WIRE = ["ps_wire", "ps_wire_transports"]
COLUMNS = IDENTITY + MODEL_INFO + PARAMETERS + METRICS + STATUS + PROVENANCE + ENGINE + WIRE

SCHEMA = pa.schema([
    ("run_id", pa.string()), ("model", pa.string()), ("method", pa.string()),
    ("network", pa.string()), ("nodes", pa.int64()), ("workers_per_node", pa.int64()),
    ("world_size", pa.int64()), ("servers", pa.int64()), ("repeat", pa.int64()),
    ("local_batch_size", pa.int64()), ("source", pa.string()),
    ("model_params", pa.int64()), ("model_tensors", pa.int64()),
    ("model_intensity", pa.float64()),
    ("warmup_iters", pa.int64()), ("timed_iters", pa.int64()), ("seed", pa.int64()),
    ("sync_each_step", pa.string()), ("rate", pa.string()),
    ("throughput", pa.float64()), ("throughput_window", pa.float64()),
    ("throughput_study", pa.float64()), ("timed_s", pa.float64()),
    ("iter_times_s", pa.list_(pa.float64())),
    ("rank_iter_times_s", pa.list_(pa.list_(pa.float64()))),
    ("forward_s", pa.float64()), ("backward_s", pa.float64()),
    ("comm_s", pa.float64()), ("update_s", pa.float64()), ("peak_memory_bytes", pa.int64()),
    ("method_host_s", pa.float64()), ("method_wait_s", pa.float64()),
    ("machine_cpu_s", pa.float64()),
    ("status", pa.string()), ("error", pa.string()),
    ("git_commit", pa.string()), ("torch_version", pa.string()), ("backend", pa.string()),
    ("device", pa.string()), ("hostnames", pa.list_(pa.string())),
    ("slurm_job_id", pa.string()), ("slurm_array_task_id", pa.string()),
    ("started_at", pa.string()), ("config_json", pa.string()), ("plan_json", pa.string()),
    ("devices", pa.list_(pa.string())), ("cuda_version", pa.string()),
    ("cudnn_version", pa.string()), ("nccl_version", pa.string()),
    ("tf32_matmul", pa.bool_()), ("tf32_cudnn", pa.bool_()), ("cudnn_benchmark", pa.bool_()),
    ("comm_env_json", pa.string()),
    ("engine", pa.string()), ("horovod_version", pa.string()),
    ("horovod_fusion_threshold_bytes", pa.int64()), ("horovod_cycle_time_s", pa.float64()),
    ("horovod_cache_capacity", pa.int64()),
    ("ps_wire", pa.string()), ("ps_wire_transports", pa.string()),
])
assert SCHEMA.names == COLUMNS


# A shard lacking any of these is no result shard (another table named *.parquet).
REQUIRED = IDENTITY + ["throughput"] + STATUS

OTHER_DATA = "microbench"  # a subfolder of results_dir with another schema (harness.microbench)


def shard_path(results_dir: str | os.PathLike, run_id: str, repeat: int) -> Path:
    """Where the shard of one repeat of one run lives."""
    return Path(results_dir) / f"{run_id}_r{repeat}.parquet"


def write_shard(path: str | os.PathLike, rows: Sequence[dict]) -> bool:
    """Write `rows` to a new shard at `path`; return False if it already exists.

    Unknown keys are an error (a typo would otherwise silently drop data);
    missing keys become nulls.
    """
    path = Path(path)
    for row in rows:
        unknown = set(row) - set(COLUMNS)
        if unknown:
            raise KeyError(f"result row has unknown columns {sorted(unknown)}; known: {COLUMNS}")
    table = pa.Table.from_pylist([{c: _null(r.get(c)) for c in COLUMNS} for r in rows],
                                 schema=SCHEMA)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:  # a full disk leaves no partial file: neither a shard nor a temporary one
        pq.write_table(table, tmp)
        os.link(tmp, path)  # atomic exclusive create: fails if a shard is already there
    except FileExistsError:
        return False
    finally:
        tmp.unlink(missing_ok=True)
    return True


def shard_files(paths: str | os.PathLike | Iterable[str | os.PathLike]) -> list[Path]:
    """Expand directories (recursively, but not into OTHER_DATA) and files into shard files."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    files: list[Path] = []
    for p in map(Path, paths):
        found = sorted(p.rglob("*.parquet")) if p.is_dir() else [p]
        files.extend(f for f in found if OTHER_DATA not in f.relative_to(p).parts[:-1])
    return files


def load(paths: str | os.PathLike | Iterable[str | os.PathLike]) -> pd.DataFrame:
    """Merge shards (files or directories of them) into one DataFrame.

    Columnar: the shards are read as one pyarrow dataset, not row by row.
    Unreadable shards are skipped with one warning line each on stderr; `load_report`
    returns them instead.
    """
    frame, bad = load_report(paths)
    warn(bad)
    return frame


def warn(bad: Iterable[tuple[Path, str]]) -> None:
    """One line on stderr per unreadable shard, naming it."""
    for path, error in bad:
        print(f"ddlbench: warning: skipped unreadable shard {path}: {error}", file=sys.stderr)


def _empty() -> pd.DataFrame:
    return pd.DataFrame({c: pd.Series(dtype=object) for c in COLUMNS})


def load_report(
    paths: str | os.PathLike | Iterable[str | os.PathLike],
) -> tuple[pd.DataFrame, list[tuple[Path, str]]]:
    """Like `load`, but return (frame, [(path, error), ...]) for unreadable shards: files
    that are no parquet, or lack a column of REQUIRED, or whose columns have other types."""
    files, bad = [], []
    for f in shard_files(paths):
        problem = _not_a_shard(f)
        if problem:
            bad.append((f, problem))
        else:
            files.append(f)
    if not files:
        return _empty(), bad
    try:  # the fast path: every shard in one columnar read
        table = ds.dataset([str(f) for f in files], schema=SCHEMA, format="parquet").to_table()
        return _frame(table), bad
    except Exception:  # noqa: BLE001 - some shard is bad: find which, keep the others
        pass
    tables = []
    for f in files:
        try:
            tables.append(pq.read_table(f, schema=SCHEMA))
        except Exception as exc:  # noqa: BLE001 - any unreadable file is reported, not fatal
            bad.append((f, _one_line(exc)))
    if not tables:
        return _empty(), bad
    return _frame(pa.concat_tables(tables)), bad


def _frame(table: pa.Table) -> pd.DataFrame:
    """The rows as a DataFrame, each row once; rows from before the engine and
    sync_each_step columns ran natively, on ddlbench's clock.

    A row read twice (the same run, repeat and configuration in two shards: a copied
    shard) is counted once, with a warning."""
    frame = table.to_pandas()
    twice = frame.duplicated([*IDENTITY, "config_json"])
    if twice.any():
        print(f"ddlbench: warning: {int(twice.sum())} rows were read twice (the same run, "
              "repeat and configuration in two shards: a copied shard?); each is counted "
              "once", file=sys.stderr)
        frame = frame[~twice].reset_index(drop=True)
    frame["engine"] = frame["engine"].fillna("native")
    frame["ps_wire"] = frame["ps_wire"].fillna("gloo")
    frame["sync_each_step"] = frame["sync_each_step"].map(ending)  # older shards: bools
    frame["rate"] = frame["rate"].fillna("window")
    return frame


def _null(value):
    """A missing value as null: rows made from a data frame hold NaN where a column was
    missing (a native run's Horovod version beside a Horovod run's)."""
    return None if isinstance(value, float) and value != value else value


def _not_a_shard(path: Path) -> str | None:
    """Why `path` is no result shard (its footer alone tells), or None."""
    try:
        names = pq.read_schema(path).names
    except Exception as exc:  # noqa: BLE001 - any unreadable file is reported, not fatal
        return _one_line(exc)
    missing = [c for c in REQUIRED if c not in names]
    return f"not a result shard: lacks columns {', '.join(missing)}" if missing else None


def _one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {first_line(exc)}"


def load_microbench(folder: str | os.PathLike) -> list[pd.DataFrame]:
    """The tables of harness.microbench in `folder`, oldest first; unreadable ones are
    skipped with a warning line each."""
    frames, bad = [], []
    for path in sorted(Path(folder).glob("*.parquet"), key=os.path.getmtime):
        try:
            frame = pd.read_parquet(path)
        except Exception as exc:  # noqa: BLE001 - any unreadable file is reported, not fatal
            bad.append((path, _one_line(exc)))
            continue
        missing = {"network", "kind", "alpha_s", "beta_s_per_byte"} - set(frame.columns)
        if missing:
            bad.append((path, f"not a microbenchmark: lacks columns {', '.join(sorted(missing))}"))
        else:
            frames.append(frame)
    warn(bad)
    return frames


def has_failed_row(paths: list[Path]) -> bool:
    """Whether any of these shards holds a failed row (an unreadable shard holds none)."""
    for path in paths:
        try:
            frame = load(path)
        except Exception:  # noqa: BLE001 - an unreadable shard is no failed row
            continue
        if (frame.status == "failed").any():
            return True
    return False


def summarize(cfg: DictConfig, run_id: str) -> str:
    """One line: this run's throughput, its speedup over a 1-worker baseline, its shards."""
    frame = load(Path(cfg.results_dir))
    mine = frame[(frame.run_id == run_id) & (frame.status == "ok")]
    where = f"shards: {cfg.results_dir}/{run_id}_r*.parquet"
    if mine.empty:
        return f"{cfg.model.name} {cfg.method.name}: no successful repeat; {where}"
    tput = mine.throughput
    line = (f"{cfg.model.name} {cfg.method.name} x{num_workers(cfg)} workers: "
            f"{tput.mean():.1f} ± {tput.std(ddof=0):.1f} samples/s over {len(tput)} repeats")
    base = frame[(frame.model == cfg.model.name) & (frame.world_size == 1)
                 & (frame.status == "ok") & (frame.network == cfg.network.name)
                 & (frame.local_batch_size == cfg.model.local_batch_size)]
    if not base.empty and num_workers(cfg) > 1:
        line += f"; speedup {tput.mean() / base.throughput.mean():.2f}x over 1 worker"
    return f"{line}; {where}"
