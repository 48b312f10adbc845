"""ByteScheduler: partitions from a priority queue under a credit, updates per layer.

Gradient hooks put a tensor's partitions into a queue ordered by the tensor's
index in the model, input side first (its gradient is needed first by the next
forward). An issuer thread starts the highest-priority partition while fewer
than `credit` elements are in flight (one always may go). A completer thread
waits for partitions in issue order and, when a layer's last partition is back,
applies that layer's update (methods/layerwise.py); the next forward of the
layer waits only for that. A partition's credit comes back only once its
communication has really finished (`Handle.complete`: on a GPU `wait` only
orders the stream). `synchronize` and `step` therefore return at once; `drain`
waits until every update is applied and nothing is in flight.

With several ranks, rank 0 decides the issue order and the others follow it
(methods/order.py). Collectives need that to be correct at all. PS messages
are matched by key, but a partition's pull completes only once every worker
has pushed it, so workers whose credit windows held different partitions
could wait for each other forever; one order makes the windows agree.
"""

from __future__ import annotations

import heapq
import queue
import threading
import time
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from methods.base import GradBuffer, Transport
from methods.delay import HookDelay
from methods.layerwise import LayerUpdates
from methods.order import STOP, OrderFollower, OrderLeader
from methods.plan import Unit, size_in_elements

JOIN_S = 10.0


class Failure:
    """The first error a communication thread met. The scheduler and its LayerUpdates share
    it, so LayerUpdates holds no reference back to the scheduler (no cycle to collect)."""

    __slots__ = ("error",)

    def __init__(self) -> None:
        self.error: BaseException | None = None

    def check(self) -> None:
        """Raise the error a communication thread met, if any."""
        if self.error is not None:
            raise RuntimeError(f"communication failed: {self.error}") from self.error


class Priority:
    """The priority scheduler with credit (Peng et al., SOSP 2019), as the study ran it."""

    def __init__(self, *, credit_elements: int | None = None, credit_bytes: int | None = None,
                 hook_delay_s: float = 0.0, delay_seed: int = 0,
                 timeout_s: float = 300.0) -> None:
        for name, value in (("credit_elements", credit_elements), ("credit_bytes", credit_bytes)):
            if value is not None and value <= 0:
                raise ValueError(f"scheduler {name}={value} is invalid; it must be > 0")
        self.credit_spec = (credit_elements, credit_bytes)
        self.hook_delay_s, self.delay_seed = hook_delay_s, delay_seed
        self.timeout_s = timeout_s
        self.failure = Failure()
        self.threads: list[threading.Thread] = []
        self.hooks: list[RemovableHandle] = []

    # -- set-up ---------------------------------------------------------------------------

    def attach(self, model: nn.Module, *, buffer: GradBuffer, units: list[Unit],
               transport: Transport) -> None:
        self.buffer, self.units, self.transport = buffer, units, transport
        self.credit = self._credit(buffer.flat.element_size())
        self.layers = LayerUpdates(model, buffer, timeout_s=self.timeout_s,
                                   check=self.failure.check)
        self._index(len(buffer.params))
        self.delay = HookDelay(self.hook_delay_s, seed=self.delay_seed, rank=transport.rank)
        self.role = "local"
        if transport.size > 1:
            self.role = "leader" if transport.rank == 0 else "follower"
        self.order = {"leader": OrderLeader, "follower": OrderFollower}.get(self.role)
        self.order = self.order(transport.group) if self.order else None
        self.cond = threading.Condition()
        self.heap: list[tuple[tuple[int, int], int]] = []
        self.ready = [False] * len(units)  # followers: ready here, not yet issued
        self.inflight = 0
        self.busy = 0  # layers between their first ready gradient and their update
        self.iteration = 0
        self.stopping = False
        self.done: queue.SimpleQueue = queue.SimpleQueue()
        self.hooks = [p.register_post_accumulate_grad_hook(self._hook(i))
                      for i, p in enumerate(buffer.params)]
        issue = self._follow if self.role == "follower" else self._issue
        self.threads = [threading.Thread(target=self._guard(issue), daemon=True, name="issuer"),
                        threading.Thread(target=self._guard(self._complete), daemon=True,
                                         name="completer")]
        for t in self.threads:
            t.start()

    def _credit(self, element_size: int) -> int:
        elements, nbytes = self.credit_spec
        if elements is None and nbytes is None:
            elements = 16_000_000  # the study's ByteScheduler-A2A credit
        credit = size_in_elements(elements=elements, nbytes=nbytes, element_size=element_size,
                                  what="scheduler credit")
        largest = max((u.numel for u in self.units), default=0)
        if credit < largest:
            raise ValueError(f"scheduler credit of {credit} elements is smaller than the "
                             f"largest partition ({largest} elements); raise the credit or "
                             "lower the planner's partition")
        return credit

    def _index(self, n: int) -> None:
        """Per parameter its units; per unit its priority (input side first) and layer."""
        self.units_of = [[] for _ in range(n)]
        for u, unit in enumerate(self.units):
            if len(unit.params) != 1:
                raise ValueError("the priority scheduler needs units of one tensor each "
                                 "(planner: partition or per_tensor)")
            self.units_of[unit.params[0]].append(u)
        self.priority = [(n - 1 - unit.params[0], unit.start) for unit in self.units]
        self.layer_of_unit = [self.layers.layer_of[unit.params[0]] for unit in self.units]
        self.layer_units = [0] * len(self.layers.names)
        for layer in self.layer_of_unit:
            self.layer_units[layer] += 1
        self.remaining = [0] * len(self.layers.names)
        self.layer_iter = [-1] * len(self.layers.names)  # iteration a layer is busy in
        self.marked = [-1] * n  # iteration a parameter's gradient was last ready in

    # -- gradient hooks (main thread, during backward) -----------------------------------

    def _hook(self, i: int):
        def ready(_param: torch.Tensor) -> None:
            self.delay()
            self._mark(i)
        return ready

    def _mark(self, i: int) -> None:
        layer = self.layers.layer_of[i]
        with self.cond:
            if self.marked[i] == self.iteration or self.layer_iter[layer] not in (-1,
                                                                                  self.iteration):
                raise RuntimeError(
                    f"the gradient of a parameter of layer {self.layers.names[layer]!r} was "
                    "produced before its previous update was applied; the priority scheduler "
                    "needs every parameter used only inside the forward of its own module")
        self.buffer.collect(i)  # outside the lock; nothing reads it before it is queued below
        with self.cond:
            self.marked[i] = self.iteration
            if self.layer_iter[layer] == -1:
                self.layer_iter[layer] = self.iteration
                self.remaining[layer] = self.layer_units[layer]
                self.busy += 1
                self.layers.begin(layer)
            for u in self.units_of[i]:
                if self.role == "follower":
                    self.ready[u] = True
                else:
                    heapq.heappush(self.heap, (self.priority[u], u))
            self.cond.notify_all()

    # -- threads ----------------------------------------------------------------------

    def _guard(self, loop):
        def run() -> None:
            try:
                loop()
            except BaseException as exc:  # noqa: BLE001 - handed to the main thread
                self._fail(exc)
        return run

    def _fail(self, exc: BaseException) -> None:
        with self.cond:
            if self.failure.error is None:
                self.failure.error = exc
            self.stopping = True
            self.cond.notify_all()
        self.layers.release()

    def _issue(self) -> None:
        """Leader or independent rank: start the best ready partition the credit allows."""
        while True:
            with self.cond:
                while not self.stopping and not self._may_issue():
                    self.cond.wait()
                if self.stopping:
                    return
                _, u = heapq.heappop(self.heap)
                self.inflight += self.units[u].numel
            if self.order is not None:
                self.order.announce(u)
            self._start(u)

    def _may_issue(self) -> bool:
        if not self.heap:
            return False
        numel = self.units[self.heap[0][1]].numel
        return self.inflight == 0 or self.inflight + numel <= self.credit

    def _follow(self) -> None:
        """Follower: start exactly the units rank 0 announces, each once it is ready here."""
        while (u := self.order.next()) != STOP:
            deadline = time.monotonic() + self.timeout_s
            with self.cond:
                while not self.ready[u] and not self.stopping:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TimeoutError(f"rank 0 issued partition {u}, whose gradient was "
                                           f"not ready here within {self.timeout_s:g} s")
                    self.cond.wait(left)
                if self.stopping:
                    return
                self.ready[u] = False
                self.inflight += self.units[u].numel
            self._start(u)

    def _start(self, u: int) -> None:
        unit = self.units[u]
        self.done.put((u, self.transport.start(self.buffer.slice(unit.start, unit.end), key=u)))

    def _complete(self) -> None:
        """Wait for partitions in issue order; update each layer when its last one is back;
        return a partition's credit once its communication has really finished."""
        while (item := self.done.get()) is not None:
            u, handle = item
            handle.wait()  # the update below, queued after this, reads the average
            layer = self.layer_of_unit[u]
            with self.cond:
                self.remaining[layer] -= 1
                finished = self.remaining[layer] == 0
                if finished:
                    self.layer_iter[layer] = -1
            if finished:
                self.layers.apply(layer)
            handle.complete()
            with self.cond:
                self.inflight -= self.units[u].numel
                self.busy -= int(finished)
                self.cond.notify_all()

    # -- the training loop's calls (main thread) --------------------------------------

    def check(self) -> None:
        """Raise the error a communication thread met, if any."""
        self.failure.check()

    def synchronize(self) -> None:
        """Nothing to wait for; send the gradients of unused parameters too."""
        self.check()
        for i in range(len(self.buffer.params)):
            if self.marked[i] != self.iteration:
                self._mark(i)
        with self.cond:
            self.iteration += 1

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """Layers are updated as their gradients come back, with `optimizer`'s settings."""
        self.check()
        self.layers.bind(optimizer)

    def zero_grad(self) -> None:
        """Each layer's gradients are released right after its update."""

    def drain(self) -> None:
        """Return once every update is applied and no partition is in flight."""
        deadline = time.monotonic() + self.timeout_s
        with self.cond:
            while (self.busy or self.inflight) and self.failure.error is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{self.busy} layers still waited for their gradients "
                                       f"({self.inflight} elements in flight) after "
                                       f"{self.timeout_s:g} s")
                self.cond.wait(left)
        self.check()

    def close(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        issuer, completer = self.threads or (None, None)
        if self.role == "leader":
            issuer.join(JOIN_S)
            if self.failure.error is None:
                self.order.close()
        elif issuer is not None:
            issuer.join(JOIN_S if self.failure.error is None else 0.1)
        if completer is not None:
            self.done.put(None)
            completer.join(JOIN_S)
        for h in self.hooks:
            h.remove()
        self.hooks.clear()
        self.layers.close()
        self.threads = []

    def describe(self) -> dict[str, Any]:
        return {"scheduler": "priority", "credit_elements": self.credit, "order": self.role,
                "units": [[u.start, u.end] for u in self.units]}
