"""Parameter-server transport, worker side, as BytePS ran it: push partitions, pull sums.

Ranks [0, W) of the default group are workers, [W, W + S) servers
(harness/launch.py). Each communication unit is cut into partitions of at
most `partition_bytes` (BytePS: 4,096,000) with BytePS's keys, each owned by one
server by `assignment` (methods/layout.py). The servers (and a serverless node's
all-reduce) sum the workers' gradients; the scheduler divides the sum by W (`scale`).
Four switches, defaults as in the study:

- `local_reduce` (BytePS): the workers of a node aggregate each partition first, and
  the node's first worker (the root) alone pushes and pulls it: servers see one push
  per node per partition. One node then needs no server at all: the partitions are
  all-reduced over the node (BytePS on one machine). Off: every worker pushes its own
  gradients.
- `node_reduce`, how a node of several workers aggregates: `scatter` (BytePS's
  default, methods/ps/scatter.py): per partition, a reduce-scatter in the node, each
  worker's slice into the node's shared host buffer (methods/ps/shared.py), the root's
  push and pull from and into it, each slice back, an all-gather, pipelined so that a
  partition's reduce-scatter overlaps the previous one on the wire; or `root`
  (BytePS's BYTEPS_REDUCE_ROOTS): the unit reduced to the root, which copies it to
  the host, pushes, pulls and broadcasts it (methods/ps/node.py).
- `assignment`: `hash` (BytePS's djb2 of the key) or `balanced` (by bytes).
- `server_schedule` (BYTEPS_SERVER_ENABLE_SCHEDULE): each server sums first the
  key with the fewest pushes counted since its last push of a round arrived (BytePS's
  queue, methods/ps/server_queue.py); workers stay FIFO.
- `engine_threads` (BYTEPS_SERVER_ENGINE_THREAD): each server's summing threads, a queue
  each, a key bound to the one with the fewest bytes bound so far (the study ran 8).

The messages and their tags are methods/ps/wire.py; the host staging and the threads
that post and land each unit are methods/ps/node.py, their steps on the scatter path
methods/ps/scatter.py, the node's collectives in one order methods/ps/order.py.
`start` only records where the unit's gradients are and hands it to those threads.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from methods.base import GradBuffer, until_completed
from methods.layout import (
    ASSIGNMENTS,
    NODE_REDUCES,
    PARTITION_BYTES,
    Part,
    partitions,
    plan_summary,
)
from methods.plan import Unit
from methods.ps import wire
from methods.ps.node import HostStaging, Node, _Exchange, _Pipeline, node_staging
from methods.ps.scatter import ScatterPipeline
from methods.ps.wire import (
    CLOSE,
    CTRL_AHEAD,
    CTRL_TAG,
    DTYPES,
    LAYOUT_TAG,
    OPEN,
    STOP,
    header,
    naming_server,
)


def server_ranks(num_workers: int) -> list[int]:
    """Global ranks of the parameter servers: everything after the workers."""
    return list(range(num_workers, dist.get_world_size()))


def stop_servers(*, num_workers: int) -> None:
    """This worker is done: tell every server (each stops once all workers said so),
    once for each receive it keeps posted (wire.CTRL_AHEAD), so none is left behind."""
    _tell_servers(header(STOP), server_ranks(num_workers) * CTRL_AHEAD)


def _tell_servers(msg: torch.Tensor, servers: list[int], *, tag: int = CTRL_TAG) -> None:
    """Send `msg` to every server in `servers` and wait until it has left."""
    sends = []
    for server in servers:
        with naming_server(server):
            sends.append((wire.isend(msg, server, tag=tag), server))
    for work, server in sends:
        with naming_server(server):
            work.wait()


class _AllReduced:
    """The partitions of a unit all-reduced over a one-node job's workers (no servers)."""

    __slots__ = ("works", "timeout_s")

    def __init__(self, works: list[dist.Work], timeout_s: float) -> None:
        self.works, self.timeout_s = works, timeout_s

    def wait(self) -> None:
        for work in self.works:
            work.wait()

    def complete(self) -> None:
        for work in self.works:
            until_completed(work, timeout_s=self.timeout_s, what="a partition's all-reduce")

    def finished(self) -> bool:
        return all(work.is_completed() for work in self.works)


class PSTransport:
    """Push to and pull from the parameter servers, BytePS's way (module docstring)."""

    def __init__(self, *, group: dist.ProcessGroup | None = None,
                 partition_bytes: int = PARTITION_BYTES, local_reduce: bool = True,
                 assignment: str = "hash", server_schedule: bool = False,
                 node_reduce: str = "scatter", engine_threads: int = 1,
                 workers_per_node: int = 1, node_groups: tuple | None = None,
                 timeout_s: float | None = None) -> None:
        if partition_bytes <= 0:
            raise ValueError(f"transport partition_bytes={partition_bytes} is invalid; "
                             "it must be > 0")
        if assignment not in ASSIGNMENTS:
            raise ValueError(f"transport assignment={assignment!r} is unknown; choose one of: "
                             f"{', '.join(ASSIGNMENTS)}")
        if engine_threads < 1:
            raise ValueError(f"transport engine_threads={engine_threads} is invalid; it must "
                             "be >= 1")
        if node_reduce not in NODE_REDUCES:
            raise ValueError(f"transport node_reduce={node_reduce!r} is unknown; choose one "
                             f"of: {', '.join(NODE_REDUCES)}")
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        per_node = workers_per_node if local_reduce else 1
        self.nodes = self.size // per_node
        self.serverless = local_reduce and self.nodes == 1  # BytePS on one machine
        self.servers = [] if self.serverless else server_ranks(self.size)
        if not self.serverless and not self.servers:
            raise ValueError("the ps transport needs parameter servers, but the job has none; "
                             "set cluster.servers >= 1")
        self.node = Node(self.rank, 1 if self.serverless else per_node, node_groups)
        self.ordered = self.serverless or self.node.size > 1  # collectives in the node
        self.identity = self.serverless and self.size == 1  # nothing to move
        self.scale = 1.0 / self.size  # the pull is the sum: the scheduler divides it by W
        self.partition_bytes, self.assignment = partition_bytes, assignment
        self.local_reduce, self.server_schedule = local_reduce, server_schedule
        self.node_reduce, self.engine_threads = node_reduce, engine_threads
        self.scatter = node_reduce == "scatter" and self.node.size > 1 and not self.serverless
        self.timeout_s = 300.0 if timeout_s is None else timeout_s
        self.parts: list[list[Part]] = []
        self.described: dict[str, Any] = {}
        self.flat: torch.Tensor | None = None
        self.chunks: list[list[torch.Tensor]] = []  # serverless: each unit's partitions
        self.staging: HostStaging | None = None
        self.pipeline: _Pipeline | None = None
        self.warm = False  # the node's communicators made (`open`)

    def open(self, buffer: GradBuffer, units: list[Unit]) -> None:
        """Start a plan: cut its units into keyed partitions and tell each server its own.
        The first plan also makes the node's communicators (`Node.warm_up`), here on the
        main thread, before any thread of the plan issues a collective."""
        if self.parts:
            self.close()
        flat = buffer.flat
        parts = partitions(units, buffer.names, servers=len(self.servers),
                           part_elements=max(1, self.partition_bytes // flat.element_size()),
                           rule=self.assignment)
        self.parts = [[Part(p.key, p.start, p.end, self.servers[p.server] if self.servers
                            else -1) for p in ps] for ps in parts]
        self.described = plan_summary(parts, len(self.servers), flat.element_size(),
                                      per_node=self.node.size, node_reduce=self.node_reduce)
        self.flat = flat
        if self.serverless:  # each partition's slice made once, not per start
            self.chunks = [[flat[p.start : p.end] for p in ps] for ps in self.parts]
            return
        if not self.warm:
            self.node.warm_up(flat.device)
            self.warm = True
        self.staging = node_staging(flat, node=self.node, scatter=self.scatter,
                                    timeout_s=self.timeout_s)
        dtype = DTYPES.index(flat.dtype)
        for server in self.servers:
            layout = torch.tensor([[p.key, p.numel] for ps in self.parts for p in ps
                                   if p.server == server], dtype=torch.int64).reshape(-1)
            opening = [layout.numel() // 2, self.node.size, int(self.server_schedule),
                       self.engine_threads]
            _tell_servers(header(OPEN, opening, dtype), [server])
            _tell_servers(layout, [server], tag=LAYOUT_TAG)
        self.pipeline = (ScatterPipeline if self.scatter else _Pipeline)(self.servers, self.node)

    def start(self, chunk: torch.Tensor, *, key: int) -> _Exchange | _AllReduced:
        """Unit `key` on its way (module docstring); returns at once."""
        parts = self.parts[key]
        if self.serverless:
            return _AllReduced([dist.all_reduce(chunk, group=self.group, async_op=True)
                                for chunk in self.chunks[key]], self.timeout_s)
        job = _Exchange(parts, staging=self.staging, ready=self.staging.ready(),
                        timeout_s=self.timeout_s)
        self.pipeline.put(job)
        return job

    def close(self) -> None:
        """End the plan (every pull of it must be complete): its threads, then the servers'."""
        if self.pipeline is not None:
            pipeline, self.pipeline = self.pipeline, None
            pipeline.stop(self.timeout_s)  # raises if a copy may still run: staging kept
        if self.staging is not None:
            staging, self.staging = self.staging, None
            staging.close()  # its registration with CUDA ends with the plan
        if not self.parts:
            return
        self.parts = []
        if self.servers:
            _tell_servers(header(CLOSE), self.servers)

    def describe(self) -> dict[str, Any]:
        return {"transport": "ps", "workers": self.size, "nodes": self.nodes,
                "servers": len(self.servers), "partition_bytes": self.partition_bytes,
                "local_reduce": self.local_reduce, "node_reduce": self.node_reduce,
                "assignment": self.assignment,
                "server_schedule": self.server_schedule,
                "engine_threads": self.engine_threads, **self.described}

