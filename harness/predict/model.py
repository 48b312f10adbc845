"""One configuration's iteration as discrete events: compute per tensor, the method's
plan and its scheduler's semantics (after backward, on ready, or a priority queue
under a credit with per-layer updates that the next forward waits for) over the
network's queued resources (harness/predict/network.py)."""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass

from omegaconf import DictConfig

from harness.config.ranks import num_workers
from harness.predict import profile
from harness.predict.network import (
    ELEMENT_SIZE,
    Collectives,
    Network,
    ParameterServers,
    allreduce_s,
    fitted_cost,
)
from harness.predict.plans import Tensors, plan_of, tensors
from methods.plan import Unit, credit_in_elements, fuse_pieces

# -- one configuration -------------------------------------------------------------------

@dataclass(frozen=True)
class Prediction:
    iteration_s: float
    throughput: float
    speedup: float            # over the same model's compute alone on one worker
    exposed_s: float          # communication not hidden behind computation, per iteration
    hidden_s: float           # communication hidden behind it: the busiest link's rest
    messages: int             # communication units issued per iteration
    bottleneck: str
    plan: dict


def _credit(scheduler: DictConfig) -> int:
    return credit_in_elements(elements=scheduler.get("credit_elements"),
                              nbytes=scheduler.get("credit_bytes"), element_size=ELEMENT_SIZE)


def predict(cfg: DictConfig, compute: profile.Compute, net: Network) -> Prediction:
    """Simulate `simulate.iterations` iterations of one configuration; steady-state time."""
    nodes, per_node = cfg.cluster.nodes, cfg.cluster.workers_per_node
    workers, method = num_workers(cfg), cfg.method

    def collective(_unit: int, nbytes: int) -> float:
        return allreduce_s(net, nbytes, nodes=nodes, per_node=per_node)

    cost = fitted_cost(net, nodes=nodes, per_node=per_node)
    model = tensors(cfg.model)
    if model.sizes != compute.sizes:  # a hand-made compute (tests): tensors named by index
        model = Tensors([str(i) for i in range(len(compute.sizes))], compute.sizes,
                        compute.sizes)
    planned = plan_of(cfg, model, backward_s=compute.backward_s, cost=cost)
    units, described = planned.units, planned.planner
    kind, sched = method.scheduler.name, method.scheduler
    cycle_s = float(sched.get("cycle_s", 0.0)) if kind == "priority" else 0.0
    if method.transport.name == "ps" and planned.servers:
        comm = ParameterServers(net, [[(p.numel * ELEMENT_SIZE, p.server) for p in ps]
                                      for ps in planned.parts], nodes, per_node,
                                planned.servers, method.transport.get("local_reduce", True))
    elif method.transport.name == "ps":  # one node, no servers: each partition all-reduced
        comm = Collectives(lambda u, _: sum(collective(u, p.numel * ELEMENT_SIZE)
                                            for p in planned.parts[u]))
    else:
        # the study's all-reduce methods ran on Horovod; torch DDP has no negotiation cycle,
        # and a method with its own cycle (ByteScheduler's pieces) rounds to that one
        horovod = method.transport.name != "ddp" and not cycle_s
        comm = Collectives(collective, net.cycle_s if horovod else 0.0)
    credit = _credit(sched) if kind == "priority" else 0
    fusion = (sched.get("fusion_bytes") or 0) // ELEMENT_SIZE if kind == "priority" else 0
    ends = _iterate(compute, units, comm, kind=kind, credit=credit, cycle_s=cycle_s,
                    fusion=fusion, iterations=cfg.simulate.iterations)
    steady = ends[1:] if len(ends) > 2 else ends
    iteration = (steady[-1] - steady[0]) / (len(steady) - 1) if len(steady) > 1 else ends[0]
    exposed = max(0.0, iteration - compute.total_s)
    busiest, busy = max(comm.busy.items(), key=lambda kv: kv[1])
    busy /= len(ends)
    bottleneck = "compute"
    if exposed > 0.05 * iteration:
        bottleneck = ("server link" if busiest.startswith("server")
                      else "exposed communication")
    plan = {**described, "units": len(units), "alpha_s": cost.alpha, "beta_s_per_byte": cost.beta,
            "busiest_link": busiest, "busy_s_per_iteration": busy,
            "compute": compute.source, "network": net.name}
    samples = workers * cfg.model.local_batch_size
    return Prediction(iteration, samples / iteration, workers * compute.total_s / iteration,
                      exposed, max(0.0, busy - exposed), len(units), bottleneck, plan)


def _iterate(compute: profile.Compute, units: list[Unit], comm, *, kind: str, credit: int,
             cycle_s: float, fusion: int, iterations: int) -> list[float]:
    """The end of each iteration (its last update), simulated one after another."""
    backward_ready = list(itertools.accumulate(compute.backward_s))
    nbytes = [u.numel * ELEMENT_SIZE for u in units]
    layers = max(compute.layer_of) + 1
    layer_done = [0.0] * layers  # when each layer's last update of the previous iteration is in
    layer_share = [0.0] * layers
    total = sum(compute.sizes)
    for i, n in enumerate(compute.sizes):
        layer_share[compute.layer_of[i]] += compute.update_s * n / total
    t, ends = 0.0, []
    for _ in range(iterations):
        for needs, seconds in compute.forward:
            if kind == "priority":  # the next forward waits only for its own layers
                t = max([t, *(layer_done[layer] for layer in needs)])
            t += seconds
        ready = [t + r for r in backward_ready]
        end_of_backward = ready[-1]
        if kind == "after_backward":
            unit_ready = [end_of_backward] * len(units)
        else:
            unit_ready = [ready[u.params[-1]] for u in units]  # ready times never decrease
        if kind == "priority":
            done = _priority(units, unit_ready, comm, credit, cycle_s=cycle_s, fusion=fusion)
            updated = [0.0] * layers
            for u, finish in zip(units, done):
                layer = compute.layer_of[u.params[0]]
                updated[layer] = max(updated[layer], finish)
            free = end_of_backward  # one thread applies the layers' updates as they come in
            for layer in sorted(range(layers), key=lambda i: updated[i]):
                free = max(free, updated[layer]) + layer_share[layer]
                layer_done[layer] = free
            t = end_of_backward
            ends.append(max(layer_done))
        else:
            done = [comm.issue(i, nbytes[i], r) for i, r in enumerate(unit_ready)]
            t = max([end_of_backward, *done]) + compute.update_s
            ends.append(t)
    return ends


def _priority(units: list[Unit], ready: list[float], comm, credit: int, *,
              cycle_s: float = 0.0, fusion: int = 0) -> list[float]:
    """ByteScheduler: the highest-priority ready units (input side first) go while any
    of `credit` elements is left, each alone; with `cycle_s`, those of one cycle start
    at its end, consecutive ones fused up to `fusion` elements (Priority._issue).
    Returns each unit's finish."""
    n = len(units)
    done = [0.0] * n
    arrivals = sorted(range(n), key=lambda u: (ready[u], u))
    queue: list[tuple[int, int, int]] = []  # (-tensor index: input side first, start, unit)
    flight: list[tuple[float, int]] = []    # (finish, elements)
    batch: list[int] = []
    used, now, nxt, tick = 0, 0.0, 0, 0.0
    while nxt < n or queue or batch:
        while nxt < n and ready[arrivals[nxt]] <= now:
            u = arrivals[nxt]
            heapq.heappush(queue, (-units[u].params[0], units[u].start, u))
            nxt += 1
        while flight and flight[0][0] <= now:
            used -= heapq.heappop(flight)[1]
        while queue and used < credit:
            if not batch and cycle_s:
                tick = math.ceil(now / cycle_s - 1e-9) * cycle_s
            batch.append(heapq.heappop(queue)[2])
            used += units[batch[-1]].numel
        if batch and (not cycle_s or now >= tick):
            start = tick if cycle_s else now
            for group in fuse_pieces([units[u].numel for u in batch], fusion if cycle_s else 0):
                members = [batch[i] for i in group]
                elements = sum(units[u].numel for u in members)
                finish = comm.issue(members[0], elements * ELEMENT_SIZE, start)
                for u in members:
                    done[u] = finish
                heapq.heappush(flight, (finish, elements))
            batch = []
            continue
        events = ([ready[arrivals[nxt]]] if nxt < n else []) + (
            [flight[0][0]] if queue and flight else []) + ([tick] if batch else [])
        if not events:
            break
        now = max(now, min(events))
    return done
