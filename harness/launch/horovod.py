"""Horovod as an engine: its start and stop in every worker (the checks before launch
and a row's columns are harness/config/engine.py).

`engine=horovod` runs an all-reduce method's collectives through Horovod's
(methods/horovod.py). Whatever started the ranks (the local launcher, torchrun, srun),
the harness starts Horovod in each worker once torch.distributed is up, as horovodrun
would with Gloo: worker 0 runs Horovod's rendezvous server (the HTTP key-value store
Horovod's Gloo contexts meet through, told the slot plan so that it clears each scope
once every rank has met there) and sends its address to the others over
torch.distributed; each worker then sets the variables horovodrun would set (its rank
and sizes, its host, the rendezvous, Gloo for control and CPU tensors, the method's
fusion threshold and cycle time, the run's timeout) and calls hvd.init(). `Session.stop`
shuts Horovod down while the process group still stands.
"""

from __future__ import annotations

import math
import os
import socket
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from omegaconf import DictConfig


@dataclass(frozen=True)
class Slot:
    """One worker's place in Horovod's world (the fields of Horovod's SlotInfo)."""

    hostname: str
    rank: int
    local_rank: int
    cross_rank: int
    size: int
    local_size: int
    cross_size: int


def slots(hosts: list[str]) -> list[Slot]:
    """Each worker's slot from the host of every worker (rank order), as horovodrun
    assigns them: local ranks count the workers of a host, cross ranks the hosts that
    have a worker of that local rank."""
    per_host = Counter(hosts)
    order = list(per_host)  # hosts in order of their first worker
    seen: Counter[str] = Counter()
    out = []
    for rank, host in enumerate(hosts):
        local = seen[host]
        seen[host] += 1
        peers = [h for h in order if per_host[h] > local]  # hosts with a worker `local`
        out.append(Slot(hostname=host, rank=rank, local_rank=local,
                        cross_rank=peers.index(host), size=len(hosts),
                        local_size=per_host[host], cross_size=len(peers)))
    return out


def environment(slot: Slot, *, addr: str, port: int, settings: DictConfig, timeout_s: float,
                iface: str | None) -> dict[str, str]:
    """The variables hvd.init() reads (horovod/runner/gloo_run.py sets the same ones)."""
    env = {
        "HOROVOD_GLOO_RENDEZVOUS_ADDR": addr, "HOROVOD_GLOO_RENDEZVOUS_PORT": str(port),
        "HOROVOD_CONTROLLER": "gloo", "HOROVOD_CPU_OPERATIONS": "gloo",
        "HOROVOD_HOSTNAME": slot.hostname, "HOROVOD_RANK": str(slot.rank),
        "HOROVOD_SIZE": str(slot.size), "HOROVOD_LOCAL_RANK": str(slot.local_rank),
        "HOROVOD_LOCAL_SIZE": str(slot.local_size), "HOROVOD_CROSS_RANK": str(slot.cross_rank),
        "HOROVOD_CROSS_SIZE": str(slot.cross_size),
        "HOROVOD_FUSION_THRESHOLD": str(settings.fusion_threshold_bytes),
        "HOROVOD_CYCLE_TIME": f"{settings.cycle_time_s * 1000:g}",  # Horovod takes ms
        "HOROVOD_CACHE_CAPACITY": str(settings.cache_capacity),
        "HOROVOD_GLOO_TIMEOUT_SECONDS": str(max(1, math.ceil(timeout_s))),
    }
    if iface:
        env["HOROVOD_GLOO_IFACE"] = iface
    return env


def _iface(addr: str) -> str | None:
    """The interface Horovod's Gloo binds: Gloo's own (GLOO_SOCKET_IFNAME: the emulated
    cluster's eth0, cluster.gloo_ifname), else loopback when every rank is on this
    machine, else none (Gloo resolves the host name, as torch.distributed's does)."""
    gloo = os.environ.get("GLOO_SOCKET_IFNAME")
    if gloo:
        return gloo.split(",")[0]
    return "lo" if addr in ("localhost", "::1") or addr.startswith("127.") else None


class Session:
    """Horovod started in this worker (and its rendezvous server on worker 0)."""

    def __init__(self, hvd: Any, server: Any | None) -> None:
        self.hvd, self.server = hvd, server

    def stop(self) -> None:
        """Shut Horovod down; every worker calls it once past its last collective."""
        self.hvd.shutdown()
        if self.server is not None:
            self.server.stop()


def start(cfg: DictConfig, *, group: dist.ProcessGroup | None) -> Session:
    """Start Horovod in this worker with the method's settings, the workers (`group`,
    None = every rank; worker 0 is rank 0) as its ranks. A collective of the workers."""
    import horovod.torch as hvd

    rank = dist.get_rank(group)
    hosts: list[str] = [""] * dist.get_world_size(group)
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    plan = slots(hosts)
    server, box = None, [None]
    if rank == 0:
        from horovod.runner.http.http_server import RendezvousServer

        server = RendezvousServer()
        port = server.start()  # binds every interface, on a free port
        server.init(plan)
        box = [(os.environ.get("MASTER_ADDR") or socket.gethostname(), port)]
    dist.broadcast_object_list(box, src=0, group=group)  # the workers reach rank 0 there
    addr, port = box[0]
    os.environ.update(environment(plan[rank], addr=addr, port=port, settings=cfg.method.horovod,
                                  timeout_s=cfg.run.timeout_s, iface=_iface(addr)))
    hvd.init()
    return Session(hvd, server)
