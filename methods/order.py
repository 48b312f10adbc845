"""Order agreement for timing-dependent schedules: rank 0 decides, the others follow.

Collectives are matched by issue order, so a priority queue whose order
depends on when gradients happen to be ready would hang or average the wrong
chunks. As in ByteScheduler's all-reduce plug-in, rank 0 of the group picks
the next unit from its own queue and sends its index to every other rank
(point-to-point, tag ORDER_TAG, one small message per decision); the others
issue exactly that sequence, each as soon as the unit is ready locally.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

ORDER_TAG = 0x5EED
STOP = -1


def global_rank(group: dist.ProcessGroup | None, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


class OrderLeader:
    """Rank 0's side: announce each decision to every other rank of `group`."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.peers = [global_rank(group, r) for r in range(1, dist.get_world_size(group))]
        self.pending: list[tuple[dist.Work, torch.Tensor]] = []

    def announce(self, unit: int) -> None:
        msg = torch.tensor([unit], dtype=torch.int64)
        self.pending = [(w, t) for w, t in self.pending if not w.is_completed()]
        for peer in self.peers:
            self.pending.append((dist.isend(msg, dst=peer, group=self.group, tag=ORDER_TAG), msg))

    def close(self) -> None:
        """Tell the followers to stop, and wait until every announcement has left."""
        self.announce(STOP)
        for w, _ in self.pending:
            w.wait()
        self.pending.clear()


class OrderFollower:
    """Every other rank's side: the next unit rank 0 decided, or STOP."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.leader = global_rank(group, 0)
        self.msg = torch.empty(1, dtype=torch.int64)

    def next(self) -> int:
        dist.recv(self.msg, src=self.leader, group=self.group, tag=ORDER_TAG)
        return int(self.msg.item())
