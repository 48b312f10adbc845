"""Per-layer parameter updates, and forward pre-hooks that wait for them.

ByteScheduler applies each layer's update as soon as that layer's gradients
are back, and the next forward of a layer waits only for that layer's update,
so communication of the output side overlaps the next forward of the input
side. A layer is the parameters one module owns directly (a parameter shared
by several modules belongs to the first of them, and every owner waits for it).

The update of a layer is the user's optimizer restricted to that layer: one
optimizer of the same class and hyper-parameters per layer, sharing the user's
optimizer's per-parameter state, so the step equals the user's step exactly.

On a GPU the updates run on the stream of the thread that applies them (the
scheduler's updater), never on the compute stream. Each update ends with an
event; the compute stream waits for a layer's event only where it must: before
the layer's next forward reads its parameters, before its next gradient is written
into the buffer the update read, and at `settle` (the end of a timed window).
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from methods.base import GradBuffer, record, wait_for
from methods.hostmeter import OFF, HostMeter


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


def module_layers(model: nn.Module, params: list[nn.Parameter]
                  ) -> tuple[list[str], list[int], dict[nn.Module, list[int]]]:
    """(layer names, the layer of each parameter, the layers each module's forward needs).

    `params` are the tracked parameters (any order); every one must be owned by a module.
    """
    index = {p: i for i, p in enumerate(params)}
    names: list[str] = []
    layer_of = [-1] * len(params)
    needs: dict[nn.Module, list[int]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        own = [index[p] for p in module.parameters(recurse=False) if p in index]
        if not own:
            continue
        fresh = [i for i in own if layer_of[i] < 0]
        if fresh:
            names.append(name or type(module).__name__)
            for i in fresh:
                layer_of[i] = len(names) - 1
        needs[module] = sorted({layer_of[i] for i in own})
    return names, layer_of, needs


def split_optimizer(optimizer: torch.optim.Optimizer,
                    layers: list[list[nn.Parameter]]) -> list[list[torch.optim.Optimizer]]:
    """Optimizers of `optimizer`'s class, one per (layer, parameter group), sharing its state."""
    cls = type(optimizer)
    accepted = inspect.signature(cls.__init__).parameters
    group_of = {p: g for g, group in enumerate(optimizer.param_groups) for p in group["params"]}
    out = []
    for layer in layers:
        by_group: dict[int, list[nn.Parameter]] = {}
        for p in layer:
            if p in group_of:
                by_group.setdefault(group_of[p], []).append(p)
        subs = []
        for g, params in by_group.items():
            hyper = {k: v for k, v in optimizer.param_groups[g].items() if k != "params"}
            sub = cls(params, **{k: v for k, v in hyper.items() if k in accepted})
            sub.param_groups[0].update(hyper)
            for p in params:
                sub.state[p] = optimizer.state[p]
            subs.append(sub)
        out.append(subs)
    return out


class LayerUpdates:
    """Applies updates layer by layer (from any thread) and gates each module's forward."""

    def __init__(self, model: nn.Module, buffer: GradBuffer, *, timeout_s: float,
                 check: Callable[[], None], meter: HostMeter = OFF, scale: float = 1.0) -> None:
        self.buffer = buffer
        self.scale = scale  # the transport's: what turns a layer's reduced sum into its average
        self.timeout_s = timeout_s
        self.check = check  # raises the scheduler's error, if it has one
        self.names, self.layer_of, needs = module_layers(model, buffer.params)
        if min(self.layer_of, default=0) < 0:
            raise ValueError("every trainable parameter must belong to a module")
        self.params = [[i for i, owner in enumerate(self.layer_of) if owner == layer]
                       for layer in range(len(self.names))]
        self.updated = [threading.Event() for _ in self.names]
        for e in self.updated:
            e.set()
        self.device = buffer.flat.device
        self.applied: list[torch.cuda.Event | None] = [None] * len(self.names)  # GPU: the end
        self.hooks: list[RemovableHandle] = [
            m.register_forward_pre_hook(meter.gate(self._gate(layers)))
            for m, layers in needs.items()]
        self.bound = threading.Event()
        self.optimizer: torch.optim.Optimizer | None = None
        self.subs: list[list[torch.optim.Optimizer]] = []

    def _gate(self, layers: list[int]):
        def wait_for_updates(_module: nn.Module, _args) -> None:
            for layer in layers:
                self.wait(layer)
        return wait_for_updates

    def wait(self, layer: int) -> None:
        """Return once `layer`'s pending update is applied (or raise the scheduler's error);
        work queued on the current stream from then on runs after it."""
        if not self.updated[layer].wait(self.timeout_s):
            self.check()
            raise TimeoutError(f"the update of layer {self.names[layer]!r} was not applied "
                               f"within {self.timeout_s:g} s")
        self.check()
        self.after_update(layer)

    def after_update(self, layer: int) -> None:
        """Work queued on the current stream from now on runs after `layer`'s last update
        (before its next gradient is written into the buffer that update read)."""
        wait_for(self.applied[layer], self.device)

    def bind(self, optimizer: torch.optim.Optimizer) -> None:
        """Use `optimizer`'s class, hyper-parameters and state for every later update."""
        if optimizer is self.optimizer:
            return
        params = [[self.buffer.params[i] for i in layer] for layer in self.params]
        self.subs = split_optimizer(optimizer, params)
        self.optimizer = optimizer
        self.bound.set()

    def begin(self, layer: int) -> None:
        """`layer`'s gradients are on their way: its next forward must wait."""
        self.updated[layer].clear()

    def apply(self, layer: int) -> None:
        """Average `layer`'s reduced gradients, step its optimizers, zero its gradients for
        the next backward (their views stay), let its forward run."""
        if not self.bound.wait(self.timeout_s):
            raise TimeoutError(f"no optimizer was given within {self.timeout_s:g} s "
                               "(the training loop must call method.step(optimizer))")
        self.check()
        if self.optimizer is None:
            return  # released on close before any step: nothing to apply
        self.buffer.scale(self.scale, self.params[layer])
        for sub in self.subs[layer]:
            sub.step()
        self.buffer.zero(self.params[layer])
        self.applied[layer] = record(self.device)
        self.updated[layer].set()

    def settle(self) -> None:
        """Work queued on the current stream from now on runs after every update applied."""
        for event in self.applied:
            wait_for(event, self.device)

    def release(self) -> None:
        """Wake every waiting forward (after an error, or on close)."""
        for e in self.updated:
            e.set()
        self.bound.set()

    def close(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks.clear()
        self.release()
