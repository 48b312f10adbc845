"""Timing a window of training iterations without breaking the overlap it measures.

Inside the window nothing synchronizes the device. On GPUs a synchronize after
backward would wait for the all-reduces still in flight, and WFBP, MG-WFBP and
ByteScheduler would lose, inside the measurement, the overlap they exist for.
So the moments between phases are CUDA events recorded on the current stream
(read once the window has ended and the device is synchronized) on GPUs, and
host clocks on CPUs, where each call returns when its work is done. Either way
an iteration's phases are consecutive intervals between moments: they add up
to its time exactly.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import pairwise

import torch
import torch.distributed as dist

from methods.base import device_sync

PHASES = ("forward_s", "backward_s", "comm_s", "update_s")


class Clock:
    """Moments on the device's own clock: CUDA events on GPUs, perf_counter on CPUs."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.moments: list = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.moments.append(event)
        else:
            self.moments.append(time.perf_counter())

    def intervals(self) -> list[float]:
        """Seconds between consecutive moments; on GPUs only once the device is synchronized."""
        if self.cuda:
            return [a.elapsed_time(b) / 1e3 for a, b in pairwise(self.moments)]
        return [b - a for a, b in pairwise(self.moments)]


@dataclass
class Window:
    seconds: float  # host clock: from the barrier to drained and synchronized
    iter_times: list[float]
    phases: list[list[float]]  # per iteration, the PHASES; [] when the steps mark nothing
    host_starts: list[float] = field(default_factory=list)  # host clock at each step's
    # start, and once more when the last step returned (before the drain): the study's timeit


def study_rate(host_starts: list[float], *, samples_per_step: float, steps: int = 10
               ) -> float | None:
    """The study's throughput statistic on one rank: the mean, over consecutive rounds of
    `steps` steps timed on the host (timeit of 10 steps, 10 times: its benchmark scripts),
    of each round's samples per second; `samples_per_step` is the whole cluster's (the
    study multiplied local rank 0's rate by the world size). A window shorter than one
    round is one round. None without host stamps."""
    if len(host_starts) < 2:
        return None
    steps = min(steps, len(host_starts) - 1)
    rounds = [host_starts[i + steps] - host_starts[i]
              for i in range(0, len(host_starts) - steps, steps)]
    return sum(samples_per_step * steps / s for s in rounds) / len(rounds)


def timed_window(step: Callable[[Clock], None], *, iters: int, drain: Callable[[], None],
                 device: torch.device, group: dist.ProcessGroup | None = None) -> Window:
    """Device synchronize, barrier of the workers' `group`, `iters` steps, `drain` (the
    method's: no communication left in flight), then one device synchronize.

    The window opens on every rank at once: each first waits for its own device (work
    queued before the window, e.g. the warm-up's last update), then for the others at
    the barrier (a host barrier: Gloo's, also on NCCL runs), then reads the clock. A rank
    that left the barrier with work still queued on its GPU would start its clock late,
    and its peers would count the difference as communication.

    Each step marks the clock after its forward, backward and synchronize, or not at
    all; the window marks each step's start. An iteration runs from its start to the
    next one's (its update ends there), the last one to the end of the drain, which
    counts as exposed communication.
    """
    device_sync(device)
    dist.barrier(group=group)
    clock = Clock(device)
    start = time.perf_counter()
    host_starts = []
    for _ in range(iters):
        host_starts.append(time.perf_counter())
        clock.mark()
        step(clock)
    host_starts.append(time.perf_counter())
    clock.mark()
    drain()
    clock.mark()
    device_sync(device)
    seconds = time.perf_counter() - start
    gaps = clock.intervals()
    per = (len(gaps) - 1) // iters  # intervals per iteration; the last interval is the drain
    iter_times = [sum(gaps[i * per : (i + 1) * per]) for i in range(iters)]
    iter_times[-1] += gaps[-1]
    phases = [gaps[i * per : (i + 1) * per] for i in range(iters)] if per == len(PHASES) else []
    if phases:
        phases[-1][PHASES.index("comm_s")] += gaps[-1]
    return Window(seconds, iter_times, phases, host_starts)
