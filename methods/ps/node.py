"""Node-local aggregation and host staging, the worker's way to the servers (BytePS).

A node's first worker (the root) pushes and pulls for all (`Node`). On the root path
(`node_reduce: root`) the unit is reduced to the root before and broadcast inside the node
after; the scatter path (the default, methods/ps/scatter.py) runs BytePS's stages per
partition on these same threads with steps of its own. A node of one worker does neither.

Every collective of a node goes in one order on all its workers (methods/ps/order.py).

Servers are CPU processes (methods/ps/server.py). Workers on GPUs stage their
gradients through page-locked host memory (`HostStaging`, made by `node_staging`), copied
on streams of their own: on the root path the root's pinned mirror of the flat buffer
(only the root pushes and pulls, so only it has one), on the scatter path the node's shared
buffer, registered with CUDA while the plan is open. On CPU the flat buffer is its own
mirror and nothing is copied. Host threads wait for a copy by polling its event
(`_finish`): an event's synchronize() would spin a core for as long as the copy runs.

`_Pipeline` is one plan's threads: for each unit (`_Exchange`) put to it, a poster
has it reduced inside the node, copies it to the host and posts its messages
(protocol: methods/ps/wire.py); a lander waits for its pulls in order, copies each
partition back and has it broadcast inside the node. Every thread starts with the
first unit, on its device (methods/base.py `start_thread`). Neither the gradient hooks
nor the compute stream wait for any of it; CPU and GPU workers take the same path.
`_Exchange.wait` and `.complete` are the unit's handle (methods/base.py `Handle`);
errors are raised there, naming the peer.
"""

from __future__ import annotations

import functools
import queue
import threading
from collections.abc import Callable
from contextlib import nullcontext

import torch
import torch.distributed as dist

from methods.base import happened, poll_until, record, side_stream, start_thread, wait_for
from methods.layout import Part
from methods.ps import wire
from methods.ps.order import BROADCAST, REDUCE, Node, NodeOrder
from methods.ps.shared import pin, share, unpin
from methods.ps.wire import (
    CTRL_TAG,
    HEADER,
    KEY_TAG,
    PUSH,
    header,
    naming_server,
    server_name,
)


class HostStaging:
    """Where pushes are read from and pulls land: the buffer itself on CPU, pinned memory on
    GPU (only where `mirror`: the root path's root), or given as `host`, the node's shared
    buffer (the scatter path, CPU and GPU; `shared`: registered with CUDA on a GPU until
    `close`). On GPU each direction has a copy stream of its own, as BytePS has: the way
    out (`side()`: after the node's reduce, the copy to the host) and the way back
    (`side(back=True)`: the copies to the device, then the node's broadcast). With one
    stream a root's next reduce, waited on there, would hold back the way back of the
    unit before. (The collectives themselves are queued by the node thread, on a stream
    of its own: `NodeOrder`.) Events are None on CPU."""

    def __init__(self, flat: torch.Tensor, *, host: torch.Tensor | None = None,
                 mirror: bool = True, shared: bool = False) -> None:
        self.flat = flat
        self.on_device = flat.device.type == "cuda"
        if host is None and self.on_device:  # the root path's own mirror, the root's alone
            host = torch.empty(flat.numel(), dtype=flat.dtype, pin_memory=True) \
                if mirror else None
        self.host = flat if host is None and not self.on_device else host
        self.mirrored = self.host is not flat
        self.pinned = shared and self.on_device  # the node's shared buffer, registered
        if self.pinned:
            pin(self.host)
        self.out, self.back = side_stream(flat.device, "ps-out"), side_stream(flat.device,
                                                                               "ps-back")

    def close(self) -> None:
        """The plan is over: the node's shared buffer is no longer registered with CUDA."""
        if self.pinned:
            self.pinned = False
            unpin(self.host)

    def ready(self) -> torch.cuda.Event | None:
        """The event of the end of the work queued so far on the current stream (gradients)."""
        return record(self.flat.device)

    def side(self, *, back: bool = False):
        """Run what follows on the copy stream of the way out, or back (CPU: as it comes)."""
        return torch.cuda.stream(self.back if back else self.out) if self.on_device \
            else nullcontext()

    def to_host(self, start: int, end: int) -> torch.cuda.Event | None:
        """Queue the copy of [start, end) to the host on the way out, after what is queued
        there; returns the event of its end."""
        if not self.on_device:
            if self.mirrored:
                self.host[start:end].copy_(self.flat[start:end])
            return None
        with self.side():
            self.host[start:end].copy_(self.flat[start:end], non_blocking=True)
        return self.out.record_event()

    def to_device(self, start: int, end: int) -> None:
        """Queue the copy of [start, end) back to the device, on the way back."""
        if self.on_device:
            with self.side(back=True):
                self.flat[start:end].copy_(self.host[start:end], non_blocking=True)
        elif self.mirrored:
            self.flat[start:end].copy_(self.host[start:end])

    def mark(self, *, back: bool = True) -> torch.cuda.Event | None:
        """The event of the end of everything queued so far on the way back (or out)."""
        if not self.on_device:
            return None
        return (self.back if back else self.out).record_event()

    def order_after(self, event: torch.cuda.Event | None) -> None:
        """Work queued on the caller's current stream from now on runs after `event`."""
        wait_for(event, self.flat.device)


def node_staging(flat: torch.Tensor, *, node: Node, scatter: bool,
                 timeout_s: float) -> HostStaging:
    """A plan's host staging: on the scatter path the node's shared buffer (every worker of
    the node calls this at the same point), registered with CUDA on a GPU; on the root
    path the root's pinned mirror, and none on the node's other workers, which never
    touch the host (torch rounds a pinned block up to a power of two: BERT-Large's
    1.34 GB takes 2 GiB, per worker that held one)."""
    if scatter:
        host = share(flat.numel(), flat.dtype, node=node, timeout_s=timeout_s)
        return HostStaging(flat, host=host, shared=True)
    return HostStaging(flat, mirror=node.is_root)


def _finish(event: torch.cuda.Event | None, *, timeout_s: float, what: str) -> None:
    """Return once `event` has happened (CPU: None, there is nothing to wait for), polling
    it as `poll_until` does; a TimeoutError naming `what` after `timeout_s`. Not
    `event.synchronize()`: a default event's synchronize spins a core while it waits."""
    if event is not None:
        poll_until(event.query, timeout_s=timeout_s, what=what)


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
        _finish(self.landed, timeout_s=self.timeout_s, what="the unit's copy back to the device")

    def finished(self) -> bool:
        return self.done.is_set() and happened(self.landed)

    def _landed(self) -> None:
        if not self.done.wait(self.timeout_s):
            raise RuntimeError(f"{self.at} failed or did not answer: timed out after "
                               f"{self.timeout_s:g} s")
        if self.error is not None:
            raise RuntimeError(str(self.error)) from self.error


def _post(job: _Exchange, *, node: Node, order: NodeOrder | None, servers: list[int]) -> None:
    """Reduce the unit to the root; there, once it is on the host: per server its control
    header, then per partition the push and the pull (the server reads the header first,
    then the data it announces)."""
    with job.staging.side():
        job.at = node.name
        if order is None:  # a node of one worker: only the gradients to wait for
            job.staging.order_after(job.ready)
        else:
            order.run(REDUCE, job.chunk(), after=job.ready, timeout_s=job.timeout_s)
    job.reduced = job.staging.mark(back=False)
    if not node.is_root:
        return
    _finish(job.staging.to_host(job.parts[0].start, job.parts[-1].end),
            timeout_s=job.timeout_s, what="the copy to the host")
    host = job.staging.host
    for server in servers:
        mine = [p for p in job.parts if p.server == server]
        for i in range(0, len(mine), HEADER - 3):
            batch = mine[i : i + HEADER - 3]
            msg = header(PUSH, [p.key for p in batch])
            job.headers.append(msg)
            job.at = server_name(server, batch[0].key)
            with naming_server(server):
                job.works.append((wire.isend(msg, server, tag=CTRL_TAG), batch[0], False))
                for p in batch:
                    data = host[p.start : p.end]
                    job.works.append((wire.isend(data, server, tag=KEY_TAG + p.key), p,
                                      False))
                    job.works.append((wire.irecv(data, server, tag=KEY_TAG + p.key), p,
                                      True))


def _land(job: _Exchange, *, node: Node, order: NodeOrder | None) -> None:
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
    if order is not None:
        with job.staging.side(back=True):
            job.at = node.name
            order.run(BROADCAST, job.chunk(), after=job.staging.mark(), timeout_s=job.timeout_s)
    job.landed = job.staging.mark()
    job.done.set()


class _Stage:
    """A thread that runs `step` on each job put to it, in order, started with the first
    job on that job's device. After its first error it fails every later job with that
    error instead."""

    def __init__(self, step: Callable[[_Exchange], None], *, name: str) -> None:
        self.step, self.name = step, name
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None
        self.lock = threading.Lock()

    def put(self, job: _Exchange) -> None:
        """Queue `job` (an `_Exchange`, or anything with its `staging` and `fail`)."""
        with self.lock:
            if self.thread is None:
                self.thread = start_thread(self._run, name=self.name,
                                           device=job.staging.flat.device)
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
        with self.lock:
            thread = self.thread
        if thread is None:
            return
        self.jobs.put(None)
        thread.join(timeout_s)
        if thread.is_alive():
            raise TimeoutError(f"the {self.name} thread did not finish within {timeout_s:g} s")


class _Pipeline:
    """One plan's threads: the poster has a unit reduced, posts it and hands it to the
    lander, which waits for its messages in order and has it broadcast; with more than one
    worker on the node, the node thread issues those collectives in the node's one order."""

    def __init__(self, servers: list[int], node: Node, *, post: Callable | None = None,
                 land: Callable | None = None) -> None:
        """`post` and `land` replace the root path's steps (methods/ps/scatter.py)."""
        self.order = NodeOrder(node) if node.size > 1 else None
        self.lander = _Stage(functools.partial(land or _land, node=node, order=self.order),
                             name="ps-lander")
        self.poster = _Stage(functools.partial(post or _post_and_hand, node=node,
                                               order=self.order, servers=servers,
                                               lander=self.lander),
                             name="ps-poster")

    def put(self, job: _Exchange) -> None:
        self.poster.put(job)

    def stop(self, timeout_s: float) -> None:
        """Post and land everything queued (nothing is left behind), then end the threads."""
        self.poster.stop(timeout_s)
        self.lander.stop(timeout_s)
        if self.order is not None:
            self.order.stop(timeout_s)


def _post_and_hand(job: _Exchange, *, node: Node, order: NodeOrder | None, servers: list[int],
                   lander: _Stage) -> None:
    _post(job, node=node, order=order, servers=servers)
    lander.put(job)
