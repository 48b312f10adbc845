"""The parameter servers' queues: a node's PS path as stages (the threads that post and land
each unit), the links between a node and its servers, each server's in-order receive
stream per node and its engine lanes (network.ParameterServers before; fastqueues.py
writes the same steps over arrays).

A node's path (`NodePath`, methods/ps/node.py and scatter.py): the way out is the node's
reduce-scatter of each partition and the copy of its slices to the host, then the root
pushes; the way back is the pull, the copy back to the device and the all-gather. Each
thread of the path is a queue that runs its stages in sequence, partition after
partition. `inorder` (what main runs): one poster runs reduce-scatter and copy out for
every partition in turn, one lander waits for the pulls in posting order, copies back and
all-gathers, so a unit lands only after the unit posted before it. `full` (BytePS's core
loops, issue 40 item 4): a thread per stage, so partition p+1's reduce-scatter overlaps
p's copy, and pulls land as they complete. `harness.plan`'s stages and `simulate.trace`'s
lanes are these queues.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from harness.config.frozen import Config
from harness.predict.network import (
    REDUCER_THREADS,
    SERVER_CORES,
    Network,
    stretched,
)
from methods.costmodel import FREE, Cost
from methods.ps.server_queue import ThreadBinding


@dataclass(frozen=True)
class NodePath:
    """A node's PS path: its threads on the way out and back (each the stages it runs in
    sequence, named as its trace lane), and whether units land in posting order."""

    name: str
    out: tuple[tuple[str, tuple[str, ...]], ...]   # (lane, its stages), reduce-scatter first
    back: tuple[tuple[str, tuple[str, ...]], ...]  # (lane, its stages), copy in first
    in_order: bool  # one lander: a unit lands no earlier than the one posted before it


PATHS = {
    "inorder": NodePath("inorder", (("bus_up", ("reduce_scatter", "copy_out")),),
                        (("bus_down", ("copy_in", "all_gather")),), True),
    # a thread per stage, but a direction's stages move their bytes over the node's one
    # PCIe bus (its share of the fabric): one bus lane each way, so what the threads change
    # is the landing order (pulls land as they complete); their start-ups' overlap is not
    # modelled. A lane per stage, each at the bus's rate, made the study's PS methods 3-25%
    # faster than one bus allows (calibrated held-out max error 22.5% -> 53.5%).
    "full": NodePath("full", (("bus_up", ("reduce_scatter", "copy_out")),),
                     (("bus_down", ("copy_in", "all_gather")),), False),
}
DEFAULT_PATH = "full"  # what methods/ps/node.py runs (a thread per stage); inorder: before


def path_of(cfg: Config) -> NodePath:
    """The node path `cfg`'s PS method runs: BytePS's, a thread per stage (methods/ps/
    node.py and scatter.py run no other; `inorder`, the poster and lander they ran before,
    stays for comparison)."""
    return PATHS[DEFAULT_PATH]


def stage_costs(path: NodePath, nccl, copy) -> list[tuple]:
    """Per thread of `path`, out then back: (the bus's start-ups, bus bytes per byte of
    partition, the share of those that NCCL's kernels move). `nccl` and `copy`: bus bytes
    per byte of the reduce-scatter (or all-gather) and of the copies, floats or arrays
    (fastqueues.py's configurations); the first thread of each way that moves anything
    pays the start-up."""
    out = []
    for way in (path.out, path.back):
        startup = 1.0
        for _, stages in way:
            kernels = nccl * (1.0 if {"reduce_scatter", "all_gather"} & set(stages) else 0.0)
            moved = kernels + copy * (1.0 if {"copy_out", "copy_in"} & set(stages) else 0.0)
            has = (moved > 0) * 1.0
            out.append((startup * has, moved, kernels / (moved + (moved == 0))))
            startup = startup * (1.0 - has)
    return out


class ParameterServers:
    """Push every partition to its server, which sums the pushes and answers once all are in.

    Links are one-way queues: a node's uplink and downlink (a worker's own when nodes
    do not reduce locally), each server's downlink and uplink, and the node's path
    (`NodePath`): its way out (the workers reduce-scatter the partition and each copies
    its slice to host memory) and back (the copies back and the all-gather, BytePS),
    each of its threads a queue. Both directions stream at once over the one PCIe fabric
    of the node, whose rate the intra-node all-reduce fact gives, so each gets half of
    it. A queue is what it carries starting once it is free, and keeping it busy.

    Each server lands each node's pushes in order (methods/ps/server.py, its receives
    posted as their header arrives): where psbench measured a unit's partitions in
    flight on this shape and wire (`Network.ps_flight`), a partition's push starts no
    earlier than the one before it to that server started plus what a partition in
    flight costs there beyond the model's own queues (`_stream`: on Gloo the server's
    "ready to receive" crosses the link behind what the server sends that node).

    Each server sums on `engine_threads` lanes (BytePS's engine threads), a partition on
    the lane its key is bound to by BytePS's rule (the fewest bytes bound so far,
    partitions bound in plan order, methods/ps/server_queue.py): per round, one add per
    push but the first and one copy into the answer, each streaming 3 and 2 bytes of memory
    per byte at the lane's share of the server's memory (`Network.server_memory`; 0: not
    timed). The adds start once a second push is in, the last add and the copy follow the
    last push; the answer leaves once they are done.

    With `node_reduce="root"` (methods/ps/node.py) the whole unit is reduced to the root,
    which alone copies it to the host, before its first push, and copies it back and
    broadcasts it after its last pull: no partition of a unit overlaps the bus. While
    `log` is a list (simulate.trace), each queue's use appends (lane, unit, start, end).
    """

    def __init__(self, net: Network, parts: list[list[tuple[int, int]]], nodes: int,
                 per_node: int, servers: int, local_reduce: bool,
                 node_reduce: str = "scatter", engine_threads: int = 1,
                 slowdown: float = 0.0, path: NodePath = PATHS[DEFAULT_PATH]) -> None:
        """`parts`: per unit, (bytes, server index) of each partition; `local_reduce`: a
        node sums its workers' gradients and pushes once (BytePS); `slowdown`: the bus's
        GPU work runs 1 + slowdown times slower while the GPU computes (as Collectives')."""
        self.net, self.servers, self.slowdown, self.busy_until = net, servers, slowdown, 0.0
        self.path = path
        sharing = per_node if local_reduce else 1  # workers that share a partition
        whole = sharing > 1 and node_reduce == "root"
        # bytes over the bus per byte of partition, each way, at half the rate: scatter,
        # each worker's reduce-scatter (or all-gather) and the copy of its slice; root, the
        # root's reduce (or broadcast) and its copy of the whole partition
        nccl = 2 * (sharing - 1) / sharing  # the reduce-scatter's share (NCCL's kernels)
        copy = 2 * net.ps_host_copy / sharing  # the copies' (the copy engines: not slowed)
        bus_share = 2 * ((sharing - 1) / sharing + net.ps_host_copy) if whole else nccl + copy
        senders = nodes if local_reduce else nodes * per_node
        node_share = 1 if local_reduce else per_node
        ways = len(path.out) + len(path.back)
        # queues by index: node up, node down, the path's threads out then back, each
        # server's in, out, then each server's engine lanes (`_name`)
        self.names = ["node_up", "node_down", *(lane for lane, _ in path.out + path.back)] + [
            f"server{s}_{way}" for s in range(servers) for way in ("in", "out")]
        self.threads = engine_threads
        inter, intra = net.inter, net.intra
        sums = _Summing(net, senders, engine_threads)
        lanes = sums.lanes(parts, len(self.names))
        per_all, per_tail, lead = sums.factors
        wire = senders * inter.beta
        handling = _handling(net, (nodes, per_node), senders)
        stream = _stream(net, (nodes, per_node), senders, handling)
        self.stages = self._stages(intra, nccl, copy, bus_share and not whole)
        first_server = 2 + ways
        # per unit, per partition: (its seconds in each thread of the path, out and back:
        # bus_s[i]; node link seconds, server link seconds, the server's handling beyond
        # them (measured: `_handling`), its in-order stream's seconds (`_stream`), the
        # server's links, its engine lane, engine seconds in all, after the last push, and
        # the lead of its second push over its last); on the root path the bus is the
        # whole unit's, below
        self.steps = [[(self._bus(size), size * node_share * inter.beta, size * wire,
                        handling.seconds(size), stream.seconds(size), server,
                        first_server + 2 * server, first_server + 1 + 2 * server, lane,
                        size * per_all, size * per_tail, size * wire * lead)
                       for (size, server), lane in zip(unit, unit_lanes)]
                      for unit, unit_lanes in zip(parts, lanes)]
        self.free = [0.0] * (len(self.names) + servers * engine_threads)
        self.busy_s = [0.0] * len(self.free)
        self.streams = [0.0] * servers  # when each server's stream from the node is free
        self.landed = 0.0  # in order: when the unit posted last landed
        self.log: list | None = None
        # root: each unit's one reduce (and broadcast) and copy, before its first push and
        # after its last pull
        self.whole = [intra.seconds(sum(size for size, _ in unit) * bus_share) if whole
                      else 0.0 for unit in parts]

    def _stages(self, intra: Cost, nccl: float, copy: float, bus: bool
                ) -> list[tuple[int, float, float, float]]:
        """Per thread of the path, out then back: (queue index, start-up seconds, seconds
        per byte of partition, the share of its work that is NCCL's); none off the bus."""
        on = 1.0 if bus else 0.0
        return [(2 + i, on * alpha * intra.alpha, on * beta * intra.beta, gpu)
                for i, (alpha, beta, gpu) in enumerate(stage_costs(self.path, nccl, copy))]

    def _bus(self, size: int) -> tuple[float, ...]:
        """A partition's seconds in each thread of the path (out, then back)."""
        return tuple(alpha + size * beta if beta or alpha else 0.0
                     for _, alpha, beta, _ in self.stages)

    @property
    def busy(self) -> dict[str, float]:
        """Seconds each queue, and each engine lane that had work, was busy so far."""
        links = len(self.names)
        return {**dict(zip(self.names, self.busy_s)),
                **{self._name(i): b for i, b in enumerate(self.busy_s[links:], links) if b}}

    def _name(self, i: int) -> str:
        """Queue `i`'s name (server<s>_engine<t> for the lanes)."""
        if i < len(self.names):
            return self.names[i]
        server, thread = divmod(i - len(self.names), self.threads)
        return f"server{server}_engine{thread}"

    def _through(self, ways: range, bus: tuple[float, ...], t: float, used: list) -> float:
        """A partition through the path's threads `ways` in turn from `t`: when it is out."""
        free, busy, until = self.free, self.busy_s, self.busy_until
        for i in ways:
            seconds = bus[i]
            if seconds:
                lane, gpu = self.stages[i][0], self.stages[i][3]
                t = t if t > free[lane] else free[lane]
                if self.slowdown and gpu and t < until:
                    seconds = stretched(t, seconds * gpu, until, self.slowdown) + \
                        seconds * (1 - gpu)
                t += seconds
                free[lane] = t
                busy[lane] += seconds
                used.append((lane, seconds))
        return t

    def issue(self, unit: int, nbytes: int, t: float) -> float:
        """Every partition of `unit` pushed from `t` and pulled back; when the unit has
        landed. (The queues of the class docstring, written out: the simulator's
        innermost loop.)"""
        done, alpha, free, busy = t, self.net.inter.alpha, self.free, self.busy_s
        whole, log, streams = self.whole[unit], self.log, self.streams
        outs = range(len(self.path.out))
        backs = range(len(self.path.out), len(self.stages))
        first, last = 2, 2 + len(self.stages) - 1  # the root path's crossings
        if whole:  # root: the unit reduced and on the host before the first push
            t = (t if t > free[first] else free[first]) + whole
            free[first] = done = t
            busy[first] += whole
            if log is not None:
                log.append((self._name(first), unit, t - whole, t))
        for (bus, node, server, handle, flight, s, s_in, s_out, lane, summing, tail,
             lead) in self.steps[unit]:
            used: list = []
            start = self._through(outs, bus, t, used)
            if flight:  # the server's in-order stream from this node (`_stream`)
                start = start if start > streams[s] else streams[s]
                streams[s] = start + flight
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
            pulled = self._through(backs, bus, (out if out > down else down) + alpha, used)
            if pulled > done:
                done = pulled
            if log is not None:  # the queues this partition used, each until it was done
                log += [(self._name(i), unit, free[i] - spent, free[i])
                        for i, spent in ((0, node), (s_in, server + handle), (lane, summing),
                                         (s_out, server), (1, node), *used) if spent]
        if whole:  # root: back to the device and broadcast after the last pull
            done = (done if done > free[last] else free[last]) + whole
            free[last] = done
            busy[last] += whole
            if log is not None:
                log.append((self._name(last), unit, done - whole, done))
        if self.path.in_order:  # the lander: after the unit posted before it
            done = done if done > self.landed else self.landed
            self.landed = done
        return done

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
        return FREE
    return Cost(max(0.0, rt.alpha - 2 * net.inter.alpha),
                max(0.0, rt.beta - 2 * senders * net.inter.beta))


def _stream(net: Network, shape: tuple[int, int], senders: int, handling: Cost = FREE
            ) -> Cost:
    """A partition's seconds on its server's in-order stream from one node: psbench's
    flight on this shape and wire (K partitions of one unit in flight took K times the
    fit), less what the model's own queues give that flight, so that the model repeats
    the measurement: its pushes start a stream's seconds apart and the last ends one
    round trip (both messages' alpha, `senders` pushes and answers over the server's
    link, the server's `handling`) after its start, so K f(s) = (K - 1) x(s) + the round
    trip. Nothing unmeasured."""
    measured = dict(net.ps_flight).get(shape)
    if measured is None:
        return FREE
    fit, k = measured
    if k < 2:
        return FREE
    alpha = (k * fit.alpha - 2 * net.inter.alpha - handling.alpha) / (k - 1)
    beta = (k * fit.beta - 2 * senders * net.inter.beta - handling.beta) / (k - 1)
    return Cost(max(0.0, alpha), max(0.0, beta)) if math.isfinite(alpha + beta) else FREE


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
