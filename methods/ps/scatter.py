"""The scatter path of node-local aggregation: BytePS's pipeline per partition
(common/core_loops.cc), the default of every PS method on nodes of more than one worker.

Per partition of a unit (its numel // n elements a slice per worker of a node of n, the
leftover numel % n at the end the root's), on every worker:

1. the poster has the node reduce-scatter the partition in place (each worker gets the sum
   of its own slice) and reduce the leftover to the root;
2. it copies its slice (the root also the leftover) into the node's shared host buffer
   (methods/ps/shared.py; on a GPU on the way-out copy stream, `HostStaging`) and tells
   the root so (a message on tag KEY_TAG + key);
3. the root's poster, once every slice is there, pushes the partition from the shared
   buffer to its server and posts the pull into it (servers see one push per node), then
   hands it to the lander: the next partition's reduce-scatter starts while this one is on
   the wire;
4. the root's lander waits for the pull and tells the others (same tag); each worker copies
   its slice back (on a GPU on the way-back stream);
5. the lander has the node all-gather the slices in place and the root broadcast the
   leftover.

Every collective goes through the node's one order (methods/ps/order.py): the poster asks
for REDUCE_SCATTER and REDUCE, the lander for ALL_GATHER and BROADCAST. The threads, the
unit's handle and its errors are the root path's (methods/ps/node.py `_Pipeline`,
`_Exchange`); only the steps differ. BytePS runs each stage on a thread of its own (one
queue per stage); here the poster runs 1-3 and the lander 4-5, which overlaps the wire
with the next partitions' reduce-scatters, the point of the pipeline.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from methods.layout import Part
from methods.ps import wire
from methods.ps.node import HostStaging, _Exchange, _finish, _Pipeline, _Stage
from methods.ps.order import ALL_GATHER, BROADCAST, REDUCE, REDUCE_SCATTER, Node, NodeOrder
from methods.ps.wire import CTRL_TAG, KEY_TAG, PUSH, header, naming, naming_server, server_name


class _Piece:
    """One partition of a unit between the poster and the lander."""

    __slots__ = ("job", "part", "last", "works")

    def __init__(self, job: _Exchange, part: Part, *, last: bool) -> None:
        self.job, self.part, self.last = job, part, last
        self.works: list[tuple[dist.Work, torch.Tensor | None]] = []  # root: push, pull

    @property
    def staging(self) -> HostStaging:
        return self.job.staging

    def fail(self, exc: BaseException) -> None:
        self.job.fail(exc)


def split(part: Part, node: Node) -> tuple[int, int, int]:
    """(where the slices end and the leftover starts, this worker's slice start, end)."""
    n = part.numel // node.size
    return part.start + n * node.size, part.start + node.index * n, \
        part.start + (node.index + 1) * n


def _signal(node: Node, part: Part, peer: int, *, send: bool) -> None:
    """One message between this worker and `peer` of its node about `part`."""
    msg = torch.ones(1, dtype=torch.int64) if send else torch.zeros(1, dtype=torch.int64)
    with naming(f"worker rank {peer} of {node.name}"):
        if send:
            wire.isend(msg, peer, tag=KEY_TAG + part.key).wait()
        else:
            wire.irecv(msg, peer, tag=KEY_TAG + part.key).wait()


def scatter_and_post(job: _Exchange, *, node: Node, order: NodeOrder, servers: list[int],
                     lander: _Stage) -> None:
    """Steps 1-3 for each partition of the unit, each handed to the lander once posted."""
    for i, part in enumerate(job.parts):
        _scatter(job, part, node=node, order=order)
        piece = _Piece(job, part, last=i == len(job.parts) - 1)
        if node.is_root:
            job.at = node.name
            for peer in node.ranks[1:]:
                _signal(node, part, peer, send=False)
            _post(piece)
        else:
            _signal(node, part, node.root, send=True)
        lander.put(piece)


def _scatter(job: _Exchange, part: Part, *, node: Node, order: NodeOrder) -> None:
    """Reduce-scatter the partition (the leftover to the root); this worker's part of it to
    the shared buffer, there once this returns."""
    staging, (body, start, end) = job.staging, split(part, node)
    job.at = node.name
    with staging.side():
        if body > part.start:
            order.run(REDUCE_SCATTER, staging.flat[part.start : body], after=job.ready,
                      timeout_s=job.timeout_s)
        if body < part.end:
            order.run(REDUCE, staging.flat[body : part.end], after=job.ready,
                      timeout_s=job.timeout_s)
    staging.to_host(start, end)
    if node.is_root:
        staging.to_host(body, part.end)
    _finish(staging.mark(back=False), timeout_s=job.timeout_s, what="the copy to the host")


def _post(piece: _Piece) -> None:
    """The root: the partition's control header, its push and its pull, from and into the
    shared buffer."""
    part, data = piece.part, piece.staging.host[piece.part.start : piece.part.end]
    msg = header(PUSH, [part.key])
    piece.job.at = server_name(part.server, part.key)
    with naming_server(part.server, part.key):
        piece.works += [(wire.isend(msg, part.server, tag=CTRL_TAG), msg),
                        (wire.isend(data, part.server, tag=KEY_TAG + part.key), None),
                        (wire.irecv(data, part.server, tag=KEY_TAG + part.key), None)]


def land_and_gather(piece: _Piece, *, node: Node, order: NodeOrder) -> None:
    """Steps 4-5: the pull (the root tells the others it is there), this worker's slice
    back, the all-gather and the leftover's broadcast; the unit lands with its last one."""
    job, part, staging = piece.job, piece.part, piece.staging
    body, start, end = split(part, node)
    if node.is_root:
        job.at = server_name(part.server, part.key)
        with naming_server(part.server, part.key):
            for work, _ in piece.works:
                work.wait()
        for peer in node.ranks[1:]:
            _signal(node, part, peer, send=True)
    else:
        job.at = f"the root of {node.name}"
        _signal(node, part, node.root, send=False)
    staging.to_device(start, end)
    if node.is_root:
        staging.to_device(body, part.end)
    job.at = node.name
    with staging.side(back=True):
        if body > part.start:
            order.run(ALL_GATHER, staging.flat[part.start : body], after=staging.mark(),
                      timeout_s=job.timeout_s)
        if body < part.end:
            order.run(BROADCAST, staging.flat[body : part.end], after=staging.mark(),
                      timeout_s=job.timeout_s)
    if piece.last:
        job.landed = staging.mark()
        job.done.set()


class ScatterPipeline(_Pipeline):
    """One plan's threads on the scatter path (module docstring); a node of more than one
    worker, with the node's shared buffer as its staging's host."""

    def __init__(self, servers: list[int], node: Node) -> None:
        if node.size < 2:
            raise ValueError("the scatter path needs a node of more than one worker")
        super().__init__(servers, node, post=scatter_and_post, land=land_and_gather)
