"""What every result row says of its run: identity, parameters and provenance (versions,
numerics, the PS wire, the commit). Pure Python, with neither pandas nor pyarrow: every rank
imports it, while only the rank that writes a shard imports `results`."""

from __future__ import annotations

import datetime as dt
import functools
import json
import os
import subprocess
import sys

from harness.config import engine as horovod
from harness.config.cache import installed_version
from harness.config.frozen import Config, to_json
from harness.config.ranks import num_servers, num_workers
from harness.config.schema import REPO, step_ending


def identity(cfg: Config, *, run_id: str, repeat: int, stack: dict | None = None) -> dict:
    """The identity, parameter and provenance columns of a row of this run (`stack`: what
    `software()` says, read once by a caller that makes many rows)."""
    return {
        "run_id": run_id, "model": cfg.model.name, "method": cfg.method.name,
        "network": cfg.network.name, "nodes": cfg.cluster.nodes,
        "workers_per_node": cfg.cluster.workers_per_node, "world_size": num_workers(cfg),
        "servers": num_servers(cfg), "repeat": repeat,
        "local_batch_size": cfg.model.local_batch_size, "source": "measured",
        "warmup_iters": cfg.run.warmup_iters, "timed_iters": cfg.run.timed_iters,
        "seed": cfg.run.seed, "sync_each_step": step_ending(cfg.run), "rate": cfg.run.rate,
        "git_commit": git_commit(),
        **(software() if stack is None else stack),
        "slurm_job_id": os.environ.get("SLURM_ARRAY_JOB_ID", os.environ.get("SLURM_JOB_ID")),
        "slurm_array_task_id": os.environ.get("SLURM_ARRAY_TASK_ID"),
        "started_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "config_json": to_json(cfg), **horovod.columns(cfg), **wire_columns(cfg),
    }


def wire_columns(cfg: Config) -> dict:
    """The PS wire of the run and, on a rank that uses it, the transports it picked (None
    elsewhere: the launcher's failed row, a rank before its first message)."""
    wire = sys.modules.get("methods.ps.wire")  # loaded by every rank; never loaded here
    live = wire.describe() if wire is not None else {}
    mine = live.get("ps_wire") == cfg.cluster.ps_wire
    return {"ps_wire": cfg.cluster.ps_wire,
            "ps_wire_transports": (live["ps_wire_transports"] or None) if mine else None}


def software() -> dict:
    """What changes GPU throughput besides the configuration: versions, the numerics in
    force (harness.launch.device_settings applied run.tf32_*), NCCL_* / GLOO_* / HOROVOD_* /
    UCX_* settings. Read from the torch this process has loaded (every run and measurement);
    a process without torch (the simulator) has only its installed version to tell."""
    torch = sys.modules.get("torch")
    env = json.dumps({k: v for k, v in sorted(os.environ.items())
                      if k.startswith(("NCCL_", "GLOO_", "HOROVOD_", "UCX_"))})
    if torch is None:
        return {"torch_version": installed_version("torch"), "comm_env_json": env}
    cudnn = torch.backends.cudnn.version()
    return {
        "torch_version": torch.__version__, "cuda_version": torch.version.cuda,
        "cudnn_version": str(cudnn) if cudnn else None, "nccl_version": nccl_version(),
        "tf32_matmul": torch.backends.cuda.matmul.fp32_precision == "tf32",
        "tf32_cudnn": torch.backends.cudnn.conv.fp32_precision == "tf32",
        "cudnn_benchmark": bool(torch.backends.cudnn.benchmark), "comm_env_json": env,
    }


def nccl_version() -> str | None:
    """The NCCL of the loaded torch, or None (no torch loaded, no CUDA, no NCCL)."""
    torch = sys.modules.get("torch")
    if torch is None or not (torch.version.cuda and torch.distributed.is_nccl_available()):
        return None
    version = torch.cuda.nccl.version()
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


@functools.cache  # one per process: a sweep's rows name one commit
def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None
