"""The reference baseline: torch DistributedDataParallel with its default buckets."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from methods.base import Method


class DDPMethod(Method):
    """DDP overlaps bucketed all-reduces with backward and waits at its end."""

    def __init__(self, *, bucket_cap_mb: float = 25.0, device_ids: list[int] | None = None,
                 process_group: dist.ProcessGroup | None = None):
        self.bucket_cap_mb = bucket_cap_mb
        self.device_ids = device_ids
        self.process_group = process_group  # the workers' group (None: the default group)
        self.model: DistributedDataParallel | None = None

    def wrap(self, model: nn.Module) -> nn.Module:
        self.model = DistributedDataParallel(
            model, device_ids=self.device_ids, bucket_cap_mb=self.bucket_cap_mb,
            process_group=self.process_group,
        )
        return self.model

    def zero_grad(self) -> None:
        self.model.zero_grad(set_to_none=False)

    def plan(self) -> dict[str, Any]:
        return {"method": "ddp", "bucket_cap_mb": self.bucket_cap_mb}
