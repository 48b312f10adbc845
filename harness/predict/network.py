"""The network of a prediction: intra- and inter-node links (alpha + beta * bytes) from a
real profile's facts or this machine's microbenchmark, the wire of its PS messages, the
all-reduce algorithms (ring, tree, hierarchical; on Horovod each may start on its
negotiation cycle), and the collective stream iterations queue on. The parameter servers'
queues are psqueues.py's."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from harness import config
from harness.config import gpus
from harness.config.frozen import Config
from harness.config.ranks import num_servers, num_workers
from harness.predict import links
from methods.costmodel import DEFAULT_FIT_SIZES as FIT_SIZES  # elements, as MG-WFBP fits
from methods.costmodel import FREE, Cost, least_squares

ELEMENT_SIZE = 4  # fp32 gradients
# The study's parameter servers, machines of their own (hosts gpu9 and up), assumed of the
# workers' kind: 2x Xeon Gold 6230, 20 cores and 6 channels of DDR4-2933 (140.8 GB/s, its
# spec sheet) per socket. BytePS sums on each engine thread with its CpuReducer's 4 OpenMP
# threads (BYTEPS_OMP_THREAD_PER_GPU's default, common/cpu_reducer.cc), each core taken
# to stream its share of the machine's memory bandwidth.
STUDY_SERVER_MEMORY_BYTES_PER_S = 2 * 140.8e9
SERVER_CORES = 40
REDUCER_THREADS = 4


# -- the network -------------------------------------------------------------------------

@dataclass(frozen=True)
class Network:
    name: str
    intra: Cost           # between the workers of one node
    inter: Cost           # between nodes, and to every parameter server
    allreduce: str        # ring | tree | hierarchical | best (the faster of ring and tree) |
                          # nccl24 (NCCL 2.4.8's tree below its threshold, its ring above)
    ps_host_copy: bool     # PS: GPU workers copy each partition to host memory and back
    server_memory: float = 0.0  # a server machine's memory bytes/s; 0: summing not timed
    gloo: tuple = ()  # ((nodes, workers per node), Cost): all-reduces measured (links.py)
    ps: tuple = ()    # the same, a push/pull round trip through the real server (links.py)
    # the wire PS messages use (a profile's `ps_wire`; this machine's: cluster.ps_wire)
    ps_wire: str = "gloo"
    ps_flight: tuple = ()  # ((nodes, workers per node), (Cost, partitions)): psbench's flight
    cpu: tuple = ()  # (((kind, (nodes, workers per node)), Cost): CPU seconds measured (links.py)


# The study's 4-GPU ring all-reduce on PCIe 3.0 (conf/network/ib100_rdma.yaml): 1.34 GB in
# 441 ms, 4.56 GB/s of bus bandwidth, 29% of PCIe 3.0 x16's 15.75 GB/s each way (its GPUs
# share the host's root complex). A fabric profile without an intra-node fact takes the
# GPU's own link (conf/gpu/) at that measured share for PCIe, and at NVLINK_SHARE for
# NVLink (assumed: not measured here or by the study).
STUDY_INTRA = {"gpus": 4, "bytes": 1.34e9, "seconds": 0.441}
PCIE_SHARE = 2 * 3 / 4 * STUDY_INTRA["bytes"] / STUDY_INTRA["seconds"] / 15.75e9
NVLINK_SHARE = 0.75


def network(cfg: Config) -> Network:
    """The link model of `cfg.network`: a real network's facts, or the microbenchmark's fit.
    A real network without an intra-node all-reduce fact (the fabrics) has the link of
    the GPU of simulate.compute between a node's GPUs (the study's PCIe 3.0 for measured
    compute)."""
    net = cfg.network
    if config.is_real_network(net):
        points = [(float(b), float(b) * 8 / (gbit * 1e9)) for b, gbit in net.inter_node.gbit_per_s]
        inter = least_squares(*zip(*points))
        return Network(net.name, Cost(net.intra_node.alpha_s, _intra_beta(cfg)), inter,
                       net.get("allreduce", "ring"), bool(net.get("ps_host_copy", False)),
                       STUDY_SERVER_MEMORY_BYTES_PER_S, ps_wire=net.get("ps_wire", "tcp"))
    wire = ps_wire(cfg)
    try:
        link = links.measured(cfg, ps_wire=wire)  # this machine's: the microbenchmarks of links.py
    except config.ConfigError:
        if moves(cfg):
            raise
        # a lone worker crosses no link: none need be measured
        return Network(net.name, FREE, FREE, "ring", False, ps_wire=wire)
    return Network(net.name, link.intra or link.link, link.link, "ring", False,
                   gloo=tuple(link.allreduce.items()), ps=tuple(link.ps.items()),
                   ps_wire=wire, ps_flight=tuple(link.ps_flight.items()),
                   cpu=tuple(link.cpu.items()))


def moves(cfg: Config) -> bool:
    """Whether anything of `cfg` crosses a link: more than one worker, or servers."""
    return num_workers(cfg) > 1 or num_servers(cfg) > 0


def ps_wire(cfg: Config) -> str:
    """The wire of `cfg`'s PS messages: a real network's profile says it (`ps_wire`: rdma,
    as BytePS's ps-lite RDMA van; tcp, ZeroMQ); on this machine's networks the run's own
    (cluster.ps_wire, gloo where the schema has no such key)."""
    if config.is_real_network(cfg.network):
        return str(cfg.network.get("ps_wire", "tcp"))
    return str(cfg.cluster.get("ps_wire", "gloo"))


def _intra_beta(cfg: Config) -> float:
    """Seconds per byte on each link of a node's ring all-reduce: the network's fact, else
    the GPU's link at its share."""
    fact = cfg.network.intra_node.get("allreduce")
    if fact is None and cfg.simulate.compute in gpus.table():
        gpu = gpus.table()[cfg.simulate.compute]
        share = NVLINK_SHARE if gpu.link.startswith("nvlink") else PCIE_SHARE
        return 1 / (gpu.link_gb_per_s * 1e9 * share)
    ar = fact or STUDY_INTRA  # a ring all-reduce: 2 (g - 1) / g of the bytes per link
    return ar["seconds"] / (2 * (ar["gpus"] - 1) / ar["gpus"] * ar["bytes"])


def key(cfg: Config) -> tuple[str, str]:
    """What a sweep's network depends on: its profile and the GPU (its intra-node link)."""
    return cfg.network.name, cfg.simulate.compute


def allreduce_s(net: Network, nbytes: int, *, nodes: int, per_node: int) -> float:
    """Seconds of one all-reduce of `nbytes` over nodes x per_node workers."""
    p = nodes * per_node
    if p == 1 or nbytes == 0:
        return 0.0
    for shape, cost in net.gloo:  # timed on this very shape: as Gloo runs it
        if shape == (nodes, per_node):
            return cost.seconds(nbytes)
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
    if net.allreduce == "nccl24":  # NCCL 2.4.8's own choice on PCIe (no NVLink), below
        return 2 * depth + moved * NCCL24_TREE_SLOWER if nbytes <= nccl24_tree_below(
            nodes, per_node) else ring
    return {"ring": ring, "tree": tree, "best": min(ring, tree)}[net.allreduce]


# NCCL 2.4.8 (src/init.cc, ncclTreeThreshold), the study's NCCL, on GPUs without NVLink:
# a multi-node all-reduce takes its double binary tree below a size and its ring above,
# from its own estimates: ring 5000 B/us and 6 us a step, tree 2/3 of the ring's bandwidth
# and 15 us per level across nodes plus 4 us per GPU within one.
NCCL24_TREE_SLOWER = 3 / 2  # the tree's bytes cost 1 / (2/3) of the ring's


def nccl24_tree_below(nodes: int, per_node: int) -> float:
    """The size (bytes) below which NCCL 2.4.8 runs an all-reduce of nodes x per_node
    GPUs (no NVLink) as a tree: ncclTreeThreshold's formula."""
    if nodes < 2:
        return 0.0
    ring_lat = 6.0 * (nodes * per_node - 1)
    tree_lat = 15.0 * math.log2(nodes) + 4.0 * (per_node - 1)
    ring_bw, tree_bw = 5000.0, 5000.0 * 2 / 3
    return max(0.0, ring_bw * tree_bw / (ring_bw - tree_bw) * (ring_lat - tree_lat))


def fitted_cost(net: Network, *, nodes: int, per_node: int) -> Cost:
    """alpha + beta * bytes fitted to this network's all-reduce (what MG-WFBP measures)."""
    fit_bytes = [n * ELEMENT_SIZE for n in FIT_SIZES]
    return least_squares(fit_bytes, [allreduce_s(net, b, nodes=nodes, per_node=per_node)
                                     for b in fit_bytes])


# -- communication: resources with a queue ---------------------------------------------------

def stretched(start: float, seconds: float, until: float, slowdown: float) -> float:
    """How long `seconds` of work starting at `start` takes when it runs 1 + `slowdown`
    times slower until `until` and at full speed after."""
    slow = (until - start) / (1 + slowdown)  # the work done before `until`
    return seconds * (1 + slowdown) if seconds <= slow else until - start + seconds - slow


class Collectives:
    """All-reduces run one at a time, in issue order (one communication stream).

    `seconds(unit, nbytes)` is the duration of unit `unit` (its first, when fused)
    moving `nbytes`, asked once per unit and size (every iteration moves the same). With
    a `cycle_s`, an all-reduce issued at t starts no earlier than the next multiple of
    it: Horovod's background loop negotiates the tensors that became ready once per
    cycle, then runs them. With a `slowdown`, an all-reduce progresses 1 + slowdown
    times slower while the GPU computes (until `busy_until`, which the iteration sets):
    its kernels share the GPU with the compute's (calibrate.py fits it). While `log` is a
    list (simulate.trace), each all-reduce appends (lane, unit, start, end) to it.
    """

    def __init__(self, seconds: Callable[[int, int], float], cycle_s: float = 0.0,
                 slowdown: float = 0.0) -> None:
        self.seconds = seconds
        self.cycle_s = cycle_s
        self.slowdown = slowdown
        self.busy_until = 0.0  # the GPU computes until then (set per iteration)
        self.free = 0.0
        self.busy_s = 0.0
        self.durations: dict[tuple[int, int], float] = {}
        self.log: list | None = None

    @property
    def busy(self) -> dict[str, float]:
        return {"collective": self.busy_s}

    def issue(self, unit: int, nbytes: int, t: float) -> float:
        """Unit `unit` moving `nbytes`, issued at `t`: when it is done."""
        duration = self.durations.get((unit, nbytes))
        if duration is None:
            duration = self.durations[unit, nbytes] = self.seconds(unit, nbytes)
        if self.cycle_s:
            t = math.ceil(t / self.cycle_s - 1e-9) * self.cycle_s
        start = t if t > self.free else self.free
        if self.slowdown and start < self.busy_until:
            duration = stretched(start, duration, self.busy_until, self.slowdown)
        self.free = start + duration
        self.busy_s += duration
        if self.log is not None:
            self.log.append(("collective", unit, self.free - duration, self.free))
        return self.free

    def issue_all(self, nbytes: list[int], ready: list[float]) -> list[float]:
        """`issue` of every unit in turn, unit i moving nbytes[i] from ready[i]."""
        return [self.issue(i, b, t) for i, (b, t) in enumerate(zip(nbytes, ready))]
