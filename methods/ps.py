"""Parameter-server transport, worker side, as BytePS ran it: push partitions, pull sums.

Ranks [0, W) of the default group are workers, [W, W + S) servers
(harness/launch.py). Each communication unit is cut into partitions of at
most `partition_bytes` (BytePS: 4,096,000) with BytePS's keys, each owned by one
server by `assignment` (methods/layout.py). Gradients enter the buffer divided by W,
so the sum over workers is the average. Three switches, defaults as in the study:

- `local_reduce` (BytePS): the workers of a node first reduce each unit to the node's
  first worker (the root), which alone pushes and pulls, then broadcasts the result
  inside the node: servers see one push per node per partition. One node then needs
  no server at all: the partitions are all-reduced over the node (BytePS on one
  machine). Off: every worker pushes its own gradients.
- `assignment`: `hash` (BytePS's djb2 of the key) or `balanced` (by bytes).
- `server_schedule` (BYTEPS_SERVER_ENABLE_SCHEDULE): each server sums the key with
  the most pushes waiting first (methods/server.py); workers stay FIFO.

Messages are matched by (peer, tag), never by arrival order:

- control stream, tag CTRL_TAG, worker -> server, fixed-size int64 headers:
  OPEN (a plan starts: its keys and sizes follow on LAYOUT_TAG), PUSH (these
  keys' data follow, each on tag KEY_TAG + key), CLOSE (the plan ends), STOP
  (the worker is done). Every worker sends OPEN, CLOSE and STOP; only roots push.
- data, tag KEY_TAG + key: the root's partition; the server answers on the same tag
  with the sum over the nodes.

Servers are CPU processes (methods/server.py). Workers on GPUs stage their
gradients through a pinned host mirror of the flat buffer, copied on a stream
of its own; on CPU the flat buffer is its own mirror and nothing is copied.
`start` only records where the unit's gradients are and hands it to two threads
per plan (`_Pipeline`): a poster reduces it inside the node, copies it to the host
and posts its messages; a lander waits for its pulls in order, copies each partition
back and broadcasts it inside the node. The node's reduces and broadcasts run on
two groups of their own (one per thread), so each group sees one order on every
worker. Neither the gradient hooks nor the compute stream wait for any of it; CPU
and GPU workers take the same path.
"""

from __future__ import annotations

import functools
import queue
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
import torch.distributed as dist

from methods.base import GradBuffer, until_completed
from methods.layout import ASSIGNMENTS, Part, imbalance, partitions, server_bytes
from methods.plan import Unit

PARTITION_BYTES = 4_096_000  # BytePS's partition size in the study
CTRL_TAG, LAYOUT_TAG, KEY_TAG = 1, 2, 16
OPEN, PUSH, CLOSE, STOP = 1, 2, 3, 4
HEADER = 64  # int64 words: [op, count, dtype, values...]
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


def header(op: int, values: list[int] = (), dtype: int = 0) -> torch.Tensor:
    msg = torch.zeros(HEADER, dtype=torch.int64)
    msg[:3] = torch.tensor([op, len(values), dtype])
    msg[3 : 3 + len(values)] = torch.tensor(list(values), dtype=torch.int64)
    return msg


def server_ranks(num_workers: int) -> list[int]:
    """Global ranks of the parameter servers: everything after the workers."""
    return list(range(num_workers, dist.get_world_size()))


def stop_servers(*, num_workers: int) -> None:
    """This worker is done: tell every server (each stops once all workers said so)."""
    _tell_servers(header(STOP), server_ranks(num_workers))


def _tell_servers(msg: torch.Tensor, servers: list[int], *, tag: int = CTRL_TAG) -> None:
    """Send `msg` to every server in `servers` and wait until it has left."""
    sends = []
    for server in servers:
        with naming_server(server):
            sends.append((dist.isend(msg, dst=server, tag=tag), server))
    for work, server in sends:
        with naming_server(server):
            work.wait()


def server_name(server: int, key: int | None = None) -> str:
    return f"parameter server rank {server}" + (f" (key {key})" if key is not None else "")


@contextmanager
def naming(peer: str) -> Iterator[None]:
    """Re-raise a communication error with the peer it involves."""
    try:
        yield
    except RuntimeError as exc:
        first = (str(exc).strip().splitlines() or [repr(exc)])[0]
        raise RuntimeError(f"{peer} failed or did not answer: {first}") from exc


def naming_server(server: int, key: int | None = None):
    return naming(server_name(server, key))


class Node:
    """This worker's node for local aggregation (BytePS): its first worker (the root) pushes
    and pulls for all; the unit is reduced to the root before and broadcast after, each on
    a group of its own. A node of one worker does neither."""

    def __init__(self, rank: int, size: int, groups: tuple | None) -> None:
        if size > 1 and not groups:
            raise ValueError("node-local aggregation needs the node's process groups "
                             "(harness.launch makes them; pass node_groups)")
        self.size, self.root = size, rank - rank % size
        self.is_root = rank == self.root
        self.reduce_group, self.broadcast_group = groups if size > 1 else (None, None)
        self.name = f"the workers of the node of rank {self.root}"

    def reduce(self, chunk: torch.Tensor) -> None:
        """Sum the node's `chunk`s into the root's (on a GPU: ordered on the current stream)."""
        if self.size > 1:
            with naming(self.name):
                dist.reduce(chunk, dst=self.root, group=self.reduce_group, async_op=True).wait()

    def broadcast(self, chunk: torch.Tensor) -> None:
        """The root's `chunk` to every worker of the node."""
        if self.size > 1:
            with naming(self.name):
                dist.broadcast(chunk, src=self.root, group=self.broadcast_group,
                               async_op=True).wait()


class HostStaging:
    """Where pushes are read from and pulls land: the buffer itself on CPU, pinned memory on
    GPU. On GPU each direction has a copy stream of its own, as BytePS has: the way out
    (`side()`: node reduce, copy to host) and the way back (`side(back=True)`: copy to the
    device, node broadcast). With one stream the node's collectives would chain: a root's
    next reduce, waited on there, would hold back its broadcast of the unit before, which
    the other workers need before their next reduce. Events are None on CPU."""

    def __init__(self, flat: torch.Tensor) -> None:
        self.flat = flat
        self.on_device = flat.device.type != "cpu"
        self.host = torch.empty(flat.numel(), dtype=flat.dtype, pin_memory=True) \
            if self.on_device else flat
        self.out, self.back = (torch.cuda.Stream(flat.device), torch.cuda.Stream(flat.device)) \
            if self.on_device else (None, None)

    def ready(self) -> torch.cuda.Event | None:
        """The event of the end of the work queued so far on the current stream (gradients)."""
        return torch.cuda.current_stream(self.flat.device).record_event() \
            if self.on_device else None

    def side(self, *, back: bool = False):
        """Run what follows on the copy stream of the way out, or back (CPU: as it comes)."""
        return torch.cuda.stream(self.back if back else self.out) if self.on_device \
            else nullcontext()

    def to_host(self, start: int, end: int) -> torch.cuda.Event | None:
        """Queue the copy of [start, end) to the host on the way out, after what is queued
        there; returns the event of its end."""
        if not self.on_device:
            return None
        with self.side():
            self.host[start:end].copy_(self.flat[start:end], non_blocking=True)
        return self.out.record_event()

    def to_device(self, start: int, end: int) -> None:
        """Queue the copy of [start, end) back to the device, on the way back."""
        if self.on_device:
            with self.side(back=True):
                self.flat[start:end].copy_(self.host[start:end], non_blocking=True)

    def mark(self, *, back: bool = True) -> torch.cuda.Event | None:
        """The event of the end of everything queued so far on the way back (or out)."""
        if not self.on_device:
            return None
        return (self.back if back else self.out).record_event()

    def order_after(self, event: torch.cuda.Event | None) -> None:
        """Work queued on the caller's current stream from now on runs after `event`."""
        if event is not None:
            torch.cuda.current_stream(self.flat.device).wait_event(event)


def _finish(event: torch.cuda.Event | None) -> None:
    """Block until `event` has happened (CPU: there is nothing to wait for)."""
    if event is not None:
        event.synchronize()


class _Exchange:
    """One unit's way through the plan's `_Pipeline`: reduced in the node, pushed and
    pulled by the root, broadcast in the node.

    `wait` makes the caller's current stream wait for the unit's result (CPU: the
    average is in place); `complete` returns once it has landed. Both raise the
    error the pipeline met, naming the peer.
    """

    __slots__ = ("parts", "staging", "ready", "reduced", "landed", "works", "headers", "done",
                 "error", "at", "timeout_s")

    def __init__(self, parts: list[Part], *, staging: HostStaging,
                 ready: torch.cuda.Event | None, timeout_s: float) -> None:
        self.parts, self.staging, self.ready = parts, staging, ready
        self.reduced: torch.cuda.Event | None = None  # the node's reduce has read the unit
        self.landed: torch.cuda.Event | None = None  # the result on the device
        self.works: list[tuple[dist.Work, Part, bool]] = []  # (work, partition, is a pull)
        self.headers: list[torch.Tensor] = []  # alive until sent
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.at = server_name(parts[0].server, parts[0].key)  # the peer waited on
        self.timeout_s = timeout_s

    def chunk(self) -> torch.Tensor:
        return self.staging.flat[self.parts[0].start : self.parts[-1].end]

    def fail(self, exc: BaseException) -> None:
        self.error = exc
        self.done.set()

    def wait(self) -> None:
        self._landed()
        self.staging.order_after(self.landed)

    def complete(self) -> None:
        self._landed()
        _finish(self.landed)

    def _landed(self) -> None:
        if not self.done.wait(self.timeout_s):
            raise RuntimeError(f"{self.at} failed or did not answer: timed out after "
                               f"{self.timeout_s:g} s")
        if self.error is not None:
            raise RuntimeError(str(self.error)) from self.error


def _post(job: _Exchange, *, node: Node, servers: list[int]) -> None:
    """Reduce the unit to the root; there, once it is on the host: per server its control
    header, then per partition the push and the pull (the server reads the header first,
    then the data it announces)."""
    with job.staging.side():
        job.staging.order_after(job.ready)
        job.at = node.name
        node.reduce(job.chunk())
    job.reduced = job.staging.mark(back=False)
    if not node.is_root:
        return
    _finish(job.staging.to_host(job.parts[0].start, job.parts[-1].end))
    host = job.staging.host
    for server in servers:
        mine = [p for p in job.parts if p.server == server]
        for i in range(0, len(mine), HEADER - 3):
            batch = mine[i : i + HEADER - 3]
            msg = header(PUSH, [p.key for p in batch])
            job.headers.append(msg)
            job.at = server_name(server, batch[0].key)
            with naming_server(server):
                job.works.append((dist.isend(msg, dst=server, tag=CTRL_TAG), batch[0], False))
                for p in batch:
                    data = host[p.start : p.end]
                    job.works.append((dist.isend(data, dst=server, tag=KEY_TAG + p.key), p,
                                      False))
                    job.works.append((dist.irecv(data, src=server, tag=KEY_TAG + p.key), p,
                                      True))


def _land(job: _Exchange, *, node: Node) -> None:
    """Wait for the unit's messages in posting order, copying each pull back as it lands;
    then broadcast the result inside the node."""
    with job.staging.side(back=True):  # nothing lands before the reduce has read the unit
        job.staging.order_after(job.reduced)
    for work, part, pull in job.works:
        job.at = server_name(part.server, part.key)
        with naming_server(part.server, part.key):
            work.wait()
        if pull:
            job.staging.to_device(part.start, part.end)
    with job.staging.side(back=True):
        job.at = node.name
        node.broadcast(job.chunk())
    job.landed = job.staging.mark()
    job.done.set()


class _Stage:
    """A thread that runs `step` on each job put to it, in order. After its first error
    it fails every later job with that error instead."""

    def __init__(self, step: Callable[[_Exchange], None], *, name: str) -> None:
        self.step, self.name = step, name
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True, name=name)
        self.thread.start()

    def put(self, job: _Exchange) -> None:
        self.jobs.put(job)

    def _run(self) -> None:
        while (job := self.jobs.get()) is not None:
            if self.error is None:
                try:
                    self.step(job)
                    continue
                except BaseException as exc:  # noqa: BLE001 - handed to the job's waiter
                    self.error = exc
            job.fail(self.error)

    def stop(self, timeout_s: float) -> None:
        """Finish every job put so far, then end the thread."""
        self.jobs.put(None)
        self.thread.join(timeout_s)
        if self.thread.is_alive():
            raise TimeoutError(f"the {self.name} thread did not finish within {timeout_s:g} s")


class _Pipeline:
    """One plan's two threads: the poster reduces and posts a unit and hands it to the
    lander, which waits for its messages in order and broadcasts it."""

    def __init__(self, servers: list[int], node: Node) -> None:
        self.lander = _Stage(functools.partial(_land, node=node), name="ps-lander")
        self.poster = _Stage(functools.partial(_post_and_hand, node=node, servers=servers,
                                               lander=self.lander), name="ps-poster")

    def put(self, job: _Exchange) -> None:
        self.poster.put(job)

    def stop(self, timeout_s: float) -> None:
        """Post and land everything queued (nothing is left behind), then end both threads."""
        self.poster.stop(timeout_s)
        self.lander.stop(timeout_s)


def _post_and_hand(job: _Exchange, *, node: Node, servers: list[int], lander: _Stage) -> None:
    _post(job, node=node, servers=servers)
    lander.put(job)


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


class PSTransport:
    """Push to and pull from the parameter servers, BytePS's way (module docstring)."""

    def __init__(self, *, group: dist.ProcessGroup | None = None,
                 partition_bytes: int = PARTITION_BYTES, local_reduce: bool = True,
                 assignment: str = "hash", server_schedule: bool = False,
                 workers_per_node: int = 1, node_groups: tuple | None = None,
                 timeout_s: float | None = None) -> None:
        if partition_bytes <= 0:
            raise ValueError(f"transport partition_bytes={partition_bytes} is invalid; "
                             "it must be > 0")
        if assignment not in ASSIGNMENTS:
            raise ValueError(f"transport assignment={assignment!r} is unknown; choose one of: "
                             f"{', '.join(ASSIGNMENTS)}")
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
        self.scale = 1.0 / self.size  # every contribution pre-divided: the sum is the average
        self.partition_bytes, self.assignment = partition_bytes, assignment
        self.local_reduce, self.server_schedule = local_reduce, server_schedule
        self.timeout_s = 300.0 if timeout_s is None else timeout_s
        self.parts: list[list[Part]] = []
        self.described: dict[str, Any] = {}
        self.flat: torch.Tensor | None = None
        self.staging: HostStaging | None = None
        self.pipeline: _Pipeline | None = None

    def open(self, buffer: GradBuffer, units: list[Unit]) -> None:
        """Start a plan: cut its units into keyed partitions and tell each server its own."""
        if self.parts:
            self.close()
        flat = buffer.flat
        parts = partitions(units, buffer.names, servers=len(self.servers),
                           part_elements=max(1, self.partition_bytes // flat.element_size()),
                           rule=self.assignment)
        self.parts = [[Part(p.key, p.start, p.end, self.servers[p.server] if self.servers
                            else -1) for p in ps] for ps in parts]
        self.described = plan_summary(parts, len(self.servers), flat.element_size())
        self.flat = flat
        if self.serverless:
            return
        self.staging = self.staging if self.staging and self.staging.flat is flat \
            else HostStaging(flat)
        dtype = DTYPES.index(flat.dtype)
        for server in self.servers:
            layout = torch.tensor([[p.key, p.numel] for ps in self.parts for p in ps
                                   if p.server == server], dtype=torch.int64).reshape(-1)
            opening = [layout.numel() // 2, self.node.size, int(self.server_schedule)]
            _tell_servers(header(OPEN, opening, dtype), [server])
            _tell_servers(layout, [server], tag=LAYOUT_TAG)
        self.pipeline = _Pipeline(self.servers, self.node)

    def start(self, chunk: torch.Tensor, *, key: int) -> _Exchange | _AllReduced:
        """Unit `key` on its way (module docstring); returns at once."""
        parts = self.parts[key]
        if self.serverless:
            return _AllReduced([dist.all_reduce(self.flat[p.start : p.end], group=self.group,
                                                async_op=True) for p in parts], self.timeout_s)
        job = _Exchange(parts, staging=self.staging, ready=self.staging.ready(),
                        timeout_s=self.timeout_s)
        self.pipeline.put(job)
        return job

    def close(self) -> None:
        """End the plan (every pull of it must be complete): its threads, then the servers'."""
        if self.pipeline is not None:
            pipeline, self.pipeline = self.pipeline, None
            pipeline.stop(self.timeout_s)
        if not self.parts:
            return
        self.parts = []
        if self.servers:
            _tell_servers(header(CLOSE), self.servers)

    def describe(self) -> dict[str, Any]:
        return {"transport": "ps", "workers": self.size, "nodes": self.nodes,
                "servers": len(self.servers), "partition_bytes": self.partition_bytes,
                "local_reduce": self.local_reduce, "assignment": self.assignment,
                "server_schedule": self.server_schedule, **self.described}


def plan_summary(parts: list[list[Part]], servers: int, element_size: int) -> dict[str, Any]:
    """Partitions, and with servers the bytes each receives from a node and busiest / mean."""
    out: dict[str, Any] = {"partitions": sum(len(ps) for ps in parts)}
    if servers:
        load = server_bytes(parts, servers, element_size)
        out |= {"server_bytes": load, "busiest_over_mean": round(imbalance(load), 4)}
    return out
