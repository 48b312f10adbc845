"""The rank side of `python -m harness.check`'s environment section (harness/check.py):
every rank's host, role, device, interfaces and versions gathered to rank 0, one
small all-reduce on every group a run uses and, with cluster.ps_wire=ucx, a round trip
over the UCX wire between every worker and server with the transports UCX picked; every
rank exits 1 when a group failed."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess

import torch
import torch.distributed as dist
from omegaconf import DictConfig

from harness.config import engine as horovod
from harness.config.schema import first_line
from harness.launch.rank import Context
from harness.measure.provenance import nccl_version
from methods.ps import wire

NET_VARS = ("NCCL_SOCKET_IFNAME", "NCCL_IB_HCA", "GLOO_SOCKET_IFNAME", "UCX_TLS",
            "UCX_NET_DEVICES")
CHECK_TAG = 5  # the wire check's messages (methods/ps/wire.py's tags stop at 3, keys from 16)


def versions(device: torch.device) -> dict[str, str]:
    """The software stack as this rank sees it (Horovod: the installed version, not loaded).
    cuDNN, NCCL and the driver are asked only on GPU ranks: servers and CPU runs never
    touch CUDA."""
    out = {"torch": torch.__version__, "CUDA": torch.version.cuda or "-",
           "cuDNN": "-", "NCCL": "-", "driver": "-", "Horovod": horovod.version() or "-"}
    if device.type != "cuda":
        return out
    with contextlib.suppress(Exception):
        out["cuDNN"] = str(torch.backends.cudnn.version() or "-")
    with contextlib.suppress(Exception):
        out["NCCL"] = nccl_version() or "-"
    out["driver"] = driver_version()
    return out


def driver_version() -> str:
    """The NVIDIA driver, from nvidia-smi ('-' where there is none or it fails)."""
    try:
        text = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return "-"
    return (text.split() or ["-"])[0]


def rank_info(ctx: Context) -> dict:
    """One row of the environment table: who this rank is, where, on what."""
    if ctx.device.type == "cuda":
        device = f"{ctx.device} {torch.cuda.get_device_name(ctx.device)}"
    else:
        device = "cpu"
    try:
        interfaces = ",".join(name for _, name in socket.if_nameindex())
    except OSError:
        interfaces = "?"
    net_env = " ".join(f"{k}={os.environ[k]}" for k in NET_VARS if k in os.environ)
    return {"rank": ctx.rank, "host": socket.gethostname(), "local_rank": ctx.local_rank,
            "role": "worker" if ctx.is_worker else "server", "device": device,
            "interfaces": interfaces, "net_env": net_env or "-",
            "versions": versions(ctx.device)}


def all_reduce_ok(group: dist.ProcessGroup | None, *, rank: int, members: int,
                  device: torch.device) -> tuple[str, str]:
    """All-reduce rank + 1 over `group` (ranks 0..members-1); (backend, '' or the error)."""
    backend = "?"
    try:
        backend = str(dist.get_backend(group))
        x = torch.full((4,), float(rank + 1), device=device)
        dist.all_reduce(x, group=group)
        got, want = x.cpu().tolist(), members * (members + 1) / 2
        if any(v != want for v in got):
            return backend, f"rank {rank}: the sum is {got[0]:g}, expected {want:g}"
        return backend, ""
    except Exception as exc:  # noqa: BLE001 - the check reports any failure, then goes on
        return backend, f"rank {rank}: {type(exc).__name__}: {first_line(exc)}"


def group_checks(ctx: Context, *, ps_wire: str = "gloo") -> dict[str, tuple[str, str]]:
    """This rank's outcome on every group it is a member of (and on the UCX wire)."""
    out = {"default": all_reduce_ok(None, rank=ctx.rank, members=ctx.world_size,
                                    device=torch.device("cpu"))}
    if ctx.is_worker:
        name = "workers" if ctx.worker_group is not None else "workers (the default group)"
        out[name] = all_reduce_ok(ctx.worker_group, rank=ctx.rank, members=ctx.num_workers,
                                  device=ctx.device)
    if ps_wire == "ucx":
        pairs = wire_pairs(ctx.num_workers, ctx.world_size)
        if any(ctx.rank in pair for pair in pairs):
            out[f"ps wire {'worker-server' if ctx.num_servers else 'worker-worker'}"] = \
                wire_ok(pairs, rank=ctx.rank)
    return out


def wire_pairs(workers: int, world: int) -> list[tuple[int, int]]:
    """Who the wire check pairs: every worker with every server; without servers
    worker 0 with every other worker (the node's signals)."""
    if world > workers:
        return [(w, s) for w in range(workers) for s in range(workers, world)]
    return [(0, w) for w in range(1, workers)]


def wire_ok(pairs: list[tuple[int, int]], *, rank: int) -> tuple[str, str]:
    """One round trip over the PS wire per pair this rank is in (a sends rank + 1, b
    answers it doubled), in one global order; ('<wire>: <transports>', '' or the error)."""
    try:
        for a, b in pairs:
            if rank == a:
                wire.send(torch.full((4,), float(a + 1)), b, tag=CHECK_TAG)
                back = torch.zeros(4)
                wire.recv(back, b, tag=CHECK_TAG)
                if back.tolist() != [2.0 * (a + 1)] * 4:
                    return _wire_name(), f"rank {rank}: rank {b} answered {back[0]:g}"
            elif rank == b:
                got = torch.zeros(4)
                wire.recv(got, a, tag=CHECK_TAG)
                wire.send(2 * got, a, tag=CHECK_TAG)
        return _wire_name(), ""
    except Exception as exc:  # noqa: BLE001 - the check reports any failure, then goes on
        return _wire_name(), f"rank {rank}: {type(exc).__name__}: {first_line(exc)}"


def _wire_name() -> str:
    said = wire.describe()
    return f"{said['ps_wire']}: {said['ps_wire_transports'] or 'no endpoint'}"


def worker(cfg: DictConfig, ctx: Context) -> None:
    """Entry of every rank of the environment check: gather the table, test the groups.
    Every rank ends with exit code 1 when a group failed."""
    infos: list = [None] * ctx.world_size
    dist.all_gather_object(infos, rank_info(ctx))
    outcomes = group_checks(ctx, ps_wire=cfg.cluster.ps_wire)
    gathered: list = [None] * ctx.world_size
    dist.all_gather_object(gathered, outcomes)
    lines = group_lines(gathered)
    if ctx.rank == 0:
        print("\n".join([*environment_lines(infos), "", "== process groups", *lines]),
              flush=True)
    if any(": ok" not in line for line in lines):
        raise SystemExit(1)


def environment_lines(infos: list[dict]) -> list[str]:
    """The versions (grouped by rank where they differ) and one table row per rank."""
    stacks: dict[str, list[int]] = {}
    for info in infos:
        text = "  ".join(f"{k} {v}" for k, v in info["versions"].items())
        stacks.setdefault(text, []).append(info["rank"])
    lines = [f"== environment ({len(infos)} ranks)"]
    if len(stacks) > 1:
        lines.append("warning: the ranks run different versions")
    lines += [f"{text}  (ranks {spans(ranks)})" for text, ranks in stacks.items()]
    return [*lines, "", *table(infos)]


def table(infos: list[dict]) -> list[str]:
    header = ("rank", "host", "local", "role", "device", "interfaces", "network env")
    rows = [header] + [(str(i["rank"]), i["host"], str(i["local_rank"]), i["role"],
                        i["device"], i["interfaces"], i["net_env"]) for i in infos]
    widths = [max(len(row[c]) for row in rows) for c in range(len(header))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]


def spans(ranks: list[int]) -> str:
    """'0-3,5' for [0, 1, 2, 3, 5]."""
    out: list[str] = []
    for r in sorted(ranks):
        if out and r == int(out[-1].split("-")[-1]) + 1:
            out[-1] = f"{out[-1].split('-')[0]}-{r}"
        else:
            out.append(str(r))
    return ",".join(out)


def group_lines(gathered: list[dict]) -> list[str]:
    """`group <name> (<backend>): ok`, or FAILED with the first member's error."""
    lines = []
    for name in dict.fromkeys(k for outcome in gathered for k in outcome):
        members = [o[name] for o in gathered if name in o]
        errors = [err for _, err in members if err]
        verdict = f"FAILED {errors[0]}" if errors else "ok"
        kinds = "; ".join(dict.fromkeys(kind for kind, _ in members))  # per rank if they differ
        lines.append(f"group {name} ({kinds}): {verdict}")
    return lines
