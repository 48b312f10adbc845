"""The all-reduce cost model t = alpha + beta * bytes, and its least-squares fit.

Pure arithmetic, no torch: MG-WFBP plans with a `Cost`, the simulator fits one to a
network's modelled all-reduce, and methods/costtiming.py fits one to all-reduces timed
on a real process group (at MG-WFBP's start-up, and in the microbenchmark).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

DEFAULT_FIT_SIZES = [1 << 10, 1 << 14, 1 << 17, 1 << 19, 1 << 21]  # elements


@dataclass(frozen=True)
class Cost:
    """Seconds of one all-reduce of `nbytes`: alpha + beta * nbytes."""

    alpha: float
    beta: float

    def seconds(self, nbytes: int) -> float:
        return self.alpha + self.beta * nbytes


def least_squares(nbytes: list[float], seconds: list[float]) -> Cost:
    """The line alpha + beta * nbytes closest to the samples; alpha and beta clamped at 0."""
    if len(nbytes) < 2 or len(set(nbytes)) < 2:
        raise ValueError("fitting alpha and beta needs samples of at least two message sizes")
    mx, my = statistics.fmean(nbytes), statistics.fmean(seconds)
    sxx = sum((x - mx) ** 2 for x in nbytes)
    beta = sum((x - mx) * (y - my) for x, y in zip(nbytes, seconds)) / sxx
    beta = max(beta, 0.0)
    return Cost(alpha=max(my - beta * mx, 0.0), beta=beta)
