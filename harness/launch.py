"""Start a run's processes, watch them, and bring the run down on any failure.

Ranks [0, workers) are workers and [workers, workers + servers) are parameter
servers. Locally the harness starts every rank itself as
`python -m harness.launch <entry> <config.json>` with an env:// rendezvous;
under torchrun or srun the process already is one rank and runs the entry
directly. An entry is a module with `worker(cfg, ctx)`, and optionally
`record_failure(cfg, run_id=..., repeat=..., error=...)` to keep a failed run as
data (harness.failure decides which failure, and which repeat, gets the row).

The local launcher watches its ranks: the first failure, a watchdog (no rank
made progress for run.timeout_s plus a grace period) and SIGINT / SIGTERM to the
launcher each stop every rank; the run's temporary folder and emulated network
go with it.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime as dt
import importlib
import itertools
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import DictConfig

from harness import failure, horovod, netem
from harness.config import ConfigError, from_json, load, resolve_backend, resolve_device, to_json
from harness.ranks import external_rank, host_of, num_servers, num_workers
from harness.schema import first_line

POLL_S = 0.1
KILL_GRACE_S = 5.0
STALL_GRACE_S = 30.0  # beyond run.timeout_s: start-up, and a peer's own timeout first
SETTLE_S = 3.0  # after a rank timed out on a peer: time for the others to say why


@dataclass
class Context:
    """Who this process is in the run."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    num_workers: int
    num_servers: int
    run_id: str
    run_dir: Path | None  # scratch folder shared with the local launcher (None under srun)
    device: torch.device
    backend: str
    worker_group: dist.ProcessGroup | None = None
    node_groups: tuple | None = None  # this worker's node's two groups (node_groups)
    repeat: int = 0  # the repeat in progress, for failure records

    @property
    def is_worker(self) -> bool:
        return self.rank < self.num_workers

    def beat(self, where: str) -> None:
        """Tell the local launcher's watchdog this rank is making progress, and where."""
        failure.beat(self.run_dir, self.rank, self.repeat, where)


def new_run_id(cfg: DictConfig) -> str:
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return f"{stamp}-{cfg.model.name}-{cfg.method.name}-w{num_workers(cfg)}-{uuid.uuid4().hex[:6]}"


def check_launcher(cfg: DictConfig) -> None:
    """Under torchrun/srun, the started processes must match the configured cluster."""
    ext = external_rank()
    expected = num_workers(cfg) + num_servers(cfg)
    if ext is not None and ext["world_size"] != expected:
        raise ConfigError(
            f"the launcher started {ext['world_size']} processes but cluster.nodes x "
            f"cluster.workers_per_node + servers = {expected}; make them agree"
        )


def launch(cfg: DictConfig, *, entry: str) -> tuple[int, str | None]:
    """Run `entry` on every rank of `cfg`'s cluster.

    Returns the exit code and, where this process should report on the run (the
    local launcher, or rank 0 under torchrun/srun), the run id.
    """
    ext = external_rank()
    if ext is None:
        return _launch_local(cfg, entry=entry)
    code, run_id = _run_rank(cfg, entry=entry, run_id=None, run_dir=None, placed=True, **ext)
    return code, run_id if ext["rank"] == 0 else None


def command(argv: list[str], *, entry: str) -> int:
    """A one-configuration command: validate `argv` (one line and exit 2 on bad input,
    before anything starts), then run `entry` on every rank; the run's exit code."""
    try:
        cfg = load(argv)
        check_launcher(cfg)
    except ConfigError as exc:
        print(f"ddlbench: error: {exc}", file=sys.stderr)
        return 2
    code, _ = launch(cfg, entry=entry)
    return code


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the child: get SIGKILL if the launcher dies, so no worker is orphaned."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _spawn(cfg_path: Path, *, entry: str, rank: int, world: int, port: int, run_id: str,
           master_addr: str, wrap: Callable[[list[str]], list[str]], extra_env: dict[str, str]
           ) -> subprocess.Popen:
    env = dict(os.environ, DDLBENCH_RANK=str(rank), DDLBENCH_WORLD_SIZE=str(world),
               DDLBENCH_RUN_ID=run_id, MASTER_ADDR=master_addr, MASTER_PORT=str(port),
               **extra_env)
    return subprocess.Popen(
        wrap([sys.executable, "-m", "harness.launch", entry, str(cfg_path)]),
        env=env, start_new_session=True, preexec_fn=_die_with_parent,
    )


def _launch_local(cfg: DictConfig, *, entry: str) -> tuple[int, str]:
    run_id = new_run_id(cfg)
    workers, world = num_workers(cfg), num_workers(cfg) + num_servers(cfg)
    port = cfg.cluster.master_port or _free_port()
    with _signals_raise(), tempfile.TemporaryDirectory(prefix=f"ddlbench-{run_id}-") as tmp, \
            _network(cfg, hosts=cfg.cluster.nodes + num_servers(cfg)) as net:
        run_dir = Path(tmp)
        cfg_path = run_dir / "config.json"
        cfg_path.write_text(to_json(cfg))
        procs: list[subprocess.Popen] = []
        try:
            for rank in range(world):
                host = host_of(cfg, rank)
                procs.append(_spawn(
                    cfg_path, entry=entry, rank=rank, world=world, port=port, run_id=run_id,
                    master_addr=net.address(0) if net else cfg.cluster.master_addr,
                    wrap=(lambda argv, h=host: net.command(h, argv)) if net else list,
                    extra_env={"GLOO_SOCKET_IFNAME": netem.IFNAME} if net else {},
                ))
            ending = _watch(procs, run_dir, idle_s=cfg.run.timeout_s + STALL_GRACE_S)
        except KeyboardInterrupt as exc:  # SIGINT, or SIGTERM by _signals_raise
            code = 143 if isinstance(exc, Terminated) else 130
            reason = ("the launcher got SIGTERM" if code == 143 else
                      "the launcher was interrupted (SIGINT, Ctrl-C)")
            ending = _stopped(procs, {}, code=code, interrupt=reason + failure.where(run_dir, 0))
        if ending.code != 0:
            error, repeat = failure.cause(run_dir, ending, workers=workers)
            print(f"ddlbench: run {run_id} failed: {error}", file=sys.stderr)
            failure.record(cfg, entry=entry, run_id=run_id, repeat=repeat, error=error)
        return ending.code, run_id


class Terminated(KeyboardInterrupt):
    """SIGTERM to the launcher: handled like Ctrl-C, exit code 143."""


@contextlib.contextmanager
def _signals_raise() -> Iterator[None]:
    """SIGTERM raises Terminated meanwhile, so a killed launcher still stops its
    ranks, records the failure and removes its temporary folder and namespaces."""
    def terminate(signum: int, frame: object) -> None:
        raise Terminated

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def _network(cfg: DictConfig, *, hosts: int) -> Iterator[netem.EmulatedNetwork | None]:
    """The run's emulated network (cluster=emulated), removed afterwards; else None."""
    if cfg.cluster.name != "emulated":
        yield None
        return
    with netem.EmulatedNetwork(hosts=hosts, rate_mbit=cfg.network.get("rate_mbit")) as net:
        yield net


def _watch(procs: list[subprocess.Popen], run_dir: Path, *, idle_s: float) -> failure.Ending:
    """Wait for every process. Stop them all on the first failure (after a short
    settling time when it is a peer's symptom, so the rank that caused it can say
    so), or when no rank has made progress for `idle_s`."""
    exits: dict[int, int] = {}
    started = time.time()
    settle_until = None
    while True:
        for rank, p in enumerate(procs):
            if rank not in exits and (code := p.poll()) is not None:
                exits[rank] = code
        failed = {r: c for r, c in exits.items() if c != 0}
        if not failed and len(exits) == len(procs):
            return failure.Ending(0, exits)
        if failed:
            if settle_until is None:
                settle_until = time.monotonic() + (
                    SETTLE_S if failure.symptoms_only(run_dir, list(failed)) else 0)
            if time.monotonic() >= settle_until or len(exits) == len(procs):
                code = next(iter(failed.values()))
                return _stopped(procs, exits, code=code if code > 0 else 1)
        elif time.time() - failure.last_progress(run_dir, since=started) > idle_s:
            return _stopped(procs, exits, code=1, stall=failure.stalled(
                run_dir, idle_s=idle_s, ranks=len(procs)))
        time.sleep(POLL_S)


def _stopped(procs: list[subprocess.Popen], exits: dict[int, int], *, code: int,
             interrupt: str = "", stall: str = "") -> failure.Ending:
    alive = [r for r, p in enumerate(procs) if r not in exits and p.poll() is None]
    _stop(procs)
    return failure.Ending(code, dict(exits), alive, interrupt=interrupt, stall=stall)


def _stop(procs: list[subprocess.Popen]) -> None:
    """SIGTERM every live process group, SIGKILL what is left after a grace period."""
    for sig, wait_s in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, KILL_GRACE_S)):
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + wait_s
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(POLL_S)


def torch_threads(cfg: DictConfig, local_world_size: int, *, placed: bool = False) -> int:
    """Threads of one rank: run.threads, else the CPUs srun gave this task (not divided
    again), else this machine's cores shared by its local processes."""
    if cfg.run.threads:
        return cfg.run.threads
    cores = len(os.sched_getaffinity(0))
    per_task = os.environ.get("SLURM_CPUS_PER_TASK")
    if placed and per_task and "SLURM_STEP_ID" in os.environ:
        return max(1, min(int(per_task), cores))
    return max(1, cores // max(1, local_world_size))


def group_backend(backend: str, *, worker: bool) -> str:
    """The default group's backend on one rank. On NCCL runs CPU tensors (run-id
    agreement, barriers, object collectives, PS messages, order messages, profile
    reductions) travel over Gloo and CUDA tensors over NCCL; parameter servers, CPU
    processes perhaps on nodes without GPUs, hold Gloo alone and so never create a CUDA
    context. (Gloo's rendezvous keys are per device type, so both sides meet.)"""
    if backend != "nccl":
        return backend
    return "cpu:gloo,cuda:nccl" if worker else "cpu:gloo"


def pick_device(device_type: str, *, worker: bool, local_rank: int, visible: int
                ) -> torch.device:
    """A rank's device: servers and CPU runs the CPU; a GPU worker the one GPU its task
    sees (Slurm's --gpus-per-task / --gpu-bind), else GPU `local_rank` of the node's."""
    if device_type != "cuda" or not worker:
        return torch.device("cpu")
    if visible == 1:
        return torch.device("cuda", 0)
    if not 0 <= local_rank < visible:
        raise ConfigError(
            f"local rank {local_rank} has no GPU of its own: this process sees {visible} GPUs "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); give "
            "each task one GPU (srun --gpus-per-task=1) or each node one GPU per worker")
    return torch.device("cuda", local_rank)


def device_settings(run: DictConfig) -> None:
    """Apply run.tf32_matmul, run.tf32_cudnn and run.cudnn_benchmark (torch's defaults:
    false, true, false) before any model is built."""
    torch.backends.cuda.matmul.fp32_precision = "tf32" if run.tf32_matmul else "ieee"
    torch.backends.cudnn.conv.fp32_precision = "tf32" if run.tf32_cudnn else "ieee"
    torch.backends.cudnn.benchmark = run.cudnn_benchmark


def _run_rank(cfg: DictConfig, *, entry: str, run_id: str | None, run_dir: Path | None,
              rank: int, world_size: int, local_rank: int, local_world_size: int,
              placed: bool = False) -> tuple[int, str | None]:
    """Be one rank: rendezvous, run the entry's worker, report a failure as data.
    `placed`: torchrun or srun started this process (else the local launcher)."""
    failure.beat(run_dir, rank, 0, "starting")
    module = importlib.import_module(entry)
    worker = rank < num_workers(cfg)
    backend = resolve_backend(cfg.cluster)
    ctx = None
    try:
        device = pick_device(resolve_device(cfg.cluster), worker=worker, local_rank=local_rank,
                             visible=torch.cuda.device_count() if worker else 0)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        torch.set_num_threads(torch_threads(cfg, local_world_size, placed=placed))
        device_settings(cfg.run)
        if cfg.cluster.gloo_ifname:
            os.environ["GLOO_SOCKET_IFNAME"] = cfg.cluster.gloo_ifname
        failure.beat(run_dir, rank, 0, "joining the process group")
        timeout = dt.timedelta(seconds=cfg.run.timeout_s)
        dist.init_process_group(group_backend(backend, worker=worker), rank=rank,
                                world_size=world_size, timeout=timeout,
                                **_rendezvous(rank, world_size, timeout, placed=placed))
        run_id = run_id or _agree_run_id(cfg)
        workers = num_workers(cfg)
        ctx = Context(rank=rank, world_size=world_size, local_rank=local_rank,
                      local_world_size=local_world_size, num_workers=workers,
                      num_servers=world_size - workers, run_id=run_id, run_dir=run_dir,
                      device=device, backend=backend)
        if ctx.num_servers:
            ctx.worker_group = dist.new_group(list(range(workers)))
        ctx.node_groups = node_groups(workers, cfg.cluster.workers_per_node, timeout=timeout)
        session = None
        if cfg.engine == "horovod" and ctx.is_worker:  # engine=horovod has no servers
            ctx.beat("starting Horovod")
            session = horovod.start(cfg, group=ctx.worker_group)
        code = 0
        try:
            module.worker(cfg, ctx)
        except SystemExit as exc:  # a worker's own verdict (e.g. verify's tolerance check)
            code = int(exc.code or 0)
        ctx.beat("leaving the process group")
        dist.barrier()  # every rank is done with every collective: nobody tears down early
        if session is not None:
            session.stop()  # Horovod's thread ends with its peers' while all are alive
        dist.destroy_process_group()
        return code, run_id
    except BaseException as exc:  # noqa: BLE001 - every failure is recorded, then fatal
        _rank_failed(cfg, entry, ctx, rank=rank, run_id=run_id, run_dir=run_dir, exc=exc)
        exit_now(1)  # peers may be stuck in a collective: do not wait for clean-up


def node_groups(workers: int, per_node: int, *, timeout: dt.timedelta) -> tuple | None:
    """Two process groups per node of `per_node` workers, for PS methods' reduce and
    broadcast inside the node (methods/ps.py), made on every rank (it is collective):
    this worker's pair, or None (servers; one worker per node; one node)."""
    if per_node == 1 or workers <= per_node:
        return None
    nodes = [list(range(n, n + per_node)) for n in range(0, workers, per_node)]
    mine = [dist.new_subgroups_by_enumeration(nodes, timeout=timeout)[0] for _ in range(2)]
    return tuple(mine) if mine[0] is not None else None


_STORE: list = []  # torchrun's or srun's store, kept for every launch of this process
_LAUNCHES = itertools.count()


def _rendezvous(rank: int, world_size: int, timeout: dt.timedelta, *, placed: bool) -> dict:
    """How a rank meets its peers. A locally spawned rank runs one launch: env://.
    A placed rank (torchrun, srun) may run several in a row (a sweep, harness.check),
    and a process group made again on the same store would reuse its keys: a rank
    arriving first would read a peer's previous, closed Gloo address. So each launch
    gets keys of its own on one store kept for the process (every rank runs the same
    launches in the same order, so they agree on the prefix)."""
    if not placed:
        return {"init_method": "env://"}
    if not _STORE:
        store, _, _ = next(dist.rendezvous("env://", rank, world_size, timeout=timeout))
        _STORE.append(store)
    return {"store": dist.PrefixStore(f"ddlbench/launch{next(_LAUNCHES)}", _STORE[0])}


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


def _agree_run_id(cfg: DictConfig) -> str:
    """Rank 0's run id for every rank (the array script's DDLBENCH_RUN_ID under srun)."""
    box = [os.environ.get("DDLBENCH_RUN_ID") or new_run_id(cfg)]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _rank_failed(cfg: DictConfig, entry: str, ctx: Context | None, *, rank: int,
                 run_id: str | None, run_dir: Path | None, exc: BaseException) -> None:
    """Say why this rank failed: to the local launcher, which names the run's cause;
    else (srun, torchrun) as a failed row, unless it is a peer's symptom and the
    array script (which sets DDLBENCH_RUN_ID) records srun's failure itself."""
    text = f"rank {rank}: {type(exc).__name__}: {first_line(exc)}".rstrip(": ")
    print(f"ddlbench: {text}\n{traceback.format_exc()}", file=sys.stderr)
    if run_dir is not None:
        failure.write_error(run_dir, rank, exc, text)
    elif run_id is not None and not (failure.symptom(exc) and "DDLBENCH_RUN_ID" in os.environ):
        failure.record(cfg, entry=entry, run_id=run_id, repeat=ctx.repeat if ctx else None,
                       error=text)


def main(argv: list[str]) -> int:
    """Entry of a locally spawned rank: `python -m harness.launch <entry> <config.json>`."""
    entry, cfg_path = argv
    cfg = from_json(Path(cfg_path).read_text())
    rank, world = int(os.environ["DDLBENCH_RANK"]), int(os.environ["DDLBENCH_WORLD_SIZE"])
    local_world = num_workers(cfg) + num_servers(cfg)
    code, _ = _run_rank(cfg, entry=entry, run_id=os.environ["DDLBENCH_RUN_ID"],
                        run_dir=Path(cfg_path).parent, rank=rank, world_size=world,
                        local_rank=rank % cfg.cluster.workers_per_node,
                        local_world_size=local_world)
    return code


if __name__ == "__main__":
    exit_now(main(sys.argv[1:]))
