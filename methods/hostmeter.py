"""What a method costs the training thread: its own host time, and its blocking waits apart.

The harness times the method's calls of the training loop (`synchronize`, `zero_grad`)
with `call`, and a method times its gradient hooks (`hook`: they run inside backward)
and its blocking waits for communication (`wait`: inside a call, or a forward pre-hook
that waits for an update). A call's host time is its time less the waits inside it, so

    host_s: the method's own code on the training thread (hooks, scheduling, zeroing
            and averaging the flat buffer, issuing units, the update path outside the user's
            optimizer.step, which the harness times as update_s);
    wait_s: the training thread blocked until communication or an update was done.

On a GPU both are host clocks: a wait there is the host blocked, not the device. Hook
time is also kept per gradient (`hook_s`, backward order) for the per-unit figures of the
plan. A meter that is `off` returns every hook unchanged, so switching it off removes
even the clock reads (run.method_host=false: the ratio with and without it is its cost).
Not thread-safe by design: only the training thread (and autograd's, while the training
thread waits in backward) touches it. While `log` is a list (run.trace's traced
iterations, harness/measure/timeline.py), each wait also appends (name, start, end) to it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from time import perf_counter
from typing import Any


class HostMeter:
    __slots__ = ("on", "host_s", "wait_s", "hook_s", "log")

    def __init__(self, *, on: bool = True) -> None:
        self.on = on
        self.log: list[tuple[str, float, float]] | None = None
        self.reset()

    def reset(self) -> None:
        self.host_s = self.wait_s = 0.0
        self.hook_s: dict[int, float] = {}

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run a call into the method (of the training loop, or a hook): its time less its
        waits is host time."""
        if not self.on:
            return fn(*args)
        waited, start = self.wait_s, perf_counter()
        try:
            return fn(*args)
        finally:
            self.host_s += perf_counter() - start - (self.wait_s - waited)

    def wait(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run a blocking wait for communication (or for an update); its time is wait time."""
        if not self.on:
            return fn(*args)
        start = perf_counter()
        try:
            return fn(*args)
        finally:
            end = perf_counter()
            self.wait_s += end - start
            if self.log is not None:
                self.log.append((getattr(fn, "__name__", "wait").strip("_"), start, end))

    def hook(self, fn: Callable[..., Any], index: int) -> Callable[..., Any]:
        """Gradient `index`'s hook (backward order), its time counted as host time."""
        if not self.on:
            return fn

        def timed(*args: Any) -> Any:  # `call`'s accounting inline: a hook is a hot path
            waited, start = self.wait_s, perf_counter()
            try:
                return fn(*args)
            finally:
                spent = perf_counter() - start - (self.wait_s - waited)
                self.host_s += spent
                self.hook_s[index] = self.hook_s.get(index, 0.0) + spent
        return timed

    def gate(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """A forward pre-hook that blocks until an update is applied: wait time."""
        if not self.on:
            return fn
        return lambda *args: self.wait(fn, *args)

    def per_unit(self, units: Sequence[Sequence[int]], iters: int) -> list[float]:
        """Hook seconds per iteration of each unit (its gradients' indices); a gradient in
        several units (partitions of one tensor) is shared among them equally."""
        shares: dict[int, int] = {}
        for params in units:
            for i in params:
                shares[i] = shares.get(i, 0) + 1
        return [sum(self.hook_s.get(i, 0.0) / shares[i] for i in params) / max(iters, 1)
                for params in units]


OFF = HostMeter(on=False)  # what a method uses until the harness gives it a meter
