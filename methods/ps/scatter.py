"""The scatter path of node-local aggregation: BytePS's pipeline per partition
(common/core_loops.cc), the default of every PS method on nodes of more than one worker.

Per partition of a unit (its numel // n elements a slice per worker of a node of n, the
leftover numel % n at the end the root's), on every worker, a thread per stage
(methods/ps/stages.py), each partition handed from one to the next as it is done:

1. ps-reduce: the node reduce-scatters the partition in place (each worker gets the sum
   of its own slice) and reduces the leftover to the root, partitions in order;
2. ps-copy-out: this worker's slice (the root's also the leftover) into the node's shared
   host buffer (methods/ps/shared.py; on a GPU on the way-out copy stream, `HostStaging`),
   while ps-reduce goes on with the next partition;
3. ps-push: the others tell the root their slice is there (a message on tag
   KEY_TAG + key); the root, once every slice is, pushes the partition from the shared
   buffer to its server and posts the pull into it (servers see one push per node);
4. ps-pull: the root's PULL_WAITERS threads wait for the pulls and hand each on as it
   completes, in any order; the others' one thread hands each on as the root's word of
   its landing comes (LANDED_TAG, the key; in the root's landing order);
5. ps-copy-in: in that landing order, the root tells the others (LANDED_TAG); each worker
   copies its slice back (on a GPU on the way-back stream);
6. ps-gather: in that landing order, the node all-gathers the slices in place and the root
   broadcasts the leftover; the unit has landed with its last partition to do so.

Every collective goes through the node's one order (methods/ps/order.py), asked for with
its kind and key: ps-reduce asks for REDUCE_SCATTER and REDUCE in partition order on every
worker; ps-gather for ALL_GATHER and BROADCAST in the root's landing order, which the root
sends the others (step 5) so that every worker asks in it. The unit's handle and its
errors are the root path's (methods/ps/node.py `_Exchange`).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable

import torch

from methods.base import record, wait_for
from methods.layout import Part
from methods.ps import wire
from methods.ps.node import _Exchange, _finish, _Piece, _Pipeline, _pull
from methods.ps.order import ALL_GATHER, BROADCAST, REDUCE, REDUCE_SCATTER, Node, NodeOrder
from methods.ps.stage_table import PULL_WAITERS
from methods.ps.stages import Stage
from methods.ps.wire import (
    CTRL_TAG,
    KEY_TAG,
    LANDED_TAG,
    naming,
    naming_server,
    push_header,
    server_name,
)


def split(part: Part, node: Node) -> tuple[int, int, int]:
    """(where the slices end and the leftover starts, this worker's slice start, end)."""
    n = part.numel // node.size
    return part.start + n * node.size, part.start + node.index * n, \
        part.start + (node.index + 1) * n


def _tell(node: Node, peer: int, value: int, *, tag: int) -> None:
    """Send `value` to worker `peer` of this worker's node, and wait until it has left."""
    with naming(f"worker rank {peer} of {node.name}"):
        wire.isend(torch.tensor([value], dtype=torch.int64), peer, tag=tag).wait()


def _hear(node: Node, peer: int, *, tag: int) -> int:
    """The next value worker `peer` of this worker's node sends on `tag`."""
    msg = torch.zeros(1, dtype=torch.int64)
    with naming(f"worker rank {peer} of {node.name}"):
        wire.irecv(msg, peer, tag=tag).wait()
    return int(msg)


def _collectives(piece: _Piece, *, node: Node, order: NodeOrder, kinds: tuple[int, int],
                 after: torch.cuda.Event | None) -> None:
    """The node's collectives of one partition, in the node's order: `kinds[0]` on the body
    (the workers' equal slices), `kinds[1]` on the leftover (the root's)."""
    job, part, (body, _, _) = piece.job, piece.part, split(piece.part, node)
    flat, kw = job.staging.flat, {"after": after, "key": part.key, "timeout_s": job.timeout_s}
    job.at = node.name
    if body > part.start:
        order.run(kinds[0], flat[part.start : body], **kw)
    if body < part.end:
        order.run(kinds[1], flat[body : part.end], **kw)


def _reduce(piece: _Piece, *, node: Node, order: NodeOrder,
            then: Callable[[_Piece], None]) -> None:
    """Step 1: reduce-scatter the partition (the leftover to the root)."""
    _collectives(piece, node=node, order=order, kinds=(REDUCE_SCATTER, REDUCE),
                 after=piece.job.ready)
    piece.reduced = record(piece.job.staging.flat.device)
    then(piece)


def _copy_out(piece: _Piece, *, node: Node, then: Callable[[_Piece], None]) -> None:
    """Step 2: this worker's part of the partition in the shared buffer once this returns."""
    staging, part, (body, start, end) = piece.staging, piece.part, split(piece.part, node)
    wait_for(piece.reduced, staging.flat.device)
    staging.to_host(start, end)
    if node.is_root:
        staging.to_host(body, part.end)
    _finish(staging.mark(back=False))
    then(piece)


def _push(piece: _Piece, *, node: Node, then: Callable[[_Piece], None]) -> None:
    """Step 3: the others tell the root; the root, once all have, pushes and posts the pull."""
    part, job = piece.part, piece.job
    if not node.is_root:
        job.at = f"the root of {node.name}"
        _tell(node, node.root, 1, tag=KEY_TAG + part.key)
        then(piece)
        return
    job.at = node.name
    for peer in node.ranks[1:]:
        _hear(node, peer, tag=KEY_TAG + part.key)
    data, msg = piece.staging.host[part.start : part.end], push_header((part.key,))
    job.at = server_name(part.server, part.key)
    with naming_server(part.server, part.key):
        piece.works += [(wire.isend(msg, part.server, tag=CTRL_TAG), msg),
                        (wire.isend(data, part.server, tag=KEY_TAG + part.key), None),
                        (wire.irecv(data, part.server, tag=KEY_TAG + part.key), None)]
    then(piece)


class _Landings:
    """Step 4 on the others: each call hands on the partition the root's next word of a
    landing names, in the root's landing order, once ps-push has put it here (the word may
    come first). One call per partition put, so every word is heard."""

    def __init__(self, node: Node, then: Callable[[_Piece], None]) -> None:
        self.node, self.then = node, then
        self.waiting: list[_Piece] = []  # put by ps-push, not landed yet
        self.cond = threading.Condition()

    def put(self, piece: _Piece) -> None:
        with self.cond:
            self.waiting.append(piece)
            self.cond.notify_all()

    def land(self, first: _Piece) -> _Piece:
        first.job.at = f"the root of {self.node.name}"
        key = _hear(self.node, self.node.root, tag=LANDED_TAG)
        with self.cond:
            if not self.cond.wait_for(lambda: any(p.key == key for p in self.waiting),
                                      timeout=first.job.timeout_s):
                raise RuntimeError(f"{self.node.name}: the root landed key {key}, which this "
                                   "worker never pushed")
            found = next(p for p in self.waiting if p.key == key)
            self.waiting.remove(found)
        self.then(found)
        return found


def _copy_in(piece: _Piece, *, node: Node, then: Callable[[_Piece], None]) -> None:
    """Step 5: the root tells the others; this worker's slice back from the shared buffer."""
    part, (body, start, end) = piece.part, split(piece.part, node)
    if node.is_root:
        for peer in node.ranks[1:]:
            _tell(node, peer, part.key, tag=LANDED_TAG)
    piece.staging.to_device(start, end)
    if node.is_root:
        piece.staging.to_device(body, part.end)
    piece.copied = record(piece.staging.flat.device)
    then(piece)


def _gather(piece: _Piece, *, node: Node, order: NodeOrder) -> None:
    """Step 6: all-gather the slices, broadcast the leftover; the unit lands with its last."""
    _collectives(piece, node=node, order=order, kinds=(ALL_GATHER, BROADCAST),
                 after=piece.copied)
    job = piece.job
    if job.back():
        job.landed = record(job.staging.flat.device)
        job.done.set()


class ScatterPipeline(_Pipeline):
    """One plan's stage threads on the scatter path (module docstring); a node of more than
    one worker, with the node's shared buffer as its staging's host."""

    def __init__(self, servers: list[int], node: Node, *, trace: list | None = None) -> None:
        if node.size < 2:
            raise ValueError("the scatter path needs a node of more than one worker")
        super().__init__(servers, node, trace=trace)

    def _stages(self) -> list[Stage]:
        """The stages, in a partition's order through them."""
        node, order = self.node, self.order
        gather = self._stage(functools.partial(_gather, node=node, order=order), "ps-gather",
                             "ps-gather")
        copy_in = self._stage(functools.partial(_copy_in, node=node, then=gather.put),
                              "ps-copy-in", "ps-back")
        if node.is_root:
            pull = self._stage(functools.partial(_pull, then=copy_in.put), "ps-pull",
                               "ps-pull", PULL_WAITERS)
            handed = pull.put
        else:
            landings = _Landings(node, copy_in.put)
            pull = self._stage(landings.land, "ps-pull", "ps-pull")

            def handed(piece: _Piece) -> None:
                landings.put(piece)
                pull.put(piece)
        push = self._stage(functools.partial(_push, node=node, then=handed), "ps-push",
                           "ps-push")
        copy_out = self._stage(functools.partial(_copy_out, node=node, then=push.put),
                               "ps-copy-out", "ps-out")
        reduce = self._stage(functools.partial(_reduce, node=node, order=order,
                                               then=copy_out.put), "ps-reduce", "ps-reduce")
        return [reduce, copy_out, push, pull, copy_in, gather]

    def put(self, job: _Exchange) -> None:
        """The unit's partitions, in order, to ps-reduce."""
        for part in job.parts:
            self.stages[0].put(_Piece(job, part))
