"""Model registry: a model config's `family` picks the class, `build` its arguments.

The names users type are the file stems of conf/model/; this module only maps
families to classes and measures what the results record about a model.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from models.synthetic import Batch

# family -> "module:class", imported on first use (transformers alone takes seconds)
FAMILIES: dict[str, str] = {"vision": "models.vision:VisionModel", "bert": "models.nlp:BertModel"}


def family_class(family: str) -> type[nn.Module]:
    """The model class of `family`."""
    if family not in FAMILIES:
        raise ValueError(f"model family {family!r} is unknown; choose one of: {sorted(FAMILIES)}")
    module, name = FAMILIES[family].split(":")
    return getattr(importlib.import_module(module), name)


def build(family: str, build_args: Mapping[str, Any], *, seed: int) -> nn.Module:
    """Build a model of `family` with random weights drawn from `seed`."""
    cls = family_class(family)
    torch.manual_seed(seed)
    return cls(**build_args)


def move_batch(batch: Batch, device: torch.device) -> Batch:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def describe(family: str, build_args: Mapping[str, Any]) -> dict[str, float]:
    """Parameter count, tensor count and model intensity of a model.

    Intensity is the study's I = C/D: forward+backward multiply-accumulates per
    sample per parameter, counted on the meta device (no memory, no compute).
    """
    with torch.device("meta"):
        model = family_class(family)(**build_args)
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
