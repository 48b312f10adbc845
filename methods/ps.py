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
gradients through a pinned host mirror of the flat buffer; on CPU the flat
buffer is its own mirror, so both take the same path.
"""

from __future__ import annotations

from collections.abc import Iterator
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
    """Where pushes are read from and pulls land: the buffer itself on CPU, pinned memory on GPU."""

    def __init__(self, flat: torch.Tensor) -> None:
        self.flat = flat
        self.on_device = flat.device.type != "cpu"
        self.host = torch.empty(flat.numel(), dtype=flat.dtype, pin_memory=True) \
            if self.on_device else flat

    def to_host(self, start: int, end: int) -> None:
        if self.on_device:
            self.host[start:end].copy_(self.flat[start:end], non_blocking=True)
            torch.cuda.current_stream(self.flat.device).synchronize()

    def to_device(self, start: int, end: int) -> None:
        if self.on_device:
            self.flat[start:end].copy_(self.host[start:end], non_blocking=True)


class _Exchange:
    """The pushes and pulls of one unit; `wait` leaves the unit's average in place."""

    __slots__ = ("works", "staging", "start", "end", "headers")

    def __init__(self, works: list[tuple[dist.Work, Part]], staging: HostStaging, start: int,
                 end: int, headers: list[torch.Tensor]) -> None:
        self.works, self.staging, self.start, self.end = works, staging, start, end
        self.headers = headers  # alive until sent

    def wait(self) -> None:
        for work, part in self.works:
            with naming_server(part.server, part.key):
                work.wait()
        self.staging.to_device(self.start, self.end)


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
        self.parts: list[list[Part]] = []
        self.num_parts = 0
        self.staging: HostStaging | None = None

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

    def start(self, chunk: torch.Tensor, *, key: int) -> _Exchange:
        """Push unit `key`'s partitions to their servers and post the pulls of their averages."""
        parts = self.parts[key]
        start, end = parts[0].start, parts[-1].end
        self.staging.to_host(start, end)
        host = self.staging.host
        works: list[tuple[dist.Work, Part]] = []
        headers = []
        for server in self.servers:
            mine = [p for p in parts if p.server == server]
            for i in range(0, len(mine), HEADER - 3):
                batch = mine[i : i + HEADER - 3]
                msg = header(PUSH, [p.key for p in batch])
                headers.append(msg)
                with naming_server(server):
                    works.append((dist.isend(msg, dst=server, tag=CTRL_TAG), batch[0]))
                    for p in batch:
                        data = host[p.start : p.end]
                        works.append((dist.isend(data, dst=server, tag=KEY_TAG + p.key), p))
                        works.append((dist.irecv(data, src=server, tag=KEY_TAG + p.key), p))
        return _Exchange(works, self.staging, start, end, headers)

    def close(self) -> None:
        """End the plan (every pull of it must be complete)."""
        if not self.parts:
            return
        self.parts = []
        _tell_servers(header(CLOSE), self.servers)

    def describe(self) -> dict[str, Any]:
        return {"transport": "ps", "workers": self.size, "servers": len(self.servers),
                "partition_bytes": self.partition_bytes,
                "partitions": self.num_parts}
