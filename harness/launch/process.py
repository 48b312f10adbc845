"""A command's own process, torch-free: its run id and its quick exit.

Every command (`harness.run`, `harness.check`, ...) imports these, and none of them
imports torch before it must: bad input is told in a second, and the local launcher
spends no import on the run's critical path that only its ranks need.
"""

from __future__ import annotations

import ctypes
import datetime as dt
import os
import signal
import sys
import uuid

from omegaconf import DictConfig

from harness.config.ranks import num_workers


def exit_now(code: int) -> None:
    """End a process that ran a rank, skipping the interpreter's finalization.

    Results are written and the process group destroyed by now, but torch's C++
    objects (Gloo's worker threads, DDP's reducer, groups still referenced by
    torch._dynamo) would be destroyed during finalization in no fixed order, and a
    still-joinable thread destroyed there aborts a correct run at exit
    ("terminate called without an active exception", SIGABRT).
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def die_with_parent() -> None:
    """In a child: get SIGKILL when the process that started it dies, so none is orphaned."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def new_run_id(cfg: DictConfig) -> str:
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return f"{stamp}-{cfg.model.name}-{cfg.method.name}-w{num_workers(cfg)}-{uuid.uuid4().hex[:6]}"
