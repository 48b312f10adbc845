"""Order agreement for timing-dependent schedules: rank 0 decides, the others follow.

Collectives are matched by issue order, so a priority queue whose order
depends on when gradients happen to be ready would hang or average the wrong
chunks. As in ByteScheduler's all-reduce plug-in, rank 0 of the group picks
the next units from its own queue (one unit, or a group fused into one
all-reduce) and sends their indices to every other rank (point-to-point: [count, first
index] with tag ORDER_TAG, then the other indices, if any, with REST_TAG); the others issue
exactly that sequence, each group as soon as its units are ready locally.

On Gloo a message moves only once its receive is posted: the receiver's "ready" word
crosses to the sender, then the data comes back (gloo/transport/tcp/pair.cc). A follower
that posted each receive only after it had issued the group before paid that round trip
per announcement, on links busy with gradients; so it keeps AHEAD receives of the next
announcements' heads posted, and the leader ends with AHEAD STOPs, one for each.

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
REST_TAG = ORDER_TAG + 1  # a group's indices after the first: not matched by a posted head
STOP = -1  # the count that ends the sequence
WINDOW = 256  # sends in flight (over all followers) before the leader waits on the oldest
AHEAD = 16  # heads a follower keeps posted


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
            self._send(torch.tensor(units[1:], dtype=torch.int64), tag=REST_TAG)

    def _send(self, msg: torch.Tensor, tag: int = ORDER_TAG) -> None:
        for peer in self.peers:
            self.pending.append((dist.isend(msg, dst=peer, group=self.group, tag=tag), msg))
        while len(self.pending) > WINDOW:
            self.pending.popleft()[0].wait()

    def close(self) -> None:
        """Tell the followers to stop (a STOP for each head they keep posted), and wait until
        every announcement has left."""
        stop = torch.tensor([STOP, STOP], dtype=torch.int64)
        for _ in range(AHEAD):
            self._send(stop)
        for w, _ in self.pending:
            w.wait()
        self.pending.clear()


class OrderFollower:
    """Every other rank's side: the next group rank 0 decided, or None at the end."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.leader = global_rank(group, 0)
        self.heads: deque[tuple[dist.Work, torch.Tensor]] = deque()  # posted, oldest first
        for _ in range(AHEAD):
            self._post()

    def _post(self) -> None:
        head = torch.empty(2, dtype=torch.int64)
        self.heads.append((dist.irecv(head, src=self.leader, group=self.group, tag=ORDER_TAG),
                           head))

    def next(self) -> list[int] | None:
        work, head = self.heads.popleft()
        work.wait()
        n, first = head.tolist()
        if n == STOP:  # the rest of the posted heads are STOPs too
            for work, _ in self.heads:
                work.wait()
            self.heads.clear()
            return None
        self._post()
        rest = torch.empty(n - 1, dtype=torch.int64)
        if n > 1:
            dist.recv(rest, src=self.leader, group=self.group, tag=REST_TAG)
        return [first, *rest.tolist()]
