"""The all-reduce cost model fitted on a real process group (methods/costmodel.py's maths).

`fit_allreduce_cost` times all-reduces of a few message sizes on the group, agrees on
the timings across ranks (the slowest rank's, since a collective ends when its last
member does) and fits the line by least squares, so every rank gets the same alpha and
beta. MG-WFBP plans with it; the microbenchmark reuses `time_allreduce`.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from methods.base import device_sync
from methods.costmodel import DEFAULT_FIT_SIZES, Cost, least_squares


def time_allreduce(group: dist.ProcessGroup | None, numel: int, *, repeats: int,
                   dtype: torch.dtype = torch.float32,
                   device: torch.device | str = "cpu") -> float:
    """Median seconds of a blocking all-reduce of `numel` elements on `group` (after a warm-up)."""
    buf = torch.zeros(numel, dtype=dtype, device=device)
    dist.all_reduce(buf, group=group)
    samples = []
    for _ in range(repeats):
        device_sync(buf.device)
        start = time.perf_counter()
        dist.all_reduce(buf, group=group)
        device_sync(buf.device)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def fit_allreduce_cost(group: dist.ProcessGroup | None, *, sizes: list[int] | None = None,
                       repeats: int = 5, dtype: torch.dtype = torch.float32,
                       device: torch.device | str = "cpu") -> Cost:
    """Fit alpha and beta on `group`; a collective: every member must call it, same arguments."""
    sizes = sizes or DEFAULT_FIT_SIZES
    measured = torch.tensor([time_allreduce(group, n, repeats=repeats, dtype=dtype, device=device)
                             for n in sizes], dtype=torch.float64)
    dist.all_reduce(measured, op=dist.ReduceOp.MAX, group=group)
    element_size = torch.empty(0, dtype=dtype).element_size()
    return least_squares([float(n * element_size) for n in sizes], measured.tolist())
