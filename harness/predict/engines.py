"""What the study's engines add to an iteration beyond their communication, read from their
code: BytePS 0.2 (the PS methods), Horovod 0.19 (the all-reduce methods on engine=horovod)
and the ByteScheduler plug-in on Horovod (bytescheduler_a2a). The facts' values are in
conf/bench.yaml's `simulate.engines`; the network's start-ups time Horovod's negotiation.

- The step's wait: BytePS's and Horovod's `WaitAndClear` sleep 1 ms between polls of a
  handle, so the training thread wakes on average half a poll after the last handle is
  done (ByteScheduler's step waits on nothing: its poller thread spins).
- The average: both engines divide each unit by the worker count with a `div_` their
  completion callback queues on the compute stream (8 bytes moved per element).
- Merged groups: the study's optimizers copy each gradient of a group into the group's
  buffer in its hook, on the compute stream (BSP-A2A's and MG-WFBP's groups, BSP-PS's
  fusion buffer): 8 bytes per element, while the backward runs.
- Horovod's negotiation: a tensor is negotiated with the coordinator (gathers to rank 0,
  broadcasts back) in the cycle after its submission. The study's cycle-0 methods submit
  in the hook, long before the GPU computes the gradient (the CPU runs ahead), so it
  costs them nothing on the critical path; ByteScheduler submits a piece only once it is
  ready, so each of its cycles pays one round before its all-reduce starts.
- ByteScheduler's poller thread applies a hand-written update per parameter once all of
  its pieces are reduced: `update_ops` CUDA ops from Python and a Python loop over the
  parameters up to the one it updates (`scan_s` each), one parameter after another; the
  next forward's layer waits until its parameters' updates are launched.
- The GIL: the poller never blocks while a handle is pending (it polls, re-queues and
  polls again), so it holds Python's GIL, and a thread woken meanwhile waits CPython's
  switch interval (`gil_switch_s`, sys.getswitchinterval()) before it asks the holder to
  drop it (take_gil in Python/ceval_gil.h): the core's scheduler thread notified of a
  ready piece or of returned credit (bytecore._loop waits on a condition), the training
  thread woken from a forward lock or from torch.cuda.synchronize() (priority.py).
- The clock holds the GIL: PyTorch 1.4's torch.cuda.synchronize() calls
  cudaDeviceSynchronize() without releasing the GIL (torch/csrc/cuda/Module.cpp; released
  since pytorch/pytorch#109159, 2023), so while the study's step waits for the GPU, the
  plug-in's Python threads stand still: rank 0's poller sees no ready event and its core
  submits no piece until the backward is done on the GPU (`sync_holds_gil`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from harness.config.frozen import Config
from harness.config.ranks import num_workers
from harness.predict.network import Network
from methods.plan import Unit

MOVED = 8  # bytes per fp32 element of a division or a copy: read and written once


@dataclass(frozen=True)
class Engine:
    """One configuration's engine costs (seconds; lists per unit or per tensor)."""

    poll_s: float                # the step's wait wakes on polls of this period (0: at once)
    divide_s: list[float]        # per unit: the average's division on the compute stream
    copy_s: list[float]          # per tensor (backward order): its copy into a merged buffer
    negotiation_s: float         # per cycle of pieces submitted once ready (ByteScheduler)
    update_host_s: list[float]   # per tensor: the poller's hand-written update (ByteScheduler)
    gil_s: float = 0.0           # a woken Python thread's wait for the GIL while the poller spins
    sync_holds_gil: bool = False  # torch.cuda.synchronize() keeps the GIL while it waits


NONE = Engine(0.0, [], [], 0.0, [])


def study_engine(cfg: Config) -> str:
    """Which of the study's engines runs `cfg`'s method: "byteps", "horovod" or "" (ours)."""
    transport = cfg.method.transport.name
    if transport == "ps":
        return "byteps"
    return "horovod" if transport != "ddp" and cfg.get("engine") == "horovod" else ""


def engine_of(cfg: Config, units: list[Unit], sizes: list[int], *, byte_s: float,
              net: Network) -> Engine:
    """The engine costs of `cfg` whose plan is `units` over tensors of `sizes` (backward
    order), on a compute stream moving a byte in `byte_s` seconds."""
    which, facts = study_engine(cfg), cfg.simulate.get("engines") or {}
    if not which or num_workers(cfg) == 1:
        return NONE
    priority = cfg.method.scheduler.name == "priority"
    divide = [u.numel * MOVED * byte_s for u in units]
    copy = [0.0] * len(sizes)
    for u in units:
        if len(u.params) > 1:
            for p in u.params:
                copy[p] = sizes[p] * MOVED * byte_s
    poll = 0.0 if priority else float(facts.get("handle_poll_s", 0.0))
    if not priority:
        return Engine(poll, divide, copy, 0.0, [])
    return Engine(0.0, divide, copy, negotiation_s(cfg, net), _updates(cfg, sizes, facts),
                  float(facts.get("gil_switch_s", 0.0)), bool(facts.get("sync_holds_gil")))


def negotiation_s(cfg: Config, net: Network) -> float:
    """One negotiation round of Horovod's MPI controller over the job: with the response
    cache off, a Gather and a Gatherv of the requests to rank 0 and two Bcasts of the
    responses; with it on (and every tensor cached), one Allreduce of the cache bits;
    each a binomial tree of the slowest link's start-ups."""
    workers = num_workers(cfg)
    link = net.inter if cfg.cluster.nodes > 1 else net.intra
    rounds = 2 if cfg.method.horovod.get("cache_capacity", 0) else 4
    return rounds * math.ceil(math.log2(workers)) * link.alpha


def _updates(cfg: Config, sizes: list[int], facts: dict) -> list[float]:
    """Per tensor (backward order), the poller's host time for its hand-written update: its
    CUDA ops, and the loop over model.parameters() (input side first) up to it."""
    ops = facts.get("update_ops", {})
    name = cfg.model.optimizer.name
    count = ops.get(name, ops.get("adam", 0))
    launch, scan = float(facts.get("op_launch_s", 0.0)), float(facts.get("scan_s", 0.0))
    n = len(sizes)
    return [count * launch + (n - i) * scan for i in range(n)]
