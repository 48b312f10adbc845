"""The network of a prediction: intra- and inter-node links (alpha + beta * bytes) from a
real profile's facts or this machine's microbenchmark, the all-reduce algorithms
(ring, tree, hierarchical; on Horovod each may start on its negotiation cycle), and the
queued resources iterations use: the collective streams and the parameter servers, each
behind its own link and summing on its engine threads."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from harness import config
from harness.config import gpus
from harness.config.frozen import Config
from harness.predict import links
from methods.costmodel import DEFAULT_FIT_SIZES as FIT_SIZES  # elements, as MG-WFBP fits
from methods.costmodel import Cost, least_squares
from methods.ps.server_queue import ThreadBinding

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
    allreduce: str        # ring | tree | hierarchical | best (the faster of ring and tree)
    ps_host_copy: bool     # PS: GPU workers copy each partition to host memory and back
    server_memory: float = 0.0  # a server machine's memory bytes/s; 0: summing not timed
    gloo: tuple = ()  # ((nodes, workers per node), Cost): all-reduces measured (links.py)
    ps: tuple = ()    # the same, a push/pull round trip through the real server (links.py)


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
                       STUDY_SERVER_MEMORY_BYTES_PER_S)
    link = links.measured(cfg)  # this machine's: the microbenchmarks of links.py
    return Network(net.name, link.intra or link.link, link.link, "ring", False,
                   gloo=tuple(link.allreduce.items()), ps=tuple(link.ps.items()))


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
    return {"ring": ring, "tree": tree, "best": min(ring, tree)}[net.allreduce]


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


class ParameterServers:
    """Push every partition to its server, which sums the pushes and answers once all are in.

    Links are one-way queues: a node's uplink and downlink (a worker's own when nodes
    do not reduce locally), each server's downlink and uplink, and the node's bus
    (intra-node links) up and down. Up: the node's workers reduce-scatter the partition
    and each copies its slice to host memory; down: the copies back and the all-gather
    (BytePS). Both directions stream at once over the one PCIe fabric of the node, whose
    rate the intra-node all-reduce fact gives, so each gets half of it. A link is a
    queue: what it carries starts once the link is free, and keeps it busy.

    Each server sums on `engine_threads` lanes (BytePS's engine threads, methods/ps/server.py),
    a partition on the lane its key is bound to by BytePS's rule (the fewest bytes bound so
    far, partitions bound in plan order, methods/ps/server_queue.py): per round, one add per
    push but the first and one copy into the answer, each streaming 3 and 2 bytes of memory
    per byte at the lane's share of the server's memory (`Network.server_memory`; 0: not
    timed). The adds start once a second push is in, the last add and the copy follow the
    last push; the answer leaves once they are done.

    With `node_reduce="root"` (methods/ps/node.py) the whole unit is reduced to the root,
    which alone copies it to the host, before its first push, and copies it back and
    broadcasts it after its last pull: no partition of a unit overlaps the bus. While
    `log` is a list (simulate.trace), each link's use appends (link, unit, start, end).
    """

    def __init__(self, net: Network, parts: list[list[tuple[int, int]]], nodes: int,
                 per_node: int, servers: int, local_reduce: bool,
                 node_reduce: str = "scatter", engine_threads: int = 1,
                 slowdown: float = 0.0) -> None:
        """`parts`: per unit, (bytes, server index) of each partition; `local_reduce`: a
        node sums its workers' gradients and pushes once (BytePS); `slowdown`: the bus's
        GPU work runs 1 + slowdown times slower while the GPU computes (as Collectives')."""
        self.net, self.servers, self.slowdown, self.busy_until = net, servers, slowdown, 0.0
        sharing = per_node if local_reduce else 1  # workers that share a partition
        whole = sharing > 1 and node_reduce == "root"
        # bytes over the bus per byte of partition, each way, at half the rate: scatter,
        # each worker's reduce-scatter (or all-gather) and the copy of its slice; root, the
        # root's reduce (or broadcast) and its copy of the whole partition
        bus_share = 2 * ((sharing - 1) / sharing + net.ps_host_copy) if whole else \
            2 * ((sharing - 1) + net.ps_host_copy) / sharing
        # of the bus's work, the share NCCL's kernels do (the rest is copies, which the
        # GPU's copy engines make: not slowed beside compute)
        nccl = (sharing - 1) / sharing
        self.gpu_share = nccl / (nccl + net.ps_host_copy) if nccl else 0.0
        senders = nodes if local_reduce else nodes * per_node
        node_share = 1 if local_reduce else per_node
        # links by index: node up, node down, bus up, bus down, each server's in, out, then
        # each server's engine lanes (`_name`)
        self.names = ["node_up", "node_down", "bus_up", "bus_down"] + [
            f"server{s}_{way}" for s in range(servers) for way in ("in", "out")]
        self.threads = engine_threads
        inter, intra = net.inter, net.intra
        sums = _Summing(net, senders, engine_threads)
        lanes = sums.lanes(parts, len(self.names))
        per_all, per_tail, lead = sums.factors
        wire = senders * inter.beta
        handling = _handling(net, (nodes, per_node), senders)
        # per unit, per partition: (bus seconds, node link seconds, server link seconds, the
        # server's handling beyond them (measured: `_handling`), the server's links, its
        # engine lane, engine seconds in all, after the last push, and the lead of its
        # second push over its last); on the root path the bus is the whole unit's, below
        self.steps = [[(intra.seconds(size * bus_share) if bus_share and not whole else 0.0,
                        size * node_share * inter.beta, size * wire, handling.seconds(size),
                        4 + 2 * server,
                        5 + 2 * server, lane, size * per_all, size * per_tail, size * wire * lead)
                       for (size, server), lane in zip(unit, unit_lanes)]
                      for unit, unit_lanes in zip(parts, lanes)]
        self.free = [0.0] * (len(self.names) + servers * engine_threads)
        self.busy_s = [0.0] * len(self.free)
        self.log: list | None = None
        # root: each unit's one reduce (and broadcast) and copy, before its first push and
        # after its last pull
        self.whole = [intra.seconds(sum(size for size, _ in unit) * bus_share) if whole
                      else 0.0 for unit in parts]

    @property
    def busy(self) -> dict[str, float]:
        """Seconds each link, and each engine lane that had work, was busy so far."""
        links = len(self.names)
        return {**dict(zip(self.names, self.busy_s)),
                **{self._name(i): b for i, b in enumerate(self.busy_s[links:], links) if b}}

    def _name(self, i: int) -> str:
        """Link or lane `i`'s name (server<s>_engine<t> for the lanes)."""
        if i < len(self.names):
            return self.names[i]
        server, thread = divmod(i - len(self.names), self.threads)
        return f"server{server}_engine{thread}"

    def issue(self, unit: int, nbytes: int, t: float) -> float:
        """Every partition of `unit` pushed from `t` and pulled back; when the last is in.
        (The queues of the class docstring, written out: the simulator's innermost loop.)"""
        done, alpha, free, busy = t, self.net.inter.alpha, self.free, self.busy_s
        whole, log, slowdown, until = self.whole[unit], self.log, self.slowdown, self.busy_until
        if whole:  # root: the unit reduced and on the host before the first push
            t = (t if t > free[2] else free[2]) + whole
            free[2] = done = t
            busy[2] += whole
            if log is not None:
                log.append((self._name(2), unit, t - whole, t))
        for bus, node, server, handle, s_in, s_out, lane, summing, tail, lead in self.steps[unit]:
            start, up_bus, down_bus = t, bus, bus
            if bus:  # bus up
                start = t if t > free[2] else free[2]
                if slowdown and start < until:
                    up_bus = self._slowed(start, bus, until)
                start += up_bus
                free[2] = start
                busy[2] += up_bus
            up = (start if start > free[0] else free[0]) + node  # node up
            free[0] = up
            busy[0] += node
            into = (start if start > free[s_in] else free[s_in]) + server + handle  # server in
            free[s_in] = into
            busy[s_in] += server + handle
            pushed = (up if up > into else into) + alpha
            if summing:  # the engine lane: from the second push, the rest after the last
                begun = pushed - lead
                summed = (begun if begun > free[lane] else free[lane]) + summing
                if summed < pushed + tail:
                    summed = pushed + tail
                free[lane] = summed
                busy[lane] += summing
            else:
                summed = pushed
            out = (summed if summed > free[s_out] else free[s_out]) + server  # server out
            free[s_out] = out
            busy[s_out] += server
            down = (summed if summed > free[1] else free[1]) + node  # node down
            free[1] = down
            busy[1] += node
            pulled = (out if out > down else down) + alpha
            if bus:  # bus down
                pulled = pulled if pulled > free[3] else free[3]
                if slowdown and pulled < until:
                    down_bus = self._slowed(pulled, bus, until)
                pulled += down_bus
                free[3] = pulled
                busy[3] += down_bus
            if pulled > done:
                done = pulled
            if log is not None:  # the links this partition used, each until it was done
                log += [(self._name(i), unit, free[i] - spent, free[i])
                        for i, spent in ((2, up_bus), (0, node), (s_in, server + handle),
                                         (lane, summing), (s_out, server), (1, node),
                                         (3, down_bus)) if spent]
        if whole:  # root: back to the device and broadcast after the last pull
            done = (done if done > free[3] else free[3]) + whole
            free[3] = done
            busy[3] += whole
            if log is not None:
                log.append((self._name(3), unit, done - whole, done))
        return done

    def _slowed(self, start: float, bus: float, until: float) -> float:
        """A partition's `bus` seconds starting at `start`, its NCCL share slowed until
        `until`, its copies not."""
        gpu = bus * self.gpu_share
        return stretched(start, gpu, until, self.slowdown) + bus - gpu

    def issue_all(self, nbytes: list[int], ready: list[float]) -> list[float]:
        """`issue` of every unit in turn, unit i moving nbytes[i] from ready[i]."""
        issue = self.issue
        return [issue(i, b, t) for i, (b, t) in enumerate(zip(nbytes, ready))]


def _handling(net: Network, shape: tuple[int, int], senders: int) -> Cost:
    """A partition's cost on its server beyond its messages: the round trip measured
    through the real server on this shape (links.py) less the two messages' alpha and the
    bytes of `senders` pushes and answers over the server's link; nothing unmeasured."""
    rt = dict(net.ps).get(shape)
    if rt is None:
        return Cost(0.0, 0.0)
    return Cost(max(0.0, rt.alpha - 2 * net.inter.alpha),
                max(0.0, rt.beta - 2 * senders * net.inter.beta))


class _Summing:
    """A server's engine work per partition and the lane it runs on (ParameterServers)."""

    def __init__(self, net: Network, senders: int, threads: int) -> None:
        share = min(REDUCER_THREADS / SERVER_CORES, 1 / threads)  # of the server's memory
        per_byte = 1 / (net.server_memory * share) if net.server_memory else 0.0
        adds = senders - 1  # one add per push but the first, then a copy: 3 and 2 bytes
        self.threads = threads
        # engine seconds per byte of partition, in all and after the last push; the second
        # push's lead over the last, per second the pushes take to come in
        self.factors = ((3 * adds + 2) * per_byte, (3 * min(adds, 1) + 2) * per_byte,
                        (adds - 1) / senders if adds else 0.0)

    def lanes(self, parts: list[list[tuple[int, int]]], first: int) -> list[list[int]]:
        """Per unit, each partition's lane, `first` + server x threads + its thread (0s
        when summing is not timed): each server binds its partitions in plan order, every
        partition a key of its own (methods/ps/server_queue.py's rule)."""
        if not self.factors[0]:
            return [[0] * len(unit) for unit in parts]
        sizes: dict[int, list[int]] = {}
        for unit in parts:
            for size, server in unit:
                sizes.setdefault(server, []).append(size)
        lanes = {server: iter([first + server * self.threads + t
                               for t in ThreadBinding(self.threads).bind_new(of)])
                 for server, of in sizes.items()}
        return [[next(lanes[server]) for _, server in unit] for unit in parts]
