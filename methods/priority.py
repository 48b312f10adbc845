"""ByteScheduler: partitions from a priority queue under a credit, updates per layer.

Gradient hooks queue a tensor's partitions by the tensor's index, input side first (the
next forward needs it first). An issuer thread starts the best partition while any credit
is left (ByteScheduler blocks only while the remaining credit is <= 0: up to credit plus
one piece is in flight, none refused). A partition is ready once its gradient is in the
buffer: on a CPU when its hook runs; on a GPU once the event its hook recorded has happened
(asked oldest first, outside the hooks' lock, each once, stopping at the first that has
not), since the host runs ahead and rank 0 would otherwise pick a piece the GPU has yet to
make, holding back the ready ones. A completer thread waits for partitions in issue order;
once one has really finished (`Handle.complete`: on a GPU `wait` only orders the stream)
its credit comes back, and a layer whose last partition it was goes to an updater thread,
which applies its update (methods/layerwise.py); the layer's next forward waits only for
that. As in ByteScheduler, whose core returns credit in its finish callbacks and whose
plug-in's poller steps the parameters, no update holds back a partition's credit.
`synchronize` and `step` return at once; `drain` waits for every update and partition.
With `cycle_s` the pieces go as ByteScheduler's went through Horovod: those issued within
one cycle start together at its end, consecutive ones fused into one all-reduce of at most
`fusion_bytes` (Horovod's fusion buffer: copied unless they lie next to each other).

On a GPU each thread queues its work on a stream of its own (methods/base.py
`start_thread`), never on the compute stream, and streams are ordered by events alone: the
issuer's stream waits for the event a gradient hook recorded, the completer's for the
piece's communication (`Handle.wait`), the updater's for an event the completer recorded
after that; the compute stream waits for a layer's update only before its next forward.

With several ranks, rank 0 decides the issue order (and the fused groups) and the others
follow it (methods/order.py): collectives need that to be correct at all. Horovod matches
pieces by name (`ordered = False`): as its ByteScheduler plug-in, rank 0 schedules, the
others submit each piece once ready, and Horovod's coordinator keeps rank 0's order. PS
messages are matched by key, but a pull completes only once every worker has pushed, so
workers whose credit windows held different partitions could wait for each other forever;
one order makes the windows agree, and rank 0's credit bounds every worker's pushes.
"""

from __future__ import annotations

import heapq
import math
import queue
import threading
import time
from collections import deque
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from methods.base import (
    POLL_MAX_S,
    Fused,
    GradBuffer,
    Transport,
    happened,
    record,
    side_stream,
    start_thread,
    wait_for,
)
from methods.delay import HookDelay
from methods.hostmeter import OFF, HostMeter
from methods.layerwise import Failure, LayerUpdates
from methods.order import OrderFollower, OrderLeader
from methods.plan import Unit, credit_in_elements, fuse_pieces

JOIN_S = 10.0


class Priority:
    """The priority scheduler with credit (Peng et al., SOSP 2019), as the study ran it."""

    def __init__(self, *, credit_elements: int | None = None, credit_bytes: int | None = None,
                 cycle_s: float = 0.0, fusion_bytes: int | None = None,
                 hook_delay_s: float = 0.0, delay_seed: int = 0,
                 timeout_s: float = 300.0) -> None:
        for name, value in (("credit_elements", credit_elements), ("credit_bytes", credit_bytes),
                            ("fusion_bytes", fusion_bytes)):
            if value is not None and value <= 0:
                raise ValueError(f"scheduler {name}={value} is invalid; it must be > 0")
        if cycle_s < 0:
            raise ValueError(f"scheduler cycle_s={cycle_s} is invalid; it must be >= 0")
        self.credit_spec = (credit_elements, credit_bytes)
        self.cycle_s, self.fusion_bytes = cycle_s, fusion_bytes
        self.hook_delay_s, self.delay_seed = hook_delay_s, delay_seed
        self.timeout_s = timeout_s
        self.failure = Failure()
        self.threads: list[threading.Thread] = []
        self.hooks: list[RemovableHandle] = []

    # -- set-up ---------------------------------------------------------------------------

    def attach(self, model: nn.Module, *, buffer: GradBuffer, units: list[Unit],
               transport: Transport, meter: HostMeter = OFF) -> None:
        self.buffer, self.units, self.transport = buffer, units, transport
        if (self.cycle_s or self.fusion_bytes) and not getattr(transport, "fuses", False):
            raise ValueError("scheduler cycle_s and fusion_bytes need a transport that can fuse "
                             "pieces (allreduce)")
        elements, nbytes = self.credit_spec
        self.credit = credit_in_elements(elements=elements, nbytes=nbytes,
                                         element_size=buffer.flat.element_size())
        self.layers = LayerUpdates(model, buffer, timeout_s=self.timeout_s, meter=meter,
                                   check=self.failure.check, scale=transport.scale)
        self._index(len(buffer.params))
        self.delay = HookDelay(self.hook_delay_s, seed=self.delay_seed, rank=transport.rank)
        coordinated = getattr(transport, "coordinated", False)  # Horovod's (module docstring)
        self.role = ("local" if transport.size == 1 else "leader" if transport.rank == 0 else
                     "submitter" if coordinated else "follower")
        if self.role == "submitter":  # submits at once: rank 0's credit alone holds back
            self.credit = math.inf
        order = {"leader": OrderLeader, "follower": OrderFollower}.get(self.role)
        self.order = order(transport.group) if order and not coordinated else None
        self.cond = threading.Condition()
        self.heap: list[tuple[tuple[int, int], int]] = []  # ready here, by priority
        # GPU: (parameter, its gradient's event), hooked but not yet seen to have happened,
        # in record order (all on the compute stream, so they happen in this order too)
        self.unready: deque[tuple[int, torch.cuda.Event]] = deque()
        self.ready = [False] * len(units)  # followers: ready here, not yet issued
        self.inflight = 0
        self.busy = 0  # layers between their first ready gradient and their update
        self.iteration = 0
        self.stopping = False
        self.done: queue.SimpleQueue = queue.SimpleQueue()  # (units, handle), issue order
        self.finished: queue.SimpleQueue = queue.SimpleQueue()  # (layers, event) to update
        self.hooks = [p.register_post_accumulate_grad_hook(meter.hook(self._hook(i), i))
                      for i, p in enumerate(buffer.params)]
        issue = self._follow if self.role == "follower" else self._issue
        self.device = device = buffer.flat.device
        self.threads = [start_thread(self._guard(loop), name=name, device=device,
                                     stream=side_stream(device, name))
                        for loop, name in ((issue, "issuer"), (self._complete, "completer"),
                                           (self._update, "updater"))]

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
        self.layer_units = [self.layer_of_unit.count(x) for x in range(len(self.layers.names))]
        self.remaining = [0] * len(self.layers.names)
        self.layer_iter = [-1] * len(self.layers.names)  # iteration a layer is busy in
        self.marked = [-1] * n  # iteration a parameter's gradient was last ready in
        self.collected: list[torch.cuda.Event | None] = [None] * n  # GPU: gradient in buffer
        self.one = [[i] for i in range(n)]  # made once: a hook queues without allocating

    # -- gradient hooks (main thread, during backward) -----------------------------------

    def _hook(self, i: int):
        return self.delay.wrap(lambda _param: self._mark(i))

    def _mark(self, i: int) -> None:
        """Parameter `i`'s gradient is in the buffer (autograd added it into its view, after
        the forward waited for the layer's last update and zeroing): queue its partitions."""
        layer = self.layers.layer_of[i]
        self.buffer.check(i)
        self.collected[i] = event = record(self.device)
        with self.cond:
            busy_in = self.layer_iter[layer]
            if self.marked[i] == self.iteration or busy_in not in (-1, self.iteration):
                raise RuntimeError(
                    f"the gradient of a parameter of layer {self.layers.names[layer]!r} was "
                    "produced before its previous update was applied; the priority scheduler "
                    "needs every parameter used only inside the forward of its own module")
            self.marked[i] = self.iteration
            if self.layer_iter[layer] == -1:
                self.layer_iter[layer] = self.iteration
                self.remaining[layer] = self.layer_units[layer]
                self.busy += 1
                self.layers.begin(layer)
            if self.role == "follower":  # rank 0 chooses; the stream waits for the event
                for u in self.units_of[i]:
                    self.ready[u] = True
            elif event is None:  # CPU: the gradient is in the buffer now
                self._queue(self.one[i])
            else:  # GPU: queued by the issuer once its event has happened
                self.unready.append((i, event))
            # wake the issuer only if it can act: out of credit, the completer wakes it
            # when credit comes back (a wake-up per hook is a thread switch per tensor)
            if self.role == "follower" or self.inflight < self.credit:
                self.cond.notify_all()

    def _queue(self, params: list[int]) -> None:
        """Queue by priority the partitions of `params`, whose gradients are in the buffer;
        the caller holds the lock."""
        for i in params:
            for u in self.units_of[i]:
                heapq.heappush(self.heap, (self.priority[u], u))

    def _promote(self) -> list[int]:
        """The issuer, outside the lock (a gradient hook waits on it): the hooked parameters
        whose gradient's event has happened, in record order, asking each event once and
        stopping at the first that has not (those after it cannot have happened either)."""
        ready = []
        while self.unready and happened(self.unready[0][1]):
            ready.append(self.unready.popleft()[0])
        return ready

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
        """Leader or independent rank: start the best ready partitions while credit is left,
        each at once, or with `cycle_s` those of one cycle together at its end."""
        batch: list[int] = []
        self.origin = self.tick = time.monotonic()
        while True:
            ready = self._promote()  # GPU: the events, asked outside the lock
            with self.cond:
                self._queue(ready)
                go = self._take(batch)
                if self.stopping:
                    return
            if not go:
                continue
            for group in self._fuse(batch):
                if self.order is not None:
                    self.order.announce(group)
                self._start(group)
            batch = []

    def _take(self, batch: list[int]) -> bool:
        """Under the lock: move the best queued partitions into `batch` while credit is left.
        True: start `batch` now; False: ask the hooked gradients' events again (GPU) first,
        at once when hooks came since they were asked, else after a pause of POLL_MAX_S."""
        asked = True  # the events were asked just before
        while not self.stopping:
            if self.heap and self.inflight < self.credit:
                _, u = heapq.heappop(self.heap)
                self.inflight += self.units[u].numel
                batch.append(u)
                if not self.cycle_s:
                    return True
                if len(batch) == 1:  # Horovod's loop runs every cycle from the start
                    self.tick = self.origin + math.ceil((time.monotonic() - self.origin) /
                                                        self.cycle_s) * self.cycle_s
                continue
            left = self.tick - time.monotonic() if batch else None
            if left is not None and left <= 0:
                return True
            if self.unready and self.inflight < self.credit:  # GPU: events to ask again
                if asked:
                    self.cond.wait(POLL_MAX_S if left is None else min(left, POLL_MAX_S))
                return False
            self.cond.wait(left)
            asked = False
        return False

    def _fuse(self, batch: list[int]) -> list[list[int]]:
        """Consecutive pieces of `batch` fused up to `fusion_bytes` (else each alone)."""
        limit = (self.fusion_bytes or 0) // self.buffer.flat.element_size()
        groups = fuse_pieces([self.units[u].numel for u in batch], limit)
        return [[batch[i] for i in group] for group in groups]

    def _follow(self) -> None:
        """Follower: start exactly the groups rank 0 announces, each once it is ready here."""
        while (group := self.order.next()) is not None:
            deadline = time.monotonic() + self.timeout_s
            with self.cond:
                while not all(self.ready[u] for u in group) and not self.stopping:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TimeoutError(f"rank 0 issued partitions {group}, whose gradients "
                                           f"were not ready here within {self.timeout_s:g} s")
                    self.cond.wait(left)
                if self.stopping:
                    return
                for u in group:
                    self.ready[u] = False
                    self.inflight += self.units[u].numel
            self._start(group)

    def _start(self, group: list[int]) -> None:
        for u in group:  # this thread's stream: after the pieces' gradients are in the buffer
            wait_for(self.collected[self.units[u].params[0]], self.device)
        units = sorted((self.units[u] for u in group), key=lambda unit: unit.start)
        if all(a.end == b.start for a, b in zip(units, units[1:])):  # one slice of the buffer
            chunk = self.buffer.slice(units[0].start, units[-1].end)
            handle = self.transport.start(chunk, key=group[0])
        else:
            handle = Fused(self.transport, [self.buffer.slice(u.start, u.end) for u in units],
                           key=group[0])
        self.done.put((group, handle))

    def _complete(self) -> None:
        """Wait for partitions in issue order; once one's communication has really finished,
        return its credit, and hand the updater each layer whose last partition it was."""
        while (item := self.done.get()) is not None:
            group, handle = item
            handle.wait()  # the updates, queued after the event below, read the average
            handle.complete()
            finished = []
            with self.cond:
                self.inflight -= sum(self.units[u].numel for u in group)
                for u in group:
                    layer = self.layer_of_unit[u]
                    self.remaining[layer] -= 1
                    if self.remaining[layer] == 0:
                        self.layer_iter[layer] = -1
                        finished.append(layer)
                self.cond.notify_all()
            if finished:
                self.finished.put((finished, record(self.device)))

    def _update(self) -> None:
        """Apply each finished layer's update, in the order the layers finished."""
        while (item := self.finished.get()) is not None:
            layers, averaged = item
            wait_for(averaged, self.device)
            for layer in layers:
                self.layers.apply(layer)
            with self.cond:
                self.busy -= len(layers)
                self.cond.notify_all()

    # -- the training loop's calls (main thread) --------------------------------------

    def check(self) -> None:
        """Raise the error a communication thread met, if any."""
        self.failure.check()

    def synchronize(self) -> None:
        """Nothing to wait for; send the gradients of unused parameters too."""
        self.check()
        for i in range(len(self.buffer.params)):
            if self.marked[i] != self.iteration:  # no gradient: its slice holds the zeros
                self.layers.after_update(self.layers.layer_of[i])  # of its last update
                self._mark(i)
        with self.cond:
            self.iteration += 1

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """Layers are updated as their gradients come back, with `optimizer`'s settings."""
        self.check()
        self.layers.bind(optimizer)

    def zero_grad(self) -> None:
        """Each layer's gradients are zeroed right after its update (methods/layerwise.py)."""

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
        self.layers.settle()  # GPU: what the caller queues next comes after every update

    def close(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        issuer, completer, updater = self.threads or (None, None, None)
        if self.order is not None and self.role == "leader":
            issuer.join(JOIN_S)
            if self.failure.error is None:
                self.order.close()
        elif issuer is not None:
            issuer.join(JOIN_S if self.failure.error is None else 0.1)
        if completer is not None:
            self.done.put(None)
            completer.join(JOIN_S)
            self.finished.put(None)  # after every layer the completer handed on
            updater.join(JOIN_S)
        for h in self.hooks:
            h.remove()
        self.hooks.clear()
        self.layers.close()
        self.threads = []

    def describe(self) -> dict[str, Any]:
        credit = None if self.credit == math.inf else self.credit  # a submitter's: none
        return {"scheduler": "priority", "credit_elements": credit, "order": self.role,
                "cycle_s": self.cycle_s, "fusion_bytes": self.fusion_bytes,
                "units": [[u.start, u.end] for u in self.units]}
