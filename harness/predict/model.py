"""One configuration's iteration as discrete events: compute per tensor, the method's
plan and its scheduler's semantics (after backward, on ready, or a priority queue
under a credit with per-layer updates that the next forward waits for) over the
network's queued resources (harness/predict/network.py)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from harness.config.frozen import Config
from harness.config.ranks import num_workers
from harness.config.schema import step_ending
from harness.predict import cpushare, engines, priority, profile
from harness.predict.network import ELEMENT_SIZE, Collectives, Network, allreduce_s
from harness.predict.plans import Tensors, mgwfbp_cost, plan_of, tensors
from harness.predict.psqueues import ParameterServers, path_of
from methods.plan import Unit, credit_in_elements

# -- one configuration -------------------------------------------------------------------

BUSIEST = 4  # the resources a prediction's plan names with their busy time per iteration


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
            log: list | None = None, slowdown: float = 0.0) -> Prediction:
    """Simulate `simulate.iterations` iterations of one configuration; steady-state time.
    With a `log` list (simulate.trace, harness/predict/timeline.py), what happened when
    is appended to it: (lane, name, start, end, args) of each phase, wait, update, unit
    (lane "comm", from its issue to its end) and link use. `slowdown`: the GPU's
    communication work runs 1 + slowdown times slower while it computes (a calibrated
    cost, harness/predict/calibrate.py; 0 uncalibrated)."""
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
                                method.transport.get("engine_threads", 1), slowdown,
                                path_of(cfg))
    elif method.transport.name == "ps":  # one node, no servers: each partition all-reduced
        comm = Collectives(lambda u, _: sum(collective(u, p.numel * ELEMENT_SIZE)
                                            for p in planned.parts[u]), slowdown=slowdown)
    else:
        # the study's all-reduce methods ran on Horovod, each with its own cycle (0 for all
        # but ByteScheduler's, whose pieces round to the scheduler's); DDP has none
        horovod = method.transport.name != "ddp" and not cycle_s
        comm = Collectives(collective, float(method.horovod.cycle_time_s) if horovod else 0.0,
                           slowdown)
    credit = _credit(sched) if kind == "priority" else 0
    fusion = (sched.get("fusion_bytes") or 0) // ELEMENT_SIZE if kind == "priority" else 0
    if log is not None:
        _log_units(comm, units, model.names, log)
    engine = engines.engine_of(cfg, units, compute.sizes, byte_s=compute.byte_s, net=net)
    # the cores a run here shares; the CPU its compute burns is the mean worker's (the
    # slowest one's longer iteration is the others' wait, not CPU: profile.Compute.straggle)
    share = cpushare.of(cfg, compute.total_s / compute.straggle, planned, net)
    ends = _iterate(compute, units, comm, kind=kind, credit=credit, cycle_s=cycle_s,
                    fusion=fusion, iterations=cfg.simulate.iterations,
                    ending=step_ending(cfg.run), engine=engine, log=log, share=share)
    steady = ends[1:] if len(ends) > 2 else ends
    simulated = (steady[-1] - steady[0]) / (len(steady) - 1) if len(steady) > 1 else ends[0]
    iteration = max(simulated, share.floor_s)
    exposed = max(0.0, iteration - compute.total_s)
    busiest, busy = max(comm.busy.items(), key=lambda kv: kv[1])
    busy /= len(ends)
    bottleneck = "compute"
    if exposed > 0.05 * iteration:
        bottleneck = ("exposed communication" if not busiest.startswith("server") else
                      "server engine" if "_engine" in busiest else "server link")
    if iteration > simulated:
        bottleneck = "shared cores"
    plan = {**described, "units": len(units), "alpha_s": cost.alpha, "beta_s_per_byte": cost.beta,
            "busiest_link": busiest, "busy_s_per_iteration": busy,
            "busiest_s": dict(sorted(((k, v / len(ends)) for k, v in comm.busy.items() if v),
                                     key=lambda kv: -kv[1])[:BUSIEST]),
            "compute": compute.source, "network": net.name, **share.described,
            **({"ps_path": comm.path.name, "ps_wire": net.ps_wire}
               if isinstance(comm, ParameterServers) else {})}
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
             engine: engines.Engine = engines.NONE, log: list | None = None,
             share: cpushare.Share = cpushare.NONE) -> list[float]:
    """The end of each iteration, simulated one after another. ByteScheduler's
    (`kind="priority"`) is harness/predict/priority.py's; every other method's step
    waits for its communication: each unit goes when ready (or after backward), the
    engine's divisions run on the compute stream once their unit is done, the training
    thread wakes half a poll period after the last unit (`engine`) and launches the
    optimizer step. `ending` (run.sync_each_step) changes nothing for them. `log`: see
    `predict` (an iteration spans from its forward to the next one's). On shared cores
    (`share`), the tensors after the first unit's compute at the rate the communication
    left them in the iteration before (cpushare.compute_rate)."""
    if kind == "priority":
        return priority.iterate(compute, units, comm, credit=credit, cycle_s=cycle_s,
                                fusion=fusion, iterations=iterations, ending=ending,
                                engine=engine, log=log, share=share)
    backward = compute.backward_s
    if engine.copy_s:  # the merged groups' copies run in the hooks, on the compute stream
        backward = [b + c for b, c in zip(backward, engine.copy_s)]
    nbytes = [u.numel * ELEMENT_SIZE for u in units]
    last = [u.params[-1] for u in units]  # a unit is ready with its last tensor
    first = min(last) if kind != "after_backward" else len(backward)  # the first unit's tensor
    update_s, t, ends, rate = compute.update_s, 0.0, [], 1.0
    for it in range(iterations):
        begin = t
        t += compute.forward_s
        backward_ready = list(itertools.accumulate(cpushare.beside(backward, first, rate)))
        ready = [t + r for r in backward_ready]
        end_of_backward = ready[-1]
        if kind == "after_backward":
            unit_ready = [end_of_backward] * len(units)
        else:
            unit_ready = [ready[p] for p in last]  # ready times never decrease
        comm.busy_until = end_of_backward
        done = comm.issue_all(nbytes, unit_ready)
        rate = share.compute_rate(min(unit_ready), max(done))
        stream = end_of_backward
        for finish, seconds in sorted(zip(done, engine.divide_s)):
            stream = (stream if stream > finish else finish) + seconds
        woken = max([end_of_backward, *done]) + engine.poll_s / 2
        t = max(stream, woken) + update_s
        ends.append(t)
        if log is not None:
            log += [("compute", "forward", begin, end_of_backward - backward_ready[-1], {}),
                    ("compute", "backward", end_of_backward - backward_ready[-1],
                     end_of_backward, {}),
                    ("compute", "synchronize", end_of_backward, t - update_s, {}),
                    ("compute", "update", t - update_s, t, {}),
                    ("compute", "traced iteration" if it == iterations - 1 else
                     f"iteration {it + 1}", begin, t, {})]
    return ends
