"""The machine's CPU clock of the microbenchmarks (microbench.py, psbench.py): how many CPU
seconds an operation keeps this machine's cores busy, read from /proc/stat.

/proc/stat counts in ticks (1/CLK_TCK s, 10 ms here): at each tick every core adds one to
the state it is in. A window of a few operations of a millisecond reads none or a whole
tick per core, so a per-operation figure from it is off by up to a tick over the few
operations: on 2 emulated eth1g nodes a 16 KiB push/pull round trip of 1.6 ms read 10 ms
of CPU (2026-11-28), more than 2 cores can give in its wall time, and the fit over sizes
gave every partition 6.5 ms. So the CPU is read over operations repeated back to back
until they fill `WINDOW_S` (at least one), as many as rank 0's timing says and every rank
of the group is told.
"""

from __future__ import annotations

import math
import os
import socket
from collections.abc import Callable

import torch.distributed as dist

WINDOW_S = 0.3  # at CLK_TCK 100, 30 ticks a core: a tick is at most ~3% of what is read


def busy_seconds() -> float:
    """The CPU seconds this machine's cores have been busy since boot (/proc/stat's first
    line: user, nice, system, irq, softirq and steal time), NaN where there is no
    /proc/stat."""
    try:
        with open("/proc/stat") as f:
            ticks = f.readline().split()[1:9]
    except OSError:
        return math.nan
    return sum(int(t) for i, t in enumerate(ticks) if i not in (3, 4)) / os.sysconf(
        "SC_CLK_TCK")  # 3, 4: idle and iowait


def cpu_clock(rank: int) -> Callable[[], float]:
    """Every rank of the run calls it (an object gather on the default group, servers
    included): on rank 0, `busy_seconds` where every rank runs on this host, else a clock
    of NaN; on the others, a clock of NaN."""
    hosts: list = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, socket.gethostname())
    here = rank == 0 and all(host == socket.gethostname() for host in hosts)
    return busy_seconds if here else no_clock


def no_clock() -> float:
    """The clock of a rank that reads none: NaN."""
    return math.nan


def per_call(one: Callable[[], None], seconds: float, *, cpu: Callable[[], float],
             group: dist.ProcessGroup | None, window_s: float = WINDOW_S) -> float:
    """CPU seconds (`cpu`) per call of `one`, read over as many calls back to back as fill
    `window_s` at rank 0's `seconds` a call. Every rank of `group` calls it (each runs
    `one` as often); the figure is rank 0's (NaN elsewhere, as `cpu` reads)."""
    calls = [max(1, math.ceil(window_s / seconds)) if seconds > 0 else 1]
    dist.broadcast_object_list(calls, src=0, group=group)
    before = cpu()
    for _ in range(calls[0]):
        one()
    return (cpu() - before) / calls[0]
