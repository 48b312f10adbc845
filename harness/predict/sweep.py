"""A sweep's predictions as result rows (source=simulated), one shard per simulation,
so the report draws simulated figures with the same code as measured ones; and the best
method per model, network and GPU count, beside the shard."""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import sys
import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from harness.config.frozen import Config
from harness.config.ranks import num_workers
from harness.measure import provenance, results
from harness.measure.progress import Progress
from harness.predict import profile
from harness.predict.model import Prediction, predict
from harness.predict.network import Network, moves, network
from harness.predict.network import key as network_key
from harness.predict.timeline import predict_traced

LINES = 300  # sweeps up to this size print a line per configuration; bigger ones, progress
CELL = ["model", "network", "world_size"]  # where methods compete: a model on N GPUs of a network

# -- the sweep ---------------------------------------------------------------------------

def row(cfg: Config, pred: Prediction, compute: profile.Compute, *, run_id: str,
        stack: dict | None = None) -> dict:
    """The result row of a prediction, with its own columns for calibration (iteration_s,
    hidden_s, messages, samples and one) beside those of results.COLUMNS (`stack`: see
    provenance.identity)."""
    return {
        **provenance.identity(cfg, run_id=run_id, repeat=0, stack=stack), "source": "simulated",
        "model_params": sum(compute.sizes), "model_tensors": len(compute.sizes),
        # every simulated iteration of the steady state is alike, so the study's statistic
        # (the mean of 10-step rates on rank 0) equals the window's
        "throughput": pred.throughput, "throughput_window": pred.throughput,
        "throughput_study": pred.throughput, "timed_s": pred.iteration_s * cfg.run.timed_iters,
        "forward_s": compute.forward_s, "backward_s": sum(compute.backward_s),
        "comm_s": pred.exposed_s, "update_s": compute.update_s, "status": "ok",
        "machine_cpu_s": pred.plan.get("machine_cpu_s"),  # on shared cores (cpushare.py)
        "device": compute.source, "plan_json": json.dumps({
            **pred.plan, "bottleneck": pred.bottleneck, "compute": compute.source,
            "calibrated": compute.calibrated}),
        "compute": compute.source, "calibrated": compute.calibrated,
        "speedup": pred.speedup, "bottleneck": pred.bottleneck, "iteration_s": pred.iteration_s,
        "hidden_s": pred.hidden_s, "messages": pred.messages, "one": 1.0,
        "samples": num_workers(cfg) * cfg.model.local_batch_size,
    }


@dataclass
class Inputs:
    """What a sweep's predictions need beside the configurations: the networks, and each
    configuration's compute."""

    networks: dict[tuple[str, str], Network]  # by network_key
    computes: list[profile.Compute]


def inputs(cfgs: list[Config], *, measured: dict | None = None) -> Inputs:
    """The networks and the compute first (a missing microbenchmark stops it before any
    profiling; measured compute runs here, one model at a time); `measured`: 1-GPU
    throughputs that calibrate GPUs of the table (profile.ComputeProfiles)."""
    networks: dict[tuple[str, str], Network] = {}
    for cfg in sorted(cfgs, key=lambda c: not moves(c)):  # a network any configuration
        if network_key(cfg) not in networks:              # moves over needs its link
            networks[network_key(cfg)] = network(cfg)
    profiles = profile.ComputeProfiles(measured)
    return Inputs(networks, [profiles(cfg) for cfg in cfgs])


def predict_sweep(cfgs: list[Config], given: Inputs | None = None, *,
                  slowdown: dict[str, float] | None = None) -> pd.DataFrame:
    """Predict every configuration: one row each (`row`), from `given` inputs (default:
    `inputs(cfgs)`); `slowdown`: per method, the calibrated slowdown of communication
    beside compute (model.predict)."""
    given = given or inputs(cfgs)
    sweep = _Sweep(cfgs, given.computes, given.networks, f"sim-{uuid.uuid4().hex[:8]}",
                   provenance.software(), slowdown or {})
    return pd.DataFrame(sweep.rows())


@dataclass
class _Sweep:
    """The predictions of a sweep, in spans of configurations. A sweep of more than
    LINES configurations shows its progress (harness.measure.progress), and shares the spans
    among processes, one per core (forked: they start with everything loaded here)."""

    cfgs: list[Config]
    computes: list[profile.Compute]
    networks: dict[tuple[str, str], Network]
    run_id: str
    stack: dict
    slowdown: dict[str, float]

    def span(self, bounds: tuple[int, int]) -> list[dict]:
        return [row(cfg, self.predict(cfg, compute), compute, run_id=self.run_id,
                    stack=self.stack)
                for cfg, compute in zip(self.cfgs[slice(*bounds)], self.computes[slice(*bounds)])]

    def predict(self, cfg: Config, compute: profile.Compute) -> Prediction:
        net, slowdown = self.networks[network_key(cfg)], self.slowdown.get(cfg.method.name, 0.0)
        if not cfg.simulate.trace:
            return predict(cfg, compute, net, slowdown=slowdown)
        pred, path = predict_traced(cfg, compute, net, run_id=self.run_id, slowdown=slowdown)
        print(f"{cfg.model.name} {cfg.method.name} x{num_workers(cfg)} {cfg.network.name}: "
              f"predicted timeline -> {path}", flush=True)
        return pred

    def rows(self) -> list[dict]:
        n = len(self.cfgs)
        if n <= LINES:
            return self.span((0, n))
        step = -(-n // SPANS)
        spans = [(a, min(a + step, n)) for a in range(0, n, step)]
        started, out = time.perf_counter(), []
        with self._spans(spans) as done, Progress(n, "simulating", unit="configurations",
                                                 file=sys.stdout, every_s=10) as shown:
            for rows in done:
                out += rows
                shown.update(len(rows))
        print(f"simulated {n} configurations in {time.perf_counter() - started:.1f} s",
              flush=True)
        return out

    @contextlib.contextmanager
    def _spans(self, spans: list[tuple[int, int]]) -> Iterator[Iterable[list[dict]]]:
        """The rows of each span, in order: from forked processes where there are cores
        for them (and no torch loaded here, which forks badly), else from this one."""
        global _FORKED
        processes = min(len(os.sched_getaffinity(0)), len(spans))
        if processes < 2 or "torch" in sys.modules:
            yield map(self.span, spans)
            return
        _FORKED = self
        try:
            with multiprocessing.get_context("fork").Pool(processes) as pool:
                yield pool.imap(_forked_span, spans)
        finally:
            _FORKED = None


SPANS = 40  # a big sweep's share of work per process and step
_FORKED: _Sweep | None = None  # the sweep a forked process works on


def _forked_span(bounds: tuple[int, int]) -> list[dict]:
    return _FORKED.span(bounds)


def write(frame: pd.DataFrame, uncalibrated: pd.DataFrame, costs: dict, results_dir: str) -> Path:
    """Write the rows as one shard, each row's plan with its method's fitted costs and its
    uncalibrated throughput, and the best method per cell beside it (`best`); print a
    line per configuration (up to LINES of them), where they went, and the best methods."""
    rows = []
    for r, raw in zip(frame.to_dict("records"), uncalibrated.throughput):
        out = {k: v for k, v in r.items() if k in results.COLUMNS}
        if costs:
            plan = json.loads(r["plan_json"])
            plan.update(calibration=costs.get(r["method"], {}), uncalibrated_throughput=raw)
            out["plan_json"] = json.dumps(plan)
        rows.append(out)
        if len(frame) <= LINES:
            print(f"[{len(rows)}/{len(frame)}] {r['model']} {r['method']} {r['nodes']}x"
                  f"{r['workers_per_node']} on {r['network']}: {r['throughput']:.1f} samples/s, "
                  f"speedup {r['speedup']:.2f}x, exposed comm {r['comm_s'] * 1e3:.1f} ms/iter "
                  f"({r['bottleneck']})", flush=True)
    path = results.shard_path(results_dir, frame.run_id.iloc[0], 0)
    results.write_shard(path, rows)
    print(f"simulated {len(rows)} configurations -> {path}", flush=True)
    winners = best(frame)
    table = path.with_name(f"{frame.run_id.iloc[0]}_best.csv")
    winners.to_csv(table, index=False)
    print(f"best method per model, network and GPU count -> {table}\n{summary(winners)}",
          flush=True)
    return path


# -- the best method per cell ------------------------------------------------------------

def best(frame: pd.DataFrame) -> pd.DataFrame:
    """Per model, compute (the GPU or profile: where a sweep's rows name it), network and
    GPU count: the fastest configuration (its method, and its
    nodes x workers per node where the sweep has several shapes), the methods that tie
    with it (within 1e-9, joined by "="; the model predicts bytescheduler_ps as wfbp_ps,
    and on one GPU nothing is sent), the fastest other method and the margin over it in %
    (empty where the cell has one method)."""
    cell = ["model", "compute", "network", "world_size"] if "compute" in frame else CELL
    ranked = frame.sort_values([*cell, "throughput", "method"],
                               ascending=[True] * len(cell) + [False, True], kind="stable")
    top = ranked.drop_duplicates(cell)[[*cell, "method", "nodes", "workers_per_node",
                                        "throughput", "speedup", "bottleneck",
                                        *["calibrated"] * ("calibrated" in frame)]]
    both = ranked[[*cell, "method", "throughput"]].merge(
        top[[*cell, "method", "throughput"]], on=cell, suffixes=("", "_top"))
    tied = (both[both.throughput >= both.throughput_top * (1 - 1e-9)]
            .groupby(cell).method.agg(lambda m: "=".join(sorted(set(m)))).rename("tied"))
    second = (both[both.method != both.method_top].drop_duplicates(cell)
              .rename(columns={"method": "runner_up", "throughput": "runner_up_throughput"}))
    out = top.merge(tied, on=cell).merge(second[[*cell, "runner_up", "runner_up_throughput"]],
                                         on=cell, how="left")
    out["margin_pct"] = 100 * (out.throughput / out.runner_up_throughput - 1)
    return (out.drop(columns="runner_up_throughput").rename(columns={"world_size": "gpus"})
            .reset_index(drop=True))


def summary(winners: pd.DataFrame) -> str:
    """One line per model and network: the GPU counts where each method is best, in runs
    (`1 any of 5, 2-8 bytescheduler_ps=wfbp_ps, 9-64 mgwfbp`)."""
    lines = []
    several = "compute" in winners and winners.compute.nunique() > 1  # GPUs: name each
    by = ["model", "compute", "network"] if several else ["model", "network"]
    for key, cells in winners.groupby(by, sort=True):
        model, net = key[0], key[-1]
        on = f" ({key[1]})" if len(key) == 3 else ""
        runs: list[list] = []  # [first GPUs, last GPUs, method]
        for gpus, tied in zip(cells.gpus, cells.tied):
            method = tied if tied.count("=") < 3 else f"any of {tied.count('=') + 1}"
            if runs and runs[-1][2] == method:
                runs[-1][1] = gpus
            else:
                runs.append([gpus, gpus, method])
        spans = ", ".join(f"{a}{f'-{b}' if b != a else ''} {m}" for a, b, m in runs)
        lines.append(f"  {model}{on} on {net} (GPUs: best method): {spans}")
    return "\n".join(lines)
