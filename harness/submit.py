"""`python -m harness.submit experiment=<name> [dry_run=true] [overrides]`: a sweep as
Slurm job arrays.

    python -m harness.submit experiment=paper dry_run=true
    python -m harness.submit experiment=smoke cluster.slurm.partition=debug run.repeats=1

Every configuration of the sweep (the union of products of `hydra.sweeper.params` and
`hydra.sweeper.extra`) is validated first. Configurations that already have a successful
shard for every repeat in `results_dir` are skipped, so resubmitting reruns only what
failed or never ran. The rest is grouped by resource shape (nodes x tasks per node):
Slurm arrays share one resource request, so each shape is one array with one task per
configuration. A task reads its overrides and rank placement from files written here,
and `srun` starts one `python -m harness.run` per rank (workers, then parameter
servers), each worker bound to one GPU of its node and each server to none. The Slurm
settings are `cluster.slurm.*` of conf/cluster/slurm.yaml. GPUs are checked against the
partition (`sinfo`), not this login node: `cluster.slurm.gpus_per_node` null requests one
GPU per worker where the runs use GPUs (cluster.device=cuda, or auto on a partition with
GPUs), and only for the workers' nodes: servers on nodes of their own
(`cluster.slurm.colocate_servers=false`) of a GPU run are a component of a
heterogeneous job that asks for none, and since Slurm has no arrays of heterogeneous
jobs, such a shape is submitted as one job per configuration, from the same script.
Bad input is one line, exit code 2, and nothing is submitted.
"""

from __future__ import annotations

import datetime as dt
import difflib
import json
import shlex
import shutil
import sys
from pathlib import Path

from omegaconf import DictConfig

from harness import config
from harness.config import checks, usage
from harness.config.frozen import thaw
from harness.config.ranks import num_servers, num_workers
from harness.config.schema import step_ending
from harness.launch.slurm import (
    Shape,
    Task,
    check_cluster,
    check_gpus,
    check_settings,
    group,
    layout,
    sbatch,
    script_text,
    slurm_command,
    write_array,
)
from harness.measure import results

SUBMIT_KEYS = ("dry_run",)
IDENTITY = ("model", "method", "engine", "nodes", "workers_per_node", "servers", "network",
            "local_batch_size", "warmup_iters", "timed_iters", "sync_each_step", "rate",
            "ps_wire")
SECTIONS = ("model", "method", "network")  # whole: any key of them overridden is another run


def split_args(argv: list[str]) -> tuple[list[str], dict[str, str]]:
    """Separate submit's own options (dry_run=...) from the harness overrides."""
    own = {a.split("=", 1)[0]: a.split("=", 1)[1] for a in argv
           if "=" in a and a.split("=", 1)[0] in SUBMIT_KEYS}
    rest = [a for a in argv if a.split("=", 1)[0] not in SUBMIT_KEYS and a not in ("-m",
                                                                                   "--multirun")]
    for key, value in own.items():
        if value.lower() not in ("true", "false"):
            raise config.ConfigError(f"{key}={value!r} is invalid; use {key}=true or false")
    for arg in rest:  # a misspelled option of submit's own (dryrun=true)
        key = arg.split("=", 1)[0].lstrip("+~")
        close = difflib.get_close_matches(key, SUBMIT_KEYS, n=1, cutoff=0.8)
        if close:
            raise config.ConfigError(f"{key} is not an option; did you mean {close[0]}=true?")
    if not any(a.split("=", 1)[0].lstrip("+") == "cluster" for a in rest):
        rest = ["cluster=slurm", *rest]
    return rest, own


def identity(cfg: DictConfig) -> tuple:
    """What makes two runs the same configuration: the result columns in IDENTITY and the
    whole of the configuration's SECTIONS (a method's transport or planner overridden, a
    model's build, a network's rate)."""
    return (cfg.model.name, cfg.method.name, cfg.engine, cfg.cluster.nodes,
            cfg.cluster.workers_per_node, num_servers(cfg), cfg.network.name,
            cfg.model.local_batch_size, cfg.run.warmup_iters, cfg.run.timed_iters,
            step_ending(cfg.run), cfg.run.rate, cfg.cluster.ps_wire, _sections(thaw(cfg)))


def _sections(tree: dict) -> str:
    return json.dumps({k: tree.get(k) for k in SECTIONS}, sort_keys=True)


def completed(results_dir: str | Path) -> dict[tuple, int]:
    """Count of status-ok measured repeats per configuration identity among the shards."""
    frame = results.load(results_dir) if Path(results_dir).is_dir() else None
    if frame is None or frame.empty:
        return {}
    ok = frame[(frame.status == "ok") & (frame.source != "simulated")]
    ok = ok.assign(sections=ok.config_json.map(
        lambda text: _sections(json.loads(text)) if isinstance(text, str) else None))
    counts = ok.groupby([*IDENTITY, "sections"], dropna=False).size()
    return {tuple(_plain(v) for v in key): int(n) for key, n in counts.items()}


def _plain(value):
    return value.item() if hasattr(value, "item") else value


def pending(tasks: list[Task]) -> tuple[list[Task], list[Task]]:
    """Split tasks into (to run, already done): done = ok repeats >= run.repeats."""
    counts: dict[str, dict[tuple, int]] = {}
    todo, done = [], []
    for task in tasks:
        where = task.cfg.results_dir
        if where not in counts:
            counts[where] = completed(where)
        ok = counts[where].get(identity(task.cfg), 0)
        (done if ok >= task.cfg.run.repeats else todo).append(task)
    return todo, done


def load_tasks(overrides: list[str]) -> list[Task]:
    """Compose, validate and place every configuration of the sweep (GPUs are not looked
    for on this machine: `check_gpus` checks the partition's)."""
    tasks = []
    jobs = config.sweep(overrides)
    for job, cfg in zip(jobs, config.load_all(jobs)):
        slurm = cfg.cluster.slurm
        if not slurm:
            raise config.ConfigError(f"cluster {cfg.cluster.name!r} has no `slurm` settings; "
                                     "use cluster=slurm (conf/cluster/slurm.yaml) or a copy")
        check_settings(cfg, slurm)
        tasks.append(Task(overrides=job, cfg=cfg, slurm=slurm, layout=layout(cfg, slurm)))
    return tasks


def describe(task: Task) -> str:
    cfg = task.cfg
    return (f"{cfg.model.name} {cfg.method.name} nodes={cfg.cluster.nodes} "
            f"workers={num_workers(cfg)} servers={num_servers(cfg)} "
            f"repeats={cfg.run.repeats}")


def main(argv: list[str]) -> int:
    if usage.answer(argv, __doc__):  # -h, --help: the help, and nothing else
        return 0
    try:
        overrides, own = split_args(argv)
        checks.used_by("harness.submit", overrides)
        dry_run = own.get("dry_run", "false").lower() == "true"
        tasks = load_tasks(overrides)
        todo, done = pending(tasks)
        notes = check_slurm(todo, dry_run=dry_run) if todo else []
        arrays = group(todo)
    except config.ConfigError as exc:
        print(f"ddlbench: error: {exc}", file=sys.stderr)
        return 2
    for note in notes:
        print(f"ddlbench: note: {note}", file=sys.stderr)
    print(f"{len(tasks)} configurations: {len(done)} already complete (skipped), "
          f"{len(todo)} to run in {len(arrays)} job array(s)")
    if not arrays:
        return 0
    return _dry_run(arrays) if dry_run else _submit(arrays, overrides)


def check_slurm(todo: list[Task], *, dry_run: bool) -> list[str]:
    """Check the tasks against the cluster (a dry run asks no Slurm) and set their GPU
    requests; return the notes to print."""
    if dry_run:
        return check_gpus(todo, partition_gpus=None, label="(not asked)")
    notes = check_cluster(todo[0].slurm, todo)
    if shutil.which("sbatch") is None:
        slurm_command(["sbatch"])
    return notes


def _dry_run(arrays: dict[Shape, list[Task]]) -> int:
    root = Path(next(iter(arrays.values()))[0].slurm.jobs_dir) / "DRY-RUN"
    for shape, tasks in arrays.items():
        name = f"DRY-RUN-{shape.label}"
        print(f"\n=== {_kind(shape)} {name}: {len(tasks)} tasks of {shape.nodes} node(s) x "
              f"{shape.tasks_per_node} ranks{_gpus(shape)} ===")
        print(script_text(tasks, shape, jobs_dir=root / name, name=name))
        for i, task in enumerate(tasks):
            print(f"  [{i}] {describe(task)}  ranks on nodes {task.layout}")
            print(f"       {shlex.join(task.overrides)}")
    return 0


def _gpus(shape: Shape) -> str:
    servers = (f", and {shape.servers} servers on {shape.server_nodes} node(s) without GPUs"
               if shape.hetero else "")
    return (f", {shape.gpus_per_node} GPUs per node" if shape.gpus_per_node else "") + servers


def _kind(shape: Shape) -> str:
    return "heterogeneous jobs" if shape.hetero else "array"


def _submit(arrays: dict[Shape, list[Task]], overrides: list[str]) -> int:
    slurm = next(iter(arrays.values()))[0].slurm
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S-%f")
    root = Path(slurm.jobs_dir).resolve()
    for shape, tasks in arrays.items():
        script = write_array(tasks, shape, root=root, name=stamp)
        if shape.hetero:  # no arrays of heterogeneous jobs: one job per task
            job_id = ",".join(sbatch(script, task=i) for i in range(len(tasks)))
        else:
            job_id = sbatch(script)
        print(f"submitted {_kind(shape)} {job_id}: {len(tasks)} tasks of {shape.nodes} "
              f"node(s) x {shape.tasks_per_node} ranks{_gpus(shape)}; script {script}, "
              f"logs {script.parent}/logs/")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
