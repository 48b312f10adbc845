"""A node for local aggregation (BytePS) and the one order of its collectives.

One order for the node's collectives. Each worker's stages (methods/ps/stages.py) reduce
(or reduce-scatter) partitions in the ps-reduce thread and broadcast (or all-gather) them
in the ps-gather / ps-broadcast thread, on two groups (one NCCL communicator each on
GPUs), and the root's broadcast of a partition waits for its pull, while the other
workers could broadcast at once: left to timing, the collectives would be queued in
different orders on different workers, and where the communicators' kernels cannot run
side by side (CUDA_DEVICE_MAX_CONNECTIONS=1, MPS, a busy device) each worker's next kernel
waits for one its peers queued behind another: a deadlock. So on every worker one thread,
the node thread (`NodeOrder`), issues all of the node's collectives, and they go in the
order the root's stages ask for them: the root's node thread announces each one's kind
and key (methods/order.py; `code`) before issuing it, and the others' issue exactly that
sequence, each once their own stage asks for that kind of that key. The kinds are the
root path's REDUCE and BROADCAST and the scatter path's REDUCE_SCATTER and ALL_GATHER
(methods/ps/scatter.py; its leftover takes REDUCE and BROADCAST).

Who owns the order: the root's ps-reduce thread (partitions in order, on every worker
alike) and the root's landing order (its pulls complete in any order; the root's
ps-copy-in tells the others each landing, in that order, and every worker's gather stage
asks in it). Each stage asks from one thread in the order the root's does, so the next
ask of an announced kind and key on a worker is the one the root meant, and no stage
waits on a collective another stage of its worker has yet to ask for.
"""

from __future__ import annotations

import queue
import threading

import torch
import torch.distributed as dist

from methods.base import side_stream, start_thread, wait_for
from methods.order import OrderFollower, OrderLeader
from methods.ps.wire import naming

# the node's collectives, as the root announces them
REDUCE, BROADCAST, REDUCE_SCATTER, ALL_GATHER = 0, 1, 2, 3
KINDS = 4


def code(kind: int, key: int = -1) -> int:
    """What the root announces for a collective: its kind and the key it is for (-1: any)."""
    return kind + KINDS * (key + 1)


class Node:
    """This worker's node for local aggregation (BytePS): its first worker (the root) pushes
    and pulls for all. Before, the node reduces (to the root) or reduce-scatters (each
    worker `index` gets its slice) on one group; after, it broadcasts (from the root) or
    all-gathers on another; all issued in one order (`NodeOrder`). A node of one worker
    does none of it."""

    def __init__(self, rank: int, size: int, groups: tuple | None) -> None:
        if size > 1 and not groups:
            raise ValueError("node-local aggregation needs the node's process groups "
                             "(harness.launch.rank makes them; pass node_groups)")
        self.size, self.root = size, rank - rank % size
        self.is_root = rank == self.root
        self.index = rank - self.root  # rank in the node's groups; slice owned (scatter)
        self.ranks = list(range(self.root, self.root + size))  # global ranks (workers first)
        self.reduce_group, self.broadcast_group = groups if size > 1 else (None, None)
        self.name = f"the workers of the node of rank {self.root}"

    def collective(self, kind: int, chunk: torch.Tensor) -> dist.Work:
        """Start the node's collective of `kind` on `chunk`: the reduce of it to the root,
        the root's broadcast of it, or in place the reduce-scatter of it (this worker's
        slice: `own(chunk)`) and the all-gather of each one's slice. Gloo has both last two
        in torch 2.14 (reduce_scatter_single, all_gather_single)."""
        with naming(self.name):
            if kind == REDUCE:
                return dist.reduce(chunk, dst=self.root, group=self.reduce_group, async_op=True)
            if kind == BROADCAST:
                return dist.broadcast(chunk, src=self.root, group=self.broadcast_group,
                                      async_op=True)
            if kind == REDUCE_SCATTER:
                return dist.reduce_scatter_single(self.own(chunk), chunk,
                                                  group=self.reduce_group, async_op=True)
            return dist.all_gather_single(chunk, self.own(chunk), group=self.broadcast_group,
                                          async_op=True)

    def warm_up(self, device: torch.device) -> None:
        """Make the node's communicators now, on the calling thread (the main one), the
        reduce group's then the broadcast group's, in this order on every worker of the
        node: NCCL makes a group's communicator at its first collective, and made later by
        the node thread the second would be set up while the first one's kernels run,
        which NCCL warns can stall. (Gloo's groups are ready; the same two collectives.)"""
        if self.size == 1:
            return
        with naming(self.name):
            for group in (self.reduce_group, self.broadcast_group):
                dist.all_reduce(torch.zeros(1, device=device), group=group)

    def own(self, chunk: torch.Tensor) -> torch.Tensor:
        """This worker's slice of `chunk` (its numel a multiple of the node's size)."""
        n = chunk.numel() // self.size
        return chunk[self.index * n : (self.index + 1) * n]


class _Ask:
    """A stage's request to the node thread: one collective on `chunk`, queued
    after `after` (an event; None on CPU)."""

    __slots__ = ("kind", "code", "chunk", "after", "work", "error", "issued")

    def __init__(self, kind: int, key: int, chunk: torch.Tensor,
                 after: torch.cuda.Event | None) -> None:
        self.kind, self.code, self.chunk, self.after = kind, code(kind, key), chunk, after
        self.work: dist.Work | None = None
        self.error: BaseException | None = None
        self.issued = threading.Event()

    def fail(self, exc: BaseException) -> None:
        self.error = exc
        self.issued.set()


class NodeOrder:
    """The node thread: issues every collective of the node, in the order the root's stages
    ask for them, on every worker of the node (module docstring)."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.order = (OrderLeader if node.is_root else OrderFollower)(node.reduce_group)
        self.asks: queue.SimpleQueue = queue.SimpleQueue()  # in the order asked
        self.waiting: dict[int, list[_Ask]] = {}  # others: asked, by code (kind and key)
        self.lock = threading.Lock()
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None

    def run(self, kind: int, chunk: torch.Tensor, *, after: torch.cuda.Event | None,
            timeout_s: float, key: int = -1) -> None:
        """Have the collective of `kind` for `key` issued in the node's order, then make the
        caller's current stream wait for it (CPU: return once it is done)."""
        ask = _Ask(kind, key, chunk, after)
        with self.lock:
            if self.error is not None:
                raise self.error
            if self.thread is None:  # the first collective: the thread starts on its device
                self.thread = start_thread(self._run, name="ps-node", device=chunk.device,
                                           stream=side_stream(chunk.device, "ps-node"))
            self.asks.put(ask)
        if not ask.issued.wait(timeout_s):
            raise RuntimeError(f"{self.node.name} failed or did not answer: the node's "
                               f"collective was not issued within {timeout_s:g} s")
        if ask.error is not None:
            raise ask.error
        with naming(self.node.name):
            ask.work.wait()

    def _run(self) -> None:
        try:
            while (ask := self._next()) is not None:
                wait_for(ask.after, ask.chunk.device)
                ask.work = self.node.collective(ask.kind, ask.chunk)
                ask.issued.set()
        except BaseException as exc:  # noqa: BLE001 - handed to every ask, now and later
            with self.lock:
                self.error = exc
                while True:
                    try:
                        ask = self.asks.get_nowait()
                    except queue.Empty:
                        break
                    if ask is not None:
                        ask.fail(exc)
                for ask in (a for asks in self.waiting.values() for a in asks):
                    ask.fail(exc)

    def _next(self) -> _Ask | None:
        """The root: the next ask, announced. The others: the next ask of the announced
        kind and key."""
        if self.node.is_root:
            ask = self.asks.get()
            if ask is None:
                self.order.close()
                return None
            with naming(self.node.name):
                self.order.announce([ask.code])
            return ask
        with naming(f"the root of {self.node.name}"):
            announced = self.order.next()
        if announced is None:
            return None
        meant = announced[0]
        while not self.waiting.get(meant):
            ask = self.asks.get()
            self.waiting.setdefault(ask.code, []).append(ask)
        asks = self.waiting[meant]
        ask = asks.pop(0)
        if not asks:
            del self.waiting[meant]
        return ask

    def stop(self, timeout_s: float) -> None:
        """After the last ask: the root tells the others; every node thread ends."""
        with self.lock:
            started = self.thread is not None
        if not started:  # no collective at all: only the end of the sequence to pass on
            if self.node.is_root:
                self.order.close()
            elif self.order.next() is not None:
                raise RuntimeError(f"{self.node.name}: the root issued collectives this "
                                   "worker never asked for")
            return
        if self.node.is_root:
            self.asks.put(None)
        self.thread.join(timeout_s)
        if self.thread.is_alive():
            raise TimeoutError(f"the ps-node thread did not finish within {timeout_s:g} s")
