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
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from contextlib import nullcontext
from typing import Any, Protocol

import torch
from torch import nn

from methods.hostmeter import OFF, HostMeter

# longest sleep between two polls of a communication's completion: on a fast GPU a
# millisecond is a layer's backward, and a credit returned that late idles the link
POLL_MAX_S = 50e-6


def device_sync(device: torch.device) -> None:
    """Wait until the work queued on `device` has run (nothing to wait for on a CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


_STREAMS: dict[tuple[str, int], torch.cuda.Stream] = {}  # (role, GPU index): made once
_STREAMS_LOCK = threading.Lock()


def side_stream(device: torch.device, role: str) -> torch.cuda.Stream | None:
    """The stream of `role` (a method thread, a copy direction) on `device`, the same one
    for the whole process (None on a CPU).

    torch.cuda.Stream() hands out the streams of a pool of 32 per device in turn, and
    ProcessGroupNCCL draws its own from that pool too: made anew per repeat or per plan, a
    role's stream would after about 32 of them be the very stream of another role or of
    NCCL, and work meant to overlap would queue behind it. So each role draws once.
    """
    if device.type != "cuda":
        return None
    key = (role, torch.cuda.current_device() if device.index is None else device.index)
    with _STREAMS_LOCK:
        if key not in _STREAMS:
            _STREAMS[key] = torch.cuda.Stream(device)
        return _STREAMS[key]


def start_thread(target: Callable[[], None], *, name: str, device: torch.device,
                 stream: torch.cuda.Stream | None = None) -> threading.Thread:
    """Start a daemon thread that runs `target` on `device`, and on a GPU on `stream`.

    A fresh thread's current device is GPU 0 and its current stream that GPU's legacy
    default stream, the one the training loop computes on. So the thread first makes
    the rank's device current (torch.cuda.stream entered before that leaves a context
    on GPU 0), then `stream`: what it queues never lands on the compute stream, and is
    ordered against other streams by events alone (`record`, `wait_for`).
    """
    def run() -> None:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            target()

    thread = threading.Thread(target=run, daemon=True, name=name)
    thread.start()
    return thread


def record(device: torch.device) -> torch.cuda.Event | None:
    """An event at the end of the work queued so far on the current stream (CPU: None,
    the work is done when its call returns)."""
    return torch.cuda.current_stream(device).record_event() if device.type == "cuda" else None


def happened(event: torch.cuda.Event | None) -> bool:
    """Whether the work before `event` has run, asked without blocking (CPU: None, it has)."""
    return event is None or event.query()


def wait_for(event: torch.cuda.Event | None, device: torch.device) -> None:
    """Work queued on the current stream from now on runs after `event` (None: nothing)."""
    if event is not None:
        torch.cuda.current_stream(device).wait_event(event)


class Handle(Protocol):
    """One started unit. Two ways to wait for it, which differ on a GPU:

    `wait()`: the unit's average is in place for work queued on the caller's current
    stream from now on (on CPU: it is in place). On a GPU this may return before the
    communication has run. `complete()`: return only once the communication has really
    finished (its link is idle, its memory free); what limits in-flight data (a credit)
    must use this one. Both raise the unit's communication error, and `complete()` a
    TimeoutError after the transport's timeout. `finished()` asks, without blocking and
    from any thread, whether `complete()` would return at once (run.trace's watcher).
    """

    def wait(self) -> None: ...

    def complete(self) -> None: ...

    def finished(self) -> bool: ...


class Done:
    """The handle of a unit with nothing to move (one worker's average is its gradient)."""

    __slots__ = ()

    def wait(self) -> None:
        pass

    def complete(self) -> None:
        pass

    def finished(self) -> bool:
        return True


def poll_until(done: Callable[[], bool], *, timeout_s: float, what: str) -> None:
    """Return once `done()` is true, polling it with a sleep a little longer each time (at
    most POLL_MAX_S); a TimeoutError ("<what> timed out ...", a peer's symptom to
    harness.launch.failure) after `timeout_s` seconds. For waits that must never block in
    a library (a dead peer would hang them)."""
    deadline, pause = time.monotonic() + timeout_s, 1e-5
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} timed out: not complete within {timeout_s:g} s")
        time.sleep(pause)
        pause = min(2 * pause, POLL_MAX_S)


def until_completed(work: Any, *, timeout_s: float, what: str) -> None:
    """Block until `work` (a torch.distributed Work) has really finished, then raise its error.

    `Work.wait()` on NCCL only makes the current stream wait; `is_completed()` queries
    the collective's end (on Gloo's collectives it is True once done), so poll it for at
    most `timeout_s` seconds. Not for Gloo's point-to-point works: their `is_completed()`
    turns True only inside `wait()`.
    """
    poll_until(work.is_completed, timeout_s=timeout_s, what=what)
    work.wait()  # raises the communication's error, if it had one


class Transport(Protocol):
    """Moves a gradient chunk and leaves it reduced over the workers, in place.

    The chunk holds this worker's gradients (autograd's sum, in the flat buffer); `wait`
    leaves the workers' sum, or their average where the reduction averages itself (NCCL's
    AVG, Horovod's Average). `scale` is what the scheduler multiplies the result by
    before the update: 1 / workers after a sum, 1 after an average. `ordered` transports
    (collectives) match messages by issue order, so every rank must start the same chunks
    in the same order; unordered ones (PS) match them by key. `open` learns the plan's units before
    the first `start` of them (`key` is the unit's index); `close` ends that plan.
    """

    ordered: bool
    identity: bool  # nothing to move (one worker on a collective): the method steps aside
    scale: float
    rank: int
    size: int

    def open(self, buffer: GradBuffer, units: list) -> None: ...

    def start(self, chunk: torch.Tensor, *, key: int) -> Handle: ...

    def close(self) -> None: ...

    def describe(self) -> dict[str, Any]: ...


class Scheduler(Protocol):
    """Decides when each unit is issued and awaited, and when the update is applied."""

    def attach(self, model: nn.Module, *, buffer: GradBuffer, units: list,
               transport: Transport, meter: HostMeter = OFF) -> None: ...

    def synchronize(self) -> None: ...

    def step(self, optimizer: torch.optim.Optimizer) -> None: ...

    def zero_grad(self) -> None: ...

    def drain(self) -> None: ...

    def close(self) -> None: ...

    def describe(self) -> dict[str, Any]: ...


class Method(ABC):
    """What the harness needs of a gradient-communication method.

    `meter` times the method's host work and waits (methods/hostmeter.py); the harness
    gives each method its own before `wrap`, and a method times its hooks and waits on it.
    """

    meter: HostMeter = OFF
    units: Sequence = ()  # the plan's communication units, each with its gradients' `params`

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
    """One flat buffer that every gradient lives in, laid out in backward order.

    From construction on, each parameter's `.grad` is a view of its slice of the buffer,
    so autograd accumulates every gradient into the buffer in place (no copy, no second
    gradient tensor) and the communicated result is what the optimizer reads, as DDP's
    `gradient_as_bucket_view`. The buffer holds this worker's sum of gradients: the
    reduction leaves the sum over the workers, and the scheduler multiplies by the
    transport's `scale` (1 / workers, or 1 where the reduction averages itself) before the
    update. `zero()` zeroes the buffer between iterations and keeps the views; anything
    that sets a `.grad` to None (optimizer.zero_grad(), model.zero_grad()) breaks the
    link, and the next gradient hook (or synchronize) refuses it. Every communication unit
    is a contiguous slice: a bucket, one tensor, a merged group or a partition are all
    (start, end).
    """

    def __init__(self, params: list[nn.Parameter], *, names: list[str] | None = None) -> None:
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1:
            raise ValueError(f"parameters must share one dtype, got {sorted(map(str, dtypes))}")
        self.params = params
        self.names = names or [str(i) for i in range(len(params))]  # PS keys follow them
        self.sizes = [p.numel() for p in params]
        self.rows = [p.shape[0] if p.dim() else 1 for p in params]  # size along dimension 0
        self.offsets = [0, *itertools.accumulate(self.sizes)][:-1]
        self.flat = torch.zeros(sum(self.sizes), dtype=params[0].dtype, device=params[0].device)
        self.views = [self.flat[off : off + n].view_as(p)
                      for p, off, n in zip(params, self.offsets, self.sizes)]
        self.none_ready = [False] * len(params)
        self.ready = list(self.none_ready)
        self.attach()

    def attach(self) -> None:
        """Point every `.grad` at its view (before the first backward)."""
        for p, view in zip(self.params, self.views):
            p.grad = view

    def detach(self) -> None:
        """Drop the views that are still attached (the method is closed)."""
        for p, view in zip(self.params, self.views):
            if p.grad is view:
                p.grad = None

    def mark(self, i: int) -> None:
        """Parameter `i`'s gradient is in the buffer (its hook ran): a flag, no copy."""
        if self.ready[i] or self.params[i].grad is not self.views[i]:
            self.refuse(i)
        self.ready[i] = True

    def check(self, i: int) -> None:
        """Raise unless parameter `i`'s `.grad` is still its view of the buffer."""
        if self.params[i].grad is not self.views[i]:
            self.refuse(i)

    def check_all(self) -> None:
        """`check` of every parameter."""
        for i in range(len(self.params)):
            self.check(i)

    def refuse(self, i: int) -> None:
        """The RuntimeError for a gradient that did not land in the buffer once."""
        if self.params[i].grad is not self.views[i]:
            raise RuntimeError(f"the .grad of parameter {self.names[i]!r} is no longer its view "
                               "of the method's gradient buffer (set to None or replaced, e.g. "
                               "by optimizer.zero_grad()); call method.zero_grad() instead")
        raise RuntimeError(f"parameter {self.names[i]!r} got a second gradient in one "
                           "iteration; call method.zero_grad() between iterations")

    def scale(self, factor: float, indices: Iterable[int] | None = None) -> None:
        """Multiply the gradients (all, or those of `indices`) by `factor` in place: the
        reduced sum becomes the average (nothing to do for a factor of 1)."""
        if factor == 1.0:
            return
        if indices is None:
            self.flat.mul_(factor)
            return
        for i in indices:
            self.views[i].mul_(factor)

    def zero(self, indices: Iterable[int] | None = None) -> None:
        """Zero the gradients (all, or those of `indices`) for the next backward; the views
        stay attached."""
        if indices is None:
            self.flat.zero_()
            self.ready[:] = self.none_ready
            return
        for i in indices:
            self.views[i].zero_()
            self.ready[i] = False

    def slice(self, start: int, end: int) -> torch.Tensor:
        return self.flat[start:end]


def backward_order(model: nn.Module) -> list[nn.Parameter]:
    """Trainable parameters, output side first: the order their gradients appear."""
    return [p for _, p in backward_named(model)]


def backward_named(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) of `backward_order`."""
    return [(n, p) for n, p in reversed(list(model.named_parameters())) if p.requires_grad]


class Fused:
    """Pieces that are not next to each other, all-reduced as one (Horovod's fusion
    buffer): copied into one tensor, started, and copied back on `wait`."""

    __slots__ = ("handle", "fused", "chunks")

    def __init__(self, transport: Transport, chunks: list[torch.Tensor], *, key: int) -> None:
        self.chunks = chunks
        self.fused = torch.cat(chunks)
        self.handle = transport.start(self.fused, key=key)

    def wait(self) -> None:
        self.handle.wait()
        for chunk, part in zip(self.chunks, self.fused.split([c.numel() for c in self.chunks])):
            chunk.copy_(part)
        if self.fused.is_cuda:  # made on the issuer's stream, read here on another
            self.fused.record_stream(torch.cuda.current_stream(self.fused.device))

    def complete(self) -> None:
        self.handle.complete()

    def finished(self) -> bool:
        return self.handle.finished()
