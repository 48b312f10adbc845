"""simulate.trace: the predicted timeline of a configuration, in run.trace's format.

The simulator logs what happened when (`predict(..., log=)`): per iteration its phases,
the forward's waits for updates and the per-layer updates (ByteScheduler), each unit
from its issue to its end on the "comm" lane, and the use of each collective stream or,
for PS, of each link, node thread and server (node_up, node_down; the node path's
threads, psqueues.PATHS: bus_up, the reduce-scatter and copy out, and bus_down, the copy
in and all-gather, on the node's one bus; server<i>_in, server<i>_out, and its engine threads
server<i>_engine<t>). This writes them as
harness/measure/traces.py's lanes, the last simulated iteration as the traced one, to
`<results_dir>/traces/<run_id>_<model>_<method>_w<workers>_<network>.trace.json`.
"""

from __future__ import annotations

from pathlib import Path

from harness.config.frozen import Config
from harness.config.ranks import num_workers
from harness.measure import traces
from harness.predict import profile
from harness.predict.model import Prediction, predict
from harness.predict.network import Network

LINKS = ("updates", "collective", "node_up", "node_down", "bus_up", "bus_down")


def _order(lane: str) -> tuple:
    """Lanes after compute and comm: updates, the stream or node links, then the servers."""
    if lane in LINKS:
        return (LINKS.index(lane), 0, "")
    server, _, way = lane.removeprefix("server").partition("_")  # in, out, engine<t>
    return (len(LINKS), int(server), ("in", "out").index(way) if way in ("in", "out") else 2,
            int(way.removeprefix("engine") or 0) if way.startswith("engine") else 0)


def predict_traced(cfg: Config, compute: profile.Compute, net: Network, *,
                   run_id: str, slowdown: float = 0.0) -> tuple[Prediction, Path]:
    """`predict`, and its timeline written as a trace file."""
    log: list[tuple] = []
    pred = predict(cfg, compute, net, log=log, slowdown=slowdown)
    lanes = ["compute", "comm", *sorted({e[0] for e in log} - {"compute", "comm"}, key=_order)]
    tid = {lane: n for n, lane in enumerate(lanes, start=1)}  # compute, comm: traces.py's
    events = [traces.meta("process_name", 0, "ddlbench (predicted)")]
    events += [traces.meta("thread_name", n, lane) for lane, n in tid.items()]
    for n, (lane, name, start, end, args) in enumerate(log):
        if lane == "comm":
            rest = dict(args)
            events += traces.unit(n, rest.pop("unit"), start * 1e6, end * 1e6, rest)
        else:
            events.append(traces.span(name, start * 1e6, end * 1e6, tid[lane], **args))
    traced = next(e for e in reversed(log) if e[1] == "traced iteration")
    trace = {"traceEvents": events, "displayTimeUnit": "ms",
             "ddlbench": {"traced_us": [traced[2] * 1e6, traced[3] * 1e6]}}
    name = (f"{run_id}_{cfg.model.name}_{cfg.method.name}_w{num_workers(cfg)}_"
            f"{cfg.network.name}")
    about = {**traces.about(cfg, source="simulated"), "run_id": run_id,
             "iteration_s": pred.iteration_s, "compute": compute.source}
    return pred, traces.write(trace, traces.trace_path(cfg.results_dir, name), about)
