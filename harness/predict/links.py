"""This machine's networks as `harness.microbench` measured them (loopback, the emulated
links): the point-to-point link between nodes, the link inside a node, and the all-reduce
as Gloo ran it on each cluster shape measured (nodes x workers per node).

The simulator models an all-reduce as a ring over the point-to-point link (network.py);
Gloo on 2 and 3 emulated nodes runs slower than that ring (its own algorithm, its threads,
the token bucket's bursts), so where the microbenchmark timed the all-reduce on the very
shape predicted, its fit is the all-reduce's cost. An emulated node's workers talk over the
node's own loopback, not its shaped link: `p2p_intra` (timed where nodes have 2 workers) is
that link, else the point-to-point one stands in. A PS unit's round trip through the real
server (`kind=ps`, measured where the microbenchmark ran a PS method: harness/measure/
psbench.py) costs more than its two messages over the link: what it costs beyond them
is the server's handling, on the shape measured; a unit's partitions in flight
(`kind=ps_flight`) give what each costs on the server's in-order stream
(psqueues.ParameterServers). Both are the wire's they ran on (`ps_wire`, gloo in tables
older than the column): a run on another wire does not take them. Beside each time, the
CPU seconds the machine was busy on it (`cpu`: the all-reduce, the PS round trip and
flight, and where nodes have several workers the node's own part of a partition on each
node path, per shape, fitted alpha + beta * bytes), from the newest microbenchmark of the
shape that measured it (tables older than the columns have none): what communication
takes from compute on shared cores (harness/predict/cpushare.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from harness import config
from harness.config.frozen import Config
from harness.measure import results
from methods.costmodel import Cost, cpu_fit

Shape = tuple[int, int]  # (nodes, workers per node)
NODE_KINDS = ("node_scatter", "node_root")  # a node's own part of a partition (psbench)


@dataclass(frozen=True)
class Measured:
    """A network's measured costs: `link` between nodes, `intra` inside one (None: not
    measured) and `allreduce` per cluster shape (the newest of each)."""
    link: Cost
    intra: Cost | None = None
    allreduce: dict[Shape, Cost] = field(default_factory=dict)
    ps: dict[Shape, Cost] = field(default_factory=dict)  # a push/pull round trip (psbench)
    # a unit's partitions in flight (psbench): a partition's share, and how many flew
    ps_flight: dict[Shape, tuple[Cost, int]] = field(default_factory=dict)
    # CPU seconds the machine was busy per operation, by (kind, shape): `allreduce` and
    # the node's part of a partition (NODE_KINDS) of the shape's microbenchmark, `ps` and
    # `ps_flight` of the wire's
    cpu: dict[tuple[str, Shape], Cost] = field(default_factory=dict)


def measured(cfg: Config, *, ps_wire: str = "gloo") -> Measured:
    """The newest microbenchmarks of `cfg.network` in `<results_dir>/microbench/`, the PS
    ones of `ps_wire`: ConfigError when none timed its link, or the link's fit is no
    link's."""
    folder = Path(cfg.results_dir) / results.OTHER_DATA
    fits = [f for f in results.load_microbench(folder) if (f.network == cfg.network.name).all()]
    link = [f for f in fits if (f.kind == "p2p").any()]
    if not link:
        where = "cluster=emulated " if cfg.network.get("rate_mbit") else ""
        raise config.ConfigError(
            f"network={cfg.network.name} has no measured link in {folder}; measure it first: "
            f"python -m harness.microbench {where}network={cfg.network.name} "
            f"cluster.{'nodes' if where else 'workers_per_node'}=2")
    intra = [f for f in fits if (f.kind == "p2p_intra").any()]
    mine = [(shape, f) for shape, f in _shapes(fits)
            if str(f.get("ps_wire", pd.Series(["gloo"])).iloc[0]) == ps_wire]
    return Measured(_cost(cfg, folder, link[-1], "p2p"),
                    _cost(cfg, folder, intra[-1], "p2p_intra") if intra else None,
                    {shape: _cost(cfg, folder, f, "allreduce") for shape, f in _shapes(fits)},
                    {shape: _cost(cfg, folder, f, "ps") for shape, f in mine
                     if (f.kind == "ps").any()},
                    {shape: (_cost(cfg, folder, f, "ps_flight"), _flown(f)) for shape, f in mine
                     if (f.kind == "ps_flight").any()},
                    {**_cpu(_shapes(fits), ("allreduce", *NODE_KINDS)),
                     **_cpu(mine, ("ps", "ps_flight"))})


def _cpu(fits: list[tuple[Shape, pd.DataFrame]], kinds: tuple[str, ...]
         ) -> dict[tuple[str, Shape], Cost]:
    """The CPU fit of each of `kinds` on each shape, from the newest microbenchmark that
    measured it there for every size (`fits` oldest first): fitted anew from its samples
    (`cpu_s`) by their shares, as harness.microbench now fits them (`costmodel.cpu_fit`), so a
    table written with the plain fit of before predicts the same."""
    out = {}
    for shape, fit in fits:
        for kind in kinds:
            rows = fit[fit.kind == kind]
            if "cpu_s" not in rows or rows.bytes.nunique() < 2:
                continue
            cost = cpu_fit(rows.bytes.astype(float).tolist(), rows.cpu_s.tolist())
            if math.isfinite(cost.alpha):
                out[(kind, shape)] = cost
    return out


def _flown(fit: pd.DataFrame) -> int:
    """How many partitions flew in a `ps_flight` row: its ranks say `roots-<server>x<K>`."""
    return int(str(fit[fit.kind == "ps_flight"].ranks.iloc[0]).rpartition("x")[2])


def _shapes(fits: list[pd.DataFrame]) -> list[tuple[Shape, pd.DataFrame]]:
    """Each microbenchmark that names its cluster's shape, oldest first (the newest of a
    shape wins); older tables without the shape are the link's alone."""
    return [((int(f.nodes.iloc[0]), int(f.workers_per_node.iloc[0])), f) for f in fits
            if {"nodes", "workers_per_node"} <= set(f.columns) and (f.kind == "allreduce").any()]


def _cost(cfg: Config, folder: Path, fit: pd.DataFrame, kind: str) -> Cost:
    """The alpha/beta of `kind` in one microbenchmark, checked finite and >= 0."""
    row = fit[fit.kind == kind].iloc[0]
    alpha, beta = float(row.alpha_s), float(row.beta_s_per_byte)
    # beta 0 is a fit over small messages only (clamped at 0); negative or no number is none
    if not (math.isfinite(alpha) and math.isfinite(beta) and alpha >= 0 and beta >= 0):
        raise config.ConfigError(
            f"the newest microbenchmark of network={cfg.network.name} in {folder} fits its "
            f"{kind} with alpha={alpha:g} s and beta={beta:g} s/byte, which no link has; "
            f"measure it again: python -m harness.microbench network={cfg.network.name} "
            "cluster.workers_per_node=2")
    return Cost(alpha, beta)
