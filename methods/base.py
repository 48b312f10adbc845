"""The method contract, the flat gradient buffer, and the pieces' interfaces.

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
    """Moves a gradient chunk and leaves it averaged over the workers, in place.

    `ordered` transports (collectives) match messages by issue order, so every
    rank must start the same chunks in the same order; unordered ones (PS)
    match them by key. `open` learns the plan's units before the first `start`
    of them (`key` is the unit's index); `close` ends that plan.
    """

    ordered: bool
    identity: bool  # nothing to move (one worker on a collective): the method steps aside
    rank: int
    size: int

    def open(self, buffer: GradBuffer, units: list) -> None: ...

    def start(self, chunk: torch.Tensor, *, key: int) -> Handle: ...

    def close(self) -> None: ...

    def describe(self) -> dict[str, Any]: ...


class Scheduler(Protocol):
    """Decides when each unit is issued and awaited, and when the update is applied."""

    def attach(self, model: nn.Module, *, buffer: GradBuffer, units: list,
               transport: Transport) -> None: ...

    def synchronize(self) -> None: ...

    def step(self, optimizer: torch.optim.Optimizer) -> None: ...

    def zero_grad(self) -> None: ...

    def drain(self) -> None: ...

    def close(self) -> None: ...

    def describe(self) -> dict[str, Any]: ...


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

    def param_slice(self, i: int) -> torch.Tensor:
        """The gradient of parameter `i` (backward order), flat."""
        return self.flat[self.offsets[i] : self.offsets[i] + self.sizes[i]]


def backward_order(model: nn.Module) -> list[nn.Parameter]:
    """Trainable parameters, output side first: the order their gradients appear."""
    return [p for p in reversed(list(model.parameters())) if p.requires_grad]
