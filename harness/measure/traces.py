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
import math
import statistics
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
    """The harness's lanes of a trace file, in seconds from its traced iteration's start.
    ValueError (OSError: unreadable) says what in it is not a ddlbench trace: its shape,
    a field missing or of the wrong type, checked before any is used."""
    try:
        trace = json.loads(Path(path).read_text())
    except RecursionError:
        raise ValueError("it is nested too deeply to be a trace") from None
    info, events = _checked(trace)
    start, end = info["traced_us"]
    ours = [(i, e) for i, e in enumerate(events) if e.get("pid") == PID]
    names = {e["tid"]: e["args"]["name"] for _, e in ours
             if e["ph"] == "M" and e.get("name") == "thread_name"}
    bars, begun = [], {}
    for i, e in ours:
        if e["ph"] in ("X", "b") and e["tid"] not in names:
            raise ValueError(f"traceEvents[{i}] is on thread (tid) {e['tid']}, which no "
                             f"thread_name event of pid {PID} names")
        if e["ph"] == "X":
            bars.append(Bar(names[e["tid"]], e["name"], (e["ts"] - start) / 1e6,
                            (e["ts"] + e["dur"] - start) / 1e6, e.get("args", {})))
        elif e["ph"] == "b":
            begun[e["id"]] = e
        elif e["ph"] == "e" and e["id"] in begun:
            b = begun.pop(e["id"])
            bars.append(Bar(names[b["tid"]], b["name"], (b["ts"] - start) / 1e6,
                            (e["ts"] - start) / 1e6, b.get("args", {})))
    lanes = [names[t] for t in sorted(names)]
    return Timeline(info, (end - start) / 1e6, lanes, bars)


FIX = "write one with run.trace=true or simulate.trace=true"
ABOUT = {"source": str, "model": str, "method": str, "workers": int, "network": str,
         "local_batch_size": int}  # what the report reads of `about` (and "rank", measured)
EVENT = {"X": {"name": str, "tid": int, "ts": float, "dur": float},  # what each kind needs
         "b": {"name": str, "tid": int, "ts": float, "id": int},
         "e": {"ts": float, "id": int},
         "M": {"tid": int}}


def _checked(trace: object) -> tuple[dict, list[dict]]:
    """(about, events) of a parsed trace file, every field `read` uses of the right type."""
    if not isinstance(trace, dict):
        raise ValueError(f"it holds a JSON {_kind(trace)}, not a trace's object; {FIX}")
    info, events = trace.get("ddlbench"), trace.get("traceEvents")
    if not isinstance(info, dict) or "traced_us" not in info:
        raise ValueError(f"it is not a ddlbench trace (no 'ddlbench' key); {FIX}")
    span_us = info["traced_us"]
    if not (isinstance(span_us, list) and len(span_us) == 2 and all(map(_number, span_us))
            and span_us[0] < span_us[1]):
        raise ValueError(f"ddlbench.traced_us is {_show(span_us)}; it must be [start, end] in "
                         "microseconds, start < end")
    needs = {**ABOUT, "rank": int} if info.get("source") == "measured" else ABOUT
    for key, kind in needs.items():
        _field(info, key, kind, "ddlbench")
    if info["source"] not in ("measured", "simulated"):
        raise ValueError(f"ddlbench.source is {_show(info['source'])}; it must be "
                         '"measured" or "simulated"')
    if not isinstance(events, list):
        raise ValueError(f"traceEvents is a JSON {_kind(events)}, not a list of events; {FIX}")
    for i, event in enumerate(events):
        _event(i, event)
    return info, events


def _event(i: int, event: object) -> None:
    if not isinstance(event, dict):
        raise ValueError(f"traceEvents[{i}] is a JSON {_kind(event)}, not an event object")
    if event.get("pid") != PID:
        return  # the profiler's own events: not read
    ph = event.get("ph")
    if ph not in EVENT:
        raise ValueError(f"traceEvents[{i}].ph is {_show(ph)}; the harness writes X, b, e or M")
    for key, kind in EVENT[ph].items():
        _field(event, key, kind, f"traceEvents[{i}]")
    if ph == "X" and event["dur"] < 0:
        raise ValueError(f"traceEvents[{i}].dur is {_show(event['dur'])}; it must be >= 0")
    args = event.get("args", {})
    if not isinstance(args, dict) or not isinstance(args.get("unit", 0), int) or (
            ph == "M" and not isinstance(args.get("name"), str)):
        raise ValueError(f"traceEvents[{i}].args is {_show(args)}; it must be an object, its "
                         "unit a whole number, a thread_name's name a string")


def _field(where: dict, key: str, kind: type, name: str) -> None:
    """ValueError unless where[key] is of `kind` (float: any finite number; no booleans)."""
    value = where.get(key)
    ok = _number(value) if kind is float else (
        isinstance(value, kind) and not isinstance(value, bool))
    if not ok:
        need = {float: "a number", int: "a whole number", str: "a string"}[kind]
        what = f"missing ({need} is needed)" if key not in where else \
            f"{_show(value)}; it must be {need}"
        raise ValueError(f"{name}.{key} is {what}")


def _number(value: object) -> bool:
    """A finite JSON number (no boolean, no integer too large for a float)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _kind(value: object) -> str:
    return {list: "list", dict: "object", str: "string", type(None): "null"}.get(
        type(value), "number" if _number(value) else type(value).__name__)


def _show(value: object, width: int = 60) -> str:
    """`value` as JSON writes it, cut to `width` characters."""
    text = json.dumps(value)
    return text if len(text) <= width else text[:width - 3] + "..."


def unit_gap(measured: Timeline, predicted: Timeline, *,
             after_backward: bool = False, at: str = "completion") -> tuple[float, int]:
    """Median absolute difference of each unit's completion (`at="issue"`: of its issue)
    from its iteration's start (`after_backward`: from the end of its backward, which
    leaves the compute's error out), as a share of the measured iteration, over the units
    both traced iterations hold (issued in them); and their number (NaN, 0 when none).
    A unit traced in pieces is issued with its first and completed with its last."""
    if at not in ("issue", "completion"):
        raise ValueError(f"at={at!r}: it must be 'issue' or 'completion'")

    def times(tl: Timeline) -> dict[int, float]:
        back = [b.end_s for b in tl.bars if b.lane == "compute" and b.name == "backward"
                and b.start_s <= tl.length_s]
        zero = max(back, default=0.0) if after_backward else 0.0
        per: dict[int, list[float]] = {}
        for b in tl.bars:
            if b.lane == "comm" and "unit" in b.args and 0 <= b.start_s <= tl.length_s:
                per.setdefault(b.args["unit"], []).append(b.start_s if at == "issue"
                                                          else b.end_s)
        pick = min if at == "issue" else max
        return {u: pick(times) - zero for u, times in per.items()}

    m, p = times(measured), times(predicted)
    gaps = [abs(m[u] - p[u]) / measured.length_s for u in m.keys() & p.keys()]
    return (statistics.median(gaps) if gaps else float("nan")), len(gaps)


def gap_text(measured: Timeline, predicted: Timeline) -> str:
    """The units' issue and completion gaps (unit_gap) as one phrase, e.g. "per unit,
    median |measured - predicted| as a share of the measured iteration: issue 3.0%,
    completion 5.0% (46 units)"."""
    issue, n = unit_gap(measured, predicted, at="issue")
    done, _ = unit_gap(measured, predicted)
    if not n:
        return "no unit issued in both traced iterations"
    return ("per unit, median |measured - predicted| as a share of the measured iteration: "
            f"issue {100 * issue:.1f}%, completion {100 * done:.1f}% ({n} units)")
