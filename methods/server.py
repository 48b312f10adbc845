"""Parameter-server side: sum the W workers' partitions, average, answer each worker.

One thread per worker reads that worker's control stream in order
(methods/ps.py describes the protocol) and receives each announced partition
from exactly that worker on exactly that key's tag. When the last of the W
contributions of a key arrives, that thread sums them in worker order (the
order the single-process reference accumulates in), divides by W and sends
the average back to every worker on the key's tag.

A server serves many plans in a row (the benchmark builds a fresh method per
repeat; MG-WFBP re-plans after profiling): the k-th OPEN of every worker
belongs to plan k, and a plan's buffers are freed when all workers closed it.
`serve` returns when every worker has sent STOP.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch
import torch.distributed as dist

from methods.ps import CLOSE, CTRL_TAG, DTYPES, HEADER, KEY_TAG, LAYOUT_TAG, OPEN, PUSH, STOP

POLL_S = 0.2


class _Slot:
    """One key: each worker's latest contribution, their average, and its answers in flight."""

    __slots__ = ("inputs", "total", "arrived", "sends", "lock")

    def __init__(self, numel: int, dtype: torch.dtype, workers: int) -> None:
        self.inputs = [torch.empty(numel, dtype=dtype) for _ in range(workers)]
        self.total = torch.empty(numel, dtype=dtype)
        self.arrived = 0
        self.sends: list[dist.Work] = []
        self.lock = threading.Lock()


class _Plan:
    """The keys this server owns in one plan, and how many workers have closed it."""

    def __init__(self, layout: torch.Tensor, dtype: torch.dtype, workers: int) -> None:
        self.layout = layout
        pairs = layout.reshape(-1, 2).tolist()
        self.slots = {key: _Slot(numel, dtype, workers) for key, numel in pairs}
        self.first_key = min(self.slots, default=-1)
        self.closed = 0


class Server:
    """The state of one parameter server, shared by its per-worker threads."""

    def __init__(self, *, num_workers: int, on_round: Callable[[int], None] | None = None) -> None:
        self.workers = num_workers
        self.on_round = on_round
        self.plans: dict[int, _Plan] = {}
        self.lock = threading.Lock()
        self.rounds = 0

    def stream(self, worker: int) -> None:
        """Serve worker `worker`'s control stream until it sends STOP."""
        msg = torch.empty(HEADER, dtype=torch.int64)
        number, plan = -1, None
        while True:
            dist.recv(msg, src=worker, tag=CTRL_TAG)
            op, count, dtype = msg[:3].tolist()
            if op == OPEN:
                layout = torch.empty(2 * int(msg[3]), dtype=torch.int64)  # [key, numel] pairs
                dist.recv(layout, src=worker, tag=LAYOUT_TAG)
                number += 1
                plan = self._open(number, layout, DTYPES[dtype], worker)
            elif op == PUSH:
                for key in msg[3 : 3 + count].tolist():
                    slot = plan.slots[key]
                    dist.recv(slot.inputs[worker], src=worker, tag=KEY_TAG + key)
                    self._arrived(plan, key, slot)
            elif op == CLOSE:
                self._close(number, plan)
            elif op == STOP:
                return
            else:
                raise ValueError(f"unknown control message {op} from worker {worker}")

    def _open(self, number: int, layout: torch.Tensor, dtype: torch.dtype,
              worker: int) -> _Plan:
        with self.lock:
            plan = self.plans.get(number)
            if plan is None:
                plan = self.plans[number] = _Plan(layout, dtype, self.workers)
            elif not torch.equal(plan.layout, layout):
                raise ValueError(f"worker {worker} opened plan {number} with other keys than "
                                 "the workers before it; all workers must run the same method")
        return plan

    def _arrived(self, plan: _Plan, key: int, slot: _Slot) -> None:
        with slot.lock:
            slot.arrived += 1
            if slot.arrived < self.workers:
                return
            slot.arrived = 0
        for work in slot.sends:  # the previous round's answers have left
            work.wait()
        slot.total.copy_(slot.inputs[0])
        for contribution in slot.inputs[1:]:
            slot.total.add_(contribution)
        slot.total.div_(self.workers)
        slot.sends = [dist.isend(slot.total, dst=w, tag=KEY_TAG + key)
                      for w in range(self.workers)]
        if key == plan.first_key and self.on_round is not None:
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


def serve(*, num_workers: int, on_round: Callable[[int], None] | None = None) -> None:
    """Be a parameter server for workers [0, num_workers) until all of them send STOP.

    `on_round(i)` is called after the i-th aggregation round of a plan's first
    key (the harness injects server faults there). Any error, such as a worker
    that died, is raised here, naming this server.
    """
    server = Server(num_workers=num_workers, on_round=on_round)
    errors: list[BaseException] = []

    def run(worker: int) -> None:
        try:
            server.stream(worker)
        except BaseException as exc:  # noqa: BLE001 - re-raised by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(w,), daemon=True, name=f"ps-worker{w}")
               for w in range(num_workers)]
    for t in threads:
        t.start()
    while not errors and (alive := [t for t in threads if t.is_alive()]):
        alive[0].join(POLL_S)
    if errors:
        raise RuntimeError(f"parameter server rank {dist.get_rank()} failed: "
                           f"{errors[0]}") from errors[0]
