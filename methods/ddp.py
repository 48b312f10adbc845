"""The reference baseline: torch DistributedDataParallel with its default buckets.

Gradients are views into DDP's buckets (`gradient_as_bucket_view`) and are set
to None between iterations (torch's default `zero_grad`): each gradient is then
copied into its bucket once, divided by the world size on the way, and never
copied back; no pass zeroes gradients and none accumulates into old ones. With
DDP's defaults (copies both ways, gradients zeroed and accumulated into) a
ResNet-50 spends three more passes over its 100 MB of gradients per iteration.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from methods.base import Method


class DDPMethod(Method):
    """DDP overlaps bucketed all-reduces with backward and waits at its end."""

    def __init__(self, *, bucket_cap_mb: float = 25.0, gradient_as_bucket_view: bool = True,
                 device_ids: list[int] | None = None,
                 process_group: dist.ProcessGroup | None = None):
        self.bucket_cap_mb = bucket_cap_mb
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.device_ids = device_ids
        self.process_group = process_group  # the workers' group (None: the default group)
        self.model: DistributedDataParallel | None = None

    def wrap(self, model: nn.Module) -> nn.Module:
        self.model = DistributedDataParallel(
            model, device_ids=self.device_ids, bucket_cap_mb=self.bucket_cap_mb,
            gradient_as_bucket_view=self.gradient_as_bucket_view, process_group=self.process_group,
        )
        return self.model

    def zero_grad(self) -> None:
        self.model.zero_grad(set_to_none=True)

    def plan(self) -> dict[str, Any]:
        return {"method": "ddp", "bucket_cap_mb": self.bucket_cap_mb,
                "gradient_as_bucket_view": self.gradient_as_bucket_view}
