"""The rank side of `python -m harness.microbench` (harness/microbench.py says what it
measures): timed point-to-point transfers and all-reduces per message size, the fitted
alpha + beta * bytes, the table and the parquet file rank 0 writes.

Beside each time, the CPU it took (`cpu_s`): the CPU seconds the machine was busy (all
cores: user, system, irq and softirq time) per operation, read by rank 0 over operations
repeated after the timed ones until they fill a window long enough for /proc/stat's ticks
(cpumeter.py); fitted by shares (`cpu_alpha_s`, `cpu_s_per_byte`: methods.costmodel's
`cpu_fit`). CPU time is what the communication takes from the run's compute where they share cores
(harness/predict/cpushare.py). The machine's clock, not the ranks' own: on a shaped link
(tc tbf) most of a packet's kernel work runs in softirq context, on the qdisc's watchdog
timer and in ksoftirqd, charged to no process (harness/predict/README.md measured it), so
what else runs on the machine counts too: measure on a quiet machine. NaN where a rank
runs on another host. Tables older than these columns load without them."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import pandas as pd
import torch
import torch.distributed as dist
from omegaconf import DictConfig

from harness.launch.rank import Context, node_local
from harness.measure import cpumeter, psbench, results
from harness.measure.progress import Progress
from harness.measure.timing import device_sync
from methods.costmodel import cpu_fit, least_squares
from methods.costtiming import time_allreduce
from methods.ps import wire

FOLDER = results.OTHER_DATA
WIRE_TAG = 6  # the `wire` kind's messages (methods/ps/wire.py's tags stop at 4, keys from 16)


def sizes(cfg: DictConfig) -> list[int]:
    """Message sizes in bytes: min_bytes, 4 x min_bytes, ... up to max_bytes."""
    out, size = [], cfg.microbench.min_bytes
    while size <= cfg.microbench.max_bytes:
        out.append(size)
        size *= 4
    return out


def pairs(*, nodes: int, workers_per_node: int) -> dict[str, tuple[int, int]]:
    """The point-to-point links to time, by kind: `p2p` the network between two nodes
    (rank 0 and the first worker of node 1; on one node, the only link there is, between
    its first two workers), `p2p_intra` the link inside a node (ranks 0 and 1) where
    several nodes have several workers."""
    out: dict[str, tuple[int, int]] = {}
    if nodes > 1:
        out["p2p"] = (0, workers_per_node)
        if workers_per_node > 1:
            out["p2p_intra"] = (0, 1)
    elif workers_per_node > 1:
        out["p2p"] = (0, 1)
    return out


def time_p2p(nbytes: int, *, rank: int, repeats: int, device: torch.device,
             pair: tuple[int, int] = (0, 1), over_wire: bool = False,
             cpu: Callable[[], float] = cpumeter.no_clock,
             group: dist.ProcessGroup | None = None) -> tuple[float, float]:
    """Median one-way seconds of `nbytes` between the ranks of `pair` (ping-pong / 2), on
    the workers' device (CUDA tensors travel over NCCL on GPU runs, as the methods' do),
    or `over_wire`: host tensors over the PS wire (methods/ps/wire.py, cluster.ps_wire),
    as pushes and pulls travel; other ranks return 0. Beside it, the CPU seconds (`cpu`,
    rank 0's clock, cpumeter.per_call) per one-way message. Every rank of `group` calls it."""
    device = torch.device("cpu") if over_wire else device
    send, recv = (_wire_send, _wire_recv) if over_wire else (_dist_send, _dist_recv)
    buf = torch.zeros(max(1, nbytes // 4), dtype=torch.float32, device=device)
    first, second = pair

    def ping_pong() -> None:
        if rank == first:
            send(buf, second)
            recv(buf, second)
        elif rank == second:
            recv(buf, first)
            send(buf, first)
        device_sync(device)

    samples = []
    for i in range(repeats + 1):
        device_sync(device)
        start = time.perf_counter()
        ping_pong()
        if i:  # the first round trip is a warm-up
            samples.append((time.perf_counter() - start) / 2)
    seconds = statistics.median(samples) if samples else 0.0
    return seconds, cpumeter.per_call(ping_pong, 2 * seconds, cpu=cpu, group=group) / 2


def _dist_send(buf: torch.Tensor, peer: int) -> None:
    dist.send(buf, dst=peer)


def _dist_recv(buf: torch.Tensor, peer: int) -> None:
    dist.recv(buf, src=peer)


def _wire_send(buf: torch.Tensor, peer: int) -> None:
    wire.send(buf, peer, tag=WIRE_TAG)


def _wire_recv(buf: torch.Tensor, peer: int) -> None:
    wire.recv(buf, peer, tag=WIRE_TAG)


def metered_allreduce(cpu: Callable[[], float], group: dist.ProcessGroup | None, numel: int,
                      *, repeats: int, device: torch.device) -> tuple[float, float]:
    """`time_allreduce`'s median seconds, and the CPU seconds (`cpu`) per all-reduce
    (cpumeter.per_call)."""
    seconds = time_allreduce(group, numel, repeats=repeats, device=device)
    buf = torch.zeros(numel, device=device)

    def one() -> None:  # waited for, as timed: NCCL's proxy threads work until it is done
        dist.all_reduce(buf, group=group)
        device_sync(device)

    return seconds, cpumeter.per_call(one, seconds, cpu=cpu, group=group)


def worker(cfg: DictConfig, ctx: Context) -> None:
    """Entry of every rank: time each size, then rank 0 fits, prints and writes."""
    cpu = cpumeter.cpu_clock(ctx.rank)
    sizes_ = sizes(cfg)
    per_node = cfg.cluster.workers_per_node
    node_part = bool(ctx.num_servers) and node_local(ctx.num_workers, per_node)
    unserved = len(sizes_) * (2 if node_part else 1)  # sizes timed without the servers
    if not ctx.is_worker:  # a PS method's servers: they answer the push/pull round trips
        # last; meanwhile they keep step with the workers, a barrier a size of each kind
        # timed without them: one wait for all of it can outlast run.timeout_s (3 eth100m
        # nodes: over 5 minutes)
        for _ in range(unserved):
            ctx.beat("waiting while the workers time the links")
            dist.barrier()
        psbench.server(ctx)
        return
    total = unserved + (psbench.round_trip_steps(sizes_) if ctx.num_servers else 0)
    shown = Progress(total, desc=f"[{ctx.run_id}] microbench", unit="sizes timed",
                     delay_s=5) if ctx.rank == 0 else None

    def step(servers_wait: bool = True) -> None:
        """After each size of each kind: the servers' step, and rank 0's progress."""
        if servers_wait and ctx.num_servers:
            dist.barrier()
        if shown is not None:
            shown.update()

    rows = []
    links = pairs(nodes=cfg.cluster.nodes, workers_per_node=per_node)
    repeats = cfg.microbench.repeats
    # the PS wire (gloo or ucx) over the `p2p` link with host tensors, as pushes and pulls go
    timed = [*((kind, pair, False) for kind, pair in links.items()), ("wire", links["p2p"], True)]
    for nbytes in sizes_:
        ctx.beat(f"timing {nbytes} bytes")
        for kind, pair, wired in timed:
            rows.append((kind, f"{pair[0]}-{pair[1]}", nbytes, *time_p2p(
                nbytes, rank=ctx.rank, repeats=repeats, device=ctx.device, pair=pair,
                over_wire=wired, cpu=cpu, group=ctx.worker_group)))
        rows.append(("allreduce", "all", nbytes, *metered_allreduce(
            cpu, ctx.worker_group, max(1, nbytes // 4), repeats=repeats, device=ctx.device)))
        step()
    if node_part:  # the node's own part around each push and pull
        rows += psbench.node_paths(ctx, sizes_, repeats=repeats, per_node=per_node, cpu=cpu,
                                   step=step)
    if ctx.num_servers:  # a PS method: round trip and flight through the real server
        rows += psbench.round_trips(ctx, sizes_, repeats=repeats, per_node=per_node, cpu=cpu,
                                    step=lambda: step(servers_wait=False))
    if shown is not None:
        shown.close()
    if ctx.rank == 0:
        frame = fitted(pd.DataFrame(rows, columns=["kind", "ranks", "bytes", "seconds", "cpu_s"]))
        frame = frame.assign(run_id=ctx.run_id, cluster=cfg.cluster.name,
                             network=cfg.network.name, world_size=ctx.num_workers,
                             nodes=cfg.cluster.nodes,  # the shape its all-reduce ran on
                             workers_per_node=cfg.cluster.workers_per_node,
                             **wire.describe())  # ps_wire, the transports it picked
        path = Path(cfg.results_dir) / FOLDER / f"{ctx.run_id}.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        frame.to_parquet(path)
        print(table(frame), f"\nwritten to {path}", sep="\n", flush=True)


def fitted(frame: pd.DataFrame) -> pd.DataFrame:
    """Add each kind's alpha (s) and beta (s/byte) fitted over its sizes, and where the
    frame has CPU seconds (`cpu_s`, none NaN) their fit too (`cpu_alpha_s`,
    `cpu_s_per_byte`; else NaN)."""
    for _, part in frame.groupby("kind"):
        nbytes = part.bytes.astype(float).tolist()
        cost = least_squares(nbytes, part.seconds.tolist())
        frame.loc[part.index, ["alpha_s", "beta_s_per_byte"]] = (cost.alpha, cost.beta)
        cpu = part.cpu_s.tolist() if "cpu_s" in part else [math.nan]
        fit = cpu_fit(nbytes, cpu)
        frame.loc[part.index, ["cpu_alpha_s", "cpu_s_per_byte"]] = (fit.alpha, fit.beta)
    return frame


def table(frame: pd.DataFrame) -> str:
    lines = [f"{'kind':>10} {'bytes':>12} {'seconds':>12} {'Gbit/s':>8}"]
    for r in frame.itertuples():
        lines.append(f"{r.kind:>10} {r.bytes:>12} {r.seconds:>12.6f} "
                     f"{r.bytes * 8 / r.seconds / 1e9 if r.seconds else 0:>8.3f}")
    for kind, part in frame.groupby("kind"):
        a, b = part.alpha_s.iloc[0], part.beta_s_per_byte.iloc[0]
        ca, cb = part.cpu_alpha_s.iloc[0], part.cpu_s_per_byte.iloc[0]
        lines.append(f"{kind}: alpha={a * 1e6:.1f} us, beta={b * 1e9:.4f} ns/byte "
                     f"({8 / b / 1e9 if b else float('inf'):.3f} Gbit/s); the machine's CPU "
                     f"{ca * 1e6:.1f} us + {cb * 1e9:.4f} ns/byte")
    return "\n".join(lines)
