"""Parameter-server transport, worker side: push partitions, pull their averages.

Ranks [0, W) of the default group are workers, [W, W + S) servers
(harness/launch.py). Each communication unit is cut into partitions of at
most `partition_bytes` (BytePS: 4,096,000), each owned by one server by a
deterministic balanced rule (`assign`). Messages are matched by (peer, tag),
never by arrival order:

- control stream, tag CTRL_TAG, worker -> server, fixed-size int64 headers:
  OPEN (a plan starts: the server's keys and sizes follow on LAYOUT_TAG),
  PUSH (these keys' data follow, each on tag KEY_TAG + key), CLOSE (the plan
  ends), STOP (the worker is done).
- data, tag KEY_TAG + key: the worker's gradient partition; the server answers
  on the same tag with the average over the W workers.

Servers are CPU processes (methods/server.py). Workers on GPUs stage their
gradients through a pinned host mirror of the flat buffer, copied on a stream
of its own; on CPU the flat buffer is its own mirror and nothing is copied.
`start` only queues a unit's copy to the host and hands the unit to two
threads per plan (`_Pipeline`): a poster posts its messages once the copy is
done, a lander waits for its pulls in order and queues each partition's copy
back, so neither the gradient hooks nor the compute stream wait for a copy.
CPU and GPU workers take the same path through both threads.
"""

from __future__ import annotations

import functools
import queue
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from methods.base import GradBuffer
from methods.plan import Unit

PARTITION_BYTES = 4_096_000  # BytePS's partition size in the study
CTRL_TAG, LAYOUT_TAG, KEY_TAG = 1, 2, 16
OPEN, PUSH, CLOSE, STOP = 1, 2, 3, 4
HEADER = 64  # int64 words: [op, count, dtype, keys...]
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


@dataclass(frozen=True)
class Part:
    """One server partition: elements [start, end) of the flat buffer, owned by `server`."""

    key: int
    start: int
    end: int
    server: int  # global rank

    @property
    def numel(self) -> int:
        return self.end - self.start


def cut(units: list[Unit], part_elements: int) -> list[list[tuple[int, int]]]:
    """Each unit's (start, end) partitions of at most `part_elements` elements."""
    return [[(s, min(s + part_elements, u.end)) for s in range(u.start, u.end, part_elements)]
            for u in units]


def assign(numels: list[int], servers: list[int]) -> list[int]:
    """Owner of each partition (in key order): the least-loaded server so far, lowest on ties."""
    load = {s: 0 for s in servers}
    owners = []
    for n in numels:
        owner = min(servers, key=lambda s: (load[s], s))
        load[owner] += n
        owners.append(owner)
    return owners


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


@contextmanager
def naming_server(server: int, key: int | None = None) -> Iterator[None]:
    """Re-raise a communication error with the server it involves."""
    try:
        yield
    except RuntimeError as exc:
        what = f" (key {key})" if key is not None else ""
        first = (str(exc).strip().splitlines() or [repr(exc)])[0]
        raise RuntimeError(f"parameter server rank {server} failed or did not answer{what}: "
                           f"{first}") from exc


class HostStaging:
    """Where pushes are read from and pulls land: the buffer itself on CPU, pinned memory on
    GPU, filled and emptied on a copy stream of its own. Events are None on CPU."""

    def __init__(self, flat: torch.Tensor) -> None:
        self.flat = flat
        self.on_device = flat.device.type != "cpu"
        self.host = torch.empty(flat.numel(), dtype=flat.dtype, pin_memory=True) \
            if self.on_device else flat
        self.stream = torch.cuda.Stream(flat.device) if self.on_device else None

    def to_host(self, start: int, end: int) -> torch.cuda.Event | None:
        """Queue the copy of [start, end) to the host after the work queued so far on the
        current stream (the gradients); returns the event of its end."""
        if not self.on_device:
            return None
        self.stream.wait_stream(torch.cuda.current_stream(self.flat.device))
        with torch.cuda.stream(self.stream):
            self.host[start:end].copy_(self.flat[start:end], non_blocking=True)
        return self.stream.record_event()

    def to_device(self, start: int, end: int) -> None:
        """Queue the copy of [start, end) back to the device, on the copy stream."""
        if self.on_device:
            with torch.cuda.stream(self.stream):
                self.flat[start:end].copy_(self.host[start:end], non_blocking=True)

    def mark(self) -> torch.cuda.Event | None:
        """The event of the end of every copy queued so far."""
        return self.stream.record_event() if self.on_device else None

    def order_after(self, event: torch.cuda.Event | None) -> None:
        """Work queued on the caller's current stream from now on runs after `event`."""
        if event is not None:
            torch.cuda.current_stream(self.flat.device).wait_event(event)


def _finish(event: torch.cuda.Event | None) -> None:
    """Block until `event` has happened (CPU: there is nothing to wait for)."""
    if event is not None:
        event.synchronize()


class _Exchange:
    """The pushes and pulls of one unit, posted and landed by the plan's `_Pipeline`.

    `wait` makes the caller's current stream wait for the unit's copy back (CPU: the
    average is in place); `complete` returns once that copy is done. Both raise the
    error the pipeline met, naming the server.
    """

    __slots__ = ("parts", "staging", "copied", "landed", "works", "headers", "done", "error",
                 "at", "timeout_s")

    def __init__(self, parts: list[Part], *, staging: HostStaging,
                 copied: torch.cuda.Event | None, timeout_s: float) -> None:
        self.parts, self.staging, self.copied = parts, staging, copied
        self.landed: torch.cuda.Event | None = None  # the copy back, once the pulls landed
        self.works: list[tuple[dist.Work, Part, bool]] = []  # (work, partition, is a pull)
        self.headers: list[torch.Tensor] = []  # alive until sent
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.at = parts[0]  # the partition in progress, for error messages
        self.timeout_s = timeout_s

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
            raise RuntimeError(f"parameter server rank {self.at.server} failed or did not "
                               f"answer (key {self.at.key}): no answer within "
                               f"{self.timeout_s:g} s")
        if self.error is not None:
            raise RuntimeError(str(self.error)) from self.error


def _post(job: _Exchange, *, servers: list[int]) -> None:
    """Once the unit is on the host: per server its control header, then per partition the
    push and the pull (the server reads the header first, then the data it announces)."""
    _finish(job.copied)
    host = job.staging.host
    for server in servers:
        mine = [p for p in job.parts if p.server == server]
        for i in range(0, len(mine), HEADER - 3):
            batch = mine[i : i + HEADER - 3]
            msg = header(PUSH, [p.key for p in batch])
            job.headers.append(msg)
            job.at = batch[0]
            with naming_server(server):
                job.works.append((dist.isend(msg, dst=server, tag=CTRL_TAG), batch[0], False))
                for p in batch:
                    data = host[p.start : p.end]
                    job.works.append((dist.isend(data, dst=server, tag=KEY_TAG + p.key), p,
                                      False))
                    job.works.append((dist.irecv(data, src=server, tag=KEY_TAG + p.key), p,
                                      True))


def _land(job: _Exchange) -> None:
    """Wait for the unit's messages in posting order; copy each pull back as it lands."""
    for work, part, pull in job.works:
        job.at = part
        with naming_server(part.server, part.key):
            work.wait()
        if pull:
            job.staging.to_device(part.start, part.end)
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
    """One plan's two threads: the poster posts a unit's messages once its copy to the host
    is done and hands it to the lander, which waits for them in order."""

    def __init__(self, servers: list[int]) -> None:
        self.lander = _Stage(_land, name="ps-lander")
        self.poster = _Stage(functools.partial(_post_and_hand, servers=servers,
                                               lander=self.lander), name="ps-poster")

    def put(self, job: _Exchange) -> None:
        self.poster.put(job)

    def stop(self, timeout_s: float) -> None:
        """Post and land everything queued (nothing is left behind), then end both threads."""
        self.poster.stop(timeout_s)
        self.lander.stop(timeout_s)


def _post_and_hand(job: _Exchange, *, servers: list[int], lander: _Stage) -> None:
    _post(job, servers=servers)
    lander.put(job)


class PSTransport:
    """Push to and pull from the parameter servers; a unit's partitions go to their owners."""

    ordered = False  # matched by (peer, key): any issue order works
    identity = False  # even one worker's gradients travel to the servers and back
    scale = 1.0  # the servers average

    def __init__(self, *, group: dist.ProcessGroup | None = None,
                 partition_bytes: int = PARTITION_BYTES, timeout_s: float | None = None) -> None:
        if partition_bytes <= 0:
            raise ValueError(f"transport partition_bytes={partition_bytes} is invalid; "
                             "it must be > 0")
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.servers = server_ranks(self.size)
        if not self.servers:
            raise ValueError("the ps transport needs parameter servers, but the job has none; "
                             "set cluster.servers >= 1")
        self.partition_bytes = partition_bytes
        self.timeout_s = 300.0 if timeout_s is None else timeout_s
        self.parts: list[list[Part]] = []
        self.num_parts = 0
        self.staging: HostStaging | None = None
        self.pipeline: _Pipeline | None = None

    def open(self, buffer: GradBuffer, units: list[Unit]) -> None:
        """Start a plan: cut its units into partitions and tell each server its keys."""
        if self.parts:
            self.close()
        flat = buffer.flat
        ranges = cut(units, max(1, self.partition_bytes // flat.element_size()))
        flat_ranges = [r for rs in ranges for r in rs]
        owners = assign([e - s for s, e in flat_ranges], self.servers)
        parts = iter(Part(k, s, e, owner)
                     for k, ((s, e), owner) in enumerate(zip(flat_ranges, owners)))
        self.parts = [[next(parts) for _ in rs] for rs in ranges]
        self.num_parts = len(flat_ranges)
        self.staging = self.staging if self.staging and self.staging.flat is flat \
            else HostStaging(flat)
        dtype = DTYPES.index(flat.dtype)
        for server in self.servers:
            layout = torch.tensor([[p.key, p.numel] for ps in self.parts for p in ps
                                   if p.server == server], dtype=torch.int64).reshape(-1)
            _tell_servers(header(OPEN, [layout.numel() // 2], dtype), [server])
            _tell_servers(layout, [server], tag=LAYOUT_TAG)
        self.pipeline = _Pipeline(self.servers)

    def start(self, chunk: torch.Tensor, *, key: int) -> _Exchange:
        """Push unit `key`'s partitions to their servers and pull their averages, from the
        plan's threads once the unit is on the host; returns at once."""
        parts = self.parts[key]
        copied = self.staging.to_host(parts[0].start, parts[-1].end)
        job = _Exchange(parts, staging=self.staging, copied=copied, timeout_s=self.timeout_s)
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
        _tell_servers(header(CLOSE), self.servers)

    def describe(self) -> dict[str, Any]:
        return {"transport": "ps", "workers": self.size, "servers": len(self.servers),
                "partition_bytes": self.partition_bytes,
                "partitions": self.num_parts}
