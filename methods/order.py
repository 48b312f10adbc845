"""Order agreement for timing-dependent schedules: rank 0 decides, the others follow.

Collectives are matched by issue order, so a priority queue whose order
depends on when gradients happen to be ready would hang or average the wrong
chunks. As in ByteScheduler's all-reduce plug-in, rank 0 of the group picks
the next units from its own queue (one unit, or a group fused into one
all-reduce) and sends their indices to every other rank (point-to-point, tag
ORDER_TAG: [count, first index], then the other indices if any); the others issue exactly that
sequence, each group as soon as its units are ready locally.

A send's tensor must live until the send is done, and a Gloo send reports done only
once waited on (`is_completed()` stays False until `wait()`), so the leader keeps its
last WINDOW sends and waits on the oldest beyond that: bounded memory and constant
work per announcement. The wait returns at once unless a follower is more than WINDOW
messages behind, and then holds the leader back until it catches up (a follower takes
each announcement before it can take part in the next unit, so it never lags far).
"""

from __future__ import annotations

from collections import deque

import torch
import torch.distributed as dist

ORDER_TAG = 0x5EED
STOP = -1  # the count that ends the sequence
WINDOW = 256  # sends in flight (over all followers) before the leader waits on the oldest


def global_rank(group: dist.ProcessGroup | None, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


class OrderLeader:
    """Rank 0's side: announce each decision to every other rank of `group`."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.peers = [global_rank(group, r) for r in range(1, dist.get_world_size(group))]
        self.pending: deque[tuple[dist.Work, torch.Tensor]] = deque()  # oldest first

    def announce(self, units: list[int]) -> None:
        """Every other rank issues `units` (one group) next."""
        self._send(torch.tensor([len(units), units[0]], dtype=torch.int64))
        if len(units) > 1:
            self._send(torch.tensor(units[1:], dtype=torch.int64))

    def _send(self, msg: torch.Tensor) -> None:
        for peer in self.peers:
            self.pending.append((dist.isend(msg, dst=peer, group=self.group, tag=ORDER_TAG), msg))
        while len(self.pending) > WINDOW:
            self.pending.popleft()[0].wait()

    def close(self) -> None:
        """Tell the followers to stop, and wait until every announcement has left."""
        self._send(torch.tensor([STOP, STOP], dtype=torch.int64))
        for w, _ in self.pending:
            w.wait()
        self.pending.clear()


class OrderFollower:
    """Every other rank's side: the next group rank 0 decided, or None at the end."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.leader = global_rank(group, 0)
        self.head = torch.empty(2, dtype=torch.int64)

    def next(self) -> list[int] | None:
        dist.recv(self.head, src=self.leader, group=self.group, tag=ORDER_TAG)
        n, first = self.head.tolist()
        if n == STOP:
            return None
        rest = torch.empty(n - 1, dtype=torch.int64)
        if n > 1:
            dist.recv(rest, src=self.leader, group=self.group, tag=ORDER_TAG)
        return [first, *rest.tolist()]
