"""The timeline files: Chrome/Perfetto traces of one iteration, measured or predicted.

run.trace (harness/measure/timeline.py) and simulate.trace (harness/predict/timeline.py)
write the same format: the harness's lanes in process PID, one thread per lane
(`thread_name` metadata): "compute" (phases and waits, complete events), "comm" (each
communication unit from its issue to its completion, async events named "unit <i>"
with the plan's unit index, tensors and bytes) and, predicted only, a lane per link,
collective stream or server (when each was busy with which unit). The top-level key
"ddlbench" says what the trace is (`about`) and where its traced iteration lies
(`traced_us`). `read` gives the report those lanes; no torch here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.config.frozen import Config
from harness.config.ranks import num_workers
from harness.config.schema import step_ending

PID = 1_000_000  # the harness's lanes, apart from the profiler's processes
COMPUTE, COMM = 1, 2  # their thread ids; predicted links follow
FOLDER = "traces"  # under results_dir
KEY = ("model", "method", "workers", "network", "local_batch_size")  # a configuration


def trace_path(results_dir: str | Path, name: str) -> Path:
    return Path(results_dir) / FOLDER / f"{name}.trace.json"


def about(cfg: Config, *, source: str) -> dict[str, Any]:
    """What a trace is of: its configuration (KEY and the rest)."""
    return {"source": source, "model": cfg.model.name, "method": cfg.method.name,
            "workers": num_workers(cfg), "nodes": cfg.cluster.nodes,
            "network": cfg.network.name, "local_batch_size": cfg.model.local_batch_size,
            "sync_each_step": step_ending(cfg.run)}


def meta(kind: str, tid: int, name: str) -> dict:
    return {"ph": "M", "name": kind, "pid": PID, "tid": tid, "args": {"name": name}}


def span(name: str, start_us: float, end_us: float, tid: int = COMPUTE, **args: Any) -> dict:
    return {"ph": "X", "name": name, "cat": "ddlbench", "pid": PID, "tid": tid,
            "ts": start_us, "dur": max(0.0, end_us - start_us), "args": args}


def unit(n: int, key: int, start_us: float, end_us: float, args: dict) -> list[dict]:
    """Unit `key` in flight from `start_us` to `end_us` on the comm lane (async id `n`)."""
    common = {"name": f"unit {key}", "cat": "ddlbench.comm", "id": n, "pid": PID, "tid": COMM}
    return [{**common, "ph": "b", "ts": start_us, "args": {"unit": key, **args}},
            {**common, "ph": "e", "ts": end_us}]


def write(trace: dict, path: Path, about: dict) -> Path:
    """`trace` (its "ddlbench" key completed by `about`) to `path`, atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    trace["ddlbench"] = {**trace.get("ddlbench", {}), **about}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(trace))
    tmp.replace(path)
    return path


@dataclass
class Bar:
    lane: str
    name: str
    start_s: float  # from the traced iteration's start
    end_s: float
    args: dict


@dataclass
class Timeline:
    about: dict
    length_s: float  # the traced iteration
    lanes: list[str]  # compute, comm, then the predicted links
    bars: list[Bar]


def read(path: str | Path) -> Timeline:
    """The harness's lanes of a trace file, in seconds from its traced iteration's start."""
    trace = json.loads(Path(path).read_text())
    info = trace.get("ddlbench")
    if not isinstance(info, dict) or "traced_us" not in info:
        raise ValueError(f"{path} is not a ddlbench trace (no 'ddlbench' key); write one with "
                         "run.trace=true or simulate.trace=true")
    start, end = info["traced_us"]
    ours = [e for e in trace["traceEvents"] if e.get("pid") == PID]
    names = {e["tid"]: e["args"]["name"] for e in ours
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
    bars, begun = [], {}
    for e in ours:
        ph = e.get("ph")
        if ph == "X":
            bars.append(Bar(names[e["tid"]], e["name"], (e["ts"] - start) / 1e6,
                            (e["ts"] + e["dur"] - start) / 1e6, e.get("args", {})))
        elif ph == "b":
            begun[e["id"]] = e
        elif ph == "e" and e["id"] in begun:
            b = begun.pop(e["id"])
            bars.append(Bar(names[b["tid"]], b["name"], (b["ts"] - start) / 1e6,
                            (e["ts"] - start) / 1e6, b.get("args", {})))
    lanes = [names[t] for t in sorted(names)]
    return Timeline(info, (end - start) / 1e6, lanes, bars)
