"""Schedulers: decide when each communication unit is issued and awaited.

- `after_backward` (BSP): every unit once backward has finished.
- `on_ready` (WFBP, MG-WFBP): a unit as soon as all its gradients are ready,
  from the gradient hooks, so communication overlaps the rest of backward.
- `priority` (ByteScheduler, methods/priority.py): partitions from a priority
  queue under a credit, updates per layer, overlapping the next forward.

Every scheduler takes `hook_delay_s` (sleep a random 0..hook_delay_s seconds
in each gradient hook, drawn per rank from `delay_seed`): tests use it to
prove that ranks issue collectives in one order whatever the timing.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from methods.base import GradBuffer, Handle, Transport
from methods.delay import HookDelay
from methods.hostmeter import OFF, HostMeter
from methods.plan import Unit
from methods.priority import Priority


class AfterBackward:
    """BSP: every unit is issued once backward has finished, in plan order."""

    def __init__(self, *, hook_delay_s: float = 0.0, delay_seed: int = 0,
                 timeout_s: float = 300.0) -> None:
        self.hook_delay_s = hook_delay_s  # no gradient hooks: nothing to delay
        self.waited: list[Handle] = []  # awaited, but on a GPU perhaps still running

    def attach(self, model: nn.Module, *, buffer: GradBuffer, units: list[Unit],
               transport: Transport, meter: HostMeter = OFF) -> None:
        self.buffer, self.units, self.transport, self.meter = buffer, units, transport, meter
        self.chunks = [buffer.slice(u.start, u.end) for u in units]  # made once, not per issue

    def synchronize(self) -> None:
        """Autograd summed every gradient into the buffer: reduce the units, then scale."""
        self.buffer.check_all()
        handles = [self._start(i) for i in range(len(self.units))]
        self._finish(handles)

    def _finish(self, handles: list[Handle]) -> None:
        """Wait for every unit, then turn the reduced sum into the average (in place)."""
        for h in handles:
            self.meter.wait(h.wait)
        self.buffer.scale(self.transport.scale)
        self.waited = handles

    def _start(self, i: int) -> Handle:
        return self.transport.start(self.chunks[i], key=i)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()

    def zero_grad(self) -> None:
        """Zero the buffer; every `.grad` stays its view."""
        self.buffer.zero()

    def drain(self) -> None:
        """synchronize() already waited for everything; on a GPU, let it really finish."""
        for h in self.waited:
            h.complete()
        self.waited = []

    def close(self) -> None:
        pass

    def describe(self) -> dict[str, Any]:
        return {"scheduler": "after_backward",
                "units": [[u.start, u.end] for u in self.units]}


class OnReady(AfterBackward):
    """WFBP: a unit is issued from the gradient hooks as soon as all its tensors are ready.

    A hook (`register_post_accumulate_grad_hook`: autograd has just added the gradient
    into the buffer) marks its tensor ready and, when that completes its unit, issues
    it; nothing else, and nothing allocated unless a unit goes. On an ordered transport
    (collectives) units go in plan order: a unit that is ready waits for the ones ahead
    of it, so every rank issues the same sequence whatever the timing of its hooks.
    Unordered transports (PS) issue at once. `synchronize` issues what never became
    ready (unused parameters: their slices hold zeros) and waits.
    """

    def __init__(self, *, hook_delay_s: float = 0.0, delay_seed: int = 0,
                 timeout_s: float = 300.0) -> None:
        self.hook_delay_s, self.delay_seed = hook_delay_s, delay_seed
        self.hooks: list[RemovableHandle] = []
        self.waited: list[Handle] = []

    def attach(self, model: nn.Module, *, buffer: GradBuffer, units: list[Unit],
               transport: Transport, meter: HostMeter = OFF) -> None:
        super().attach(model, buffer=buffer, units=units, transport=transport, meter=meter)
        self.delay = HookDelay(self.hook_delay_s, seed=self.delay_seed, rank=transport.rank)
        self.unit_of = [0] * len(buffer.params)
        for u, unit in enumerate(units):
            for i in unit.params:
                self.unit_of[i] = u
        self.counts = [len(u.params) for u in units]
        self.missing, self.issued = list(self.counts), [False] * len(units)
        self.hooks = [p.register_post_accumulate_grad_hook(meter.hook(self._hook(i), i))
                      for i, p in enumerate(buffer.params)]
        self._reset()

    def _reset(self) -> None:
        self.missing[:] = self.counts
        self.issued[:] = [False] * len(self.units)
        self.next = 0
        self.handles: list[Handle] = []

    def _hook(self, i: int):
        buffer, u, missing = self.buffer, self.unit_of[i], self.missing

        def ready(_param: torch.Tensor) -> None:
            buffer.mark(i)
            missing[u] -= 1
            if missing[u] == 0:
                self._issue(u)
        return self.delay.wrap(ready)

    def _issue(self, u: int) -> None:
        if not self.transport.ordered:
            self._issue_one(u)
            return
        while self.next < len(self.units) and self.missing[self.next] <= 0:
            self._issue_one(self.next)
            self.next += 1

    def _issue_one(self, u: int) -> None:
        if not self.issued[u]:
            self.issued[u] = True
            self.handles.append(self._start(u))

    def synchronize(self) -> None:
        for u in range(len(self.units)):  # in plan order: units whose tensors got no gradient
            if not self.issued[u]:
                for i in self.units[u].params:
                    self.buffer.check(i)
            self._issue_one(u)
        self._finish(self.handles)
        self._reset()

    def close(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks.clear()

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "scheduler": "on_ready"}


SCHEDULERS = {"after_backward": AfterBackward, "on_ready": OnReady, "priority": Priority}
