"""Node-local aggregation and host staging, the worker's way to the servers (BytePS).

A node's first worker (the root) pushes and pulls for all (`Node`). On the root path
(`node_reduce: root`) the unit is reduced to the root before and broadcast inside the node
after; the scatter path (the default, methods/ps/scatter.py) runs BytePS's stages per
partition with steps of its own. A node of one worker does neither.

Every collective of a node goes in one order on all its workers (methods/ps/order.py).

Servers are CPU processes (methods/ps/server.py). Workers on GPUs stage their
gradients through page-locked host memory (`HostStaging`, made by `node_staging`), copied
on streams of their own: on the root path the root's pinned mirror of the flat buffer
(only the root pushes and pulls, so only it has one), on the scatter path the node's shared
buffer, registered with CUDA while the plan is open. On CPU the flat buffer is its own
mirror and nothing is copied. A stage thread waits for its copy in CUDA with the GIL
released (`_finish`), as BytePS's copy loops wait in cudaStreamSynchronize, not by polling
the event: on a GPU the autograd thread needs the GIL for every gradient hook and every
Python-visible tensor it frees, and each poll held it back (an H100's bert_tiny wfbp_ps
backward: 18.6 ms polled, 13.8 ms waited in CUDA; bsp_ps, nothing running: 4.3 ms).

`_Pipeline` is one plan's stage threads (methods/ps/stages.py), as BytePS's core loops; on
the root path, for each unit (`_Exchange`) put to it:

1. ps-reduce: the unit reduced to the root (a node of one worker: its gradients' event);
2. ps-copy-out (root): the unit to the host mirror, on the way-out stream;
3. ps-push (root): per server its control header, per partition (`_Piece`) the push and the
   pull (protocol: methods/ps/wire.py), each partition handed on once its pull is posted;
4. ps-pull (root): PULL_WAITERS threads wait for the pulls, each handed on as it completes,
   whatever its order (Gloo's point-to-point handles tell completion only in `wait`);
5. ps-copy-in (root): each partition back to the device as it lands, on the way-back stream;
6. ps-broadcast: per unit, in unit order (the node's order), once all its partitions are
   back, the root's broadcast inside the node; then the unit has landed.

So a unit's reduce overlaps the copy of the one before, and a partition's copy back starts
when its pull completes. Neither the gradient hooks nor the compute stream wait for any of
it; CPU and GPU workers take the same path. `_Exchange.wait` and `.complete` are the
unit's handle (methods/base.py `Handle`); errors are raised there, naming the peer.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from contextlib import nullcontext

import torch

from methods.base import happened, poll_until, record, side_stream, wait_for
from methods.layout import Part
from methods.ps import wire
from methods.ps.order import BROADCAST, REDUCE, Node, NodeOrder
from methods.ps.shared import pin, share, unpin
from methods.ps.stage_table import PULL_WAITERS
from methods.ps.stages import Stage
from methods.ps.wire import (
    CTRL_TAG,
    HEADER,
    KEY_TAG,
    naming_server,
    push_header,
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


def _finish(event: torch.cuda.Event | None) -> None:
    """A stage thread's wait for its copy: return once `event` has happened (CPU: None,
    nothing to wait for), waiting in CUDA with the GIL released, as BytePS's copy loops do
    (module docstring; it may spin a core meanwhile, as theirs). No timeout: a copy that
    never ends is reported by the unit's waiter, whose wait times out (`_Exchange`)."""
    if event is not None:
        event.synchronize()


class _Exchange:
    """One unit's way through the plan's `_Pipeline`: reduced in the node, pushed and
    pulled by the root, broadcast in the node.

    `wait` makes the caller's current stream wait for the unit's result (CPU: the
    average is in place); `complete` returns once it has landed. Both raise the
    error the pipeline met, naming the peer.
    """

    __slots__ = ("parts", "staging", "ready", "reduced", "landed", "done", "error", "at",
                 "timeout_s", "left", "copied", "copied_event")

    def __init__(self, parts: list[Part], *, staging: HostStaging,
                 ready: torch.cuda.Event | None, timeout_s: float) -> None:
        self.parts, self.staging, self.ready = parts, staging, ready
        self.reduced: torch.cuda.Event | None = None  # the node's reduce has read the unit
        self.landed: torch.cuda.Event | None = None  # the result on the device
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.at = server_name(parts[0].server, parts[0].key)  # the peer waited on
        self.timeout_s = timeout_s
        self.left = len(parts)  # partitions not back yet (one stage thread counts them)
        self.copied = threading.Event()  # root path: every partition back (or failed)
        self.copied_event: torch.cuda.Event | None = None

    @property
    def key(self) -> int:
        return self.parts[0].key

    def chunk(self) -> torch.Tensor:
        return self.staging.flat[self.parts[0].start : self.parts[-1].end]

    def back(self) -> bool:
        """One more partition is back; whether it was the last."""
        self.left -= 1
        return self.left == 0

    def fail(self, exc: BaseException) -> None:
        self.error = exc
        self.done.set()
        self.copied.set()

    def wait(self) -> None:
        self._landed()
        self.staging.order_after(self.landed)

    def complete(self) -> None:
        self._landed()
        if self.landed is not None:  # the caller's wait must time out: polled
            poll_until(self.landed.query, timeout_s=self.timeout_s,
                       what="the unit's copy back to the device")

    def finished(self) -> bool:
        return self.done.is_set() and happened(self.landed)

    def _landed(self) -> None:
        if not self.done.wait(self.timeout_s):
            raise RuntimeError(f"{self.at} failed or did not answer: timed out after "
                               f"{self.timeout_s:g} s")
        if self.error is not None:
            raise RuntimeError(str(self.error)) from self.error


class _Piece:
    """One partition of a unit on its way through the stages; `works` the root's messages
    to wait for (handle, what must stay alive until it is sent)."""

    __slots__ = ("job", "part", "works", "reduced", "copied")

    def __init__(self, job: _Exchange, part: Part) -> None:
        self.job, self.part = job, part
        self.works: list[tuple[object, torch.Tensor | None]] = []
        self.reduced: torch.cuda.Event | None = None  # scatter path: its reduce-scatter's end
        self.copied: torch.cuda.Event | None = None  # its copy back to the device's end

    @property
    def key(self) -> int:
        return self.part.key

    @property
    def staging(self) -> HostStaging:
        return self.job.staging

    def fail(self, exc: BaseException) -> None:
        self.job.fail(exc)


def _reduce(job: _Exchange, *, node: Node, order: NodeOrder | None,
            then: Callable[[_Exchange], None]) -> None:
    """Stage 1: the unit reduced to the root (a node of one: its gradients waited for)."""
    job.at = node.name
    if order is None:
        wait_for(job.ready, job.staging.flat.device)
    else:
        order.run(REDUCE, job.chunk(), after=job.ready, key=job.key, timeout_s=job.timeout_s)
    job.reduced = record(job.staging.flat.device)
    if node.is_root:
        then(job)
    else:  # nothing to copy back: the broadcast may go once the reduce has read the unit
        job.copied_event = job.reduced
        job.copied.set()


def _copy_out(job: _Exchange, *, then: Callable[[_Exchange], None]) -> None:
    """Stage 2 (root): the unit on the host once this returns."""
    wait_for(job.reduced, job.staging.flat.device)
    _finish(job.staging.to_host(job.parts[0].start, job.parts[-1].end))
    then(job)


def _push(job: _Exchange, *, servers: list[int], then: Callable[[_Piece], None]) -> None:
    """Stage 3 (root): per server its control header, then per partition the push and the
    pull (the server reads the header first, then the data it announces)."""
    host = job.staging.host
    for server in servers:
        mine = [p for p in job.parts if p.server == server]
        for i in range(0, len(mine), HEADER - 3):
            batch = mine[i : i + HEADER - 3]
            msg = push_header(tuple(p.key for p in batch))
            job.at = server_name(server, batch[0].key)
            with naming_server(server):
                sent = (wire.isend(msg, server, tag=CTRL_TAG), msg)
            for p in batch:
                piece, data = _Piece(job, p), host[p.start : p.end]
                with naming_server(server, p.key):
                    piece.works += [sent] if p is batch[0] else []
                    piece.works += [(wire.isend(data, server, tag=KEY_TAG + p.key), None),
                                    (wire.irecv(data, server, tag=KEY_TAG + p.key), None)]
                then(piece)


def _pull(piece: _Piece, *, then: Callable[[_Piece], None]) -> None:
    """Stage 4 (root, one of the waiters): the partition's messages, then hand it on."""
    part = piece.part
    piece.job.at = server_name(part.server, part.key)
    with naming_server(part.server, part.key):
        for work, _ in piece.works:
            work.wait()
    piece.works = []
    then(piece)


def _copy_in(piece: _Piece) -> None:
    """Stage 5 (root): the partition back to the device; after the unit's last, its event.
    (The reduce that read the unit has happened: the copy out waited for it.)"""
    piece.staging.to_device(piece.part.start, piece.part.end)
    job = piece.job
    if job.back():
        job.copied_event = record(job.staging.flat.device)
        job.copied.set()


def _broadcast(job: _Exchange, *, node: Node, order: NodeOrder | None) -> None:
    """Stage 6, in unit order: once the unit is back, the root's broadcast in the node."""
    if not job.copied.wait(job.timeout_s):
        raise RuntimeError(f"{job.at} failed or did not answer: timed out after "
                           f"{job.timeout_s:g} s")
    if job.error is not None:
        return
    wait_for(job.copied_event, job.staging.flat.device)
    if order is not None:
        job.at = node.name
        order.run(BROADCAST, job.chunk(), after=job.copied_event, key=job.key,
                  timeout_s=job.timeout_s)
    job.landed = record(job.staging.flat.device)
    job.done.set()


class _Pipeline:
    """One plan's stage threads on the root path (module docstring); with more than one
    worker on the node, the node thread issues the collectives in the node's one order.
    `trace` (tests): every stage appends (thread, "start" | "end", key) as it runs."""

    def __init__(self, servers: list[int], node: Node, *, trace: list | None = None) -> None:
        self.node, self.servers, self.trace = node, servers, trace
        self.order = NodeOrder(node) if node.size > 1 else None
        self.stages = self._stages()

    def _stage(self, step: Callable, name: str, role: str, threads: int = 1) -> Stage:
        return Stage(step, name=name, role=role, threads=threads, trace=self.trace)

    def _stages(self) -> list[Stage]:
        """The stages, in a unit's order through them; the first takes `put`'s units."""
        self.broadcast = self._stage(functools.partial(_broadcast, node=self.node,
                                                       order=self.order),
                                     "ps-broadcast", "ps-gather")
        copy_in = self._stage(_copy_in, "ps-copy-in", "ps-back")
        pull = self._stage(functools.partial(_pull, then=copy_in.put), "ps-pull", "ps-pull",
                           PULL_WAITERS)
        push = self._stage(functools.partial(_push, servers=self.servers, then=pull.put),
                           "ps-push", "ps-push")
        copy_out = self._stage(functools.partial(_copy_out, then=push.put), "ps-copy-out",
                               "ps-out")
        reduce = self._stage(functools.partial(_reduce, node=self.node, order=self.order,
                                               then=copy_out.put), "ps-reduce", "ps-reduce")
        return [reduce, copy_out, push, pull, copy_in, self.broadcast]

    def put(self, job: _Exchange) -> None:
        self.stages[0].put(job)
        self.broadcast.put(job)  # in unit order: it waits there until the unit is back

    def stop(self, timeout_s: float) -> None:
        """Let everything queued through (nothing is left behind), then end the threads."""
        for stage in self.stages:
            stage.stop(timeout_s)
        if self.order is not None:
            self.order.stop(timeout_s)
