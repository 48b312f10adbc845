"""The fast path of a large what-if sweep: every configuration of a family (one model and
method, any GPU, fabric and cluster shape) predicted at once with numpy, instead of one
discrete-event simulation each (model.py).

What it keeps of model.py: the compute (profile.py), the plans (plans.py: one per family,
MG-WFBP's once per merge cost within MERGE_BUCKET), the all-reduce times (network.py's
ring, tree, best and hierarchical are each alpha + beta * bytes for a shape), the
communication stream and the PS path's links, servers and engine lanes (fastqueues.py:
network.Collectives' and ParameterServers' queues over arrays), the study's engines'
polls, divisions and merged copies (engines.py). What it simplifies: one iteration from
t = 0 instead of the steady state of `simulate.iterations` (Horovod's cycle rounds on that
clock), and ByteScheduler (scheduler `priority`: a credit-bound queue whose pieces overlap
the next forward) as bounds (fastqueues.priority). tests/test_fastpath.py checks it
against model.py; the README of this room states the agreement.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from harness.config.frozen import Config, assign
from harness.predict import engines, profile
from harness.predict.fastqueues import Arrays, priority, ps, queue
from harness.predict.network import ELEMENT_SIZE, Network
from harness.predict.plans import Plan, mgwfbp_cost, plan_of, tensors

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


MERGE_BUCKET = 1.5  # MG-WFBP is planned once per merge cost within this factor


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

def _arrays(fam: Family) -> Arrays:
    """The family's per-configuration inputs as arrays (computes and networks shared by
    many configurations are read once)."""
    def col(values: list[float]) -> np.ndarray:
        return np.asarray(values, dtype=float)

    comp = {id(c): c for c in fam.computes}
    rows = {i: np.asarray(c.backward_s) for i, c in comp.items()}
    cs, ns = fam.computes, fam.nets
    return Arrays(
        col([c.forward_s for c in cs]), np.stack([rows[id(c)] for c in cs]),
        col([c.update_s for c in cs]), col([c.byte_s for c in cs]),
        col([c.total_s for c in cs]), fam.nodes.astype(float), fam.per_node.astype(float),
        col([n.intra.alpha for n in ns]), col([n.intra.beta for n in ns]),
        col([n.inter.alpha for n in ns]), col([n.inter.beta for n in ns]),
        col([float(n.ps_host_copy) for n in ns]), col([n.server_memory for n in ns]),
        [n.allreduce for n in ns])


def allreduce_affine(x: Arrays) -> tuple[np.ndarray, np.ndarray]:
    """network.allreduce_s as alpha + beta * bytes per configuration (0 on one worker).
    `nccl24` (the study's networks) is taken as its ring at every size: NCCL 2.4.8's tree
    below 1.3 MB is the discrete-event model's only (no fabric of experiment=whatif uses
    it)."""
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
        it, exposed, hidden = priority(cfg, x, plan, ready, nbytes, a, b, divide, facts, sizes)
        return Result(it, exposed, hidden, np.zeros(len(a), bool), np.full(len(a), len(units)))
    unit_ready = ready[:, [-1] * len(units)] if kind == "after_backward" else ready[:, last]
    if transport == "ps":
        done, busy, server_bound = ps(cfg, x, plan, unit_ready, a, b)
    else:
        cycle = 0.0 if transport == "ddp" else float(cfg.method.horovod.cycle_time_s)
        dur = a[:, None] * (nbytes[None, :] > 0) + b[:, None] * nbytes[None, :]
        done = queue(unit_ready, dur, cycle)
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
