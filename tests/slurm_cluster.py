"""A real single-host Slurm for tests: munged, slurmctld and slurmd of this machine.

Everything lives in a temporary directory (config, state, spool, logs, munge key and
socket) and uses private ports, so a system Slurm or munge is never touched. Client
commands find this cluster through `SLURM_CONF` in `SlurmCluster.env`. `stop()` ends
the daemons by pid; call it from a fixture finalizer.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

PACKAGES = ("slurm-wlm", "munge")
START_TIMEOUT_S = 60.0


@dataclass
class SlurmCluster:
    """A started single-host cluster; `env` points Slurm's client commands at it."""

    root: Path
    partition: str
    env: dict[str, str]
    procs: list[subprocess.Popen] = field(default_factory=list)

    def run(self, *argv: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run(list(argv), env=self.env, capture_output=True, text=True,
                              timeout=timeout)

    def stop(self) -> None:
        """SIGTERM every daemon this cluster started, SIGKILL what outlives 10 s."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for proc in self.procs:
                if proc.poll() is None:
                    proc.send_signal(sig)
            deadline = time.monotonic() + 10
            while any(p.poll() is None for p in self.procs) and time.monotonic() < deadline:
                time.sleep(0.1)


def install() -> None:
    """apt-get install slurm-wlm and munge when their daemons are missing."""
    if all(shutil.which(b) for b in ("slurmctld", "slurmd", "munged", "sbatch")):
        return
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    subprocess.run(["apt-get", "update"], check=True, capture_output=True, env=env, timeout=600)
    subprocess.run(["apt-get", "install", "-y", *PACKAGES], check=True, capture_output=True,
                   env=env, timeout=900)


def _free_ports(count: int) -> list[int]:
    socks = [socket.socket() for _ in range(count)]
    try:
        for s in socks:
            s.bind(("", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _memory_mb() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) // 1024 - 1024
    return 1024


def write_config(root: Path, *, partition: str) -> Path:
    """slurm.conf for this host alone, everything under `root`. CPUs are its cores but at
    least 2 (config_overrides lets slurmd take the config's count), so an srun of 2
    tasks (one per CPU, CR_CPU) fits on a 1-core machine too."""
    host = socket.gethostname().split(".")[0]
    ctld_port, slurmd_port = _free_ports(2)
    for sub in ("state", "spool", "log"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    conf = root / "slurm.conf"
    conf.write_text(f"""\
ClusterName=ddlbenchtest
SlurmctldHost={host}
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={root / "munge.socket"}
CredType=cred/munge
StateSaveLocation={root / "state"}
SlurmdSpoolDir={root / "spool"}
SlurmctldPidFile={root / "slurmctld.pid"}
SlurmdPidFile={root / "slurmd.pid"}
SlurmctldLogFile={root / "log" / "slurmctld.log"}
SlurmdLogFile={root / "log" / "slurmd.log"}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
MaxArraySize=1001
NodeName={host} CPUs={max(2, os.cpu_count() or 1)} RealMemory={_memory_mb()} State=UNKNOWN
PartitionName={partition} Nodes={host} Default=YES MaxTime=INFINITE State=UP
""")
    return conf


def _start_munge(root: Path) -> subprocess.Popen:
    key = root / "munge.key"
    subprocess.run(["mungekey", "--create", f"--keyfile={key}"], check=True,
                   capture_output=True)
    key.chmod(0o600)
    return subprocess.Popen(
        ["munged", "--foreground", "--force", f"--socket={root / 'munge.socket'}",
         f"--key-file={key}", f"--pid-file={root / 'munged.pid'}",
         f"--log-file={root / 'log' / 'munged.log'}", f"--seed-file={root / 'munge.seed'}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)


def start(root: Path, *, partition: str = "ddlbench") -> SlurmCluster:
    """Start munged, slurmctld and slurmd from a private config; wait until the node is idle.

    On failure the daemons already started are stopped and RuntimeError names the log.
    """
    root.chmod(0o755)  # munged refuses group/world-writable directories
    conf = write_config(root, partition=partition)
    env = dict(os.environ, SLURM_CONF=str(conf))
    cluster = SlurmCluster(root=root, partition=partition, env=env)
    try:
        cluster.procs.append(_start_munge(root))
        _wait(lambda: (root / "munge.socket").exists(), "munged", root)
        for daemon in ("slurmctld", "slurmd"):
            cluster.procs.append(subprocess.Popen(
                [daemon, "-D", "-f", str(conf)], env=env,
                stdout=(root / "log" / f"{daemon}.out").open("w"), stderr=subprocess.STDOUT))
        _wait(lambda: _idle(cluster), "the node to be idle in sinfo", root)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _idle(cluster: SlurmCluster) -> bool:
    for proc in cluster.procs:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with code {proc.returncode}; see "
                               f"{cluster.root / 'log'}")
    out = cluster.run("sinfo", "--noheader", "--format=%t", timeout=20)
    return out.returncode == 0 and out.stdout.strip() in ("idle", "mix", "alloc")


def _wait(ready, what: str, root: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if ready():
            return
        time.sleep(0.5)
    raise RuntimeError(f"timed out after {START_TIMEOUT_S:.0f}s waiting for {what}; see "
                       f"{root / 'log'}")
