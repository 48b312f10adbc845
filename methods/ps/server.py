"""Parameter-server side, as BytePS v0.2.3's server (byteps/server/server.cc): receive
pushes, sum them on engine threads, answer.

One thread per worker reads that worker's control stream in order (methods/ps/wire.py
describes the protocol; CTRL_AHEAD of its receives posted at once) and posts the receive
of each announced partition, from exactly that worker on exactly that key's tag, as its
header arrives; a second thread per worker waits for them in that order and handles each
as BytePSHandler does: the key is bound to one of the plan's `engine_threads` engine
threads (the one with the fewest bytes bound so far, methods/ps/server_queue.py), the
round's first push becomes the running sum in place (no engine work), each later one is
queued on the key's thread to be added to it, and after the last one (a push from every
node: the pushing roots) a copy of the sum into the key's answer buffer is queued, which,
once run, is sent back to each root. The answer is the workers' sum; each worker divides
it by their count before its update.

Each engine thread has a queue of its own (`EngineQueue`): FIFO, or with
`server_schedule` (BytePS's BYTEPS_SERVER_ENABLE_SCHEDULE) BytePS's heap: the message
whose key has the FEWEST pushes counted goes first, the oldest on ties; a key's count
grows with every message queued, is not decremented when one is served and is reset as
soon as the key's last push arrives, before its sums run, so that key's remaining work
then compares at count 0 (the heap is not rebuilt). So the order stays close to FIFO;
it is neither layer priority nor a favour to keys about to finish.

A server serves many plans in a row (the benchmark builds a fresh method per repeat;
MG-WFBP re-plans after profiling): the k-th OPEN of every worker belongs to plan k, each
plan binds its keys to threads afresh (as a fresh BytePS job would), and a plan's
buffers are freed when all workers closed it. The engine threads are the server's,
started when a plan first binds a key to them. `serve` returns when every worker has
sent STOP.
"""

from __future__ import annotations

import collections
import queue
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from methods.ps import wire
from methods.ps.server_queue import EngineQueue, ThreadBinding
from methods.ps.wire import (
    CLOSE,
    CTRL_AHEAD,
    CTRL_TAG,
    DTYPES,
    HEADER,
    KEY_TAG,
    LAYOUT_TAG,
    OPEN,
    PUSH,
    STOP,
)

POLL_S = 0.2
SUM, COPY = 0, 1  # engine work: add a push into the running sum (SUM_RECV); copy the sum
                  # into the answer and send it (COPY_MERGED)

__all__ = ["EngineQueue", "Server", "serve"]


class _Slot:
    """One key: each node's latest push, the answer buffer, the pushes of this round so
    far (`arrived`) and the node whose push is the running sum, and its answers in flight."""

    __slots__ = ("key", "nbytes", "inputs", "total", "arrived", "merged", "summed", "held",
                 "sends")

    def __init__(self, key: int, numel: int, dtype: torch.dtype, nodes: int) -> None:
        self.key = key
        self.inputs = [torch.empty(numel, dtype=dtype) for _ in range(nodes)]
        self.total = torch.empty(numel, dtype=dtype)
        self.nbytes = numel * self.total.element_size()
        self.arrived, self.merged = 0, 0
        self.summed = 0     # this round's sums run so far (engine thread only)
        self.held = False   # this round's copy popped before its last sum (engine thread only)
        self.sends: list[dist.Work] = []


class _Plan:
    """The keys this server owns in one plan, who pushes them, their engine threads, and
    who has closed it."""

    def __init__(self, layout: torch.Tensor, dtype: torch.dtype, *, workers: int,
                 node_size: int, schedule: bool, threads: int) -> None:
        self.layout, self.node_size, self.schedule = layout, node_size, schedule
        self.threads = threads
        self.binding = ThreadBinding(threads)
        self.roots = list(range(0, workers, node_size))  # the ranks that push and pull
        self.sums = len(self.roots) - 1  # engine sums per key and round
        pairs = layout.reshape(-1, 2).tolist()
        self.slots = {key: _Slot(key, numel, dtype, len(self.roots)) for key, numel in pairs}
        self.first_key = min(self.slots, default=-1)
        self.closed = 0


class Server:
    """The state of one parameter server, shared by its per-worker threads and its engine
    threads (one `EngineQueue` each, `queues[i]` served by thread i)."""

    def __init__(self, *, num_workers: int, on_round: Callable[[int], None] | None = None) -> None:
        self.workers = num_workers
        self.on_round = on_round
        self.plans: dict[int, _Plan] = {}
        self.lock = threading.Lock()    # the plans
        self.handle = threading.Lock()  # BytePS's handle_mu_: one push handled at a time
        self.queues: list[EngineQueue] = []
        self.engines: list[threading.Thread] = []
        self.errors: list[BaseException] = []
        self.stopped = threading.Event()
        self.rounds = 0
        self.pushes: collections.Counter = collections.Counter()  # per worker, all plans

    def spawn(self, name: str, fn: Callable, *args: Any) -> threading.Thread:
        """Start `fn(*args)` on a daemon thread whose error lands in `errors`."""
        def run() -> None:
            try:
                fn(*args)
            except BaseException as exc:  # noqa: BLE001 - re-raised by serve
                self.errors.append(exc)
        thread = threading.Thread(target=run, daemon=True, name=name)
        thread.start()
        return thread

    def stream(self, worker: int) -> None:
        """Serve worker `worker`'s control stream until it sends STOP. This thread keeps
        CTRL_AHEAD of its headers' receives posted, reads them in order and posts each
        announced push's receive as its header arrives; a thread of its own (`_land`)
        waits for the pushes in order and hands each on. So a push goes as soon as its
        header has arrived, and a header as soon as it is sent, whatever the server is
        still waiting for: as ZeroMQ buffers messages ahead of ps-lite's reader. On Gloo a
        message goes once its receiver said it is ready (methods/ps/wire.py): a push's
        receive posted only once the one before had landed cost every push a round trip,
        and one header's receive posted at a time made each header wait for the server's
        "ready" to cross back behind its answers, and queue behind the pushes sent
        meanwhile."""
        heads: collections.deque = collections.deque()  # (buffer, its posted receive)

        def post() -> None:
            msg = torch.empty(HEADER, dtype=torch.int64)
            heads.append((msg, wire.irecv(msg, worker, tag=CTRL_TAG)))

        for _ in range(CTRL_AHEAD):
            post()
        landing: queue.SimpleQueue = queue.SimpleQueue()
        lander = self.spawn(f"ps-land{worker}", self._land, worker, landing)
        number, plan = -1, None
        while True:
            msg, work = heads.popleft()
            work.wait()
            op, count, dtype = msg[:3].tolist()
            if op != STOP:
                post()
            if op == OPEN:
                keys, node_size, schedule, threads = msg[3:7].tolist()
                layout = torch.empty(2 * keys, dtype=torch.int64)  # [key, numel] pairs
                wire.recv(layout, worker, tag=LAYOUT_TAG)
                number += 1
                plan = self._open(number, layout, DTYPES[dtype], worker, node_size,
                                  bool(schedule), threads)
            elif op == PUSH:
                node = worker // plan.node_size
                for key in msg[3 : 3 + count].tolist():
                    slot = plan.slots[key]  # its buffer is free: the worker pushes a key
                    # again only after its answer, sent after the sum left the buffer
                    landing.put((PUSH, plan, slot, node,
                                 wire.irecv(slot.inputs[node], worker, tag=KEY_TAG + key)))
            elif op == CLOSE:
                landing.put((CLOSE, number, plan))
            elif op == STOP:
                for _, work in heads:  # the worker's other STOPs
                    work.wait()
                landing.put(None)
                while lander.is_alive() and not self.errors:
                    lander.join(POLL_S)
                return
            else:
                raise ValueError(f"unknown control message {op} from worker {worker}")

    def _land(self, worker: int, landing: queue.SimpleQueue) -> None:
        """Worker `worker`'s pushes as they land, in its order; a plan closed after them."""
        while (item := landing.get()) is not None:
            if item[0] == CLOSE:
                self._close(*item[1:])
                continue
            _, plan, slot, node, work = item
            work.wait()
            self.pushes[worker] += 1
            self.arrived(plan, slot, node)

    def _open(self, number: int, layout: torch.Tensor, dtype: torch.dtype, worker: int,
              node_size: int, schedule: bool, threads: int) -> _Plan:
        with self.lock:
            plan = self.plans.get(number)
            if plan is None:
                plan = self.plans[number] = _Plan(layout, dtype, workers=self.workers,
                                                  node_size=node_size, schedule=schedule,
                                                  threads=threads)
            elif (not torch.equal(plan.layout, layout) or plan.node_size != node_size
                  or plan.threads != threads):
                raise ValueError(f"worker {worker} opened plan {number} with other keys or "
                                 "engine threads than the workers before it; all workers "
                                 "must run the same method")
        return plan

    def arrived(self, plan: _Plan, slot: _Slot, node: int) -> None:
        """Node `node`'s push of `slot` is in (BytePSHandler): queue its engine work on the
        key's thread; after the round's last push, the copy into the answer, and the key's
        count starts again (ClearCounter) before any of its queued work runs."""
        with self.handle:
            queue = self.queue(plan.binding.bind(slot.key, slot.nbytes))
            if slot.arrived == 0:  # the first push is the running sum, in place
                slot.merged = node
            else:
                queue.put(slot.key, (SUM, plan, slot, node), schedule=plan.schedule)
            slot.arrived += 1
            if slot.arrived < len(plan.roots):
                return
            slot.arrived = 0
            queue.put(slot.key, (COPY, plan, slot, slot.merged), schedule=plan.schedule)
            queue.clear_count(slot.key)

    def queue(self, thread: int) -> EngineQueue:
        """Engine thread `thread`'s queue; the thread (and those before it) start on first use."""
        while len(self.queues) <= thread:
            self.queues.append(queue := EngineQueue())
            self.engines.append(self.spawn(f"ps-engine{len(self.engines)}", self.engine, queue))
        return self.queues[thread]

    def engine(self, queue: EngineQueue) -> None:
        """Run `queue`'s engine work until the server stops or fails."""
        while not self.errors and not self.stopped.is_set():
            if (item := queue.get(POLL_S)) is not None:
                self._run(*item)

    def _run(self, op: int, plan: _Plan, slot: _Slot, node: int) -> None:
        """SUM: add node `node`'s push into the running sum; COPY: copy the sum into the
        answer buffer and send that to every root, once the round's last sum has run.

        BytePS's heap can pop a key's COPY_MERGED before one of its SUM_RECVs (its
        comparator's counts move under a heap that is never rebuilt), and BytePS then
        answers a sum missing a push. Here the copy waits for the key's last sum and runs
        right after it: the order BytePS serves, except where BytePS would be wrong."""
        if op == SUM:
            slot.inputs[slot.merged].add_(slot.inputs[node])
            slot.summed += 1
            if not slot.held or slot.summed < plan.sums:
                return
        elif slot.summed < plan.sums:
            slot.held = True
            return
        slot.summed, slot.held = 0, False
        self._answer(plan, slot)

    def _answer(self, plan: _Plan, slot: _Slot) -> None:
        """Copy the round's sum into the answer buffer and send it to every root."""
        for work in slot.sends:  # the previous round's answers have left
            work.wait()
        slot.total.copy_(slot.inputs[slot.merged])
        slot.sends = [wire.isend(slot.total, root, tag=KEY_TAG + slot.key)
                      for root in plan.roots]
        if slot.key == plan.first_key and self.on_round is not None:
            self.on_round(self.rounds)
            self.rounds += 1

    def _close(self, number: int, plan: _Plan) -> None:
        with self.lock:
            plan.closed += 1
            if plan.closed < self.workers:
                return
            del self.plans[number]
        for slot in plan.slots.values():
            for work in slot.sends:
                work.wait()

    def stop(self) -> None:
        """Stop the engine threads (every worker is done, or the server failed)."""
        self.stopped.set()
        with self.handle:
            engines = list(self.engines)
        for thread in engines:
            thread.join()


def serve(*, num_workers: int, on_round: Callable[[int], None] | None = None) -> Server:
    """Be a parameter server for workers [0, num_workers) until all of them send STOP;
    returns the server (its `pushes` per worker say who pushed how much).

    `on_round(i)` is called after the i-th aggregation round of a plan's first
    key (the harness injects server faults there). Any error, such as a worker
    that died, is raised here, naming this server.
    """
    server = Server(num_workers=num_workers, on_round=on_round)
    streams = [server.spawn(f"ps-worker{w}", server.stream, w) for w in range(num_workers)]
    while not server.errors and (alive := [t for t in streams if t.is_alive()]):
        alive[0].join(POLL_S)
    server.stop()
    if server.errors:
        raise RuntimeError(f"parameter server rank {dist.get_rank()} failed: "
                           f"{server.errors[0]}") from server.errors[0]
    return server
