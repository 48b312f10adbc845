"""Schedulers: decide when each communication unit is issued and awaited."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from methods.base import GradBuffer, Handle, Transport
from methods.plan import Unit


class AfterBackward:
    """BSP: every unit is issued once backward has finished, in plan order."""

    def attach(
        self, model: nn.Module, *, buffer: GradBuffer, units: list[Unit], transport: Transport
    ) -> None:
        self.buffer, self.units, self.transport = buffer, units, transport

    def synchronize(self) -> None:
        handles = [self._start(i) for i in range(len(self.units))]
        for h in handles:
            h.wait()

    def _start(self, i: int) -> Handle:
        unit = self.units[i]
        return self.transport.start(self.buffer.slice(unit.start, unit.end), key=i)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()

    def drain(self) -> None:
        pass  # synchronize() already waited for everything

    def close(self) -> None:
        pass

    def describe(self) -> dict[str, Any]:
        return {"scheduler": type(self).__name__, "units": [[u.start, u.end] for u in self.units]}


SCHEDULERS = {"after_backward": AfterBackward}
