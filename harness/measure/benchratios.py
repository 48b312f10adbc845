"""The ratios `python -m harness.methodbench` prints: run-list names of the rows (a method
and its twin's suffix), each round's ratios, and their medians over the rounds."""

from __future__ import annotations

import json
import statistics

import pandas as pd

ALLREDUCE = ("bsp_a2a", "wfbp_a2a", "mgwfbp", "bytescheduler_a2a", "ddp")
TWIN = "@horovod"  # a method's name in the run list: that method on engine=horovod
ROOT = "@root"  # a PS method on the node path through the root (node_reduce=root)
UNMETERED = "@unmetered"  # a method without its host meter (run.method_host=false)
UCX = "@ucx"  # a PS method's messages over the UCX wire (cluster.ps_wire=ucx)
TWINS = {TWIN: ["engine=horovod"], ROOT: ["method.transport.node_reduce=root"],
         UNMETERED: ["run.method_host=false"], UCX: ["cluster.ps_wire=ucx"]}
PS = ("bsp_ps", "wfbp_ps", "bytescheduler_ps", "priority_ps")  # PAIRS: what each buys
PAIRS = (*((m, "bsp_ps") for m in PS[1:]), ("bytescheduler_a2a", "wfbp_a2a"),
         *((m + ROOT, "bsp_ps" + ROOT) for m in PS[1:]), *((m, m + ROOT) for m in PS),
         *((m + UCX, m) for m in PS))

def _twin(config_json: object) -> str:
    """The twin suffix of a row's run-list name, from its configuration ("" for none)."""
    if not isinstance(config_json, str):
        return ""
    cfg = json.loads(config_json)
    root = cfg["method"]["transport"].get("node_reduce") == "root"
    ucx = cfg.get("cluster", {}).get("ps_wire") == "ucx"
    unmetered = cfg.get("run", {}).get("method_host") is False
    return (ROOT if root else "") + (UCX if ucx else "") + (UNMETERED if unmetered else "")


def _run_names(frame: pd.DataFrame) -> pd.Series:
    """Each row's run-list name: its method, with ROOT for a PS run on the root path, UCX
    for one on the UCX wire and UNMETERED for one without its host meter."""
    if "config_json" not in frame:
        return frame.method
    return frame.method + frame.config_json.map(_twin)


def ratios(frame: pd.DataFrame, *, workers: list[int]) -> dict[str, dict[str, float]]:
    """The targets' ratios per model within one round's runs (rows as `results.load` gives
    them: every row names its engine)."""
    ok = frame[frame.status == "ok"].assign(method=_run_names)
    tput = ok.groupby(["model", "method", "engine", "world_size"]).throughput.max().to_dict()
    top = max(workers)
    out = {}
    for model_name in sorted(ok.model.unique()):
        def get(method: str, n: int, model_name: str = model_name,
                engine: str = "native") -> float | None:
            return tput.get((model_name, method, engine, n))

        r = {}
        fast = max((t for t in (get("wfbp_a2a", top), get("mgwfbp", top)) if t), default=None)
        if fast and get("ddp", top):
            r[f"best(wfbp_a2a,mgwfbp)/ddp@{top}w"] = fast / get("ddp", top)
        pairs = [*PAIRS, *((m + UNMETERED, m) for m in ok.method.unique()
                           if not m.endswith(UNMETERED))]
        for method, base in pairs:
            if get(method, top) and get(base, top):
                r[f"{method}/{base}@{top}w"] = get(method, top) / get(base, top)
        for method in ALLREDUCE:
            if get("plain", 1) and get(method, 1):
                r[f"{method}/plain@1w"] = get(method, 1) / get("plain", 1)
            if get(method, top) and get(method, top, engine="horovod"):
                r[f"{method} native/horovod@{top}w"] = (get(method, top)
                                                        / get(method, top, engine="horovod"))
        out[model_name] = r
    return out


def report(rounds: list[pd.DataFrame], *, workers: list[int]) -> dict[str, dict[str, dict]]:
    """Print throughput per configuration and each ratio's median over the rounds (each
    round's ratio pairs runs made minutes apart, so the drift of a shared machine cancels);
    return {model: {ratio: {"median", "min", "max", "rounds"}}}."""
    frame = pd.concat(rounds)
    ok = frame[frame.status == "ok"].assign(method=_run_names).groupby(
        ["model", "world_size", "method", "engine"])
    summary = ok.throughput.agg(["median", "min", "max", "count"])
    if "method_host_s" in frame:  # the method's own host time and its waits, per iteration
        summary["host_ms"] = ok.method_host_s.median() * 1e3
        summary["wait_ms"] = ok.method_wait_s.median() * 1e3
    print(summary.round(2).to_string())
    per_round = [ratios(f, workers=workers) for f in rounds]
    table: dict[str, dict[str, dict]] = {}
    for model_name in sorted({m for r in per_round for m in r}):
        names = dict.fromkeys(n for r in per_round for n in r.get(model_name, {}))
        for name in names:
            values = [r[model_name][name] for r in per_round if name in r.get(model_name, {})]
            table.setdefault(model_name, {})[name] = {
                "median": statistics.median(values), "min": min(values), "max": max(values),
                "rounds": values}
            print(f"{model_name:16s} {name:36s} median {statistics.median(values):.3f}  "
                  f"(rounds: {', '.join(f'{v:.3f}' for v in values)})")
    return table


