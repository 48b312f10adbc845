"""A harness entry for tests: each rank writes the environment it was spawned with (the
NCCL_* and GLOO_* variables), the network namespace it runs in and its parent's pid to
`<results_dir>/env_rank<rank>.json`, and does nothing else."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from omegaconf import DictConfig

from harness.launch.rank import Context


def worker(cfg: DictConfig, ctx: Context) -> None:
    found = subprocess.run(["ip", "netns", "identify", str(os.getpid())], capture_output=True,
                           text=True)
    seen = {k: v for k, v in os.environ.items() if k.startswith(("NCCL_", "GLOO_"))}
    Path(cfg.results_dir, f"env_rank{ctx.rank}.json").write_text(
        json.dumps({"namespace": found.stdout.strip(), "env": seen, "parent": os.getppid()}))
