"""Be one rank of a run: rendezvous over env:// (the local launcher's variables, or
torchrun's or srun's), pick the rank's device and groups, run the entry's `worker(cfg,
ctx)`, report a failure as data and end with `os._exit` after an explicit teardown.

Ranks [0, workers) are workers, the rest parameter servers, and worker r belongs to node
r // workers_per_node. The local launcher places them so. Under torchrun or srun the
launcher placed them: right after the rendezvous every rank tells the others its host,
its launcher's local rank and the GPUs its task sees (`Seat`), and `placed_devices`
checks that layout and gives each worker its GPU, failing on every rank, naming the rank
and host, where the layout cannot be honoured.

Locally spawned ranks run `python -m harness.launch.rank <entry> <config.json>`; under
torchrun or srun, harness.launch.launcher calls `run_rank` in the process itself.
"""

from __future__ import annotations

import datetime as dt
import importlib
import itertools
import os
import socket
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import DictConfig

from harness.config import ConfigError, from_json, resolve_backend, resolve_device
from harness.config.ranks import num_servers, num_workers, torch_threads
from harness.config.schema import first_line
from harness.launch import failure, horovod
from harness.launch.process import exit_now, new_run_id
from methods.ps import wire


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


def group_backend(backend: str, *, worker: bool) -> str:
    """The default group's backend on one rank. On NCCL runs CPU tensors (run-id
    agreement, barriers, object collectives, PS messages, order messages, profile
    reductions) travel over Gloo and CUDA tensors over NCCL; parameter servers, CPU
    processes perhaps on nodes without GPUs, hold Gloo alone and so never create a CUDA
    context. (Gloo's rendezvous keys are per device type, so both sides meet.)"""
    if backend != "nccl":
        return backend
    return "cpu:gloo,cuda:nccl" if worker else "cpu:gloo"


NCCL_GRACE_S = 60.0  # NCCL's timeout beyond twice run.timeout_s (the launcher's watchdog: +30 s)


def nccl_timeout(timeout_s: float) -> dt.timedelta:
    """NCCL's timeout in a run of `timeout_s` (run.timeout_s). NCCL's watchdog aborts the
    whole process (SIGABRT, without a word) once a collective has waited that long, which
    would end the healthy ranks waiting on a frozen one; so it outlasts every wait of the
    harness's own (Gloo's, the methods', Horovod's: run.timeout_s, each begun after the
    collective it waits on; the launcher's watchdog), and those end the run first, naming
    the frozen rank (harness.launch.failure)."""
    return dt.timedelta(seconds=2 * timeout_s + NCCL_GRACE_S)


def lengthen_nccl(groups: list, timeout_s: float) -> None:
    """Give the NCCL backend of each of `groups` (None: the default group) `nccl_timeout`;
    their Gloo keeps the `timeout_s` they were made with. Groups without NCCL (CPU runs,
    parameter servers) are left as they are."""
    for group in groups:
        pg = dist.group.WORLD if group is None else group
        # "cpu:gloo,cuda:nccl" on GPU workers; CPU twin: "cpu:gloo,cuda:gloo", left alone
        if "nccl" in dist.get_backend_config(pg):
            pg._get_backend(torch.device("cuda")).set_timeout(nccl_timeout(timeout_s))


def pick_device(device_type: str, *, worker: bool, index: int, visible: int
                ) -> torch.device:
    """A rank's device when the local launcher started it: servers and CPU runs the CPU;
    a GPU worker GPU `index` of this machine (its rank: every worker of every emulated
    node runs here, so each emulated node has GPUs of its own)."""
    if device_type != "cuda" or not worker:
        return torch.device("cpu")
    if not 0 <= index < visible:
        raise ConfigError(
            f"worker {index} has no GPU of its own: this machine shows {visible} GPUs "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); run at "
            "most one worker per GPU (cluster.nodes x cluster.workers_per_node), or "
            "cluster.device=cpu")
    return torch.device("cuda", index)


@dataclass(frozen=True)
class Seat:
    """Where a launcher (torchrun, srun) put one rank."""

    rank: int
    host: str
    local_rank: int  # the launcher's (LOCAL_RANK, SLURM_LOCALID)
    worker: bool
    gpus: tuple[str, ...] = ()  # the GPUs its task sees, in its order: `gpu_ids`


def gpu_ids(count: int) -> tuple[str, ...]:
    """The first `count` GPUs this process sees, each by what names it on its host
    whatever the process's view: its UUID, else its PCI address. Not its
    CUDA_VISIBLE_DEVICES entry: sites that give each task a device cgroup of its own
    show every task its GPU as "0", and two tasks on two GPUs would look like one."""
    ids = []
    for index in range(count):
        props = torch.cuda.get_device_properties(index)
        uuid = str(getattr(props, "uuid", "") or "")
        ids.append(uuid or f"pci {props.pci_domain_id:04x}:{props.pci_bus_id:02x}:"
                           f"{props.pci_device_id:02x}")
    return tuple(ids)


def my_seat(*, rank: int, local_rank: int, worker: bool, device_type: str) -> Seat:
    """This process's seat (the GPUs only for a worker of a GPU run)."""
    gpus = gpu_ids(torch.cuda.device_count()) if worker and device_type == "cuda" else ()
    return Seat(rank=rank, host=socket.gethostname(), local_rank=local_rank, worker=worker,
                gpus=gpus)


def placed_devices(seats: list[Seat], *, workers_per_node: int, device_type: str,
                   backend: str, dedicated_servers: bool = False) -> list[torch.device]:
    """Every rank's device where a launcher placed the ranks (`seats`, indexed by rank).

    A worker takes the one GPU its task sees (srun --gpus-per-task / --gpu-bind), else
    GPU k of its host's, k its place among the host's workers by the launcher's local
    rank (ties by rank: two ranks of one local rank still get two GPUs). ConfigError,
    naming the rank and host, where the layout cannot be honoured: a node's workers on
    different hosts, more workers on a host than GPUs, two NCCL workers on one GPU, or a
    parameter server beside workers when servers have nodes of their own.
    """
    _check_nodes(seats, workers_per_node=workers_per_node, dedicated_servers=dedicated_servers)
    devices = [torch.device("cpu")] * len(seats)
    if device_type != "cuda":
        return devices
    hosts: dict[str, list[Seat]] = {}
    for seat in seats:
        if seat.worker:
            hosts.setdefault(seat.host, []).append(seat)
    for host, mine in hosts.items():
        taken: dict[str, int] = {}
        for place, seat in enumerate(sorted(mine, key=lambda s: (s.local_rank, s.rank))):
            index = 0 if len(seat.gpus) == 1 else place
            if index >= len(seat.gpus):
                raise ConfigError(
                    f"rank {seat.rank} is worker {place + 1} of {len(mine)} on host {host}, "
                    f"whose tasks see {len(seat.gpus)} GPUs: give each worker a GPU (srun "
                    "--gpus-per-task=1, or fewer workers per host)")
            gpu = seat.gpus[index]
            if backend == "nccl" and gpu in taken:
                raise ConfigError(
                    f"ranks {taken[gpu]} and {seat.rank} would share GPU {gpu} of host {host}, "
                    "and NCCL needs a GPU per rank: bind one GPU per task (srun --gpu-bind), "
                    "or share it over cluster.backend=gloo")
            taken[gpu] = seat.rank
            devices[seat.rank] = torch.device("cuda", index)
    return devices


def _check_nodes(seats: list[Seat], *, workers_per_node: int, dedicated_servers: bool) -> None:
    """Worker r is a worker of node r // workers_per_node: a node's workers share a host;
    with dedicated server nodes, no server shares one with a worker."""
    first: dict[int, Seat] = {}
    for seat in (s for s in seats if s.worker):
        node = seat.rank // workers_per_node
        head = first.setdefault(node, seat)
        if seat.host != head.host:
            raise ConfigError(
                f"rank {seat.rank} is a worker of node {node} but runs on host {seat.host}, "
                f"and rank {head.rank} of that node on {head.host}: the launcher must put "
                f"cluster.workers_per_node={workers_per_node} workers on each host, in rank "
                "order, servers after them (torchrun --nproc-per-node, srun --ntasks-per-node "
                "--distribution=block, or python -m harness.submit)")
    worker_hosts = {s.host: s.rank for s in seats if s.worker}
    for seat in (s for s in seats if not s.worker):
        if dedicated_servers and seat.host in worker_hosts:
            raise ConfigError(
                f"rank {seat.rank} is a parameter server but runs on host {seat.host} with "
                f"worker rank {worker_hosts[seat.host]}, and cluster.slurm.colocate_servers="
                "false gives servers nodes of their own: start the servers on other hosts")


def device_settings(run: DictConfig) -> None:
    """Apply run.tf32_matmul, run.tf32_cudnn and run.cudnn_benchmark (torch's defaults:
    false, true, false) before any model is built."""
    torch.backends.cuda.matmul.fp32_precision = "tf32" if run.tf32_matmul else "ieee"
    torch.backends.cudnn.conv.fp32_precision = "tf32" if run.tf32_cudnn else "ieee"
    torch.backends.cudnn.benchmark = run.cudnn_benchmark


def run_rank(cfg: DictConfig, *, entry: str, run_id: str | None, run_dir: Path | None,
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
        device_type = resolve_device(cfg.cluster)
        device = torch.device("cpu")
        if not placed:  # the local launcher's: worker r takes this machine's GPU r
            device = pick_device(device_type, worker=worker, index=rank,
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
        if placed:  # before any CUDA collective: NCCL takes the current device
            device = _placed_device(cfg, rank=rank, local_rank=local_rank, worker=worker,
                                    device_type=device_type, backend=backend)
        workers = num_workers(cfg)
        ctx = Context(rank=rank, world_size=world_size, local_rank=local_rank,
                      local_world_size=local_world_size, num_workers=workers,
                      num_servers=world_size - workers, run_id=run_id, run_dir=run_dir,
                      device=device, backend=backend)
        if ctx.num_servers:
            ctx.worker_group = dist.new_group(list(range(workers)), timeout=timeout)
        ctx.node_groups = node_groups(workers, cfg.cluster.workers_per_node, timeout=timeout)
        if worker:
            lengthen_nccl([None, ctx.worker_group, *(ctx.node_groups or ())], cfg.run.timeout_s)
        if cfg.cluster.ps_wire == "ucx":
            os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")  # ucxx sets an old one
        wire.start(cfg.cluster.ps_wire, store=dist.distributed_c10d._get_default_store(),
                   rank=rank, timeout_s=cfg.run.timeout_s, device=device)
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
        wire.close()  # the PS wire's threads end (UCX's progress thread)
        if session is not None:
            session.stop()  # Horovod's thread ends with its peers' while all are alive
        dist.destroy_process_group()
        return code, run_id
    except BaseException as exc:  # noqa: BLE001 - every failure is recorded, then fatal
        _rank_failed(cfg, entry, ctx, rank=rank, run_id=run_id, run_dir=run_dir, exc=exc,
                     placed=placed)
        exit_now(1)  # peers may be stuck in a collective: do not wait for clean-up


def _placed_device(cfg: DictConfig, *, rank: int, local_rank: int, worker: bool,
                   device_type: str, backend: str) -> torch.device:
    """This rank's device under torchrun or srun, from every rank's seat (made current)."""
    seats: list[Seat | None] = [None] * dist.get_world_size()
    dist.all_gather_object(seats, my_seat(rank=rank, local_rank=local_rank, worker=worker,
                                          device_type=device_type))
    slurm = cfg.cluster.get("slurm")
    device = placed_devices(seats, workers_per_node=cfg.cluster.workers_per_node,
                            device_type=device_type, backend=backend,
                            dedicated_servers=bool(slurm) and not slurm.colocate_servers)[rank]
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def node_local(workers: int, per_node: int) -> bool:
    """Whether a PS method's workers reduce inside their node first: several nodes of
    several workers each."""
    return per_node > 1 and workers > per_node


def node_groups(workers: int, per_node: int, *, timeout: dt.timedelta) -> tuple | None:
    """Two process groups per node of `per_node` workers, for PS methods' reduce and
    broadcast inside the node (methods/ps/node.py), made on every rank (it is collective):
    this worker's pair, or None (servers; one worker per node; one node)."""
    if not node_local(workers, per_node):
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


def _agree_run_id(cfg: DictConfig) -> str:
    """Rank 0's run id for every rank (the array script's DDLBENCH_RUN_ID under srun)."""
    box = [os.environ.get("DDLBENCH_RUN_ID") or new_run_id(cfg)]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _rank_failed(cfg: DictConfig, entry: str, ctx: Context | None, *, rank: int,
                 run_id: str | None, run_dir: Path | None, exc: BaseException,
                 placed: bool) -> None:
    """Say why this rank failed: to the run folder (the local launcher's, or the array
    script's), whose owner names the run's cause; under srun or torchrun also as a failed
    row, unless it is a peer's symptom and the array script (which sets DDLBENCH_RUN_ID)
    records srun's failure itself."""
    text = f"rank {rank}: {type(exc).__name__}: {first_line(exc)}".rstrip(": ")
    print(f"ddlbench: {text}\n{traceback.format_exc()}", file=sys.stderr)
    if run_dir is not None:
        failure.write_error(run_dir, rank, exc, text)
    if placed and run_id is not None and not (
            failure.symptom(exc) and "DDLBENCH_RUN_ID" in os.environ):
        failure.record(cfg, entry=entry, run_id=run_id, repeat=ctx.repeat if ctx else None,
                       error=text)


def main(argv: list[str]) -> int:
    """Entry of a locally spawned rank: `python -m harness.launch.rank <entry> <config.json>`."""
    entry, cfg_path = argv
    cfg = from_json(Path(cfg_path).read_text())
    rank, world = int(os.environ["DDLBENCH_RANK"]), int(os.environ["DDLBENCH_WORLD_SIZE"])
    local_world = num_workers(cfg) + num_servers(cfg)
    code, _ = run_rank(cfg, entry=entry, run_id=os.environ["DDLBENCH_RUN_ID"],
                        run_dir=Path(cfg_path).parent, rank=rank, world_size=world,
                        local_rank=rank % cfg.cluster.workers_per_node,
                        local_world_size=local_world)
    return code


if __name__ == "__main__":
    exit_now(main(sys.argv[1:]))
