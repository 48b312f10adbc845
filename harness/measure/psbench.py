"""`harness.microbench` on a cluster with parameter servers (a PS `method=`): a push/pull
round trip per partition size through the real server (methods/ps/server.py), as the PS
methods' roots make it.

Every worker opens one plan on server 0 whose keys are the message sizes (one key each,
float32, one engine thread, the cluster's node size), as a PS method's workers open
theirs; then, per size and round, the workers meet at a barrier and each node's root
pushes the key and waits for the server's answer (the sum over the nodes, sent once every
root's push is in and summed): rank 0 times that round trip. Then every worker closes the
plan and tells every server to stop. The round trip holds what a PS unit pays beyond the
link: the server's control message and receive thread, its engine thread's sum and copy,
the answer's send, and each side's Gloo per-message cost (`kind=ps` in the table, fitted
to alpha + beta * bytes like the links)."""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from harness.launch.rank import Context
from methods.ps import wire
from methods.ps.server import serve
from methods.ps.transport import server_ranks, stop_servers
from methods.ps.wire import CLOSE, CTRL_TAG, KEY_TAG, LAYOUT_TAG, OPEN, PUSH, header


def server(ctx: Context) -> None:
    """A server rank: serve until every worker said STOP."""
    serve(num_workers=ctx.num_workers)


def round_trips(ctx: Context, sizes: list[int], *, repeats: int, per_node: int
                ) -> list[tuple[str, str, int, float]]:
    """Every worker's side; rank 0 returns (kind, ranks, bytes, median seconds) per size."""
    target = server_ranks(ctx.num_workers)[0]
    numels = [max(1, n // 4) for n in sizes]
    layout = torch.tensor([v for key, numel in enumerate(numels) for v in (key, numel)],
                          dtype=torch.int64)
    wire.send(header(OPEN, [len(numels), per_node, 0, 1]), target, tag=CTRL_TAG)
    wire.send(layout, target, tag=LAYOUT_TAG)
    root = ctx.rank % per_node == 0
    rows = []
    for key, (nbytes, numel) in enumerate(zip(sizes, numels)):
        ctx.beat(f"push/pull {nbytes} bytes")
        data, answer = torch.ones(numel), torch.empty(numel)
        samples = []
        for i in range(repeats + 1):  # the first round is a warm-up
            dist.barrier(group=ctx.worker_group)
            start = time.perf_counter()
            if root:
                wire.send(header(PUSH, [key]), target, tag=CTRL_TAG)
                wire.send(data, target, tag=KEY_TAG + key)
                wire.recv(answer, target, tag=KEY_TAG + key)
            if i:
                samples.append(time.perf_counter() - start)
        rows.append(("ps", f"roots-{target}", nbytes, statistics.median(samples)))
    wire.send(header(CLOSE), target, tag=CTRL_TAG)
    stop_servers(num_workers=ctx.num_workers)
    return rows
