"""The fast path of a large what-if sweep: every configuration of a family (one model and
method, any GPU, fabric and cluster shape) predicted at once with numpy, instead of one
discrete-event simulation each (model.py).

What it keeps of model.py, exactly: the compute (profile.py), the plans (plans.py: one per
family, MG-WFBP's once per distinct merge cost), the all-reduce times (network.py's ring,
tree, best and hierarchical are each alpha + beta * bytes per shape), the PS path's links
and servers (network.ParameterServers' queues, written over arrays: each partition's
server by BytePS's hash, its engine lane round-robin on that server instead of by bytes
bound), the study's engines' polls, divisions and merged copies (engines.py). What it
simplifies: one iteration from t = 0 instead of the steady state of `simulate.iterations`
(Horovod's cycle rounds on that clock), and ByteScheduler (scheduler `priority`: a
credit-bound queue whose pieces overlap the next forward) as bounds, the slowest of its
compute with the input-side pieces' tail exposed, its pieces back to back and its
poller's updates. tests/test_fastpath.py checks it against model.py; the README of this
room states the agreement.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from harness.config.frozen import Config, assign
from harness.predict import engines, profile
from harness.predict.network import ELEMENT_SIZE, Network, _Summing
from harness.predict.plans import Plan, mgwfbp_cost, plan_of, tensors
from methods import layout

# -- a family's configurations as arrays ----------------------------------------------------


@dataclass
class Family:
    """The configurations of one model and method (`cfg`: any of them, for what they
    share), each with its compute, network and cluster shape (arrays by configuration)."""

    cfg: Config
    computes: list[profile.Compute]   # per configuration
    nets: list[Network]              # per configuration
    nodes: np.ndarray
    per_node: np.ndarray


@dataclass
class Result:
    """Per configuration: the predicted iteration and where it goes."""

    iteration_s: np.ndarray
    exposed_s: np.ndarray
    hidden_s: np.ndarray
    server_bound: np.ndarray  # bool: a server's link or engine is the busiest resource
    messages: np.ndarray


def predict_family(fam: Family) -> Result:
    """Every configuration of `fam` predicted; MG-WFBP's plan depends on each one's merge
    cost, so its configurations are split by the plan they get."""
    if fam.cfg.method.planner.name != "mgwfbp":
        return _predict(fam, plan_of(_shaped(fam, 0), tensors(fam.cfg.model)))
    plans: dict[tuple, tuple[Plan, list[int]]] = {}
    for i in range(len(fam.nodes)):
        cfg = _shaped(fam, i)
        cost = mgwfbp_cost(cfg, fam.nets[i])
        key = (id(fam.computes[i]), _bucket(cost.alpha), _bucket(cost.beta))
        if key not in plans:
            plans[key] = (plan_of(cfg, tensors(fam.cfg.model),
                                  backward_s=fam.computes[i].backward_s, cost=cost), [])
        plans[key][1].append(i)
    by_units: dict[tuple, tuple[Plan, list[int]]] = {}
    for plan, members in plans.values():  # plans that merge alike predict together
        key = tuple((u.start, u.end) for u in plan.units)
        by_units.setdefault(key, (plan, []))[1].extend(members)
    out = [np.zeros(len(fam.nodes)) for _ in range(4)] + [np.zeros(len(fam.nodes), int)]
    for plan, members in by_units.values():
        idx = np.array(members)
        part = _predict(_subset(fam, idx), plan)
        for arr, got in zip(out, (part.iteration_s, part.exposed_s, part.hidden_s,
                                  part.server_bound, part.messages)):
            arr[idx] = got
    out[3] = out[3].astype(bool)
    return Result(*out)


WIDE = 64  # PS: configurations of up to this many servers go together, and those above
MERGE_BUCKET = 1.25  # MG-WFBP is planned once per merge cost within this factor


def _bucket(value: float) -> int:
    """A merge cost's alpha or beta to within MERGE_BUCKET: MG-WFBP's merges barely move
    within it."""
    return round(math.log(value) / math.log(MERGE_BUCKET)) if value > 0 else -10**6


def _shaped(fam: Family, i: int) -> Config:
    """Configuration `i` of the family: its shape, GPU and network on the family's tree."""
    cfg = assign(fam.cfg, "cluster.nodes", int(fam.nodes[i]))
    return assign(cfg, "cluster.workers_per_node", int(fam.per_node[i]))


def _subset(fam: Family, idx: np.ndarray) -> Family:
    return Family(fam.cfg, [fam.computes[i] for i in idx], [fam.nets[i] for i in idx],
                  fam.nodes[idx], fam.per_node[idx])


# -- the model, over arrays ------------------------------------------------------------------

@dataclass
class _Arrays:
    """What the configurations differ in, as arrays (k configurations, n tensors)."""

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


def _arrays(fam: Family) -> _Arrays:
    """The family's per-configuration inputs as arrays (computes and networks shared by
    many configurations are read once)."""
    def col(values: list[float]) -> np.ndarray:
        return np.asarray(values, dtype=float)

    comp = {id(c): c for c in fam.computes}
    rows = {i: np.asarray(c.backward_s) for i, c in comp.items()}
    cs, ns = fam.computes, fam.nets
    return _Arrays(
        col([c.forward_s for c in cs]), np.stack([rows[id(c)] for c in cs]),
        col([c.update_s for c in cs]), col([c.byte_s for c in cs]),
        col([c.total_s for c in cs]), fam.nodes.astype(float), fam.per_node.astype(float),
        col([n.intra.alpha for n in ns]), col([n.intra.beta for n in ns]),
        col([n.inter.alpha for n in ns]), col([n.inter.beta for n in ns]),
        col([float(n.ps_host_copy) for n in ns]), col([n.server_memory for n in ns]),
        [n.allreduce for n in ns])


def allreduce_affine(x: _Arrays) -> tuple[np.ndarray, np.ndarray]:
    """network.allreduce_s as alpha + beta * bytes per configuration (0 on one worker)."""
    n, g, p = x.nodes, x.per_node, x.workers
    alpha = np.maximum(np.where(g > 1, x.a_intra, 0.0), np.where(n > 1, x.a_inter, 0.0))
    beta = np.maximum(np.where(g > 1, x.b_intra, 0.0), np.where(n > 1, x.b_inter, 0.0))
    moved = 2 * (p - 1) / p * beta
    ring = 2 * (p - 1) * alpha
    depth = np.ceil(np.log2(n)) * x.a_inter + (g - 1) * x.a_intra
    algo = np.asarray(x.algorithm)
    a = np.where(algo == "tree", 2 * depth,
                 np.where(algo == "best", np.minimum(ring, 2 * depth), ring))
    hier = algo == "hierarchical"
    a = np.where(hier, 2 * (g - 1) * x.a_intra + 2 * (n - 1) * x.a_inter, a)
    b = np.where(hier, 2 * (g - 1) / g * x.b_intra + 2 * (n - 1) / p * x.b_inter, moved)
    one = p == 1
    return np.where(one, 0.0, a), np.where(one, 0.0, b)


def _predict(fam: Family, plan: Plan) -> Result:
    """The family's configurations under one plan."""
    x, cfg = _arrays(fam), fam.cfg
    units = plan.units
    sizes = fam.computes[0].sizes
    engine = engines.study_engine(cfg)
    facts = cfg.simulate.get("engines") or {}
    many = x.workers > 1
    backward = x.backward.copy()
    if engine:  # merged groups' copies in the hooks, on the compute stream
        merged = np.zeros(len(sizes))
        for u in units:
            if len(u.params) > 1:
                merged[list(u.params)] = np.asarray(sizes)[list(u.params)] * engines.MOVED
        backward += np.where(many, 1.0, 0.0)[:, None] * merged[None, :] * x.byte_s[:, None]
    ready = x.forward[:, None] + np.cumsum(backward, axis=1)
    nbytes = np.array([u.numel * ELEMENT_SIZE for u in units], dtype=float)
    last = [u.params[-1] for u in units]
    divide = (np.where(many & bool(engine), 1.0, 0.0)[:, None]
              * nbytes[None, :] / ELEMENT_SIZE * engines.MOVED * x.byte_s[:, None])
    kind, transport = cfg.method.scheduler.name, cfg.method.transport.name
    a, b = allreduce_affine(x)
    if kind == "priority":
        return _priority(cfg, x, plan, ready, nbytes, a, b, divide, facts, sizes)
    unit_ready = ready[:, [-1] * len(units)] if kind == "after_backward" else ready[:, last]
    if transport == "ps":
        done, busy, server_bound = _ps(cfg, x, plan, unit_ready, a, b)
    else:
        cycle = 0.0 if transport == "ddp" else float(cfg.method.horovod.cycle_time_s)
        dur = a[:, None] * (nbytes[None, :] > 0) + b[:, None] * nbytes[None, :]
        done = _queue(unit_ready, dur, cycle)
        busy, server_bound = dur.sum(axis=1), np.zeros(len(a), bool)
    end = ready[:, -1]
    stream = end.copy()
    for u in range(len(units)):
        stream = np.maximum(stream, done[:, u]) + divide[:, u]
    poll = float(facts.get("handle_poll_s", 0.0)) if engine else 0.0
    woken = np.maximum(end, done.max(axis=1)) + np.where(many, poll / 2, 0.0)
    iteration = np.maximum(stream, woken) + x.update
    iteration = np.where(many, iteration, x.total)
    exposed = np.maximum(0.0, iteration - x.total)
    return Result(iteration, exposed, np.maximum(0.0, busy - exposed), server_bound & many,
                  np.full(len(a), len(units)))


def _queue(ready: np.ndarray, dur: np.ndarray, cycle: float) -> np.ndarray:
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


def _ps(cfg: Config, x: _Arrays, plan: Plan, unit_ready: np.ndarray, a: np.ndarray,
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
        done[one], busy[one] = _queue(unit_ready[one], dur, 0.0), dur.sum(axis=1)
    for w in (1, 2):
        idx = np.flatnonzero(width == w)
        if not len(idx):
            continue
        done[idx], busy[idx], bound[idx] = _ps_alike(cfg, _take(x, idx), plan, unit_ready[idx],
                                                     a[idx], b[idx])
    return done, busy, bound


def _take(x: _Arrays, idx: np.ndarray) -> _Arrays:
    """The configurations `idx` of `x`."""
    return _Arrays(**{f: ([v[i] for i in idx] if isinstance(v, list) else v[idx])
                      for f, v in vars(x).items()})


def _ps_alike(cfg: Config, x: _Arrays, plan: Plan, unit_ready: np.ndarray, a: np.ndarray,
              b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`_ps` of configurations with alike server counts."""
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
    free = {name: np.zeros(k) for name in ("up", "down", "bus_up", "bus_down")}
    s_in, s_out = np.zeros((k, width)), np.zeros((k, width))
    lanes, count = np.zeros((k, width * threads)), np.zeros((k, width), int)
    busy = {name: np.zeros(k) for name in ("node", "server", "bus")}
    s_busy = np.zeros((k, width))
    done = np.zeros(unit_ready.shape)
    flat = [p for ps in plan.parts for p in ps]
    hashes = np.array([layout.djb2(p.key) for p in flat], dtype=np.uint64)
    owners = np.stack([hashes % np.uint64(s) for s in range(1, width + 1)]).astype(int)
    j = 0
    for u, parts in enumerate(plan.parts):
        t0 = unit_ready[:, u]
        unit_bytes = sum(p.numel for p in parts) * ELEMENT_SIZE
        whole_s = np.where(whole, x.a_intra + x.b_intra * unit_bytes * bus_share, 0.0)
        t0 = np.where(whole, np.maximum(t0, free["bus_up"]) + whole_s, t0)
        free["bus_up"] = np.where(whole, t0, free["bus_up"])
        last = t0.copy()
        for p in parts:
            size = p.numel * ELEMENT_SIZE
            bus = np.where(whole | (bus_share == 0), 0.0, x.a_intra + x.b_intra * size * bus_share)
            start = np.where(bus > 0, np.maximum(t0, free["bus_up"]) + bus, t0)
            free["bus_up"] = np.where(bus > 0, start, free["bus_up"])
            node = size * node_share * x.b_inter
            free["up"] = up = np.maximum(start, free["up"]) + node
            server = size * wire
            s = owners[servers - 1, j]
            into = np.maximum(start, s_in[rows, s]) + server
            s_in[rows, s] = into
            pushed = np.maximum(up, into) + x.a_inter
            lane = s * threads + count[rows, s] % threads
            count[rows, s] += 1
            summed = np.maximum(np.maximum(pushed - server * lead, lanes[rows, lane])
                                + size * per_all, pushed + size * per_tail)
            summed = np.where(per_all > 0, summed, pushed)
            lanes[rows, lane] = summed
            out = np.maximum(summed, s_out[rows, s]) + server
            s_out[rows, s] = out
            free["down"] = down = np.maximum(summed, free["down"]) + node
            pulled = np.maximum(out, down) + x.a_inter
            pulled = np.where(bus > 0, np.maximum(pulled, free["bus_down"]) + bus, pulled)
            free["bus_down"] = np.where(bus > 0, pulled, free["bus_down"])
            last = np.maximum(last, pulled)
            busy["node"] += node
            busy["bus"] += bus + whole_s / max(len(parts), 1)
            s_busy[rows, s] += np.maximum(server, size * per_all)
            j += 1
        last = np.where(whole, np.maximum(last, free["bus_down"]) + whole_s, last)
        free["bus_down"] = np.where(whole, last, free["bus_down"])
        # one node: no servers, each partition all-reduced in turn
        done[:, u] = last
    top_server = s_busy.max(axis=1)
    other = np.maximum(busy["node"], busy["bus"])
    return done, np.maximum(top_server, other), top_server > other


def _summing(memory: float, senders: int, threads: int) -> tuple[float, float, float]:
    """network._Summing's factors: engine seconds per byte in all and after the last push,
    and the second push's lead."""
    return _Summing(Network("", None, None, "", False, memory), senders, threads).factors


def _priority(cfg: Config, x: _Arrays, plan: Plan, ready: np.ndarray, nbytes: np.ndarray,
              a: np.ndarray, b: np.ndarray, divide: np.ndarray, facts: dict,
              sizes: list[int]) -> Result:
    """ByteScheduler as bounds: the compute with the input-side pieces (the last ready,
    issued first) exposed after it; its pieces back to back (the PS path's queues from
    t = 0; all-reduces fused within a cycle up to the fusion bytes, one negotiation each);
    its poller's updates one after another. The slowest of the three."""
    units, many = plan.units, x.workers > 1
    first = [u for u, unit in enumerate(units) if unit.params[-1] == len(sizes) - 1]
    sched = cfg.method.scheduler
    if cfg.method.transport.name == "ps":
        comm = _ps_alone(cfg, x, plan, plan.parts, a, b)
        tail = _ps_alone(cfg, x, plan, [[p for u in first for p in plan.parts[u]]], a, b)
        credit = _credit_bytes(sched)
        parts = sorted((p for ps in plan.parts for p in ps), key=lambda p: -p.numel)
        wave, held = [], 0
        for p in parts:  # a credit's worth of the largest partitions in flight at once
            if wave and held + p.numel * ELEMENT_SIZE > credit:
                break
            wave.append(p)
            held += p.numel * ELEMENT_SIZE
        waves = nbytes.sum() / held
        comm = np.maximum(comm, waves * _ps_alone(cfg, x, plan, [wave], a, b))
    else:
        tail = a * len(first) + b * nbytes[first].sum()
        messages = np.full(len(a), float(len(units)))
        cycle, fusion = float(sched.get("cycle_s", 0.0)), float(sched.get("fusion_bytes") or 0)
        if cycle and fusion:  # a cycle's ready pieces go as one, up to the fusion bytes
            span = ready[:, -1] - ready[:, 0]
            messages = np.minimum(messages, np.maximum(np.ceil(nbytes.sum() / fusion),
                                                       np.ceil(span / cycle)))
        comm = a * messages + b * nbytes.sum()
        if cycle:  # each cycle's negotiation: rounds of the slowest link's start-ups
            link = np.where(x.nodes > 1, x.a_inter, x.a_intra)
            rounds = 2 if cfg.method.horovod.get("cache_capacity", 0) else 4
            comm = comm + messages * rounds * np.ceil(np.log2(np.maximum(x.workers, 2))) * link
    ops = facts.get("update_ops", {})
    count = ops.get(cfg.model.optimizer.name, ops.get("adam", 0))
    n = len(sizes)
    host = (count * float(facts.get("op_launch_s", 0.0)) * n
            + float(facts.get("scan_s", 0.0)) * n * (n + 1) / 2)
    host = host if engines.study_engine(cfg) else 0.0
    compute = x.total + divide.sum(axis=1)
    iteration = np.maximum.reduce([compute + tail, comm, np.full(len(a), host)])
    iteration = np.where(many, iteration, x.total)
    exposed = np.maximum(0.0, iteration - x.total)
    return Result(iteration, exposed, np.maximum(0.0, comm - exposed), np.zeros(len(a), bool),
                  np.full(len(a), len(units)))


def _credit_bytes(sched: Config) -> float:
    """ByteScheduler's credit in bytes (unbounded without one)."""
    if sched.get("credit_bytes"):
        return float(sched.credit_bytes)
    return float(sched.get("credit_elements") or math.inf) * ELEMENT_SIZE


def _ps_alone(cfg: Config, x: _Arrays, plan: Plan, parts: list[list], a: np.ndarray,
              b: np.ndarray) -> np.ndarray:
    """How long `parts` (one unit's partitions, from t = 0, alone) take on the PS path."""
    units = [plan.units[0]] * len(parts)
    zero = np.zeros((len(a), len(parts)))
    return _ps(cfg, x, Plan(units, {}, parts, plan.servers), zero, a, b)[0].max(axis=1)
