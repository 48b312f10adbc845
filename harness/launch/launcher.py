"""Start a run's processes, watch them, and bring the run down on any failure.

Ranks [0, workers) are workers and [workers, workers + servers) are parameter
servers. Locally the harness starts every rank itself as
`python -m harness.launch.rank <entry> <config.json>` with an env:// rendezvous;
under torchrun or srun the process already is one rank and runs the entry
directly. An entry is a module with `worker(cfg, ctx)`, and optionally
`record_failure(cfg, run_id=..., repeat=..., error=...)` to keep a failed run as
data (harness.launch.failure decides which failure, and which repeat, gets the row).

The local launcher watches its ranks: the first failure, a watchdog (no rank
made progress for run.timeout_s plus a grace period) and SIGINT / SIGTERM to the
launcher each stop every rank; the run's temporary folder and emulated network
go with it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from omegaconf import DictConfig

import models
from harness.config import ConfigError, checks, load, resolve_device, to_json
from harness.config.ranks import external_rank, host_of, num_servers, num_workers
from harness.launch import failure, leftovers, netem, ports, zygote
from harness.launch.process import die_with_parent, new_run_id

POLL_S = 0.1
KILL_GRACE_S = 5.0
STALL_GRACE_S = 30.0  # beyond run.timeout_s: start-up, and a peer's own timeout first
SETTLE_S = 3.0  # after a rank timed out on a peer: time for the others to say why

Process = subprocess.Popen | zygote.Fork  # a rank: its pid and poll()


def check_launcher(cfg: DictConfig) -> None:
    """Under torchrun/srun, the started processes must match the configured cluster;
    launched here, rank 0 must be able to listen on the rendezvous address and port
    (harness.launch.ports)."""
    ext = external_rank()
    expected = num_workers(cfg) + num_servers(cfg)
    if ext is not None and ext["world_size"] != expected:
        raise ConfigError(
            f"the launcher started {ext['world_size']} processes but cluster.nodes x "
            f"cluster.workers_per_node + servers = {expected}; make them agree"
        )
    if ext is None and cfg.cluster.name != "emulated":
        # an emulated network's rank 0 listens in a namespace of its own: nothing shares it
        ports.check_free(cfg.cluster.master_addr, cfg.cluster.master_port)


def launch(cfg: DictConfig, *, entry: str) -> tuple[int, str | None]:
    """Run `entry` on every rank of `cfg`'s cluster.

    Returns the exit code and, where this process should report on the run (the
    local launcher, or rank 0 under torchrun/srun), the run id.
    """
    ext = external_rank()
    if ext is None:
        return _launch_local(cfg, entry=entry)
    from harness.launch.rank import run_rank  # torch: this process is the rank itself

    shared = os.environ.get("DDLBENCH_RUN_DIR")  # the array script's, for the blame
    run_dir = Path(shared) if shared and Path(shared).is_dir() else None
    code, run_id = run_rank(cfg, entry=entry, run_id=None, run_dir=run_dir, placed=True, **ext)
    return code, run_id if ext["rank"] == 0 else None


def command(argv: list[str], *, name: str, entry: str,
            check: Callable[[DictConfig], None] | None = None) -> int:
    """The one-configuration command `name`: validate `argv` (and `check` the command's
    own needs; one line and exit 2 on bad input, before anything starts), then run `entry`
    on every rank; the run's exit code."""
    try:
        checks.used_by(name, argv)
        cfg = load(argv)
        if check is not None:
            check(cfg)
        check_launcher(cfg)
    except ConfigError as exc:
        print(f"ddlbench: error: {exc}", file=sys.stderr)
        return 2
    code, _ = launch(cfg, entry=entry)
    return code


def _spawn(cfg_path: Path, *, entry: str, rank: int, world: int, port: int, run_id: str,
           master_addr: str, net: netem.EmulatedNetwork | None, host: int,
           preload: list[str] | None, patience_s: float) -> Process:
    """Rank `rank`, on `host`'s namespace of `net` if any: forked by this process's zygote
    once it imported `preload`, else (None, or the zygote failed or took over
    `patience_s`) spawned."""
    env = dict(os.environ, DDLBENCH_RANK=str(rank), DDLBENCH_WORLD_SIZE=str(world),
               DDLBENCH_RUN_ID=run_id, MASTER_ADDR=master_addr, MASTER_PORT=str(port),
               **(net.environment(host) if net else {}))
    args = [entry, str(cfg_path)]
    if preload is not None:
        with contextlib.suppress(zygote.ZygoteGone):  # then spawned, as without one
            return zygote.zygote().fork("harness.launch.rank", args, env=env, preload=preload,
                                        timeout_s=patience_s,
                                        namespace=net.namespace(host) if net else None)
    argv = [sys.executable, "-m", "harness.launch.rank", *args]
    return subprocess.Popen(net.command(host, argv) if net else argv, env=env,
                            start_new_session=True, preexec_fn=die_with_parent)


def _forked(cfg: DictConfig) -> bool:
    """Whether a local run's ranks are forked by the zygote (harness.launch.zygote): on
    CPU, unless DDLBENCH_FORK=0 asks to spawn each."""
    return os.environ.get("DDLBENCH_FORK") != "0" and resolve_device(cfg.cluster) == "cpu"


def _launch_local(cfg: DictConfig, *, entry: str) -> tuple[int, str]:
    run_id = new_run_id(cfg)
    workers, world = num_workers(cfg), num_workers(cfg) + num_servers(cfg)
    port = cfg.cluster.master_port or ports.free_port()
    cleaned = leftovers.say_cleaned(leftovers.clean())
    if cleaned:
        print(f"ddlbench: {cleaned}", file=sys.stderr)
    with signals_raise(), tempfile.TemporaryDirectory(
            prefix=leftovers.folder_prefix(run_id)) as tmp, \
            _network(cfg, hosts=cfg.cluster.nodes + num_servers(cfg), run_dir=Path(tmp)) as net:
        run_dir = Path(tmp)
        cfg_path = run_dir / "config.json"
        cfg_path.write_text(to_json(cfg))
        procs: list[Process] = []
        idle_s = cfg.run.timeout_s + STALL_GRACE_S
        preload = (["harness.launch.rank", entry, *models.entry(cfg.model.family).modules()]
                   if _forked(cfg) else None)
        try:
            for rank in range(world):
                procs.append(_spawn(
                    cfg_path, entry=entry, rank=rank, world=world, port=port, run_id=run_id,
                    master_addr=net.address(0) if net else cfg.cluster.master_addr, net=net,
                    host=host_of(cfg, rank), preload=preload, patience_s=idle_s,
                ))
            ending = _watch(procs, run_dir, idle_s=idle_s)
        except KeyboardInterrupt as exc:  # SIGINT, or SIGTERM by signals_raise
            code = 143 if isinstance(exc, Terminated) else 130
            reason = ("the launcher got SIGTERM" if code == 143 else
                      "the launcher was interrupted (SIGINT, Ctrl-C)")
            ending = _stopped(procs, {}, run_dir, code=code,
                              interrupt=reason + failure.where(run_dir, 0))
        if ending.code != 0:
            error, repeat = failure.cause(run_dir, ending, workers=workers,
                                          timeout_s=cfg.run.timeout_s)
            print(f"ddlbench: run {run_id} failed: {error}", file=sys.stderr)
            failure.record(cfg, entry=entry, run_id=run_id, repeat=repeat, error=error)
        return ending.code, run_id


class Terminated(KeyboardInterrupt):
    """SIGTERM to the launcher: handled like Ctrl-C, exit code 143."""


@contextlib.contextmanager
def signals_raise() -> Iterator[None]:
    """SIGTERM raises Terminated meanwhile, so a killed launcher still stops its
    ranks, records the failure and removes its temporary folder and namespaces (and
    harness.methodbench, between its runs, records the one about to start)."""
    def terminate(signum: int, frame: object) -> None:
        raise Terminated

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def _network(cfg: DictConfig, *, hosts: int, run_dir: Path
             ) -> Iterator[netem.EmulatedNetwork | None]:
    """The run's emulated network (cluster=emulated), removed afterwards; else None. Its
    token is written into the run's folder first, for harness.launch.leftovers."""
    if cfg.cluster.name != "emulated":
        yield None
        return
    net = netem.EmulatedNetwork(hosts=hosts, rate_mbit=cfg.network.get("rate_mbit"))
    (run_dir / leftovers.NETWORK).write_text(net.token)
    with net:
        yield net


def _watch(procs: list[Process], run_dir: Path, *, idle_s: float) -> failure.Ending:
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
                return _stopped(procs, exits, run_dir, code=code if code > 0 else 1)
        elif time.time() - failure.last_progress(run_dir, since=started) > idle_s:
            return _stopped(procs, exits, run_dir, code=1, stall=failure.stalled(
                run_dir, idle_s=idle_s, ranks=len(procs)))
        time.sleep(POLL_S)


def _stopped(procs: list[Process], exits: dict[int, int], run_dir: Path, *, code: int,
             interrupt: str = "", stall: str = "") -> failure.Ending:
    """Stop every rank; how the run ended, with how long each rank still running had
    been silent (failure.cause reads it)."""
    alive = [r for r, p in enumerate(procs) if r not in exits and p.poll() is None]
    quiet = failure.silence(run_dir, alive)
    _stop(procs)
    return failure.Ending(code, dict(exits), alive, interrupt=interrupt, stall=stall,
                          silence=quiet)


def _stop(procs: list[Process]) -> None:
    """SIGTERM every live process group, SIGKILL what is left after a grace period, and
    reap them all. A stopped (SIGSTOP) rank gets SIGCONT after the SIGTERM, so that it
    ends at once, as the shell's kill does; SIGKILL ends it anyway."""
    for sig, wait_s in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, KILL_GRACE_S)):
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, sig)
                    if sig == signal.SIGTERM:
                        os.killpg(p.pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + wait_s
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(POLL_S)
