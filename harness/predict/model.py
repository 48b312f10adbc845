"""One configuration's iteration as discrete events: compute per tensor, the method's
plan and its scheduler's semantics (after backward, on ready, or a priority queue
under a credit with per-layer updates that the next forward waits for) over the
network's queued resources (harness/predict/network.py)."""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass

from harness.config.frozen import Config
from harness.config.ranks import num_workers
from harness.config.schema import step_ending
from harness.predict import profile
from harness.predict.network import (
    ELEMENT_SIZE,
    Collectives,
    Network,
    ParameterServers,
    allreduce_s,
)
from harness.predict.plans import Tensors, mgwfbp_cost, plan_of, tensors
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


def _credit(scheduler: Config) -> int:
    return credit_in_elements(elements=scheduler.get("credit_elements"),
                              nbytes=scheduler.get("credit_bytes"), element_size=ELEMENT_SIZE)


def predict(cfg: Config, compute: profile.Compute, net: Network, *,
            log: list | None = None) -> Prediction:
    """Simulate `simulate.iterations` iterations of one configuration; steady-state time.
    With a `log` list (simulate.trace, harness/predict/timeline.py), what happened when
    is appended to it: (lane, name, start, end, args) of each phase, wait, update, unit
    (lane "comm", from its issue to its end) and link use."""
    nodes, per_node = cfg.cluster.nodes, cfg.cluster.workers_per_node
    workers, method = num_workers(cfg), cfg.method

    def collective(_unit: int, nbytes: int) -> float:
        return allreduce_s(net, nbytes, nodes=nodes, per_node=per_node)

    cost = mgwfbp_cost(cfg, net)
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
                                planned.servers, method.transport.get("local_reduce", True),
                                method.transport.get("node_reduce", "scatter"),
                                method.transport.get("engine_threads", 1))
    elif method.transport.name == "ps":  # one node, no servers: each partition all-reduced
        comm = Collectives(lambda u, _: sum(collective(u, p.numel * ELEMENT_SIZE)
                                            for p in planned.parts[u]))
    else:
        # the study's all-reduce methods ran on Horovod, each with its own cycle (0 for all
        # but ByteScheduler's, whose pieces round to the scheduler's); DDP has none
        horovod = method.transport.name != "ddp" and not cycle_s
        comm = Collectives(collective, float(method.horovod.cycle_time_s) if horovod else 0.0)
    credit = _credit(sched) if kind == "priority" else 0
    fusion = (sched.get("fusion_bytes") or 0) // ELEMENT_SIZE if kind == "priority" else 0
    if log is not None:
        _log_units(comm, units, model.names, log)
    ends = _iterate(compute, units, comm, kind=kind, credit=credit, cycle_s=cycle_s,
                    fusion=fusion, iterations=cfg.simulate.iterations,
                    ending=step_ending(cfg.run), log=log)
    steady = ends[1:] if len(ends) > 2 else ends
    iteration = (steady[-1] - steady[0]) / (len(steady) - 1) if len(steady) > 1 else ends[0]
    exposed = max(0.0, iteration - compute.total_s)
    busiest, busy = max(comm.busy.items(), key=lambda kv: kv[1])
    busy /= len(ends)
    bottleneck = "compute"
    if exposed > 0.05 * iteration:
        bottleneck = ("exposed communication" if not busiest.startswith("server") else
                      "server engine" if "_engine" in busiest else "server link")
    plan = {**described, "units": len(units), "alpha_s": cost.alpha, "beta_s_per_byte": cost.beta,
            "busiest_link": busiest, "busy_s_per_iteration": busy,
            "compute": compute.source, "network": net.name}
    samples = workers * cfg.model.local_batch_size
    return Prediction(iteration, samples / iteration, workers * compute.total_s / iteration,
                      exposed, max(0.0, busy - exposed), len(units), bottleneck, plan)


def _log_units(comm, units: list[Unit], names: list[str], log: list) -> None:
    """From now on `comm` logs its links' use (lanes of their own) and each unit, on the
    comm lane from its issue to its end, named as the plan names it."""
    comm.log = links = []
    issue = comm.issue

    def logged(unit: int, nbytes: int, t: float) -> float:
        done = issue(unit, nbytes, t)
        u = units[unit]
        log.append(("comm", f"unit {unit}", t, done, {
            "unit": unit, "bytes": nbytes, "tensors": len(u.params), "first": names[u.params[0]],
            "last": names[u.params[-1]], "merged_with_next": nbytes > u.numel * ELEMENT_SIZE}))
        log.extend((lane, f"unit {i}", a, b, {"unit": i}) for lane, i, a, b in links)
        links.clear()
        return done

    comm.issue = logged  # an instance attribute: issue_all and _priority call this one


def _iterate(compute: profile.Compute, units: list[Unit], comm, *, kind: str, credit: int,
             cycle_s: float, fusion: int, iterations: int, ending: str = "false",
             log: list | None = None) -> list[float]:
    """The end of each iteration (its last update), simulated one after another.
    `ending` (run.sync_each_step) matters where communication outlives the step, under
    ByteScheduler (every other method's step waits for its communication anyway): with
    `drain` each step ends once its communication and updates are done, so none of them
    overlaps the next forward; with `device` (the study's torch.cuda.synchronize() at
    the step's end, the end of backward) it waits for the pieces already started, not
    for those held back by credit or a cycle. `log`: see `predict` (an iteration spans
    from its forward to the next one's)."""
    backward_ready = list(itertools.accumulate(compute.backward_s))
    nbytes = [u.numel * ELEMENT_SIZE for u in units]
    layers = max(compute.layer_of) + 1
    layer_done = [0.0] * layers  # when each layer's last update of the previous iteration is in
    layer_share = [0.0] * layers
    total = sum(compute.sizes)
    for i, n in enumerate(compute.sizes):
        layer_share[compute.layer_of[i]] += compute.update_s * n / total
    unit_layer = [compute.layer_of[u.params[0]] for u in units]
    last = [u.params[-1] for u in units]  # a unit is ready with its last tensor
    update_s = compute.update_s
    keys = _keys(units) if kind == "priority" else None
    t, ends = 0.0, []
    for it in range(iterations):
        begin = t
        for needs, seconds in compute.forward:
            if kind == "priority":  # the next forward waits only for its own layers
                for layer in needs:
                    if layer_done[layer] > t:
                        if log is not None:
                            log.append(("compute", "wait: update", t, layer_done[layer], {}))
                        t = layer_done[layer]
            t += seconds
        ready = [t + r for r in backward_ready]
        end_of_backward = ready[-1]
        if log is not None:
            log += [("compute", "forward", begin, t, {}),
                    ("compute", "backward", t, end_of_backward, {})]
        if kind == "after_backward":
            unit_ready = [end_of_backward] * len(units)
        else:
            unit_ready = [ready[p] for p in last]  # ready times never decrease
        if kind == "priority":
            started = [math.inf] * len(units)
            done = _priority(units, unit_ready, comm, credit, cycle_s=cycle_s, fusion=fusion,
                             keys=keys, started=started)
            updated = [0.0] * layers
            for layer, finish in zip(unit_layer, done):
                if finish > updated[layer]:
                    updated[layer] = finish
            free = end_of_backward  # one thread applies the layers' updates as they come in
            for layer in sorted(range(layers), key=updated.__getitem__):
                free = (free if free > updated[layer] else updated[layer]) + layer_share[layer]
                layer_done[layer] = free
                if log is not None:
                    log.append(("updates", f"update layer {layer}", free - layer_share[layer],
                                free, {}))
            t = end_of_backward
            if ending == "drain":
                t = max(layer_done)
            elif ending == "device":  # the GPU work queued by then: pieces started
                t = max([t, *(f for s, f in zip(started, done) if s <= end_of_backward)])
                if log is not None and t > end_of_backward:
                    log.append(("compute", "synchronize", end_of_backward, t, {}))
            ends.append(max(layer_done))
        else:
            done = comm.issue_all(nbytes, unit_ready)
            t = max([end_of_backward, *done]) + update_s
            ends.append(t)
            if log is not None:
                log += [("compute", "synchronize", end_of_backward, t - update_s, {}),
                        ("compute", "update", t - update_s, t, {})]
        if log is not None:
            log.append(("compute", "traced iteration" if it == iterations - 1 else
                        f"iteration {it + 1}", begin, t, {}))
    return ends


def _keys(units: list[Unit]) -> tuple[list[int], list[tuple[int, int, int]]]:
    """Each unit's elements, and its place in the priority queue (input side first)."""
    return [u.numel for u in units], [(-u.params[0], u.start, i) for i, u in enumerate(units)]


def _priority(units: list[Unit], ready: list[float], comm, credit: int, *,
              cycle_s: float = 0.0, fusion: int = 0,
              keys: tuple[list[int], list[tuple[int, int, int]]] | None = None,
              started: list[float] | None = None) -> list[float]:
    """ByteScheduler: the highest-priority ready units (input side first) go while any
    of `credit` elements is left, each alone; with `cycle_s`, those of one cycle start
    at its end, consecutive ones fused up to `fusion` elements (Priority._issue).
    Returns each unit's finish (`keys`: `_keys(units)`, when the caller has them), and
    writes each unit's start into `started` when given. An
    event loop over arrivals, completions and cycle ticks, written for speed: the
    simulator spends most of its time here."""
    n = len(units)
    numel, order = keys or _keys(units)
    done = [0.0] * n
    arrivals = sorted(range(n), key=ready.__getitem__)  # stable: ties in unit order
    arrive = [ready[u] for u in arrivals]
    queue: list[tuple[int, int, int]] = []  # (-tensor index: input side first, start, unit)
    flight: list[tuple[float, int]] = []    # (finish, elements)
    batch: list[int] = []
    push, pop, issue = heapq.heappush, heapq.heappop, comm.issue
    used, now, nxt, tick = 0, 0.0, 0, 0.0
    while nxt < n or queue or batch:
        while nxt < n and arrive[nxt] <= now:
            push(queue, order[arrivals[nxt]])
            nxt += 1
        while flight and flight[0][0] <= now:
            used -= pop(flight)[1]
        if not cycle_s and queue and used < credit:  # each goes alone, now
            soonest = math.inf
            while queue and used < credit:
                u = pop(queue)[2]
                used += numel[u]
                done[u] = finish = issue(u, numel[u] * ELEMENT_SIZE, now)
                if started is not None:
                    started[u] = now
                push(flight, (finish, numel[u]))
                soonest = min(soonest, finish)
            if soonest <= now:  # one is back already (it moved nothing): its credit is free
                continue
        while queue and used < credit:  # a cycle: the pieces wait for its tick, together
            if not batch:
                tick = math.ceil(now / cycle_s - 1e-9) * cycle_s
            batch.append(pop(queue)[2])
            used += numel[batch[-1]]
        if batch and now >= tick:
            for group in fuse_pieces([numel[u] for u in batch], fusion):
                members = [batch[i] for i in group]
                elements = sum(numel[u] for u in members)
                finish = issue(members[0], elements * ELEMENT_SIZE, tick)
                for u in members:
                    done[u] = finish
                    if started is not None:
                        started[u] = tick
                push(flight, (finish, elements))
            batch = []
            continue
        event = arrive[nxt] if nxt < n else math.inf  # the next arrival, completion or tick
        if queue and flight and flight[0][0] < event:
            event = flight[0][0]
        if batch and tick < event:
            event = tick
        if event == math.inf:
            break
        if event > now:
            now = event
    return done
