"""Model registry: a model config's `family` picks the class, `build` its arguments.

The names users type are the file stems of conf/model/; this module only maps
families to classes and measures what the results record about a model.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from models.nlp import BertModel
from models.synthetic import Batch
from models.vision import VisionModel

FAMILIES: dict[str, type[nn.Module]] = {"vision": VisionModel, "bert": BertModel}


def build(family: str, build_args: Mapping[str, Any], *, seed: int) -> nn.Module:
    """Build a model of `family` with random weights drawn from `seed`."""
    if family not in FAMILIES:
        raise ValueError(f"model family {family!r} is unknown; choose one of: {sorted(FAMILIES)}")
    torch.manual_seed(seed)
    return FAMILIES[family](**build_args)


def move_batch(batch: Batch, device: torch.device) -> Batch:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def describe(family: str, build_args: Mapping[str, Any]) -> dict[str, float]:
    """Parameter count, tensor count and model intensity of a model.

    Intensity is the study's I = C/D: forward+backward multiply-accumulates per
    sample per parameter, counted on the meta device (no memory, no compute).
    """
    with torch.device("meta"):
        model = FAMILIES[family](**build_args)
        batch = model.make_batch(2, None)
    params = [p for p in model.parameters() if p.requires_grad]
    counter = FlopCounterMode(display=False)
    with counter:
        model(batch).backward()
    n_params = sum(p.numel() for p in params)
    macs_per_sample = counter.get_total_flops() / 2 / 2
    return {
        "model_params": n_params,
        "model_tensors": len(params),
        "model_intensity": macs_per_sample / n_params,
    }
