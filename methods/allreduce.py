"""All-reduce transport: the workers' average of a chunk of the flat gradient buffer, in place:
NCCL's AVG on GPUs, a sum on Gloo (which has no AVG) that the scheduler scales by 1 / size."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from methods.base import Done, GradBuffer, until_completed
from methods.plan import Unit


class _Pending:
    __slots__ = ("work", "key", "timeout_s")

    def __init__(self, work: dist.Work, *, key: int, timeout_s: float) -> None:
        self.work, self.key, self.timeout_s = work, key, timeout_s

    def wait(self) -> None:
        self.work.wait()  # NCCL: the current stream waits; Gloo: the sum is in place

    def complete(self) -> None:
        until_completed(self.work, timeout_s=self.timeout_s, what=f"the all-reduce of unit "
                        f"{self.key}")

    def finished(self) -> bool:
        return self.work.is_completed()


class AllreduceTransport:
    """Reduces a chunk over the workers' group asynchronously, in place.

    The chunk holds this worker's gradients (autograd wrote them into the flat buffer).
    NCCL averages in the reduction itself (ReduceOp.AVG: `scale` 1); Gloo has no AVG, so
    it sums and the scheduler multiplies by `scale` = 1 / size before the update, in place
    (a sum then a division: the reference's own order). Collectives are matched by issue
    order, so `ordered` tells the scheduler to issue them in one order on every rank.
    """

    ordered = True
    fuses = True  # any chunks may be summed as one (the priority scheduler's fusion)

    def __init__(self, *, group: dist.ProcessGroup | None = None,
                 timeout_s: float | None = None) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.identity = self.size == 1  # one worker's gradient is already the average
        averages = dist.get_backend(group) == "nccl"  # GPU: NCCL's AVG, no pass of ours
        self.scale = 1.0 if averages else 1.0 / self.size  # CPU: Gloo sums
        self.timeout_s = 300.0 if timeout_s is None else timeout_s
        # what dist.all_reduce(chunk, group=group, async_op=True) calls after its checks,
        # made once: its per-call Python (about 10 us here) is paid per unit, in a hook
        self.process_group = group if group is not None else dist.group.WORLD
        self.options = dist.AllreduceOptions()
        self.options.reduceOp = dist.ReduceOp.AVG if averages else dist.ReduceOp.SUM
        self.options.asyncOp = True

    def open(self, buffer: GradBuffer, units: list[Unit]) -> None:
        """Collectives need no set-up per plan."""

    def start(self, chunk: torch.Tensor, *, key: int) -> _Pending | Done:
        # `key` names the chunk for transports that match messages by key (PS);
        # collectives are matched by issue order, which the scheduler keeps equal.
        if self.size == 1:
            return Done()
        work = self.process_group.allreduce([chunk], self.options)
        return _Pending(work, key=key, timeout_s=self.timeout_s)

    def close(self) -> None:
        pass

    def describe(self) -> dict[str, Any]:
        return {"transport": "allreduce", "workers": self.size}
