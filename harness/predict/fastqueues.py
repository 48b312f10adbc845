"""The queued paths of the fast path (fastpath.py), over arrays of configurations: one
communication stream (network.Collectives), the PS path's node threads, links, servers
and engine lanes (psqueues.ParameterServers' queues written over arrays, its node path's
stages from the same description: psqueues.PATHS, stage_costs), and ByteScheduler's
bounds. What psbench measured of a server (the round trip's handling, the in-order
stream of a flight) is not taken here: the fast path serves sweeps of the fabrics."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from harness.config.frozen import Config
from harness.predict import engines
from harness.predict.network import ELEMENT_SIZE, Network
from harness.predict.plans import Plan
from harness.predict.psqueues import _Summing, path_of, stage_costs
from methods import layout
from methods.ps.server_queue import ThreadBinding

WIDE = 64  # PS: configurations of up to this many servers go together, and those above


@dataclass
class Arrays:
    """What a family's configurations differ in, as arrays (k configurations, n tensors;
    fastpath._arrays makes them)."""

    forward: np.ndarray        # k
    backward: np.ndarray       # k x n
    update: np.ndarray         # k
    byte_s: np.ndarray         # k
    total: np.ndarray          # k
    nodes: np.ndarray
    per_node: np.ndarray
    a_intra: np.ndarray
    b_intra: np.ndarray
    a_inter: np.ndarray
    b_inter: np.ndarray
    host_copy: np.ndarray
    server_memory: np.ndarray
    algorithm: list[str]

    @property
    def workers(self) -> np.ndarray:
        return self.nodes * self.per_node


def queue(ready: np.ndarray, dur: np.ndarray, cycle: float) -> np.ndarray:
    """network.Collectives: units one at a time in issue order, each from its ready time
    (rounded up to Horovod's cycle); when each is done (k x units)."""
    if cycle:
        ready = np.ceil(ready / cycle - 1e-9) * cycle
    done = np.empty_like(dur)
    free = np.zeros(len(dur))
    for u in range(dur.shape[1]):
        free = np.maximum(ready[:, u], free) + dur[:, u]
        done[:, u] = free
    return done


def ps(cfg: Config, x: Arrays, plan: Plan, unit_ready: np.ndarray, a: np.ndarray,
        b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """network.ParameterServers over arrays (one node: each partition all-reduced).
    When each unit is done, the busiest resource's seconds, and whether a server's is.
    Configurations of alike server counts go together (each server's queue is a column)."""
    servers = x.nodes if cfg.cluster.servers is None else np.full(len(a), cfg.cluster.servers)
    width = np.where(x.nodes == 1, 0, np.where(servers <= WIDE, 1, 2))
    done, busy, bound = np.zeros(unit_ready.shape), np.zeros(len(a)), np.zeros(len(a), bool)
    one = np.flatnonzero(width == 0)
    if len(one):  # one node: no servers, each partition all-reduced in turn
        counts = np.array([len(ps) for ps in plan.parts], dtype=float)
        nb = np.array([sum(p.numel for p in ps) * ELEMENT_SIZE for ps in plan.parts], float)
        dur = a[one, None] * counts[None, :] + b[one, None] * nb[None, :]
        done[one], busy[one] = queue(unit_ready[one], dur, 0.0), dur.sum(axis=1)
    for w in (1, 2):
        idx = np.flatnonzero(width == w)
        if not len(idx):
            continue
        done[idx], busy[idx], bound[idx] = _ps_alike(cfg, _take(x, idx), plan, unit_ready[idx],
                                                     a[idx], b[idx])
    return done, busy, bound


def _take(x: Arrays, idx: np.ndarray) -> Arrays:
    """The configurations `idx` of `x`."""
    return type(x)(**{f: ([v[i] for i in idx] if isinstance(v, list) else v[idx])
                      for f, v in vars(x).items()})


def _ps_alike(cfg: Config, x: Arrays, plan: Plan, unit_ready: np.ndarray, a: np.ndarray,
              b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`ps` of configurations with alike server counts."""
    t = cfg.method.transport
    local, root = bool(t.get("local_reduce", True)), t.get("node_reduce", "scatter") == "root"
    threads = int(t.get("engine_threads", 1))
    k, n, g = len(a), x.nodes, x.per_node
    servers = (n if cfg.cluster.servers is None else np.full(k, cfg.cluster.servers)).astype(int)
    sharing = g if local else np.ones(k)
    whole = (sharing > 1) & root
    bus_share = np.where(whole, 2 * ((sharing - 1) / sharing + x.host_copy),
                         2 * ((sharing - 1) + x.host_copy) / sharing)
    senders = n if local else n * g
    node_share = 1.0 if local else g
    per_all, per_tail, lead = (np.zeros(k) for _ in range(3))
    for i in range(k):  # the servers' summing factors (network._Summing), per configuration
        per_all[i], per_tail[i], lead[i] = _summing(x.server_memory[i], int(senders[i]), threads)
    wire = senders * x.b_inter
    rows = np.arange(k)
    width = int(servers.max())
    s_in, s_out = np.zeros((k, width)), np.zeros((k, width))
    lanes = np.zeros((k, width * threads))
    node_busy = np.zeros(k)
    s_busy = np.zeros((k, width))
    done = np.zeros(unit_ready.shape)
    flat = [p for ps in plan.parts for p in ps]
    counts, which = np.unique(servers, return_inverse=True)  # each partition's server, by
    rule = t.get("assignment", "hash")                       # the method's rule, per count
    owners = np.array([layout.assign([p.key for p in flat], [p.numel for p in flat], int(c),
                                     rule) for c in counts])
    threads_of = np.array([_threads(flat, row, threads) for row in owners])
    has_bus = ~(whole | (bus_share == 0))
    path = path_of(cfg)
    costs = stage_costs(path, 2 * (sharing - 1) / sharing, 2 * x.host_copy / sharing)
    stages = [(np.where(has_bus, alpha * x.a_intra, 0.0), np.where(has_bus, beta * x.b_intra, 0.0))
              for alpha, beta, _ in costs]
    outs, backs = range(len(path.out)), range(len(path.out), len(stages))
    node_b, timed = node_share * x.b_inter, bool((per_all > 0).all())
    up_free, down_free, landed = np.zeros(k), np.zeros(k), np.zeros(k)
    lane_free, lane_busy = np.zeros((len(stages), k)), np.zeros((len(stages), k))
    first, last_lane = 0, len(stages) - 1  # the root path's crossings
    j = 0
    for u, parts in enumerate(plan.parts):
        t0 = unit_ready[:, u]
        unit_bytes = sum(p.numel for p in parts) * ELEMENT_SIZE
        whole_s = np.where(whole, x.a_intra + x.b_intra * unit_bytes * bus_share, 0.0)
        if whole.any():  # root: the unit reduced and on the host before its first push
            t0 = np.where(whole, np.maximum(t0, lane_free[first]) + whole_s, t0)
            lane_free[first] = np.where(whole, t0, lane_free[first])
            lane_busy[first] += whole_s
        last = t0
        for p in parts:  # the partition through each queue: ParameterServers.issue
            size = p.numel * ELEMENT_SIZE
            start = _through(lane_free, stages, outs, t0, size)
            node = size * node_b
            up_free = up = np.maximum(start, up_free) + node
            server = size * wire
            s = owners[which, j]
            into = np.maximum(start, s_in[rows, s]) + server
            s_in[rows, s] = into
            pushed = np.maximum(up, into) + x.a_inter
            lane = s * threads + threads_of[which, j]
            summed = np.maximum(np.maximum(pushed - server * lead, lanes[rows, lane])
                                + size * per_all, pushed + size * per_tail)
            if not timed:
                summed = np.where(per_all > 0, summed, pushed)
            lanes[rows, lane] = summed
            out = np.maximum(summed, s_out[rows, s]) + server
            s_out[rows, s] = out
            down_free = down = np.maximum(summed, down_free) + node
            pulled = _through(lane_free, stages, backs, np.maximum(out, down) + x.a_inter,
                              size)
            last = np.maximum(last, pulled)
            node_busy += node
            lane_busy += [alpha + beta * size for alpha, beta in stages]
            s_busy[rows, s] += np.maximum(server, size * per_all)
            j += 1
        if whole.any():  # root: back to the device and broadcast after the last pull
            last = np.where(whole, np.maximum(last, lane_free[last_lane]) + whole_s, last)
            lane_free[last_lane] = np.where(whole, last, lane_free[last_lane])
        if path.in_order:  # the lander: after the unit posted before it
            last = landed = np.maximum(last, landed)
        done[:, u] = last
    top_server = s_busy.max(axis=1)
    other = np.maximum(node_busy, lane_busy.max(axis=0))
    return done, np.maximum(top_server, other), top_server > other


def _through(free: np.ndarray, stages: list, ways: range, t: np.ndarray, size: int
             ) -> np.ndarray:
    """A partition through the node path's threads `ways` in turn from `t` (per
    configuration; a thread it costs nothing is skipped): when it is through."""
    for i in ways:
        alpha, beta = stages[i]
        seconds = alpha + beta * size
        on = seconds > 0
        after = np.maximum(t, free[i]) + seconds
        t = np.where(on, after, t)
        free[i] = np.where(on, after, free[i])
    return t


def _threads(flat: list, owners: np.ndarray, threads: int) -> list[int]:
    """Each partition's engine thread on its server: BytePS's rule, the fewest bytes bound
    so far, each server binding its partitions in plan order (network._Summing.lanes)."""
    sizes: dict[int, list[int]] = {}
    for p, server in zip(flat, owners):
        sizes.setdefault(int(server), []).append(p.numel * ELEMENT_SIZE)
    bound = {server: iter(ThreadBinding(threads).bind_new(of)) for server, of in sizes.items()}
    return [next(bound[int(server)]) for server in owners]


def _summing(memory: float, senders: int, threads: int) -> tuple[float, float, float]:
    """network._Summing's factors: engine seconds per byte in all and after the last push,
    and the second push's lead."""
    return _Summing(Network("", None, None, "", False, memory), senders, threads).factors


def priority(cfg: Config, x: Arrays, plan: Plan, ready: np.ndarray, nbytes: np.ndarray,
              a: np.ndarray, b: np.ndarray, divide: np.ndarray, facts: dict,
              sizes: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ByteScheduler as bounds: the compute with the input-side pieces (the last ready,
    issued first) exposed after it; its pieces back to back (the PS path's queues from
    t = 0; all-reduces fused within a cycle up to the fusion bytes, one negotiation each),
    at most a credit's worth in flight, moved once per round trip (per cycle); its
    poller's updates one after another. The slowest of the three, on half cycles where
    the method has a cycle (as model.py's iterations settle): per configuration, the
    iteration, its exposed and its hidden communication."""
    units, many = plan.units, x.workers > 1
    first = [u for u, unit in enumerate(units) if unit.params[-1] == len(sizes) - 1]
    sched = cfg.method.scheduler
    if cfg.method.transport.name == "ps":
        comm = _ps_alone(cfg, x, plan, plan.parts, a, b)
        tail = _ps_alone(cfg, x, plan, [[p for u in first for p in plan.parts[u]]], a, b)
        # a credit's worth in flight: a partition goes as one comes back, so the credit
        # (in partitions of the median byte's size) moves once per round trip of one
        typical = _median_part([p for ps in plan.parts for p in ps])
        size = typical.numel * ELEMENT_SIZE
        flight = max(1, math.ceil(_credit_bytes(sched) / size)) * size  # while any is left
        comm = np.maximum(comm, nbytes.sum() / flight
                          * _ps_alone(cfg, x, plan, [[typical]], a, b))
    else:
        tail = a * len(first) + b * nbytes[first].sum()
        messages = np.full(len(a), float(len(units)))
        cycle, fusion = float(sched.get("cycle_s", 0.0)), float(sched.get("fusion_bytes") or 0)
        if cycle and fusion:  # a cycle's ready pieces go as one, up to the fusion bytes
            span = ready[:, -1] - ready[:, 0]
            messages = np.minimum(messages, np.maximum(np.ceil(nbytes.sum() / fusion),
                                                       np.ceil(span / cycle)))
        comm, negotiation = a * messages + b * nbytes.sum(), np.zeros(len(a))
        if cycle:  # each cycle's negotiation: rounds of the slowest link's start-ups
            link = np.where(x.nodes > 1, x.a_inter, x.a_intra)
            rounds = 2 if cfg.method.horovod.get("cache_capacity", 0) else 4
            negotiation = rounds * np.ceil(np.log2(np.maximum(x.workers, 2))) * link
            comm = comm + messages * negotiation
        credit = min(_credit_bytes(sched), float(nbytes.sum()))
        waves = math.ceil(nbytes.sum() / credit)  # a credit's worth in flight at once
        wave = a * np.maximum(1.0, messages / waves) + b * credit + negotiation
        if cycle:  # the next wave goes on the first cycle after the last is done
            wave = np.ceil(wave / cycle) * cycle
        comm = np.maximum(comm, waves * wave)
    ops = facts.get("update_ops", {})
    count = ops.get(cfg.model.optimizer.name, ops.get("adam", 0))
    n = len(sizes)
    host = (count * float(facts.get("op_launch_s", 0.0)) * n
            + float(facts.get("scan_s", 0.0)) * n * (n + 1) / 2)
    host = host if engines.study_engine(cfg) else 0.0
    compute = x.total + divide.sum(axis=1)
    iteration = np.maximum.reduce([compute + tail, comm, np.full(len(a), host)])
    cycle = float(sched.get("cycle_s", 0.0))
    if cycle:  # the input side's pieces wait for a cycle: the model's iterations settle
        iteration = np.ceil(iteration / (cycle / 2) - 1e-9) * (cycle / 2)  # on half cycles
    iteration = np.where(many, iteration, x.total)
    exposed = np.maximum(0.0, iteration - x.total)
    return iteration, exposed, np.maximum(0.0, comm - exposed)


def _credit_bytes(sched: Config) -> float:
    """ByteScheduler's credit in bytes (unbounded without one)."""
    if sched.get("credit_bytes"):
        return float(sched.credit_bytes)
    return float(sched.get("credit_elements") or math.inf) * ELEMENT_SIZE


def _ps_alone(cfg: Config, x: Arrays, plan: Plan, parts: list[list], a: np.ndarray,
              b: np.ndarray) -> np.ndarray:
    """How long `parts` (one unit's partitions, from t = 0, alone) take on the PS path."""
    units = [plan.units[0]] * len(parts)
    zero = np.zeros((len(a), len(parts)))
    return ps(cfg, x, Plan(units, {}, parts, plan.servers), zero, a, b)[0].max(axis=1)


def _median_part(parts: list) -> object:
    """The partition the median byte is in, partitions by size."""
    parts = sorted(parts, key=lambda p: p.numel)
    half, seen = sum(p.numel for p in parts) / 2, 0
    for p in parts:
        seen += p.numel
        if seen >= half:
            return p
    return parts[-1]
