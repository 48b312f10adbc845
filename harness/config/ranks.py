"""Who the processes of a run are: workers, then parameter servers, on which node, and
the rank a launcher outside the harness (torchrun, srun) gave this process."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Mapping, MutableMapping

from harness.config.frozen import Config
from harness.config.schema import is_real_network

# Slurm's step ids from here up are not srun steps: the batch script, the extern step,
# salloc's interactive shell (SLURM_MAX_NORMAL_STEP_ID of slurm.h)
MAX_NORMAL_STEP_ID = 0xFFFFFFF0


def num_servers(cfg: Config) -> int:
    """Parameter-server processes the run needs: only PS methods have any, and none on one
    node with node-local aggregation (methods.uses_servers)."""
    import methods

    if not methods.uses_servers(cfg.method, nodes=cfg.cluster.nodes):
        return 0
    return cfg.cluster.nodes if cfg.cluster.servers is None else cfg.cluster.servers


def num_workers(cfg: Config) -> int:
    return cfg.cluster.nodes * cfg.cluster.workers_per_node


def profile_processes(cfg: Config) -> int:
    """The processes of a measured compute profile (simulate.compute=measured), all at
    once: one per distinct thing it times. Per-layer times do not depend on the number of
    workers, so one process, unless the run predicted is this machine's own (a local or
    emulated cluster on one of its networks: loopback or a rate-limited one), whose
    workers share its cores: then as many as it has workers, as the run starts them (on
    GPUs process k on GPU k, as the launcher places worker k)."""
    ours = on_one_machine(cfg) and not is_real_network(cfg.network)
    return num_workers(cfg) if ours else 1


def on_one_machine(cfg: Config) -> bool:
    """Whether every rank of the run, servers included, runs on this machine: a local or
    emulated cluster."""
    return cfg.cluster.name in ("local", "emulated")


def host_of(cfg: Config, rank: int) -> int:
    """The node a rank runs on: workers fill nodes in order, each server has a node of its own."""
    workers = num_workers(cfg)
    return rank // cfg.cluster.workers_per_node if rank < workers else cfg.cluster.nodes + (
        rank - workers)


def external_rank(env: MutableMapping[str, str] | None = None) -> dict[str, int] | None:
    """Rank and sizes when torchrun or srun started this process, else None.

    torchrun: RANK and WORLD_SIZE. srun: a job step (SLURM_STEP_ID, not the batch script
    nor salloc's interactive shell, which have no step or a special one) of more than one
    task (SLURM_STEP_NUM_TASKS, else SLURM_NTASKS); this process is task SLURM_PROCID. An
    srun step of a single task is not an external launch: the harness's local launcher
    starts every rank on that node, as when started plainly. Under srun, MASTER_ADDR and
    MASTER_PORT that `env` (default os.environ) lacks are set in it, for the env://
    rendezvous: see `slurm_rendezvous`.
    """
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        return {"rank": int(env["RANK"]), "world_size": int(env["WORLD_SIZE"]),
                "local_rank": int(env.get("LOCAL_RANK", 0)),
                "local_world_size": int(env.get("LOCAL_WORLD_SIZE", 1))}
    tasks = srun_tasks(env)
    if tasks <= 1:
        return None
    for key, value in slurm_rendezvous(env).items():
        env.setdefault(key, value)
    return {"rank": int(env["SLURM_PROCID"]), "world_size": tasks,
            "local_rank": int(env.get("SLURM_LOCALID", 0)),
            "local_world_size": _slurm_local_tasks(env)}


def srun_tasks(env: Mapping[str, str]) -> int:
    """Tasks of the srun step this process is a task of; 0 outside one. A batch script
    has SLURM_PROCID and SLURM_NTASKS but no SLURM_STEP_ID; salloc's interactive shell
    (LaunchParameters=use_interactive_step) is step 4294967290 and keeps the allocation's
    SLURM_NTASKS, so the step's own SLURM_STEP_NUM_TASKS comes first."""
    step = env.get("SLURM_STEP_ID", "")
    if "SLURM_PROCID" not in env or not step.isdigit() or int(step) >= MAX_NORMAL_STEP_ID:
        return 0
    return int(env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS") or 0)


def slurm_master_port(job_id: int) -> int:
    """The rendezvous port of a Slurm job: every task of the job derives the same one, and
    jobs sharing a node (each array task is a job of its own) mostly differ."""
    return 20000 + job_id % 40000


def slurm_rendezvous(env: Mapping[str, str]) -> dict[str, str]:
    """MASTER_ADDR and MASTER_PORT of an srun step: the step's first node (where task 0
    runs, for srun's block and cyclic distributions and harness.submit's layouts) and
    `slurm_master_port` of the job id."""
    nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or ""
    hosts = hostnames(nodes) if nodes else []
    return {"MASTER_ADDR": hosts[0] if hosts else "127.0.0.1",
            "MASTER_PORT": str(slurm_master_port(int(env.get("SLURM_JOB_ID", 0))))}


def hostnames(nodelist: str) -> list[str]:
    """The hosts of a Slurm node list ("node[01-04,07],gpu1"), in order: by
    `scontrol show hostnames` where it runs, else by `parse_nodelist`."""
    if shutil.which("scontrol"):
        try:
            out = subprocess.run(["scontrol", "show", "hostnames", nodelist],
                                 capture_output=True, text=True, timeout=10)
            if out.returncode == 0 and out.stdout.split():
                return out.stdout.split()
        except (OSError, subprocess.SubprocessError):
            pass
    return parse_nodelist(nodelist)


def parse_nodelist(nodelist: str) -> list[str]:
    """Expand a Slurm node list without Slurm: comma-separated names, each with any
    number of bracketed ranges ("gpu[1-2]-ib[01,03]"); zero padding is kept."""
    hosts: list[str] = []
    for name in _top_level_split(nodelist):
        expanded = [""]
        for text, ranges in re.findall(r"([^\[]*)(?:\[([^\]]*)\])?", name):
            values = _expand_ranges(ranges) if ranges else [""]
            expanded = [e + text + v for e in expanded for v in values]
        hosts += expanded
    return hosts


def _top_level_split(nodelist: str) -> list[str]:
    """Split at the commas outside brackets."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(nodelist):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            parts.append(nodelist[start:i])
            start = i + 1
    parts.append(nodelist[start:])
    return [p.strip() for p in parts if p.strip()]


def _expand_ranges(ranges: str) -> list[str]:
    """'01-03,07' -> ['01', '02', '03', '07'] (the width of the first bound is kept)."""
    values = []
    for item in ranges.split(","):
        low, _, high = item.strip().partition("-")
        width = len(low)
        values += [str(n).zfill(width) for n in range(int(low), int(high or low) + 1)]
    return values


def _slurm_local_tasks(env: Mapping[str, str]) -> int:
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


def torch_threads(cfg: Config, local_world_size: int, *, placed: bool = False) -> int:
    """Threads of one rank: run.threads, else the CPUs srun gave this task (not divided
    again), else this machine's cores shared by its local processes."""
    if cfg.run.threads:
        return cfg.run.threads
    cores = len(os.sched_getaffinity(0))
    per_task = os.environ.get("SLURM_CPUS_PER_TASK")
    if placed and per_task and "SLURM_STEP_ID" in os.environ:
        return max(1, min(int(per_task), cores))
    return max(1, cores // max(1, local_world_size))
