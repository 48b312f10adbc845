"""A harness entry for tests: each rank writes the timeouts of the process groups the
harness made for it (the default group, the workers' group, its node's two groups), as
their Gloo backends hold them, to $TIMEOUTS_OUT/rank<r>.json."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from omegaconf import DictConfig

from harness.launch.rank import Context


def _timeout_s(group) -> float:
    return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()


def worker(cfg: DictConfig, ctx: Context) -> None:
    groups = {"default": torch.distributed.group.WORLD}
    if ctx.is_worker and ctx.worker_group is not None:
        groups["workers"] = ctx.worker_group
    for i, group in enumerate(ctx.node_groups or ()):
        groups[f"node{i}"] = group
    out = Path(os.environ["TIMEOUTS_OUT"]) / f"rank{ctx.rank}.json"
    out.write_text(json.dumps({name: _timeout_s(g) for name, g in groups.items()}))
