"""Vision family: torchvision classifiers with random weights on synthetic images."""

from __future__ import annotations

import torch
from torch import nn

from models.synthetic import Batch, image_batch


class VisionModel(nn.Module):
    """A torchvision classifier whose forward returns the cross-entropy loss of a batch."""

    def __init__(self, *, arch: str, image_size: int, num_classes: int) -> None:
        import torchvision  # a second to import: on use

        super().__init__()
        if arch not in torchvision.models.list_models(module=torchvision.models):
            raise ValueError(f"vision arch {arch!r} is not a torchvision classifier")
        self.net = torchvision.models.get_model(arch, weights=None, num_classes=num_classes)
        self.image_size = image_size
        self.num_classes = num_classes

    def forward(self, batch: Batch) -> torch.Tensor:
        return nn.functional.cross_entropy(self.net(batch["images"]), batch["labels"])

    def make_batch(self, batch_size: int, generator: torch.Generator) -> Batch:
        return image_batch(batch_size, self.image_size, self.num_classes, generator)
