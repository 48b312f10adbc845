"""`python -m harness.simulate experiment=<name> network=<profile>`: predict a sweep.

A discrete-event model of training iterations, per configuration:

- compute: per-tensor forward and backward times (harness.profile): FLOPs scaled to a
  GPU of `simulate.gpus` (calibrated only by its 1-GPU throughput), or measured here;
- the method's own plan (harness.plan.plan_of: the planners of methods.plan, the
  MG-WFBP merge from the backward times and a fitted alpha/beta, ByteScheduler's
  slices, and the PS partitions, keys and servers of methods.layout) and its
  scheduler's semantics: after backward, on ready, or a priority queue under a credit
  (issuing while any is left) with per-layer updates that the next forward pass waits
  for, its pieces of one cycle fused as Horovod did when the method sets `cycle_s`;
- the network: intra- and inter-node links (alpha + beta * bytes) from a real profile's
  facts or from the microbenchmark; ring, tree or hierarchical all-reduce (on the study's
  networks each starting on Horovod's negotiation cycle); S parameter servers each behind
  its own link, fed once per node with node-local aggregation (none on one node: the
  partitions are all-reduced there). Server-side scheduling only reorders a server's
  summations, which this model does not time: it predicts bytescheduler_ps as wfbp_ps.

Every configuration of the sweep becomes one result row with source=simulated (one
shard per simulation), so `harness.report` draws simulated figures with the same code.
`simulate.calibrate=<csv>` fits each method's costs that no fact gives on one node's
measurements (harness.calibrate), `simulate.reference=<csv>` validates against measured
throughputs, `simulate.advise=true` ranks the methods per model and cluster.
"""

from __future__ import annotations

import heapq
import itertools
import json
import math
import sys
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
from omegaconf import DictConfig

from harness import calibrate, config, profile, results
from harness.launch import torch_threads
from harness.plan import Tensors, plan_of, tensors
from harness.ranks import num_servers, num_workers
from methods.costmodel import Cost, least_squares
from methods.plan import Unit, credit_in_elements, fuse_pieces

ELEMENT_SIZE = 4  # fp32 gradients
FIT_SIZES = [1 << 10, 1 << 14, 1 << 17, 1 << 19, 1 << 21]  # elements, as methods.costmodel


# -- the network -------------------------------------------------------------------------

@dataclass(frozen=True)
class Network:
    name: str
    intra: Cost           # between the workers of one node
    inter: Cost           # between nodes, and to every parameter server
    allreduce: str        # ring | tree | hierarchical | best (the faster of ring and tree)
    ps_host_copy: bool     # PS: GPU workers copy each partition to host memory and back
    cycle_s: float = 0.0   # all-reduces start on a framework cycle (Horovod's negotiation)


def network(cfg: DictConfig) -> Network:
    """The link model of `cfg.network`: a real network's facts, or the microbenchmark's fit."""
    net = cfg.network
    if config.is_real_network(net):
        points = [(float(b), float(b) * 8 / (gbit * 1e9)) for b, gbit in net.inter_node.gbit_per_s]
        inter = least_squares(*zip(*points))
        ar = net.intra_node.allreduce  # a ring all-reduce: 2 (g - 1) / g of the bytes per link
        beta = ar.seconds / (2 * (ar.gpus - 1) / ar.gpus * ar.bytes)
        return Network(net.name, Cost(net.intra_node.alpha_s, beta), inter,
                       net.get("allreduce", "ring"), bool(net.get("ps_host_copy", False)),
                       float(net.get("cycle_s", 0.0)))
    link = _microbench_link(cfg)
    return Network(net.name, link, link, "ring", False)


def _microbench_link(cfg: DictConfig) -> Cost:
    """The point-to-point alpha/beta of the newest microbenchmark of this network."""
    folder = Path(cfg.results_dir) / results.OTHER_DATA
    fits = [f for f in results.load_microbench(folder)
            if (f.network == cfg.network.name).all() and (f.kind == "p2p").any()]
    if not fits:
        where = "cluster=emulated " if cfg.network.get("rate_mbit") else ""
        raise config.ConfigError(
            f"network={cfg.network.name} has no measured link in {folder}; measure it first: "
            f"python -m harness.microbench {where}network={cfg.network.name} "
            f"cluster.{'nodes' if where else 'workers_per_node'}=2")
    p2p = fits[-1][fits[-1].kind == "p2p"].iloc[0]
    return Cost(float(p2p.alpha_s), float(p2p.beta_s_per_byte))


def allreduce_s(net: Network, nbytes: int, *, nodes: int, per_node: int) -> float:
    """Seconds of one all-reduce of `nbytes` over nodes x per_node workers."""
    p = nodes * per_node
    if p == 1 or nbytes == 0:
        return 0.0
    links = ([net.intra] if per_node > 1 else []) + ([net.inter] if nodes > 1 else [])
    alpha, beta = max(c.alpha for c in links), max(c.beta for c in links)
    moved = 2 * (p - 1) / p * nbytes * beta  # every link of a ring carries this much
    if net.allreduce == "hierarchical":  # reduce-scatter in the node, ring across, all-gather
        local = 2 * (per_node - 1) * (net.intra.alpha + nbytes / per_node * net.intra.beta)
        across = 2 * (nodes - 1) * (net.inter.alpha + nbytes / p * net.inter.beta)
        return local + across
    ring = 2 * (p - 1) * alpha + moved
    # a tree: logarithmic start-up across nodes, a chain within; no better bandwidth than a ring
    depth = math.ceil(math.log2(nodes)) * net.inter.alpha + (per_node - 1) * net.intra.alpha
    tree = 2 * depth + moved
    return {"ring": ring, "tree": tree, "best": min(ring, tree)}[net.allreduce]


def fitted_cost(net: Network, *, nodes: int, per_node: int) -> Cost:
    """alpha + beta * bytes fitted to this network's all-reduce (what MG-WFBP measures)."""
    fit_bytes = [n * ELEMENT_SIZE for n in FIT_SIZES]
    return least_squares(fit_bytes, [allreduce_s(net, b, nodes=nodes, per_node=per_node)
                                     for b in fit_bytes])


# -- communication: resources with a queue ---------------------------------------------------

class Collectives:
    """All-reduces run one at a time, in issue order (one communication stream).

    `seconds(unit, nbytes)` is the duration of unit `unit` (its first, when fused)
    moving `nbytes`. With a `cycle_s`, an all-reduce issued at t starts no earlier
    than the next multiple of it: Horovod's background loop negotiates the tensors
    that became ready once per cycle, then runs them.
    """

    def __init__(self, seconds: Callable[[int, int], float], cycle_s: float = 0.0) -> None:
        self.seconds = seconds
        self.cycle_s = cycle_s
        self.free = 0.0
        self.busy = {"collective": 0.0}

    def issue(self, unit: int, nbytes: int, t: float) -> float:
        duration = self.seconds(unit, nbytes)
        if self.cycle_s:
            t = math.ceil(t / self.cycle_s - 1e-9) * self.cycle_s
        self.free = max(t, self.free) + duration
        self.busy["collective"] += duration
        return self.free


@dataclass
class _Link:
    free: float = 0.0
    busy: float = 0.0

    def occupy(self, t: float, seconds: float) -> float:
        self.free = max(t, self.free) + seconds
        self.busy += seconds
        return self.free


@dataclass
class ParameterServers:
    """Push every partition to its server, which answers once all pushes are in.

    Links are one-way queues: a node's uplink and downlink (a worker's own when nodes
    do not reduce locally), each server's downlink and uplink, and the node's bus
    (intra-node links) up and down. Up: the node's workers reduce-scatter the partition
    and each copies its slice to host memory; down: the copies back and the all-gather
    (BytePS). Both directions stream at once over the one PCIe fabric of the node, whose
    rate the intra-node all-reduce fact gives, so each gets half of it.
    """

    net: Network
    parts: list[list[tuple[int, int]]]  # per unit: (bytes, server index)
    nodes: int
    per_node: int
    servers: int
    local_reduce: bool  # a node sums its workers' gradients and pushes once (BytePS)
    links: dict[str, _Link] = field(default_factory=dict)

    def __post_init__(self) -> None:
        sharing = self.per_node if self.local_reduce else 1  # workers that share a partition
        # bytes per worker over the bus per byte of partition, each way: the
        # reduce-scatter (or all-gather) and the copy of its slice, at half the rate
        bus_share = 2 * ((sharing - 1) + self.net.ps_host_copy) / sharing
        senders = self.nodes if self.local_reduce else self.nodes * self.per_node
        node_share = 1 if self.local_reduce else self.per_node
        self.links = {n: _Link() for n in ("node_up", "node_down", "bus_up", "bus_down")}
        servers = [(_Link(), _Link()) for _ in range(self.servers)]
        for s, (down, up) in enumerate(servers):
            self.links[f"server{s}_in"], self.links[f"server{s}_out"] = down, up
        inter, intra = self.net.inter, self.net.intra
        # per unit, per partition: (bus seconds, node link seconds, server link seconds, links)
        self.steps = [[(intra.seconds(size * bus_share) if bus_share else 0.0,
                        size * node_share * inter.beta, size * senders * inter.beta,
                        servers[server]) for size, server in unit] for unit in self.parts]

    @property
    def busy(self) -> dict[str, float]:
        return {n: link.busy for n, link in self.links.items()}

    def issue(self, unit: int, nbytes: int, t: float) -> float:
        done, alpha = t, self.net.inter.alpha
        node_up, node_down = self.links["node_up"], self.links["node_down"]
        bus_up, bus_down = self.links["bus_up"], self.links["bus_down"]
        for bus, node, server, (server_in, server_out) in self.steps[unit]:
            start = bus_up.occupy(t, bus) if bus else t
            pushed = max(node_up.occupy(start, node), server_in.occupy(start, server)) + alpha
            pulled = max(server_out.occupy(pushed, server), node_down.occupy(pushed, node)) + alpha
            if bus:
                pulled = bus_down.occupy(pulled, bus)
            done = max(done, pulled)
        return done


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


# -- the sweep ---------------------------------------------------------------------------

class ComputeProfiles:
    """Each model's compute, profiled once per simulation."""

    def __init__(self) -> None:
        self.cache: dict[tuple, profile.Compute] = {}

    def __call__(self, cfg: DictConfig) -> profile.Compute:
        sim, model = cfg.simulate, cfg.model
        if sim.compute != "measured":
            key = (config.to_json(model), sim.compute)
            if key not in self.cache:
                self.cache[key] = profile.counted(
                    model, throughput=sim.gpus[sim.compute][model.name], gpu=sim.compute)
            return self.cache[key]
        threads = torch_threads(cfg, num_workers(cfg) + num_servers(cfg))  # as a run gets
        # every worker of a local or emulated cluster runs on this machine: profile as many
        # processes at once, so the profile has their sharing of its cores in it
        together = num_workers(cfg) if cfg.cluster.name in ("local", "emulated") else 1
        key = (config.to_json(model), threads, together)
        if key not in self.cache:
            import torch

            print(f"profiling {model.name} on this machine ({together} process(es) of "
                  f"{threads} thread(s))...", flush=True)
            torch.set_num_threads(threads)
            device = torch.device(config.resolve_device(cfg.cluster))
            self.cache[key] = (
                profile.measured_together(model, processes=together, threads=threads,
                                          iters=sim.profile_iters, device=device,
                                          seed=cfg.run.seed) if together > 1 else
                profile.measured(model, iters=sim.profile_iters, device=device,
                                 seed=cfg.run.seed))
        return self.cache[key]


def row(cfg: DictConfig, pred: Prediction, compute: profile.Compute, *, run_id: str) -> dict:
    """The result row of a prediction, with its own columns for calibration (iteration_s,
    hidden_s, messages, samples and one) beside those of results.COLUMNS."""
    from harness.bench import identity

    return {
        **identity(cfg, run_id=run_id, repeat=0), "source": "simulated",
        "model_params": sum(compute.sizes), "model_tensors": len(compute.sizes),
        "throughput": pred.throughput, "timed_s": pred.iteration_s * cfg.run.timed_iters,
        "forward_s": compute.forward_s, "backward_s": sum(compute.backward_s),
        "comm_s": pred.exposed_s, "update_s": compute.update_s, "status": "ok",
        "device": compute.source, "plan_json": json.dumps({**pred.plan,
                                                           "bottleneck": pred.bottleneck}),
        "speedup": pred.speedup, "bottleneck": pred.bottleneck, "iteration_s": pred.iteration_s,
        "hidden_s": pred.hidden_s, "messages": pred.messages, "one": 1.0,
        "samples": num_workers(cfg) * cfg.model.local_batch_size,
    }


def predict_sweep(cfgs: list[DictConfig]) -> pd.DataFrame:
    """Predict every configuration: one row each (`row`)."""
    networks: dict[str, Network] = {}
    for cfg in cfgs:  # first, so a missing microbenchmark stops it before any profiling
        if cfg.network.name not in networks:
            networks[cfg.network.name] = network(cfg)
    profiles, run_id, rows = ComputeProfiles(), f"sim-{uuid.uuid4().hex[:8]}", []
    for cfg in cfgs:
        compute = profiles(cfg)
        rows.append(row(cfg, predict(cfg, compute, networks[cfg.network.name]), compute,
                        run_id=run_id))
    return pd.DataFrame(rows)


def write(frame: pd.DataFrame, uncalibrated: pd.DataFrame, costs: dict, results_dir: str) -> Path:
    """Print a line per configuration and write them as one shard, each row's plan with
    its method's fitted costs and its uncalibrated throughput."""
    rows = []
    for i, (r, raw) in enumerate(zip(frame.to_dict("records"),
                                     uncalibrated.throughput), 1):
        plan = json.loads(r["plan_json"])
        if costs:
            plan.update(calibration=costs.get(r["method"], {}), uncalibrated_throughput=raw)
        rows.append({**{k: v for k, v in r.items() if k in results.COLUMNS},
                     "plan_json": json.dumps(plan)})
        print(f"[{i}/{len(frame)}] {r['model']} {r['method']} {r['nodes']}x"
              f"{r['workers_per_node']} on {r['network']}: {r['throughput']:.1f} samples/s, "
              f"speedup {r['speedup']:.2f}x, exposed comm {r['comm_s'] * 1e3:.1f} ms/iter "
              f"({r['bottleneck']})", flush=True)
    path = results.shard_path(results_dir, frame.run_id.iloc[0], 0)
    results.write_shard(path, rows)
    print(f"simulated {len(rows)} configurations -> {path}", flush=True)
    return path


def main(argv: list[str]) -> int:
    try:
        jobs = config.sweep(argv)
        cfgs = config.load_all(jobs, simulate=True)
        sim = cfgs[0].simulate
        ref = (calibrate.read_cells(f"simulate.reference={sim.reference}", sim.reference, cfgs)
               if sim.reference else None)
        measured = (calibrate.read_cells(f"simulate.calibrate={sim.calibrate}", sim.calibrate,
                                         cfgs) if sim.calibrate else None)
        fitted_on = (calibrate.fit_cells(measured, sim.calibrate_gpus)
                     if measured is not None else measured)
        raw = predict_sweep(cfgs)
        costs = calibrate.fit(raw, fitted_on) if fitted_on is not None else {}
        frame = calibrate.apply(raw, costs)
        write(frame, raw, costs, cfgs[0].results_dir)
        if costs:
            print(calibrate.describe(costs, fitted_on, list(raw.method)))
        errors = {}
        check = ref if ref is not None else measured
        if check is not None:  # the cells fitted on are no test of the fit
            if fitted_on is not None:
                check = check.merge(fitted_on[calibrate.CELL], how="left", indicator=True)
                check = check[check._merge == "left_only"].drop(columns="_merge")
            for name, predicted in [("uncalibrated", raw)] + [("calibrated", frame)] * bool(costs):
                both, line = calibrate.validate(predicted, check)
                errors = both.pct_error.abs().groupby([both.model, both.network]).median().to_dict()
                print(f"validation, {name}: {line}")
        if sim.advise:
            print(calibrate.advice(frame, errors))
    except config.ConfigError as exc:
        print(f"ddlbench: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
