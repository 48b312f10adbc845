"""Slurm job arrays: where each rank of a configuration goes (`layout`), the settings and
partition checks that need no run (`check_settings`, `check_cluster`, `check_gpus`),
one array per resource shape (`group`), and the array script rendered from
slurm/array.sbatch and handed to sbatch. `python -m harness.submit` drives it.

GPUs go to workers only. On each node the workers are the first tasks (`layout`), and
each sees one GPU of its node, the one of its place (`RANK_ENV`, CUDA_VISIBLE_DEVICES per
task); parameter servers, CPU processes, see none. Servers on nodes of their own
(colocate_servers: false) of a GPU run are a component of their own that asks for no
GPUs: a heterogeneous job (`Shape.hetero`), one per configuration, since Slurm has no
arrays of heterogeneous jobs.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig

from harness import config
from harness.config import paths
from harness.config import sbatch as sbatch_values
from harness.config.ranks import num_servers, num_workers
from harness.config.sbatch import directive, extra_directive
from harness.config.schema import REPO

# Run by bash in every srun task before the rank starts (`exec "$@"`). In a heterogeneous
# job the rank comes from the step (torchrun's variables, read first by
# harness.config.ranks: one step over both components). With GPUs, a worker (SLURM_PROCID
# below DDLBENCH_WORKERS) keeps the one GPU of its place on its node, SLURM_LOCALID
# (workers are each node's first tasks), and a parameter server none.
RANK_ENV = """\
if [ -n "${WORLD_SIZE:-}" ]; then
  export RANK="$SLURM_PROCID" LOCAL_RANK="$SLURM_LOCALID"
fi
if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then
  IFS=, read -ra gpus <<< "$CUDA_VISIBLE_DEVICES"
  if [ "$SLURM_PROCID" -lt "$DDLBENCH_WORKERS" ]; then
    export CUDA_VISIBLE_DEVICES="${gpus[$SLURM_LOCALID]:-none}"
  else
    export CUDA_VISIBLE_DEVICES=""
  fi
fi
exec "$@"
"""


# what `render` fills in: {{name}} in the template
PLACEHOLDERS = ("job_name", "output", "resources", "jobs_dir", "workdir", "setup", "hetero",
                "rank_env", "srun_options", "python")
SITE = ("partition", "account", "qos", "constraint", "reservation", "time")


@dataclass(frozen=True)
class Shape:
    """The resources of one array: every task gets `nodes` nodes x `tasks_per_node` ranks
    and `gpus_per_node` GPUs on each node; with `server_nodes`, `servers` more ranks on
    that many nodes of their own without GPUs (a heterogeneous job per task)."""

    nodes: int
    tasks_per_node: int
    gpus_per_node: int = 0
    server_nodes: int = 0
    servers: int = 0

    @property
    def hetero(self) -> bool:
        return self.server_nodes > 0

    @property
    def label(self) -> str:
        return f"n{self.nodes}x{self.tasks_per_node}" + (
            f"g{self.gpus_per_node}" if self.gpus_per_node else "") + (
            f"+s{self.servers}n{self.server_nodes}" if self.hetero else "")


@dataclass(frozen=True)
class Partition:
    """What submission checks of a partition, from `sinfo`."""

    nodes: int
    gpus_per_node: int  # the most GPUs (gres gpu) of any of its nodes; 0 = none


@dataclass
class Task:
    """One configuration: its overrides, config, rank placement and resource shape."""

    overrides: list[str]
    cfg: DictConfig
    slurm: DictConfig  # cluster.slurm: only submission reads it
    layout: list[int]  # node index (in the allocation) of each rank: workers, then servers
    gpus: int = 0  # GPUs per node to request: set by `check_gpus`

    @property
    def workers(self) -> int:
        return num_workers(self.cfg)

    @property
    def shape(self) -> Shape:
        counts = [self.layout.count(n) for n in range(max(self.layout) + 1)]
        worker_nodes = max(self.layout[: self.workers]) + 1
        if not self.gpus or worker_nodes == len(counts):  # one kind of node
            return Shape(nodes=len(counts), tasks_per_node=max(counts), gpus_per_node=self.gpus)
        return Shape(nodes=worker_nodes, tasks_per_node=max(counts[:worker_nodes]),
                     gpus_per_node=self.gpus, server_nodes=len(counts) - worker_nodes,
                     servers=len(self.layout) - self.workers)


def layout(cfg: DictConfig, slurm: DictConfig) -> list[int]:
    """Node index of every rank: workers fill `nodes` nodes in order, then the servers go
    round-robin onto the worker nodes (colocate_servers) or onto nodes of their own."""
    ranks = [n for n in range(cfg.cluster.nodes) for _ in range(cfg.cluster.workers_per_node)]
    for s in range(num_servers(cfg)):
        if slurm.colocate_servers:
            ranks.append(s % cfg.cluster.nodes)
        else:
            ranks.append(cfg.cluster.nodes + s // slurm.servers_per_node)
    return ranks


def check_settings(cfg: DictConfig, slurm: DictConfig) -> None:
    """The cluster.slurm rules that need no Slurm to check: every value one sbatch accepts
    (`sbatch.check_values`), and the values fit the configuration."""
    sbatch_values.check_values(slurm)
    if cfg.cluster.device == "cuda" and slurm.gpus_per_node == 0:
        raise config.ConfigError(
            "cluster.device=cuda but cluster.slurm.gpus_per_node=0 requests no GPUs; set it "
            "to null (one per worker) or a count, or use cluster.device=cpu")
    if slurm.gpus_per_node and cfg.cluster.workers_per_node > slurm.gpus_per_node:
        raise config.ConfigError(
            f"cluster.workers_per_node={cfg.cluster.workers_per_node} exceeds "
            f"cluster.slurm.gpus_per_node={slurm.gpus_per_node}; one GPU per worker")
    if not (REPO / slurm.template).is_file():
        raise config.ConfigError(f"cluster.slurm.template={slurm.template!r} does not exist; "
                                 "give a path relative to the repository")
    found = re.findall(r"\{\{(\w+)\}\}", (REPO / slurm.template).read_text())
    unknown = sorted(set(found) - set(PLACEHOLDERS))
    if unknown:
        raise config.ConfigError(f"cluster.slurm.template={slurm.template!r} has "
                                 f"{{{{{unknown[0]}}}}}, which harness.submit does not fill "
                                 f"in; use only {', '.join(PLACEHOLDERS)}")
    # task lists, scripts, logs
    paths.output_dir("cluster.slurm.jobs_dir", slurm.jobs_dir, example="slurm/jobs")


def group(tasks: list[Task]) -> dict[Shape, list[Task]]:
    """Tasks by resource shape, smallest first (one array each)."""
    shapes: dict[Shape, list[Task]] = {}
    for task in tasks:
        shapes.setdefault(task.shape, []).append(task)
    return dict(sorted(shapes.items(), key=lambda kv: (kv[0].nodes, kv[0].tasks_per_node,
                                                       kv[0].gpus_per_node)))


def partitions() -> dict[str, Partition]:
    """Every partition by name, from `sinfo` (the default partition also as '')."""
    out = slurm_command(["sinfo", "--noheader", "--format=%P|%D|%G"])
    found: dict[str, Partition] = {}
    default = None
    for line in out.splitlines():  # a partition has one line per group of alike nodes
        name, count, gres = line.strip().split("|")
        if name.endswith("*"):
            name = default = name.rstrip("*")
        seen = found.get(name, Partition(nodes=0, gpus_per_node=0))
        found[name] = Partition(nodes=seen.nodes + int(count),
                                gpus_per_node=max(seen.gpus_per_node, gres_gpus(gres)))
    if default is not None:
        found[""] = found[default]
    return found


def gres_gpus(gres: str) -> int:
    """GPUs per node in a generic-resource string of `sinfo --format=%G`: 'gpu:4',
    'gpu:a100:4(S:0-1)', 'gpu:a100:2,gpu:v100:2' (summed), '(null)' (none)."""
    total = 0
    for item in re.sub(r"\([^)]*\)", "", gres).split(","):
        fields = item.strip().split(":")
        if fields[0] == "gpu":
            total += int(fields[-1]) if fields[-1].isdigit() else 1
    return total


def slurm_command(argv: list[str]) -> str:
    if shutil.which(argv[0]) is None:
        raise config.ConfigError(f"{argv[0]} is not on PATH; run on a Slurm login node, or "
                                 "add dry_run=true to only print the job arrays")
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        first = (out.stderr.strip().splitlines() or [f"exit code {out.returncode}"])[0]
        raise config.ConfigError(f"{' '.join(argv)} failed: {first}")
    return out.stdout


def check_cluster(slurm: DictConfig, tasks: list[Task]) -> list[str]:
    """The partition exists and has the nodes and GPUs every task needs; set each task's
    GPU request (`check_gpus`) and return the notes to print."""
    found = partitions()
    name = slurm.partition or ""
    if name not in found:
        known = ", ".join(sorted(k for k in found if k))
        raise config.ConfigError(f"cluster.slurm.partition={slurm.partition!r} is unknown; "
                                 f"choose one of: {known}")
    part, label = found[name], repr(slurm.partition or "(default)")
    need = max(t.shape.nodes + t.shape.server_nodes for t in tasks)
    if need > part.nodes:
        raise config.ConfigError(
            f"a configuration needs {need} nodes but partition {label} has {part.nodes}; "
            "drop the larger cluster.nodes or choose a bigger cluster.slurm.partition")
    return check_gpus(tasks, partition_gpus=part.gpus_per_node, label=label)


def gpus_for(cfg: DictConfig, partition_gpus: int | None) -> int:
    """GPUs per node a configuration requests: cluster.slurm.gpus_per_node, or where that
    is null one per worker if the runs use GPUs: cluster.device=cuda, or auto and the
    partition has GPUs (`partition_gpus`; None = not asked, a dry run: taken as yes)."""
    asked = cfg.cluster.slurm.gpus_per_node
    if asked is not None:
        return asked
    device = cfg.cluster.device
    if device == "cuda" or (device == "auto" and partition_gpus != 0):
        return cfg.cluster.workers_per_node
    return 0


def check_gpus(tasks: list[Task], *, partition_gpus: int | None, label: str) -> list[str]:
    """Set every task's GPU request and check it against the partition's GPUs per node
    (None: not asked); return the notes on runs of cluster.device=auto that use CPUs."""
    notes: list[str] = []
    for task in tasks:
        cfg, task.gpus = task.cfg, gpus_for(task.cfg, partition_gpus)
        asked = cfg.cluster.slurm.gpus_per_node
        why = (f"cluster.slurm.gpus_per_node={asked}" if asked is not None else
               f"one per worker, cluster.workers_per_node={cfg.cluster.workers_per_node}")
        if partition_gpus is not None and task.gpus > partition_gpus:
            raise config.ConfigError(
                f"a configuration requests --gpus-per-node={task.gpus} ({why}) but partition "
                f"{label} has {partition_gpus} GPUs per node; choose a partition with more "
                "(cluster.slurm.partition), or lower cluster.workers_per_node")
        if task.gpus == 0 and cfg.cluster.backend == "nccl":
            raise config.ConfigError(f"cluster.backend=nccl needs GPUs but {_no_gpus(asked, label)}"
                                     "; use cluster.backend=auto or gloo")
        if task.gpus == 0 and cfg.cluster.device == "auto":
            notes.append(f"{_no_gpus(asked, label)}, so the runs (cluster.device=auto) use "
                         "CPUs; set cluster.device=cpu to say so, or request GPUs")
        elif partition_gpus is None and asked is None and cfg.cluster.device == "auto":
            notes.append("dry run, Slurm not asked: cluster.device=auto requests one GPU per "
                         "worker; on a partition without GPUs submission requests none and "
                         "the runs use CPUs")
    return list(dict.fromkeys(notes))


def _no_gpus(asked: int | None, label: str) -> str:
    """Why a task requests no GPUs."""
    if asked == 0:
        return "cluster.slurm.gpus_per_node=0 requests none"
    return f"partition {label} has none (no gpu gres in sinfo; cluster.slurm.partition)"


def sbatch_resources(slurm: DictConfig, shape: Shape, *, count: int) -> str:
    """The #SBATCH lines of the resources: an array of `count` tasks of the shape's nodes,
    or a heterogeneous job of the worker nodes (with GPUs) and the server nodes (CPUs
    only), each with the site's settings; every value quoted as sbatch reads it."""
    site = [directive(key, slurm[key]) for key in SITE if slurm[key]]
    per_task = [directive("cpus-per-task", slurm.cpus_per_task) if slurm.cpus_per_task
                else None, directive("mem", slurm.mem) if slurm.mem else None]
    extra = [extra_directive(str(option)) for option in slurm.extra]
    throttle = f"%{slurm.max_parallel}" if slurm.max_parallel else ""
    lines = [None if shape.hetero else f"--array=0-{count - 1}{throttle}",
             f"--nodes={shape.nodes}", f"--ntasks-per-node={shape.tasks_per_node}", *site,
             f"--gpus-per-node={shape.gpus_per_node}" if shape.gpus_per_node else None,
             *per_task, *extra]
    if shape.hetero:  # the servers' component: nodes of their own, no GPUs
        lines += ["hetjob", f"--nodes={shape.server_nodes}", f"--ntasks={shape.servers}",
                  *site, *per_task, *extra]
    return "\n".join(f"#SBATCH {o}" for o in lines if o)


def render(template: str, *, slurm: DictConfig, shape: Shape, count: int, job_name: str,
           jobs_dir: Path, workdir: Path) -> str:
    """The sbatch script of one array (or heterogeneous job): `template` with its
    {{placeholders}} filled in. A user's value reaches a shell line only shell-quoted
    (paths), or not at all (overrides: read from the task's argument file)."""
    # srun does not inherit sbatch's --cpus-per-task (Slurm >= 22.05)
    srun = f"--cpus-per-task={slurm.cpus_per_task} " if slurm.cpus_per_task else ""
    logs = str(jobs_dir / "logs").replace("%", "%%")  # %A, %a: Slurm's patterns
    values = {
        "job_name": directive("job-name", job_name),
        "output": directive("output", f"{logs}/%A_%a.out"),
        "hetero": "1" if shape.hetero else "0",
        "jobs_dir": shlex.quote(str(jobs_dir)),
        "resources": sbatch_resources(slurm, shape, count=count),
        "srun_options": srun, "rank_env": shlex.quote(RANK_ENV),
        "workdir": shlex.quote(str(workdir)), "setup": slurm.setup or "",
        "python": shlex.quote(sys.executable),
    }
    for key, value in values.items():
        template = template.replace("{{" + key + "}}", value)
    return template


def write_array(tasks: list[Task], shape: Shape, *, root: Path, name: str) -> Path:
    """Write one array's task list, layout and script under `root`; return the script."""
    jobs_dir = root / f"{name}-{shape.label}"
    (jobs_dir / "logs").mkdir(parents=True, exist_ok=True)
    (jobs_dir / "tasks.txt").write_text("".join(shlex.join(t.overrides) + "\n" for t in tasks))
    (jobs_dir / "args").mkdir(exist_ok=True)  # what the script reads: NUL-separated, no eval
    for i, task in enumerate(tasks):
        (jobs_dir / "args" / str(i)).write_text("".join(f"{o}\0" for o in task.overrides))
    (jobs_dir / "layout.txt").write_text("".join(" ".join(map(str, t.layout)) + "\n"
                                                 for t in tasks))
    (jobs_dir / "workers.txt").write_text("".join(f"{t.workers}\n" for t in tasks))
    script = jobs_dir / "array.sbatch"
    script.write_text(script_text(tasks, shape, jobs_dir=jobs_dir, name=jobs_dir.name))
    return script


def script_text(tasks: list[Task], shape: Shape, *, jobs_dir: Path, name: str) -> str:
    slurm = tasks[0].slurm
    template = (REPO / slurm.template).read_text()
    return render(template, slurm=slurm, shape=shape, count=len(tasks),
                  job_name=f"ddlbench-{name}", jobs_dir=jobs_dir.resolve(), workdir=Path.cwd())


def sbatch(script: Path, *, task: int | None = None) -> str:
    """Submit `script` (an array; or with `task`, the heterogeneous job of that task of it,
    which the script reads from its first argument); return the job id."""
    argv = ["sbatch", "--parsable"]
    if task is not None:
        logs = str(script.parent / "logs").replace("%", "%%")  # %j: Slurm's pattern
        argv.append(f"--output={logs}/%j_{task}.out")
    out = slurm_command([*argv, str(script), *([] if task is None else [str(task)])])
    return out.strip().split(";")[0]
