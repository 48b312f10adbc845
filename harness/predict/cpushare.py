"""The CPU a run's communication takes from its compute where the run shares this
machine's cores (issue 43, item 2).

A run of this machine's own on CPU workers (a local or emulated cluster on one of its
networks) runs every process on the same cores: the workers' compute, their communication
threads and Gloo's, the parameter servers' receive threads, sums and answers. The compute
profile (profile.py) times the W worker processes at once and nothing else, so the CPU the
communication burns is not in it. `harness.microbench` measures that CPU (harness/measure/
microbench.py, psbench.py): the CPU seconds the machine is busy per all-reduce and per PS
round trip of one partition (the ranks' threads and the kernel's softirq work for their
packets, which no rank is charged with), each fitted alpha + beta * bytes
(links.Measured's `cpu`, per kind and shape, carried by network.Network's `cpu`).

The model: the cores are a resource no iteration outruns. An iteration's compute keeps
`busy` cores busy for the profile's compute time (busy = min(cores, W x threads): the
profile's processes, each with the run's thread count, on this machine's cores), and its
communication takes `comm_cpu_s` CPU seconds (the sum over the iteration's messages of
their measured CPU), so

    iteration_s >= (busy x compute_s + comm_cpu_s) / cores

and the simulated iteration is stretched to that floor where it is shorter. And where it
runs (harness/predict/model.py, priority.py): communication that runs while backward does
wants cores beside the compute's `busy`, its iteration's CPU spread evenly over its span
(the first unit's readiness to the last one's end, in the iteration before); where the two
want more than there are, they share them in proportion, and the tensors after the first
unit's compute at that share of their speed (`compute_rate`, `beside`): a method that
overlaps pays for its overlap in backward. Traced on 2 eth1g nodes x 1, the model makes
backward x1.46 longer beside `wfbp_ps` and x1.22 beside `wfbp_a2a` on resnet50_small
(measured x1.7-1.9 and x1.26), x1.17 and x1.11 on bert_tiny (x1.24 and x1.08). Assumed:
the cores are shared without idling while any process of the run has work (the floor is
then reached when the communication's CPU fills what compute leaves), and a message costs
the CPU it cost alone in the microbenchmark. Where nodes have several workers, the node's
own part of each partition (its collectives and copies on the method's node path,
psbench's `node_scatter` and `node_root`) is counted beside the round trip, which only the
roots make. Not counted: ByteScheduler's fusion of pieces (each piece is one all-reduce
here). GPU clusters, counted compute and networks that are not this machine's get no
floor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from harness import config
from harness.config import checks
from harness.config.frozen import Config
from harness.config.ranks import num_servers, num_workers, profile_processes, torch_threads
from harness.predict.network import ELEMENT_SIZE, Network
from harness.predict.plans import Plan
from methods.costmodel import FREE


@dataclass(frozen=True)
class Share:
    """One configuration's iteration on shared cores: the CPU its communication takes
    (`comm_cpu_s`, NaN: not measured, or the run shares no cores) beside its compute."""

    comm_cpu_s: float = math.nan
    compute_s: float = 0.0
    busy: int = 0   # cores the compute keeps busy
    cores: int = 1

    @property
    def floor_s(self) -> float:
        """The shortest iteration the cores allow (0: no floor)."""
        if not math.isfinite(self.comm_cpu_s):
            return 0.0
        return floor_s(self.compute_s, busy=self.busy, cores=self.cores,
                       comm_cpu_s=self.comm_cpu_s)

    def compute_rate(self, start: float, end: float) -> float:
        """The compute's speed, as a share of its speed alone, while the iteration's
        communication runs from `start` to `end` beside it: its CPU, spread evenly over
        that span, wants `comm` cores beside the compute's `busy`; where the two want more
        than the cores, the cores are shared in proportion (1: no share, or cores enough
        for both)."""
        if not math.isfinite(self.comm_cpu_s) or end <= start or not self.busy:
            return 1.0
        comm = self.comm_cpu_s / (end - start)  # cores the communication keeps busy
        return min(1.0, self.cores / (self.busy + comm))

    @property
    def described(self) -> dict:
        """What a prediction's plan says of it (nothing where the run shares no cores)."""
        if not self.busy:
            return {}
        cpu = self.comm_cpu_s if math.isfinite(self.comm_cpu_s) else None
        return {"cores": self.cores, "busy_cores": self.busy, "comm_cpu_s": cpu,
                "cpu_floor_s": self.floor_s if cpu is not None else None,
                # the machine's CPU seconds an iteration (a measured row's machine_cpu_s)
                "machine_cpu_s": self.floor_s * self.cores if cpu is not None else None}


NONE = Share()  # a run that shares no cores with its communication


def beside(backward_s: list[float], first: int, rate: float) -> list[float]:
    """Each tensor's backward seconds where the tensors after `first` (the first unit's
    last: communication runs from its readiness on) compute at `rate` of their speed."""
    return [b if i <= first else b / rate for i, b in enumerate(backward_s)]


def floor_s(compute_s: float, *, busy: int, cores: int, comm_cpu_s: float) -> float:
    """(busy x compute_s + comm_cpu_s) / cores: the iteration that uses every core."""
    return (busy * compute_s + comm_cpu_s) / cores


def shares_cores(cfg: Config) -> bool:
    """Whether `cfg`'s workers share this machine's cores with its communication: a run of
    its own (profile.profile_processes) on CPU workers, its compute measured here."""
    return (cfg.simulate.compute == "measured" and profile_processes(cfg) > 1
            and config.resolve_device(cfg.cluster) == "cpu")


def of(cfg: Config, compute_s: float, plan: Plan, net: Network) -> Share:
    """The share of `cfg`'s iteration (its compute `compute_s`, its method's `plan`, the
    CPU `net` measured, links.Measured's `cpu`): NONE where the run shares no cores; NaN
    CPU where its shape's CPU was not measured."""
    if not shares_cores(cfg):
        return NONE
    workers = num_workers(cfg)
    cores = checks.cores()
    threads = torch_threads(cfg, workers + num_servers(cfg))  # as profile.py gives each
    busy = min(cores, workers * threads)
    return Share(comm_cpu_s(cfg, plan, net), compute_s, busy, cores)


def comm_cpu_s(cfg: Config, plan: Plan, net: Network) -> float:
    """CPU seconds of one iteration's messages: each PS partition's round trip through
    its server (psbench's `ps`), where there are servers, and where nodes of several
    workers reduce locally the node's own part of it on the method's node path
    (`node_scatter` or `node_root`; nothing where an older microbenchmark has none); else
    each unit's, or on one node each PS partition's, all-reduce (`allreduce`) on the shape;
    NaN where not measured."""
    shape = (cfg.cluster.nodes, cfg.cluster.workers_per_node)
    cpu = dict(net.cpu)
    if plan.parts:  # a PS method: partitions through servers, or all-reduced on one node
        costs = [cpu.get(("ps" if plan.servers else "allreduce", shape))]
        transport = cfg.method.transport
        if plan.servers and shape[1] > 1 and transport.get("local_reduce", True):
            costs.append(cpu.get((f"node_{transport.get('node_reduce', 'scatter')}", shape),
                                 FREE))
        sizes = [p.numel * ELEMENT_SIZE for ps in plan.parts for p in ps]
    else:
        costs = [cpu.get(("allreduce", shape))]
        sizes = [u.numel * ELEMENT_SIZE for u in plan.units]
    if costs[0] is None:
        return math.nan
    return sum(cost.seconds(n) for cost in costs for n in sizes)
