"""Parameter-server side, as BytePS's server: receive pushes, sum them on an engine, answer.

One thread per worker reads that worker's control stream in order (methods/ps_wire.py
describes the protocol) and receives each announced partition from exactly that
worker on exactly that key's tag, then queues it for the engine. The engine thread
adds the queued pushes into each key's sum (the first one is copied) and, when the
key has one push from every node (the pushing roots), sends the sum back to each of
them. Workers pre-divide their gradients, so the sum is the average.

The engine's queue is FIFO, or with `server_schedule` (BytePS's
BYTEPS_SERVER_ENABLE_SCHEDULE) BytePS's priority queue (server/queue.h, ComparePriority):
the push whose key has the FEWEST pushes counted so far goes first, the oldest on ties;
a key's count grows with each push, is not decremented when a push is served and is
reset when the key completes (`EngineQueue`). So the order stays close to FIFO; it is
neither layer priority nor a favour to keys about to finish.

A server serves many plans in a row (the benchmark builds a fresh method per
repeat; MG-WFBP re-plans after profiling): the k-th OPEN of every worker
belongs to plan k, and a plan's buffers are freed when all workers closed it.
`serve` returns when every worker has sent STOP.
"""

from __future__ import annotations

import collections
import itertools
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from methods.ps_wire import CLOSE, CTRL_TAG, DTYPES, HEADER, KEY_TAG, LAYOUT_TAG, OPEN, PUSH, STOP

POLL_S = 0.2


class EngineQueue:
    """The server engine's queue of pushes, each (key, item): FIFO, or for pushes put with
    `schedule` BytePS's rule: fewest counted pushes of the key first, then the oldest.
    Counts grow on `put`, stay on `get` and go back to 0 on `completed(key)`."""

    def __init__(self) -> None:
        self.items: list[tuple[int, int, Any, bool]] = []  # (id, key, item, schedule)
        self.counted: collections.Counter = collections.Counter()  # pushes per key so far
        self.ids = itertools.count()  # BytePS's message id: arrival order
        self.cond = threading.Condition()

    def put(self, key: int, item: Any, *, schedule: bool = False) -> None:
        with self.cond:
            self.items.append((next(self.ids), key, item, schedule))
            if schedule:
                self.counted[key] += 1
            self.cond.notify()

    def completed(self, key: int) -> None:
        """Every node's push of `key` is summed: its count starts again (ClearCounter)."""
        with self.cond:
            self.counted.pop(key, None)

    def get(self, timeout_s: float | None = None) -> Any:
        """The next push to sum (None after `timeout_s` with nothing queued)."""
        with self.cond:
            if not self.cond.wait_for(lambda: self.items, timeout_s):
                return None
            i = 0
            if self.items[0][3]:  # scheduled: fewest counted first, the oldest id on ties
                i = min(range(len(self.items)),
                        key=lambda j: (self.counted[self.items[j][1]], self.items[j][0]))
            return self.items.pop(i)[2]


class _Slot:
    """One key: each node's latest push, the running sum, and its answers in flight."""

    __slots__ = ("inputs", "total", "summed", "sends", "key")

    def __init__(self, key: int, numel: int, dtype: torch.dtype, nodes: int) -> None:
        self.key = key
        self.inputs = [torch.empty(numel, dtype=dtype) for _ in range(nodes)]
        self.total = torch.empty(numel, dtype=dtype)
        self.summed = 0
        self.sends: list[dist.Work] = []


class _Plan:
    """The keys this server owns in one plan, who pushes them, and who has closed it."""

    def __init__(self, layout: torch.Tensor, dtype: torch.dtype, *, workers: int,
                 node_size: int, schedule: bool) -> None:
        self.layout, self.node_size, self.schedule = layout, node_size, schedule
        self.roots = list(range(0, workers, node_size))  # the ranks that push and pull
        pairs = layout.reshape(-1, 2).tolist()
        self.slots = {key: _Slot(key, numel, dtype, len(self.roots)) for key, numel in pairs}
        self.first_key = min(self.slots, default=-1)
        self.closed = 0


class Server:
    """The state of one parameter server, shared by its per-worker threads and its engine."""

    def __init__(self, *, num_workers: int, on_round: Callable[[int], None] | None = None) -> None:
        self.workers = num_workers
        self.on_round = on_round
        self.plans: dict[int, _Plan] = {}
        self.lock = threading.Lock()
        self.queue = EngineQueue()
        self.rounds = 0
        self.pushes: collections.Counter = collections.Counter()  # per worker, all plans

    def stream(self, worker: int) -> None:
        """Serve worker `worker`'s control stream until it sends STOP."""
        msg = torch.empty(HEADER, dtype=torch.int64)
        number, plan = -1, None
        while True:
            dist.recv(msg, src=worker, tag=CTRL_TAG)
            op, count, dtype = msg[:3].tolist()
            if op == OPEN:
                keys, node_size, schedule = msg[3:6].tolist()
                layout = torch.empty(2 * keys, dtype=torch.int64)  # [key, numel] pairs
                dist.recv(layout, src=worker, tag=LAYOUT_TAG)
                number += 1
                plan = self._open(number, layout, DTYPES[dtype], worker, node_size,
                                  bool(schedule))
            elif op == PUSH:
                node = worker // plan.node_size
                for key in msg[3 : 3 + count].tolist():
                    slot = plan.slots[key]
                    dist.recv(slot.inputs[node], src=worker, tag=KEY_TAG + key)
                    self.pushes[worker] += 1
                    self.queue.put(key, (plan, slot, node), schedule=plan.schedule)
            elif op == CLOSE:
                self._close(number, plan)
            elif op == STOP:
                return
            else:
                raise ValueError(f"unknown control message {op} from worker {worker}")

    def _open(self, number: int, layout: torch.Tensor, dtype: torch.dtype, worker: int,
              node_size: int, schedule: bool) -> _Plan:
        with self.lock:
            plan = self.plans.get(number)
            if plan is None:
                plan = self.plans[number] = _Plan(layout, dtype, workers=self.workers,
                                                  node_size=node_size, schedule=schedule)
            elif not torch.equal(plan.layout, layout) or plan.node_size != node_size:
                raise ValueError(f"worker {worker} opened plan {number} with other keys than "
                                 "the workers before it; all workers must run the same method")
        return plan

    def engine(self, running: Callable[[], bool]) -> None:
        """Sum queued pushes while `running()`; answer each key once every node pushed it."""
        while running():
            if (item := self.queue.get(POLL_S)) is not None:
                self._add(*item)

    def _add(self, plan: _Plan, slot: _Slot, node: int) -> None:
        if slot.summed == 0:
            for work in slot.sends:  # the previous round's answers have left
                work.wait()
            slot.total.copy_(slot.inputs[node])
        else:
            slot.total.add_(slot.inputs[node])
        slot.summed += 1
        if slot.summed < len(plan.roots):
            return
        slot.summed = 0
        self.queue.completed(slot.key)
        slot.sends = [dist.isend(slot.total, dst=root, tag=KEY_TAG + slot.key)
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


def serve(*, num_workers: int, on_round: Callable[[int], None] | None = None) -> Server:
    """Be a parameter server for workers [0, num_workers) until all of them send STOP;
    returns the server (its `pushes` per worker say who pushed how much).

    `on_round(i)` is called after the i-th aggregation round of a plan's first
    key (the harness injects server faults there). Any error, such as a worker
    that died, is raised here, naming this server.
    """
    server = Server(num_workers=num_workers, on_round=on_round)
    errors: list[BaseException] = []

    def guarded(fn: Callable, *args) -> Callable[[], None]:
        def run() -> None:
            try:
                fn(*args)
            except BaseException as exc:  # noqa: BLE001 - re-raised by the main thread
                errors.append(exc)
        return run

    threads = [threading.Thread(target=guarded(server.stream, w), daemon=True,
                                name=f"ps-worker{w}") for w in range(num_workers)]
    for t in threads:
        t.start()
    engine = threading.Thread(target=guarded(server.engine, lambda: not errors and any(
        t.is_alive() for t in threads)), daemon=True, name="ps-engine")
    engine.start()
    while not errors and (alive := [t for t in threads if t.is_alive()]):
        alive[0].join(POLL_S)
    engine.join()
    if errors:
        raise RuntimeError(f"parameter server rank {dist.get_rank()} failed: "
                           f"{errors[0]}") from errors[0]
    return server
