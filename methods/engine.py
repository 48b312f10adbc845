"""The engine: one method built from a transport, a planner and a scheduler.

DESIGN.md's Table I describes every method by the same switches; the engine
composes them. A planner that needs measurements of the running job (MG-WFBP)
gets them here: the first `profile_iters` iterations run with one bucket after
backward while a profiler records when each gradient is ready; then the engine
fits the all-reduce cost (or reads the study's table: `cost: study`), asks the
planner for its plan and hands the real scheduler the new units.

When the transport has nothing to move (one worker on an all-reduce: its
gradient already is the average), the engine steps aside: no buffer, no hooks,
no scheduler, the plain training loop. The study divides by exactly that
single-GPU baseline.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from methods.base import GradBuffer, Method, Scheduler, Transport, backward_named, backward_order
from methods.costmodel import study_cost
from methods.costtiming import fit_allreduce_cost
from methods.order import global_rank
from methods.plan import Unit
from methods.profile import BackwardProfiler
from methods.sched import AfterBackward


class Engine(Method):
    """A method built from a transport, a planner and a scheduler (DESIGN.md, Table I)."""

    def __init__(self, *, name: str, transport: Transport, planner: Any, scheduler: Scheduler,
                 timeout_s: float = 300.0) -> None:
        self.name = name
        self.transport = transport
        self.planner = planner
        self.scheduler = scheduler
        self.timeout_s = timeout_s
        self.buffer: GradBuffer | None = None
        self.model: nn.Module | None = None
        self.active: Scheduler | None = None
        self.profiler: BackwardProfiler | None = None
        self.units: list[Unit] = []

    def wrap(self, model: nn.Module) -> nn.Module:
        self.model = model
        if getattr(self.transport, "identity", False):
            self.active = _StepAside(backward_order(model))
            return model
        names, params = zip(*backward_named(model))
        self.buffer = GradBuffer(list(params), names=list(names))  # .grad now views of it
        units = self.planner.plan(self.buffer.sizes, element_size=self._element_size(),
                                  rows=self.buffer.rows)
        if getattr(self.planner, "profile_iters", 0):
            self.profiler = BackwardProfiler(model, self.buffer.params,
                                             device=self.buffer.flat.device)
            self._activate(units, AfterBackward(timeout_s=self.timeout_s))
        else:
            self._activate(units, self.scheduler)
        return model

    def _element_size(self) -> int:
        return self.buffer.flat.element_size()

    def _activate(self, units: list[Unit], scheduler: Scheduler) -> None:
        self.transport.open(self.buffer, units)
        scheduler.attach(self.model, buffer=self.buffer, units=units, transport=self.transport,
                         meter=self.meter)
        self.units = units
        self.active = scheduler

    def synchronize(self) -> None:
        self.active.synchronize()

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        self.active.step(optimizer)
        if self.profiler is not None:
            self.profiler.end_iteration()
            if len(self.profiler.iterations) >= self.planner.profile_iters:
                self._plan_from_profile()

    def _plan_from_profile(self) -> None:
        """Every rank, at the same iteration: agree on the measurements, then switch plans."""
        group = self.transport.group
        backward_s = self.profiler.backward_times(group)
        self.profiler.close()
        self.profiler = None
        flat = self.buffer.flat
        if self.planner.cost_from == "study":  # the study's table, as its merges used
            cost = study_cost(self.planner.network, dist.get_world_size(group),
                              table=self.planner.table)
        else:
            cost = fit_allreduce_cost(group, sizes=self.planner.fit_sizes,
                                      repeats=self.planner.fit_repeats, dtype=flat.dtype,
                                      device=flat.device)
        units = self.planner.plan_measured(self.buffer.sizes, backward_s=backward_s, cost=cost,
                                           element_size=self._element_size())
        # Every rank planned from the same agreed numbers; still, collectives must match
        # exactly, so every rank takes rank 0's plan.
        box = [units]
        dist.broadcast_object_list(box, src=global_rank(group, 0), group=group)
        units = box[0]
        self.planner.groups = [list(u.params) for u in units]
        self.active.close()
        self.transport.close()
        self._activate(units, self.scheduler)

    def zero_grad(self) -> None:
        self.active.zero_grad()

    def drain(self) -> None:
        self.active.drain()

    def close(self) -> None:
        self.active.close()
        if self.profiler is not None:
            self.profiler.close()
        self.transport.close()
        if self.buffer is not None:
            self.buffer.detach()  # the model no longer holds the buffer through its .grad

    def plan(self) -> dict[str, Any]:
        return {"method": self.name, **self.transport.describe(), **self.planner.describe(),
                **self.active.describe()}


class _StepAside:
    """A scheduler for a transport with nothing to move: the plain training loop."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.params = params

    def synchronize(self) -> None:
        pass

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def drain(self) -> None:
        pass

    def close(self) -> None:
        pass

    def describe(self) -> dict[str, Any]:
        return {"scheduler": "none (one worker: nothing to communicate)"}
