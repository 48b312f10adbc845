"""The simulator against measurements: fit the costs no fact gives, validate, advise.

`simulate.calibrate=<csv in the study's format, or a folder of measured results>` fits,
per method, three costs on the measured cells of `simulate.calibrate_gpus` (default:
each model's and method's smallest GPU count above 1: one node) and adds them to every
prediction of that method:

- `slowdown` (0 to 3, in quarters): while the GPU computes, the communication work it
  runs (NCCL's kernels, BytePS's in-node stages) progresses 1 + slowdown times slower,
  as both share its SMs and memory. It costs nothing where the communication stays
  hidden (ResNet-50's on one node: the study measured it at the 1-GPU speed) and the
  exposed rest where it does not (BERT's); it enters the simulation (model.predict);
- `message_s` (0 to 5 ms): training-thread time per message (one communication unit:
  a tensor, a merged group, a piece) in an iteration: its hook, negotiation, scheduling;
- `host_s` (0 to 0.5 s): training-thread time per iteration that the engine adds
  whatever the model and cluster (its per-iteration bookkeeping).

    iteration = simulated(slowdown) + message_s * messages + host_s

The fit simulates the fit cells at every slowdown of SLOWDOWNS; for each, the linear
costs are a bounded least squares over the method's fit cells (seconds per iteration),
solved exactly by trying every set of free costs; the slowdown with the smallest
residual wins (ties: the smaller). The cells it fits on are left out of the validation.
"""

from __future__ import annotations

import itertools
import json
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from harness import config
from harness.config import tables
from harness.config.frozen import Config
from harness.config.ranks import num_workers
from harness.measure import results

CELL = ["model", "method", "network", "world_size"]


@dataclass(frozen=True)
class Term:
    name: str
    feature: str  # the prediction's column it multiplies (seconds per iteration per unit)
    high: float   # the bound: 0 <= cost <= high
    meaning: str


SLOWDOWNS = tuple(i / 4 for i in range(13))  # 0 to 3: the fitted slowdown's candidates
TERMS = (
    Term("message_s", "messages", 0.005, "training-thread seconds per message per iteration"),
    Term("host_s", "one", 0.5, "training-thread seconds per iteration"),
)
FITTED = ("slowdown", *(t.name for t in TERMS))  # each method's calibration, in order


# -- measured cells ------------------------------------------------------------------------

def measured(source: str) -> pd.DataFrame:
    """Measured throughputs: a CSV in the study's format, or a folder of measured results
    (their mean per cell)."""
    if not Path(source).is_dir():
        return tables.read_csv(source)
    runs = results.load(Path(source))
    runs = runs[(runs.status == "ok") & (runs.source == "measured")]
    keys = ["model", "method", "network", "world_size"]
    return (runs.groupby(keys, as_index=False).throughput.mean()
            .rename(columns={"world_size": "gpus", "throughput": "throughput_mean"}))


def read_cells(where: str, source: str, cfgs: list[Config], *, empty_ok: bool = False
               ) -> pd.DataFrame | None:
    """The measured cells of the sweep `cfgs` in `source`, read and checked before anything
    is simulated (`where` names the setting): ConfigError names the problem (with
    `empty_ok`, None where it has no cell of the sweep)."""
    ref = tables.read_table(where, source, read=measured,
                            columns=["model", "method", "network", "gpus", "throughput_mean"],
                            numeric=["gpus", "throughput_mean"], whole=["gpus"])
    twice = tables.duplicate(ref, ["model", "method", "network", "gpus"], where=where,
                             first_row=1)
    if twice:
        raise config.ConfigError(twice)
    ref = ref.astype({"gpus": int})
    cells = {(c.model.name, c.method.name, c.network.name, num_workers(c)) for c in cfgs}
    ref = ref[[cell in cells for cell in zip(ref.model, ref.method, ref.network, ref.gpus)]]
    if ref.empty and empty_ok:
        return None
    if ref.empty:
        raise config.ConfigError(f"{where} has no cell of this sweep (network "
                                 f"{', '.join(sorted({c.network.name for c in cfgs}))})")
    return ref.rename(columns={"gpus": "world_size"})[[*CELL, "throughput_mean"]]


def fit_cells(cells: pd.DataFrame, gpus: list[int] | None) -> pd.DataFrame:
    """The cells to fit on: those at `gpus`, or each model's and method's smallest GPU
    count above 1."""
    if gpus:
        chosen = cells[cells.world_size.isin(gpus)]
    else:
        multi = cells[cells.world_size > 1]
        smallest = multi.groupby(["model", "method"]).world_size.transform("min")
        chosen = multi[multi.world_size == smallest]
    if chosen.empty:
        at = f"at {', '.join(map(str, gpus))} GPUs" if gpus else "above 1 GPU"
        raise config.ConfigError(f"simulate.calibrate has no cell of this sweep {at} to fit "
                                 f"on; set simulate.calibrate_gpus to GPU counts it has")
    return chosen


# -- the fit -----------------------------------------------------------------------------

def _bounded_least_squares(a: np.ndarray, y: np.ndarray, high: np.ndarray) -> np.ndarray:
    """min |a x - y| with 0 <= x <= high: the best over every choice of free costs (the
    others at 0 or their bound); ties go to fewer free costs."""
    n = a.shape[1]
    best: tuple[float, int, np.ndarray] | None = None
    for fixed in itertools.product((None, 0.0, 1.0), repeat=n):  # free, at 0, at its bound
        x = np.array([0.0 if f is None else f * h for f, h in zip(fixed, high)])
        free = [i for i, f in enumerate(fixed) if f is None]
        if free:
            x[free] = np.linalg.lstsq(a[:, free], y - a @ x, rcond=None)[0]
            if (x[free] < 0).any() or (x[free] > high[free]).any():
                continue
        residual = float(np.sum((a @ x - y) ** 2))
        key = (round(residual, 12), len(free))
        if best is None or key < best[:2]:
            best = (*key, x)
    assert best is not None  # every cost at 0 is always admissible
    return best[2]


def fit(simulate_at: Callable[[float, set[str]], pd.DataFrame], cells: pd.DataFrame
        ) -> dict[str, dict[str, float]]:
    """Per method, the costs that best explain the measured `cells`. `simulate_at(s,
    methods)` predicts the cells of `methods` with their communication slowed by `s`; for
    each slowdown tried, the linear costs are the bounded least squares over the cells'
    iteration times. Methods that hide no communication keep slowdown 0; the others try
    every other one of SLOWDOWNS, then the two beside the best (ties: the smaller)."""
    plain = simulate_at(0.0, set(cells.method))
    scores = {m: {0.0: _linear(rows)} for m, rows in plain.merge(cells, on=CELL)
              .groupby("method")}
    hiding = set(plain[plain.hidden_s > 1e-9].method) & set(scores)  # beyond rounding
    for tried in (SLOWDOWNS[2::2], None):
        wanted: dict[float, set[str]] = {}
        for method in hiding:
            best = min(scores[method], key=lambda s, m=method: (scores[m][s][0], s))
            step = SLOWDOWNS[1]
            for s in tried or (best - step, best + step):
                if SLOWDOWNS[0] <= s <= SLOWDOWNS[-1] and s not in scores[method]:
                    wanted.setdefault(s, set()).add(method)
        for slowdown, methods in sorted(wanted.items()):
            for method, rows in simulate_at(slowdown, methods).merge(cells, on=CELL).groupby(
                    "method"):
                scores[method][slowdown] = _linear(rows)
    costs = {}
    for method, by_slowdown in scores.items():
        slowdown = min(by_slowdown, key=lambda s, b=by_slowdown: (b[s][0], s))
        x = by_slowdown[slowdown][1]
        costs[method] = {"slowdown": slowdown, **{t.name: float(v) for t, v in zip(TERMS, x)}}
    return costs


def _linear(rows: pd.DataFrame) -> tuple[float, np.ndarray]:
    """The linear costs' bounded least squares over predicted-and-measured `rows`: the
    residual (rounded, so that equal fits tie) and the costs."""
    a = rows[[t.feature for t in TERMS]].to_numpy(float)
    y = (rows.samples / rows.throughput_mean - rows.iteration_s).to_numpy(float)
    x = _bounded_least_squares(a, y, np.array([t.high for t in TERMS]))
    return round(float(np.sum((a @ x - y) ** 2)), 12), x


def apply(predicted: pd.DataFrame, costs: dict[str, dict[str, float]]) -> pd.DataFrame:
    """The predictions with each method's linear costs added (methods without:
    unchanged); `predicted` simulated each method at its fitted slowdown."""
    out = predicted.copy()
    extra = np.zeros(len(out))
    for t in TERMS:
        extra += out.method.map(lambda m, name=t.name: costs.get(m, {}).get(name, 0.0)) * out[
            t.feature]
    iteration = out.iteration_s + extra
    out["speedup"] *= out.iteration_s / iteration
    out["throughput"] = out["throughput_window"] = out["throughput_study"] = (
        out.samples / iteration)
    out["timed_s"] *= iteration / out.iteration_s
    out["comm_s"] += extra  # time beyond the compute, as exposed communication is
    out["iteration_s"] = iteration
    return out


def describe(costs: dict[str, dict[str, float]], cells: pd.DataFrame,
             methods: list[str]) -> str:
    """The fitted costs, one line per method of the sweep (`methods`), and what they were
    fitted on."""
    where = ", ".join(f"{m} at {'/'.join(map(str, sorted(g.world_size.unique())))} GPUs"
                      for m, g in cells.groupby("model"))
    lines = [f"calibrated on {len(cells)} measured cells ({where}):"]
    for method in sorted(set(methods)):
        fitted = costs.get(method)
        lines.append(f"  {method:<18} " + ("  ".join(
            f"{name}={fitted[name] * (1e3 if name.endswith('_s') else 1):.3g}"
            f"{' ms' if name.endswith('_s') else ''}" for name in FITTED)
            if fitted else "not calibrated (no measured cell to fit on)"))
    return "\n".join(lines)


# -- validation and advice ---------------------------------------------------------------

def kendall_tau(x: list[float], y: list[float]) -> float:
    """Kendall's tau-b of two orderings (ties within 1e-9 relative count as ties)."""
    def sign(a: float, b: float) -> int:
        return 0 if abs(a - b) <= 1e-9 * max(abs(a), abs(b)) else (1 if a > b else -1)

    pairs = [(sign(x[i], x[j]), sign(y[i], y[j]))
             for i, j in itertools.combinations(range(len(x)), 2)]
    n0 = len(pairs)
    tied_x = sum(1 for a, _ in pairs if a == 0)
    tied_y = sum(1 for _, b in pairs if b == 0)
    denom = math.sqrt((n0 - tied_x) * (n0 - tied_y))
    return sum(a * b for a, b in pairs) / denom if denom else 0.0


def validate(predicted: pd.DataFrame, cells: pd.DataFrame) -> tuple[pd.DataFrame, str]:
    """Predicted vs measured throughput on `cells`: the cells with their errors, and the
    line of figures (median and max absolute error in %, mean Kendall tau per model,
    network and GPU count)."""
    both = predicted.merge(cells, on=CELL)
    both["pct_error"] = 100 * (both.throughput - both.throughput_mean) / both.throughput_mean
    taus = [kendall_tau(list(g.throughput), list(g.throughput_mean))
            for _, g in both.groupby(["model", "network", "world_size"]) if len(g) > 1]
    err = both.pct_error.abs()
    line = (f"median_abs_pct_error={err.median():.1f} max_abs_pct_error={err.max():.1f} "
            f"mean_kendall_tau={statistics.fmean(taus) if taus else float('nan'):.2f} "
            f"cells={len(both)}")
    return both, line


def advice(frame: pd.DataFrame, errors: dict[tuple[str, str], float]) -> str:
    """Per model, compute and cluster: the methods ranked by predicted throughput, whether
    the best one's margin over the next is larger than the model's validated error on
    that network (`errors`: median absolute error in % per (model, network), from this
    run's reference; else the study's held-out figures for its GPU and networks), and
    where the best one's iteration goes."""
    out = []
    keys = ["model", "compute", "network", "nodes", "workers_per_node"]
    frame = frame if "compute" in frame else frame.assign(compute=frame.device)
    for (model, compute, net, nodes, per_node), g in frame[frame.world_size > 1].groupby(keys):
        ranked = list(g.sort_values("throughput", ascending=False).itertuples())
        gpu = compute.split(":")[1] if compute.startswith("counted:") else compute
        out.append(f"\n{model} on {nodes} node(s) x {per_node} worker(s), {net}, {gpu}"
                   f" (compute calibrated: {getattr(ranked[0], 'calibrated', 'no')}):")
        for i, r in enumerate(ranked, 1):
            out.append(f"  {i}. {r.method:<18} {r.throughput:10.1f} samples/s  "
                       f"speedup {r.speedup:5.2f}x  bottleneck: {r.bottleneck}")
        tied = [r.method for r in ranked[1:] if r.throughput >= ranked[0].throughput * (1 - 1e-9)]
        ranked = [ranked[0], *(r for r in ranked[1:] if r.method not in tied)]
        if len(ranked) > 1:
            margin = 100 * (ranked[0].throughput / ranked[1].throughput - 1)
            err = errors.get((model, net), STUDY_ERRORS.get((compute, net)))
            verdict = (f"not validated on {gpu} and {net}: spec sheets and facts alone"
                       if err is None else
                       f"{'beyond' if margin > err else 'within'} the validated error of "
                       f"{err:.1f}%{'' if margin > err else ': a coin toss'}")
            out.append(f"  best: {ranked[0].method}, {margin:.1f}% over {ranked[1].method}, "
                       f"{verdict}{'; tied with ' + ', '.join(tied) if tied else ''}")
        out.append(_where_time_goes(ranked[0]))
    return "\n".join(out)


# The study's held-out uncalibrated median errors (harness/predict/README.md): ib100_rdma
# on its 63 cells at 8-32 GPUs, its TCP networks on theirs against its published TCP
# throughputs (ddl-benchmarks results/2020-05-29/README.md), with NCCL 2.4.8's trees and
# the synchronize that holds the GIL.
STUDY_ERRORS = {("counted:rtx2080ti:fp32", "ib100_rdma"): 3.8,
                ("counted:rtx2080ti:fp32", "eth100_tcp"): 6.9,
                ("counted:rtx2080ti:fp32", "eth10_tcp"): 11.8}


def _where_time_goes(r) -> str:
    """One line: the best method's iteration as compute and exposed communication, and
    its busiest resources' time per iteration (each a stage: the all-reduce stream; a
    node's links and bus, a server's links and engine threads)."""
    ms = 1e3
    busiest = json.loads(r.plan_json).get("busiest_s", {})
    stages = ", ".join(f"{k} {v * ms:.1f}" for k, v in busiest.items())
    return (f"  where {r.method}'s {r.iteration_s * ms:.1f} ms go: compute "
            f"{(r.forward_s + r.backward_s + r.update_s) * ms:.1f} (forward "
            f"{r.forward_s * ms:.1f}, backward {r.backward_s * ms:.1f}, update "
            f"{r.update_s * ms:.1f}), exposed communication {r.comm_s * ms:.1f}; busy per "
            f"iteration (ms): {stages or 'nothing sent'}")
