"""Horovod transport: each unit summed by Horovod's asynchronous all-reduce.

The planner and scheduler decide what a unit is and when it is submitted; Horovod's
background thread decides when it runs. Every cycle it agrees with the other ranks
on which named tensors all of them have submitted, packs those that fit into its
fusion buffer and all-reduces them (Gloo on CPU tensors, NCCL on GPU ones), with the
cycle time and fusion threshold the harness gave hvd.init (harness/launch/horovod.py). Units
are matched across ranks by name, not by issue order, so ranks may submit them in any
order (`ordered = False`), as WFBP's gradient hooks did on Horovod.

`methods.params.on_engine` turns a method's config into its Horovod twin (without torch:
the configuration checks it). Horovod is imported on first use, so native methods never
need it installed.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from methods.base import Done, GradBuffer, poll_until
from methods.plan import Unit


def _horovod() -> tuple[Any, str]:
    """Horovod's torch API and its version."""
    import horovod
    import horovod.torch as hvd

    return hvd, horovod.__version__


class _Pending:
    """One submitted unit. Horovod marks it done once its all-reduce has run (on a GPU
    too: Horovod's finalizer waits for the kernel), so `wait` and `complete` are one."""

    __slots__ = ("hvd", "handle", "name", "timeout_s", "done")

    def __init__(self, hvd: Any, handle: int, *, name: str, timeout_s: float) -> None:
        self.hvd, self.handle, self.name, self.timeout_s = hvd, handle, name, timeout_s
        self.done = False

    def wait(self) -> None:
        """Poll (never block in Horovod: a dead peer would hang it) for at most the
        timeout, then collect the result, raising Horovod's error if the unit failed."""
        if self.done:
            return
        poll_until(lambda: self.hvd.poll(self.handle), timeout_s=self.timeout_s,
                   what=f"Horovod's all-reduce of {self.name}")
        self.hvd.synchronize(self.handle)
        self.done = True

    complete = wait

    def finished(self) -> bool:
        try:
            return self.done or self.hvd.poll(self.handle)
        except ValueError:  # the training thread collected it meanwhile: it is done
            return True


class HorovodTransport:
    """Averages a chunk over every worker with hvd.allreduce_async_ (op Average: Horovod
    divides in its own reduction, `scale` 1); `wait` leaves the average in place.

    The chunk holds this worker's gradients (autograd wrote them into the flat buffer).
    Horovod must be initialized in this process with the workers as its ranks
    (harness.horovod.start).
    """

    ordered = False  # Horovod matches units by name: any issue order is fine
    coordinated = True  # its coordinator starts a unit once every rank submitted it
    fuses = False  # Horovod's own fusion buffer fuses; a scheduler must not do it again

    def __init__(self, *, group: dist.ProcessGroup | None = None,
                 timeout_s: float | None = None) -> None:
        self.hvd, self.version = _horovod()
        self.group = group  # torch.distributed, for the schedulers' own messages
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        if not self.hvd.is_initialized():
            raise RuntimeError("Horovod is not initialized in this process; the harness starts "
                               "it in every worker of an engine=horovod run "
                               "(harness/launch/horovod.py)")
        if (self.hvd.rank(), self.hvd.size()) != (self.rank, self.size):
            raise RuntimeError(f"Horovod's rank {self.hvd.rank()} of {self.hvd.size()} is not "
                               f"this worker's rank {self.rank} of {self.size}; start Horovod "
                               "on the workers' group")
        self.identity = self.size == 1  # one worker's gradient is already the average
        self.scale = 1.0  # Horovod's Average divides (its postscale), nothing left to us
        self.timeout_s = 300.0 if timeout_s is None else timeout_s
        self.plans = 0

    def open(self, buffer: GradBuffer, units: list[Unit]) -> None:
        """A new plan: its units get names of their own (Horovod caches each name's size)."""
        self.plans += 1

    def start(self, chunk: torch.Tensor, *, key: int) -> _Pending | Done:
        if self.size == 1:
            return Done()
        name = f"ddlbench.plan{self.plans}.unit{key}"  # the same unit has it on every rank
        handle = self.hvd.allreduce_async_(chunk, name=name, op=self.hvd.Average)
        return _Pending(self.hvd, handle, name=name, timeout_s=self.timeout_s)

    def close(self) -> None:
        pass

    def describe(self) -> dict[str, Any]:
        return {"transport": "horovod", "workers": self.size,
                "horovod_version": self.version}
