"""The method contract, and the engine that composes transport x planner x scheduler.

The training loop drives every method the same way:

    model = method.wrap(model)            # once, before the optimizer is built
    for each iteration:
        loss = model(batch); loss.backward()
        method.synchronize()              # gradients averaged on every rank (or scheduled)
        method.step(optimizer)            # apply the update
        method.zero_grad()
    method.drain()                        # end of a timed window: no communication in flight
    method.close()
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from typing import Any, Protocol

import torch
from torch import nn


class Handle(Protocol):
    def wait(self) -> None: ...


class Transport(Protocol):
    """Moves a gradient chunk and leaves it averaged over the workers, in place."""

    def start(self, chunk: torch.Tensor, *, key: int) -> Handle: ...


class Method(ABC):
    """What the harness needs of a gradient-communication method."""

    @abstractmethod
    def wrap(self, model: nn.Module) -> nn.Module:
        """Prepare `model` (hooks, buffers, wrappers); return the module to call."""

    def synchronize(self) -> None:
        """After backward: return when the gradients are averaged (if the method waits here)."""

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()

    @abstractmethod
    def zero_grad(self) -> None: ...

    def drain(self) -> None:
        """Return only when no communication of past iterations is in flight."""

    def close(self) -> None:
        """Remove hooks and release resources."""

    def plan(self) -> dict[str, Any]:
        """The method's chosen plan (stored with the results)."""
        return {}


class GradBuffer:
    """One flat buffer holding every gradient, laid out in backward order.

    Each parameter's `.grad` is a view into it, so backward accumulates straight
    into the buffer and every communication unit is a contiguous slice: a
    bucket, one tensor, a merged group or a partition are all (start, end).
    """

    def __init__(self, params: list[nn.Parameter]) -> None:
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1:
            raise ValueError(f"parameters must share one dtype, got {sorted(map(str, dtypes))}")
        self.params = params
        self.sizes = [p.numel() for p in params]
        self.offsets = [0, *itertools.accumulate(self.sizes)][:-1]
        self.flat = torch.zeros(sum(self.sizes), dtype=params[0].dtype, device=params[0].device)
        for p, off, n in zip(params, self.offsets, self.sizes):
            p.grad = self.flat[off : off + n].view_as(p)

    def slice(self, start: int, end: int) -> torch.Tensor:
        return self.flat[start:end]


def backward_order(model: nn.Module) -> list[nn.Parameter]:
    """Trainable parameters, output side first: the order their gradients appear."""
    return [p for p in reversed(list(model.parameters())) if p.requires_grad]


class Engine(Method):
    """A method built from a transport, a planner and a scheduler (DESIGN.md, Table I)."""

    def __init__(self, *, name: str, transport: Transport, planner: Any, scheduler: Any) -> None:
        self.name = name
        self.transport = transport
        self.planner = planner
        self.scheduler = scheduler
        self.buffer: GradBuffer | None = None

    def wrap(self, model: nn.Module) -> nn.Module:
        self.buffer = GradBuffer(backward_order(model))
        units = self.planner.plan(self.buffer.sizes)
        self.scheduler.attach(model, buffer=self.buffer, units=units, transport=self.transport)
        return model

    def synchronize(self) -> None:
        self.scheduler.synchronize()

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        self.scheduler.step(optimizer)

    def zero_grad(self) -> None:
        self.buffer.flat.zero_()

    def drain(self) -> None:
        self.scheduler.drain()

    def close(self) -> None:
        self.scheduler.close()

    def plan(self) -> dict[str, Any]:
        return {"method": self.name, **self.planner.describe(), **self.scheduler.describe()}
