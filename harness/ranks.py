"""Who the processes of a run are: workers, then parameter servers, on which node, and
the rank a launcher outside the harness (torchrun, srun) gave this process."""

from __future__ import annotations

import os

from omegaconf import DictConfig


def num_servers(cfg: DictConfig) -> int:
    """Parameter-server processes the run needs: only PS methods have any."""
    if cfg.method.transport.name != "ps":
        return 0
    return cfg.cluster.nodes if cfg.cluster.servers is None else cfg.cluster.servers


def num_workers(cfg: DictConfig) -> int:
    return cfg.cluster.nodes * cfg.cluster.workers_per_node


def host_of(cfg: DictConfig, rank: int) -> int:
    """The node a rank runs on: workers fill nodes in order, each server has a node of its own."""
    workers = num_workers(cfg)
    return rank // cfg.cluster.workers_per_node if rank < workers else cfg.cluster.nodes + (
        rank - workers)


def external_rank() -> dict[str, int] | None:
    """Rank and sizes when torchrun or srun started this process, else None."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return {"rank": int(env["RANK"]), "world_size": int(env["WORLD_SIZE"]),
                "local_rank": int(env.get("LOCAL_RANK", 0)),
                "local_world_size": int(env.get("LOCAL_WORLD_SIZE", 1))}
    if "SLURM_PROCID" in env and "SLURM_STEP_ID" in env and "MASTER_ADDR" in env:
        return {"rank": int(env["SLURM_PROCID"]), "world_size": int(env["SLURM_NTASKS"]),
                "local_rank": int(env.get("SLURM_LOCALID", 0)),
                "local_world_size": _slurm_local_tasks(env)}
    return None


def _slurm_local_tasks(env: os._Environ | dict[str, str]) -> int:
    """Tasks of this srun step on this node. SLURM_STEP_TASKS_PER_NODE ("4(x2),5", one
    count per node of the step) is exact for every distribution, including arbitrary
    placements where SLURM_NTASKS_PER_NODE is absent or wrong."""
    spec = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if not spec:
        return int(env.get("SLURM_NTASKS_PER_NODE", 1))
    counts: list[int] = []
    for part in spec.split(","):
        count, _, times = part.partition("(x")
        counts += [int(count)] * int(times.rstrip(")") or 1)
    return counts[min(int(env.get("SLURM_NODEID", 0)), len(counts) - 1)]
