"""Layer-wise backward times, measured on the running job (MG-WFBP's input).

The profiler stamps the start of backward (a hook on the model's output) and
the moment each gradient is ready (the gradient hooks), per iteration. On a
GPU a hook runs when its kernels are queued, not when they have run, so each
stamp is a CUDA event recorded on the hook's stream, read once the iteration is
over: backward is never stalled and no synchronize's latency enters the times
(the study synchronized in every hook). On the CPU a hook runs when its
gradient is computed, so the stamp is the clock. A
tensor's backward time is how much later than the tensor before it (backward
order) its gradient is ready; the median over the profiled iterations is
agreed across ranks by an all-reduce mean, so every rank plans the same. The
profile runs in the first iterations, which the configuration keeps inside the
warm-up (`run.warmup_iters >= method.planner.profile_iters`).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

Stamp = float | torch.cuda.Event


class BackwardProfiler:
    """Records when each gradient of `params` (backward order) is ready, per iteration."""

    def __init__(self, model: nn.Module, params: list[nn.Parameter], *,
                 device: torch.device) -> None:
        self.device = device
        self.index = {p: i for i, p in enumerate(params)}
        self.n = len(params)
        self.iterations: list[list[float]] = []
        self._start: Stamp = 0.0
        self._stamps: list[Stamp] = [0.0] * self.n
        self._hooks: list[RemovableHandle] = [model.register_forward_hook(self._on_output)]
        self._hooks += [p.register_post_accumulate_grad_hook(self._on_grad) for p in params]

    def _on_output(self, _module: nn.Module, _inputs, output) -> None:
        self._start = self._now()  # if the output has no grad hook, backward ~ now
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(self._on_backward_start)

    def _on_backward_start(self, _grad: torch.Tensor) -> None:
        self._start = self._now()

    def _on_grad(self, param: nn.Parameter) -> None:
        self._stamps[self.index[param]] = self._now()

    def _now(self) -> Stamp:
        """When the work queued so far on this thread's stream will have run."""
        if self.device.type == "cuda":  # GPU: an event, read after the iteration
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()  # CPU: the work has run when its hook runs

    def end_iteration(self) -> None:
        """Close the iteration in progress: keep its gradient-ready times (seconds)."""
        start = self._start
        if isinstance(start, float):
            self.iterations.append([s - start for s in self._stamps])
            return
        events = [e for e in self._stamps if isinstance(e, torch.cuda.Event)]
        for event in events:  # GPU: wait for the stamps, then read them (a gradient not
            event.synchronize()  # stamped yet counts as ready at the start)
        self.iterations.append([start.elapsed_time(e) / 1e3 if isinstance(e, torch.cuda.Event)
                                else 0.0 for e in self._stamps])

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def backward_times(self, group: dist.ProcessGroup | None, *, skip: int = 1) -> list[float]:
        """Per-tensor backward seconds (backward order), the same on every rank of `group`.

        Ready times are made monotonic (a unit cannot go before the ones ahead of
        it), the first `skip` iterations are dropped when more remain (warm-up).
        A collective: every rank of `group` must call it.
        """
        kept = self.iterations[skip:] or self.iterations
        ready = torch.tensor(kept, dtype=torch.float64).median(dim=0).values
        ready = torch.cummax(ready.clamp(min=0), dim=0).values
        times = torch.diff(ready, prepend=torch.zeros(1, dtype=torch.float64))
        dist.all_reduce(times, group=group)
        return (times / dist.get_world_size(group)).tolist()
