"""`harness.microbench` on a cluster with parameter servers (a PS `method=`): through the
real server (methods/ps/server.py), as the PS methods' roots use it,

- `kind=ps`: a push/pull round trip of one partition per size;
- `kind=ps_flight`: FLIGHT partitions of one size in flight at once, posted as a PS
  method's poster posts one unit (one control header, then each partition's push and
  its pull) and landed as its lander lands them (each pull waited in posting order);
  the row's seconds are the whole unit's over FLIGHT, a partition's share.

Every worker opens one plan on server 0 whose keys are the message sizes (one key each
for the round trip, FLIGHT keys each for the flight; float32, one engine thread, the
cluster's node size), as a PS method's workers open theirs; then, per size and round,
the workers meet at a barrier and each node's root pushes and waits for the server's
answers (the sum over the nodes, sent once every root's push is in and summed): rank 0
times it. Then every worker closes the plan and tells every server to stop.

The round trip holds what one partition pays beyond the link: the server's control
message and receive thread, its engine thread's sum and copy, the answer's send, each
side's per-message cost on the wire. The flight holds what the round trip cannot show:
the server lands each worker's pushes in order, and on Gloo a message moves only once its
receive is posted (Gloo's rendezvous: the receiver's "ready" goes back over the link,
behind whatever the server sends that way); the server posts a header's receives as the
header arrives (methods/ps/server.py), so the partitions of a unit follow one another
with no round trip between them; what each costs there beyond its bytes is the in-order
path's per partition cost (harness/predict/psqueues.py). Sizes of the flight go up to the
methods' partition (FLIGHT_MAX_BYTES, 4 MiB against methods/layout.py's 4,096,000
bytes): on 2 x 1 eth1g a partition in flight cost 22.7 ns a byte at 4 MiB, where the fit
up to 256 KiB said 19.5, and a `bsp_ps` run's 4 MB partitions took the former
(harness/predict/README.md). A 100 Mb/s link moves 16 x 4 MiB from 2 roots in about 11 s
a round. Both fitted to alpha +
beta * bytes like the links; each row names the PS wire it used (`ps_wire`). Beside the
seconds, the CPU seconds the machine was busy (the roots, the other workers, the servers,
and the kernel's work for their messages) per round trip, or per partition of the flight
(`cpu_s`, read by rank 0 over rounds repeated to fill cpumeter.py's window): what the PS path
takes from compute where the run shares cores (harness/predict/cpushare.py).

Where nodes have several workers, the node's own part of a partition's way around the push
and pull, every node at once (`node_paths`): `node_scatter` the scatter path's (methods/ps/
scatter.py: the reduce-scatter, this worker's slice copied out to the node's buffer and
back, the all-gather), `node_root` the root path's (the reduce to the root, its broadcast),
each through the node's groups as the methods issue them (methods/ps/order.py `Node`).
Nothing crosses the network there; the CPU it burns is what the round trip's roots-only
clock leaves out.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from harness.launch.rank import Context
from harness.measure import cpumeter
from methods.ps import wire
from methods.ps.order import ALL_GATHER, BROADCAST, REDUCE, REDUCE_SCATTER, Node
from methods.ps.server import serve
from methods.ps.transport import server_ranks, stop_servers
from methods.ps.wire import CLOSE, CTRL_TAG, KEY_TAG, LAYOUT_TAG, OPEN, PUSH, header

FLIGHT = 16                  # partitions of one unit in flight (at most HEADER - 3 a header)
FLIGHT_MAX_BYTES = 1 << 22   # the largest partition size flown: the methods' partition
COPY = -1                    # a step of the node's part: the slice out and back


def server(ctx: Context) -> None:
    """A server rank: serve until every worker said STOP."""
    ctx.beat("serving the round trips")
    serve(num_workers=ctx.num_workers)


def round_trip_steps(sizes: list[int]) -> int:
    """How many sizes `round_trips` times: each size's round trip, and the flights."""
    return len(sizes) + sum(n <= FLIGHT_MAX_BYTES for n in sizes)


def round_trips(ctx: Context, sizes: list[int], *, repeats: int, per_node: int,
                cpu: Callable[[], float] = cpumeter.no_clock,
                step: Callable[[], None] = lambda: None
                ) -> list[tuple[str, str, int, float, float]]:
    """Every worker's side; rank 0 returns (kind, ranks, bytes, median seconds, CPU
    seconds) per size, of the round trip (`ps`) and of the flight (`ps_flight`, a
    partition's share of both); `cpu`: microbench's CPU clock (rank 0); `step()` after
    each of the `round_trip_steps(sizes)`."""
    target = server_ranks(ctx.num_workers)[0]
    numels = [max(1, n // 4) for n in sizes]
    flown = [(i, numel) for i, (n, numel) in enumerate(zip(sizes, numels))
             if n <= FLIGHT_MAX_BYTES]
    keys = [(key, numel) for key, numel in enumerate(numels)]
    flight_keys = {i: [len(numels) + j * FLIGHT + k for k in range(FLIGHT)]
                   for j, (i, _) in enumerate(flown)}
    keys += [(key, numels[i]) for i, ks in flight_keys.items() for key in ks]
    layout = torch.tensor([v for key, numel in keys for v in (key, numel)], dtype=torch.int64)
    wire.send(header(OPEN, [len(keys), per_node, 0, 1]), target, tag=CTRL_TAG)
    wire.send(layout, target, tag=LAYOUT_TAG)
    root = ctx.rank % per_node == 0
    rows = []
    for key, (nbytes, numel) in enumerate(zip(sizes, numels)):
        ctx.beat(f"push/pull {nbytes} bytes")
        rows.append(("ps", f"roots-{target}", nbytes,
                     *_timed(ctx, root, target, [key], numel, repeats, cpu)))
        step()
    for i, numel in flown:
        ctx.beat(f"{FLIGHT} x {sizes[i]} bytes in flight")
        seconds, spent = _timed(ctx, root, target, flight_keys[i], numel, repeats, cpu)
        rows.append(("ps_flight", f"roots-{target}x{FLIGHT}", sizes[i], seconds / FLIGHT,
                     spent / FLIGHT))
        step()
    wire.send(header(CLOSE), target, tag=CTRL_TAG)
    stop_servers(num_workers=ctx.num_workers)
    return rows


def _timed(ctx: Context, root: bool, target: int, keys: list[int], numel: int,
           repeats: int, cpu: Callable[[], float]) -> tuple[float, float]:
    """Median seconds, over `repeats` rounds after a warm-up, of the roots' one header and
    a push and pull per key, the pulls waited in posting order (rank 0's clock); and the
    CPU seconds (`cpu`) per round over those rounds."""
    data = [torch.ones(numel) for _ in keys]
    answers = [torch.empty(numel) for _ in keys]

    def one() -> None:
        if root:
            works = [wire.isend(header(PUSH, keys), target, tag=CTRL_TAG)]
            for key, push, answer in zip(keys, data, answers):
                works.append(wire.isend(push, target, tag=KEY_TAG + key))
                works.append(wire.irecv(answer, target, tag=KEY_TAG + key))
            for work in works:
                work.wait()
    return _metered(ctx, one, repeats, cpu)


def node_paths(ctx: Context, sizes: list[int], *, repeats: int, per_node: int,
               cpu: Callable[[], float] = cpumeter.no_clock,
               step: Callable[[], None] = lambda: None
               ) -> list[tuple[str, str, int, float, float]]:
    """Every worker's side; (kind, ranks, bytes, median seconds, CPU seconds) per size of
    the node's part of one partition on each path, `node_scatter` and `node_root` (rank 0's
    clock; the others' rows are theirs, unused); `step()` after each size."""
    node = Node(ctx.rank, per_node, ctx.node_groups)
    node.warm_up(torch.device("cpu"))
    rows = []
    for nbytes in sizes:
        ctx.beat(f"the node's part of {nbytes} bytes")
        chunk = torch.ones(max(per_node, nbytes // 4 // per_node * per_node))
        shared = torch.empty(chunk.numel() // per_node)  # the node's buffer: this slice
        for kind, steps in (("node_scatter", (REDUCE_SCATTER, COPY, ALL_GATHER)),
                            ("node_root", (REDUCE, BROADCAST))):
            one = functools.partial(_node_part, node, steps, chunk, shared)
            rows.append((kind, f"nodes-of-{per_node}", nbytes,
                         *_metered(ctx, one, repeats, cpu)))
        step()
    return rows


def _node_part(node: Node, steps: tuple[int, ...], chunk: torch.Tensor,
               shared: torch.Tensor) -> None:
    """The node's part of one partition: its collectives, and on the scatter path this
    worker's slice copied out to the node's buffer and back (COPY)."""
    for step in steps:
        if step == COPY:
            shared.copy_(node.own(chunk))
            node.own(chunk).copy_(shared)
        else:
            node.collective(step, chunk).wait()


def _metered(ctx: Context, one: Callable[[], None], repeats: int, cpu: Callable[[], float]
             ) -> tuple[float, float]:
    """Median seconds of `one()` on every worker at once, over `repeats` rounds after a
    warm-up, and the CPU seconds (`cpu`) per round (cpumeter.per_call)."""
    samples = []
    for i in range(repeats + 1):
        dist.barrier(group=ctx.worker_group)
        start = time.perf_counter()
        one()
        if i:
            samples.append(time.perf_counter() - start)
    seconds = statistics.median(samples)
    return seconds, cpumeter.per_call(one, seconds, cpu=cpu, group=ctx.worker_group)
