"""Start a run's processes, watch them, and bring the run down on any failure.

Ranks [0, workers) are workers and [workers, workers + servers) are parameter
servers. Locally the harness starts every rank itself as
`python -m harness.launch <entry> <config.json>` with an env:// rendezvous;
under torchrun or srun the process already is one rank and runs the entry
directly. An entry is a module with `worker(cfg, ctx)`, and optionally
`record_failure(cfg, ctx, error)` to keep a failed run as data.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime as dt
import importlib
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

from harness import netem
from harness.config import ConfigError, from_json, load, resolve_backend, resolve_device, to_json

POLL_S = 0.1
KILL_GRACE_S = 5.0


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
    repeat: int = 0  # the repeat in progress, for failure records

    @property
    def is_worker(self) -> bool:
        return self.rank < self.num_workers


def num_servers(cfg: DictConfig) -> int:
    """Parameter-server processes the run needs: only PS methods have any."""
    if cfg.method.transport.name != "ps":
        return 0
    return cfg.cluster.nodes if cfg.cluster.servers is None else cfg.cluster.servers


def num_workers(cfg: DictConfig) -> int:
    return cfg.cluster.nodes * cfg.cluster.workers_per_node


def new_run_id(cfg: DictConfig) -> str:
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return f"{stamp}-{cfg.model.name}-{cfg.method.name}-w{num_workers(cfg)}-{uuid.uuid4().hex[:6]}"


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
    code, run_id = _run_rank(cfg, entry=entry, run_id=None, run_dir=None, **ext)
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


def host_of(cfg: DictConfig, rank: int) -> int:
    """The node a rank runs on: workers fill nodes in order, each server has a node of its own."""
    workers = num_workers(cfg)
    return rank // cfg.cluster.workers_per_node if rank < workers else cfg.cluster.nodes + (
        rank - workers)


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
    world = num_workers(cfg) + num_servers(cfg)
    port = cfg.cluster.master_port or _free_port()
    with tempfile.TemporaryDirectory(prefix=f"ddlbench-{run_id}-") as tmp, \
            _network(cfg, hosts=cfg.cluster.nodes + num_servers(cfg)) as net:
        cfg_path = Path(tmp) / "config.json"
        cfg_path.write_text(to_json(cfg))
        procs = []
        for rank in range(world):
            host = host_of(cfg, rank)
            procs.append(_spawn(
                cfg_path, entry=entry, rank=rank, world=world, port=port, run_id=run_id,
                master_addr=net.address(0) if net else cfg.cluster.master_addr,
                wrap=(lambda argv, h=host: net.command(h, argv)) if net else list,
                extra_env={"GLOO_SOCKET_IFNAME": netem.IFNAME} if net else {},
            ))
        code, error = _watch(procs)
        if code != 0:
            _record_failure(cfg, entry=entry, run_id=run_id, run_dir=Path(tmp), error=error)
        return code, run_id


@contextlib.contextmanager
def _network(cfg: DictConfig, *, hosts: int) -> Iterator[netem.EmulatedNetwork | None]:
    """The run's emulated network (cluster=emulated), removed afterwards; else None.

    SIGTERM is turned into KeyboardInterrupt meanwhile, so a killed launcher
    still stops its ranks and removes the namespaces.
    """
    if cfg.cluster.name != "emulated":
        yield None
        return
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        with netem.EmulatedNetwork(hosts=hosts, rate_mbit=cfg.network.get("rate_mbit")) as net:
            yield net
    finally:
        signal.signal(signal.SIGTERM, previous)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _watch(procs: list[subprocess.Popen]) -> tuple[int, str]:
    """Wait for every process; on the first failure (or Ctrl-C) stop them all."""
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                _stop(procs)
                rank, code = failed[0]
                return code if code > 0 else 1, f"rank {rank} exited with code {code}"
            if all(c == 0 for c in codes):
                return 0, ""
            time.sleep(POLL_S)
    except KeyboardInterrupt:
        _stop(procs)
        return 130, "interrupted by the user (Ctrl-C)"


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


def _record_failure(cfg: DictConfig, *, entry: str, run_id: str, run_dir: Path,
                    error: str) -> None:
    """Report the failure; keep it as data unless a rank that failed already did."""
    errors = sorted(run_dir.glob("error.rank*.txt"))
    if errors:  # the rank recorded its own failure, with the repeat it was in
        error = errors[0].read_text().strip()
    print(f"ddlbench: run {run_id} failed: {error}", file=sys.stderr)
    module = importlib.import_module(entry)
    if not errors and hasattr(module, "record_failure"):
        module.record_failure(cfg, run_id=run_id, repeat=None, error=error)


def torch_threads(cfg: DictConfig, local_world_size: int) -> int:
    if cfg.run.threads:
        return cfg.run.threads
    cores = len(os.sched_getaffinity(0))
    return max(1, cores // max(1, local_world_size))


def _run_rank(cfg: DictConfig, *, entry: str, run_id: str | None, run_dir: Path | None,
              rank: int, world_size: int, local_rank: int, local_world_size: int
              ) -> tuple[int, str | None]:
    """Be one rank: rendezvous, run the entry's worker, report a failure as data."""
    module = importlib.import_module(entry)
    device_type = resolve_device(cfg.cluster)
    backend = resolve_backend(cfg.cluster)
    on_gpu = device_type == "cuda" and rank < num_workers(cfg)  # servers are CPU processes
    device = torch.device("cuda", local_rank) if on_gpu else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.set_num_threads(torch_threads(cfg, local_world_size))
    ctx = None
    try:
        dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world_size,
                                timeout=dt.timedelta(seconds=cfg.run.timeout_s))
        run_id = run_id or _agree_run_id(cfg)
        workers = num_workers(cfg)
        ctx = Context(rank=rank, world_size=world_size, local_rank=local_rank,
                      local_world_size=local_world_size, num_workers=workers,
                      num_servers=world_size - workers, run_id=run_id, run_dir=run_dir,
                      device=device, backend=backend)
        if ctx.num_servers:
            ctx.worker_group = dist.new_group(list(range(workers)))
        module.worker(cfg, ctx)
        dist.destroy_process_group()
        return 0, run_id
    except SystemExit as exc:  # a worker's own verdict (e.g. verify's tolerance check)
        return int(exc.code or 0), run_id
    except BaseException as exc:  # noqa: BLE001 - every failure is recorded, then fatal
        _report_rank_failure(cfg, module, ctx, rank=rank, run_id=run_id, run_dir=run_dir, exc=exc)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # peers may be stuck in a collective: do not wait for clean-up


def _agree_run_id(cfg: DictConfig) -> str:
    box = [new_run_id(cfg)]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _report_rank_failure(cfg: DictConfig, module, ctx: Context | None, *, rank: int,
                         run_id: str | None, run_dir: Path | None, exc: BaseException) -> None:
    text = f"rank {rank}: {type(exc).__name__}: {exc}"
    print(f"ddlbench: {text}\n{traceback.format_exc()}", file=sys.stderr)
    if run_dir is not None:
        (run_dir / f"error.rank{rank}.txt").write_text(text)
    if hasattr(module, "record_failure") and run_id is not None:
        module.record_failure(cfg, run_id=run_id, repeat=ctx.repeat if ctx else None, error=text)


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
    sys.exit(main(sys.argv[1:]))
