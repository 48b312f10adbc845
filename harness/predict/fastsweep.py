"""A what-if sweep of more than FAST_FROM configurations on the fast path (fastpath.py):
its jobs grouped by everything but the cluster's shape, one configuration loaded per group
(Hydra's composition and the rules run per group, not per job), every model and method
predicted at once over its GPUs, fabrics and shapes, the rows made as columns and written
as one shard, with the best method per cell beside it (sweep.best)."""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from harness import config
from harness.config.frozen import Config, assign, to_json
from harness.config.ranks import num_servers
from harness.measure import provenance, results
from harness.predict import profile
from harness.predict.fastpath import Family, Result, predict_family
from harness.predict.network import key as network_key
from harness.predict.network import network
from harness.predict.sweep import best, summary

FAST_FROM = 20_000  # a sweep of more configurations is predicted on the fast path
SHAPE = ("cluster.nodes", "cluster.workers_per_node")


def wanted(jobs: list[list[str]]) -> bool:
    """Whether a sweep is big enough for the fast path."""
    return len(jobs) > FAST_FROM


@dataclass
class Group:
    """The jobs that differ only in the cluster's shape: one loaded configuration."""

    cfg: Config
    nodes: np.ndarray
    per_node: np.ndarray


def load(jobs: list[list[str]]) -> list[Group]:
    """The sweep's jobs as groups, one configuration loaded (and checked) per group; each
    job's shape is checked as a count of at least 1 (ConfigError naming it else)."""
    by: dict[tuple[str, ...], list[dict[str, str]]] = {}
    for job in jobs:
        rest, shape = [], {}
        for override in job:
            key, _, value = override.partition("=")
            if key in SHAPE:
                shape[key] = value
            else:
                rest.append(override)
        by.setdefault(tuple(rest), []).append(shape)
    firsts = [[*rest, *(f"{k}={v}" for k, v in shapes[0].items())] for rest, shapes in by.items()]
    groups = []
    for cfg, shapes in zip(config.load_all(firsts, simulate=True), by.values()):
        nodes = [_count(s.get(SHAPE[0], cfg.cluster.nodes), SHAPE[0]) for s in shapes]
        per = [_count(s.get(SHAPE[1], cfg.cluster.workers_per_node), SHAPE[1]) for s in shapes]
        groups.append(Group(cfg, np.array(nodes), np.array(per)))
    return groups


def _count(value: object, key: str) -> int:
    try:
        count = int(value)
    except (TypeError, ValueError):
        count = 0
    if count < 1 or str(count) != str(value).strip():
        raise config.ConfigError(f"{key}={value} is not a count of at least 1; give e.g. "
                                 f"{key}=2")
    return count


def predict_groups(groups: list[Group]) -> pd.DataFrame:
    """One row per configuration (source=simulated), each model and method predicted at
    once over its groups' GPUs, networks and shapes."""
    profiles, nets = profile.ComputeProfiles(), {}
    families: dict[str, list[int]] = {}
    for i, g in enumerate(groups):
        if network_key(g.cfg) not in nets:
            nets[network_key(g.cfg)] = network(g.cfg)
        families.setdefault(_family_key(g.cfg), []).append(i)
    run_id, stack = f"sim-{uuid.uuid4().hex[:8]}", provenance.software()
    fams, computes = [], []
    for members in families.values():
        computes.append([profiles(groups[i].cfg) for i in members])
        sizes = [len(groups[i].nodes) for i in members]
        fams.append(Family(groups[members[0]].cfg,
                           [c for c, n in zip(computes[-1], sizes) for _ in range(n)],
                           [nets[network_key(groups[i].cfg)] for i, n in zip(members, sizes)
                            for _ in range(n)],
                           np.concatenate([groups[i].nodes for i in members]),
                           np.concatenate([groups[i].per_node for i in members])))
    return pd.concat([_rows([groups[i] for i in members], comp, fam, got, run_id, stack)
                      for members, comp, fam, got in zip(families.values(), computes, fams,
                                                         _predict_all(fams))],
                     ignore_index=True)


def _predict_all(fams: list[Family]) -> list[Result]:
    """`predict_family` of each, in forked processes, one per core, where there are cores
    for them (and no torch loaded here, which forks badly), else here; the biggest first."""
    global _FAMILIES
    processes = min(len(os.sched_getaffinity(0)), len(fams))
    if processes < 2 or "torch" in sys.modules:
        return [predict_family(f) for f in fams]
    order = sorted(range(len(fams)), key=lambda i: -len(fams[i].nodes)
                   * len(fams[i].computes[0].sizes))
    _FAMILIES = fams
    try:
        with multiprocessing.get_context("fork").Pool(processes) as pool:
            got = dict(zip(order, pool.imap(_predict_forked, order, chunksize=1)))
    finally:
        _FAMILIES = None
    return [got[i] for i in range(len(fams))]


_FAMILIES: list[Family] | None = None  # the families forked processes predict


def _predict_forked(i: int) -> Result:
    return predict_family(_FAMILIES[i])


def _family_key(cfg: Config) -> str:
    """What a family shares: everything but the GPU, the network and the shape."""
    for key, value in (("network", None), ("simulate.compute", None), (SHAPE[0], None),
                       (SHAPE[1], None)):
        cfg = assign(cfg, key, value)
    return to_json(cfg)


def _rows(groups: list[Group], computes: list[profile.Compute], fam: Family, got: Result,
          run_id: str, stack: dict) -> pd.DataFrame:
    """The family's rows: each group's identity and compute broadcast over its shapes."""
    sizes = [len(g.nodes) for g in groups]

    def each(values: list) -> list:
        return [v for v, n in zip(values, sizes) for _ in range(n)]

    # config_json: the group's, its shape null (the row's columns give it)
    ids = [{**provenance.identity(g.cfg, run_id=run_id, repeat=0, stack=stack),
            "config_json": to_json(assign(assign(g.cfg, SHAPE[0], None), SHAPE[1], None))}
           for g in groups]
    counts = np.array(sizes)  # as plain objects: no pandas string arrays of the same texts
    frame = pd.DataFrame({k: pd.Series(np.repeat(np.array([i[k] for i in ids], dtype=object),
                                                 counts), dtype=object) for k in ids[0]})
    n, per = fam.nodes, fam.per_node
    cfg = fam.cfg
    frame["nodes"], frame["workers_per_node"], frame["world_size"] = n, per, n * per
    frame["servers"] = _servers(cfg, n)
    batch = np.array(each([g.cfg.model.local_batch_size for g in groups]))
    total = np.array(each([c.total_s for c in computes]))
    it = got.iteration_s
    bottleneck = np.where(got.exposed_s <= 0.05 * it, "compute",
                          np.where(got.server_bound, "server link", "exposed communication"))
    source = each([c.source for c in computes])
    calibrated = each([c.calibrated for c in computes])
    frame = frame.assign(
        source="simulated", model_params=each([sum(c.sizes) for c in computes]),
        model_tensors=each([len(c.sizes) for c in computes]),
        throughput=n * per * batch / it, timed_s=it * cfg.run.timed_iters,
        forward_s=each([c.forward_s for c in computes]),
        backward_s=each([sum(c.backward_s) for c in computes]), comm_s=got.exposed_s,
        update_s=each([c.update_s for c in computes]), status="ok", device=source,
        compute=source, calibrated=calibrated, speedup=n * per * total / it,
        bottleneck=bottleneck, iteration_s=it, hidden_s=got.hidden_s,
        messages=got.messages, one=1.0, samples=n * per * batch)
    frame["throughput_window"] = frame["throughput_study"] = frame["throughput"]
    plans: dict[tuple, str] = {}
    frame["plan_json"] = [
        plans.get(k) or plans.setdefault(k, json.dumps({
            "fastpath": True, "units": int(k[0]), "bottleneck": k[1], "compute": k[2],
            "calibrated": k[3]}))
        for k in zip(got.messages, bottleneck, source, calibrated)]
    return frame


def _servers(cfg: Config, nodes: np.ndarray) -> np.ndarray:
    """ranks.num_servers at each node count."""
    at = {int(v): num_servers(assign(cfg, SHAPE[0], int(v))) for v in np.unique(nodes)}
    return np.array([at[int(v)] for v in nodes])


def write(frame: pd.DataFrame, results_dir: str) -> Path:
    """The rows as one shard (pyarrow, from the columns), the best method per cell beside
    it; print where they went and the best methods."""
    path = results.shard_path(results_dir, frame.run_id.iloc[0], 0)
    schema = results.SCHEMA
    columns = [pa.array(frame[c], type=schema.field(c).type, from_pandas=True) if c in frame
               else pa.nulls(len(frame), schema.field(c).type) for c in results.COLUMNS]
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_arrays(columns, schema=schema), path)
    print(f"simulated {len(frame)} configurations (fast path) -> {path}", flush=True)
    winners = best(frame[["model", "compute", "network", "world_size", "method", "nodes",
                          "workers_per_node", "throughput", "speedup", "bottleneck",
                          "calibrated"]])
    out = path.with_name(f"{frame.run_id.iloc[0]}_best.csv")
    winners.to_csv(out, index=False)
    print(f"best method per model, GPU, network and GPU count -> {out}\n{summary(winners)}",
          flush=True)
    return path


def simulate(jobs: list[list[str]]) -> bool:
    """Predict and write a big sweep on the fast path; False where it does not serve
    (a measured profile, calibration, validation, advice or traces asked for: the full
    model's work)."""
    started = time.perf_counter()
    groups = load(jobs)
    sim = groups[0].cfg.simulate
    asks = [k for k in ("calibrate", "reference", "advise", "trace") if sim.get(k)]
    if sim.compute == "measured" or asks:
        why = f"simulate.{asks[0]}" if asks else "simulate.compute=measured"
        print(f"ddlbench: note: {len(jobs)} configurations through the discrete-event model "
              f"(the fast path does not serve {why}): this takes minutes; choose fewer with "
              "model=, simulate.compute=, network=", file=sys.stderr, flush=True)
        return False
    frame = predict_groups(groups)
    print(f"predicted {len(frame)} configurations on the fast path in "
          f"{time.perf_counter() - started:.1f} s", flush=True)
    write(frame, groups[0].cfg.results_dir)
    return True

