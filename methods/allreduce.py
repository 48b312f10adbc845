"""All-reduce transport: a collective on a torch.distributed group, then / world size."""

from __future__ import annotations

import torch
import torch.distributed as dist


class _Pending:
    __slots__ = ("work", "chunk", "size")

    def __init__(self, work: dist.Work, chunk: torch.Tensor, size: int) -> None:
        self.work, self.chunk, self.size = work, chunk, size

    def wait(self) -> None:
        self.work.wait()
        self.chunk.div_(self.size)


class AllreduceTransport:
    """Sums a chunk over the workers' group asynchronously; `wait` leaves the average."""

    def __init__(self, *, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.size = dist.get_world_size(group)

    def start(self, chunk: torch.Tensor, *, key: int) -> _Pending:
        # `key` names the chunk for transports that match messages by key (PS);
        # collectives are matched by issue order, which the scheduler keeps equal.
        return _Pending(dist.all_reduce(chunk, group=self.group, async_op=True), chunk, self.size)
