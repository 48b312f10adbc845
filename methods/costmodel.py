"""The all-reduce cost model t = alpha + beta * bytes, and its least-squares fits.

Pure arithmetic, no torch: MG-WFBP plans with a `Cost`, the simulator fits one to a
network's modelled all-reduce, and methods/costtiming.py fits one to all-reduces timed
on a real process group (at MG-WFBP's start-up, and in the microbenchmark). Or MG-WFBP
reads the study's own table (`study_cost`, `method.planner.cost: study`).
"""

from __future__ import annotations

import math
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


FREE = Cost(0.0, 0.0)  # what costs nothing: a link not crossed, a cost not measured


def least_squares(nbytes: list[float], seconds: list[float]) -> Cost:
    """The line alpha + beta * nbytes closest to the samples; alpha and beta clamped at 0."""
    if len(nbytes) < 2 or len(set(nbytes)) < 2:
        raise ValueError("fitting alpha and beta needs samples of at least two message sizes")
    mx, my = statistics.fmean(nbytes), statistics.fmean(seconds)
    sxx = sum((x - mx) ** 2 for x in nbytes)
    beta = sum((x - mx) * (y - my) for x, y in zip(nbytes, seconds)) / sxx
    beta = max(beta, 0.0)
    return Cost(alpha=max(my - beta * mx, 0.0), beta=beta)


def relative_least_squares(nbytes: list[float], values: list[float]) -> Cost:
    """The line alpha + beta * nbytes whose errors are smallest as shares of the samples
    (least squares weighted by 1/value^2), alpha and beta clamped at 0. Over sizes that
    span orders of magnitude the small ones set alpha and the large ones beta; a plain fit
    takes alpha from the large samples' noise (the microbenchmark's CPU a PS round trip
    on 2 x 2 eth1g: alpha 6.2 and 1.2 ms from two tables whose small sizes both cost
    2.0-2.6 ms; this fit 2.1 and 2.0)."""
    if len(nbytes) < 2 or len(set(nbytes)) < 2:
        raise ValueError("fitting alpha and beta needs samples of at least two message sizes")
    least = min((v for v in values if v > 0), default=1.0)  # a 0 read (a clock's tick) too
    w = [1.0 / max(v, least) ** 2 for v in values]
    sw = sum(w)
    mx = sum(wi * x for wi, x in zip(w, nbytes)) / sw
    my = sum(wi * y for wi, y in zip(w, values)) / sw
    sxx = sum(wi * (x - mx) ** 2 for wi, x in zip(w, nbytes))
    beta = max(sum(wi * (x - mx) * (y - my) for wi, x, y in zip(w, nbytes, values)) / sxx, 0.0)
    alpha = my - beta * mx
    if alpha < 0:  # through the origin: the slope alone
        alpha, beta = 0.0, (sum(wi * x * y for wi, x, y in zip(w, nbytes, values))
                            / sum(wi * x * x for wi, x in zip(w, nbytes)))
    return Cost(alpha=alpha, beta=beta)


def cpu_fit(nbytes: list[float], cpu_s: list[float]) -> Cost:
    """CPU seconds per message as alpha + beta * bytes, fitted by each sample's share (the
    metered CPU of a few large sizes is noisier than the small ones'); NaN where a size
    has none. harness.microbench writes it, harness/predict/links.py fits older tables'
    samples with it."""
    if not all(math.isfinite(c) for c in cpu_s):
        return Cost(math.nan, math.nan)
    return relative_least_squares(nbytes, cpu_s)


# MG-WFBP's alpha (s) and beta (s/byte) as the study ran it: hard-coded per worker count and
# network family (ddl-benchmarks mgwfbp/hv_distributed_optimizer.py: --rdma picks IB), not
# fitted at run time.
COSTS = ("fitted", "study")  # MG-WFBP's cost: fitted on the run, or the study's table
STUDY_COSTS = {
    "ib": {2: (2.555e-6, 9.838e-11), 4: (4.204e-5, 2.059e-10), 8: (9.754e-5, 3.057e-10),
           16: (7.075e-4, 4.059e-10), 32: (4.063e-4, 4.907e-10), 64: (8.063e-4, 5.888e-10)},
    "tcp": {2: (2.555e-6, 9.838e-11), 4: (4.204e-5, 2.059e-10), 8: (5.230e-4, 8.571e-10),
            16: (9.081e-4, 7.396e-10), 32: (4.043e-3, 8.643e-10), 64: (7.043e-3, 9.643e-10)},
}


# the table each of the study's networks read: its runs passed --rdma (the IB table) on the
# InfiniBand network (rdma=1) and on "100GbE" (rdma=2: TCP over the same IB NICs); only
# 10GbE (rdma=0) read the TCP table (ddl-benchmarks mgwfbp/horovod_mpi_cj.sh)
STUDY_TABLE = {"ib100_rdma": "ib", "eth100_tcp": "ib", "eth10_tcp": "tcp"}


def network_family(network: str | None) -> str:
    """The study's table a network reads: the study's own choice for its three networks,
    else IB for an InfiniBand profile (ib*) and TCP for the rest."""
    name = network or ""
    return STUDY_TABLE.get(name) or ("ib" if name.startswith("ib") else "tcp")


def study_cost(network: str | None, workers: int, *, table: str | None = None,
               fix: str = "use method.planner.cost=fitted (measured on this run)") -> Cost:
    """The study's all-reduce cost for `workers` from its `table` (ib or tcp; None: the
    `network`'s family); one worker sends nothing. ValueError for a count the study's
    table lacks, ending with `fix`."""
    if workers == 1:
        return Cost(alpha=0.0, beta=0.0)
    table = STUDY_COSTS[table or network_family(network)]
    if workers not in table:
        raise ValueError(f"MG-WFBP's cost=study has the study's alpha and beta for "
                         f"{', '.join(map(str, table))} workers, not {workers}; {fix}")
    alpha, beta = table[workers]
    return Cost(alpha=alpha, beta=beta)
