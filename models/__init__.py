"""Model registry: a model config's `family` picks the class, `build` its arguments.

The names users type are the file stems of conf/model/; this module maps families to
their classes and declares, as data, the arguments each family's `build` takes, so a
configuration is checked without torch. Building or measuring a model imports torch
(and transformers or torchvision) on use. tests/test_params.py checks the declared
arguments against the classes.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn

    from models.synthetic import Batch


@dataclass(frozen=True)
class VisionArgs:
    """models.vision.VisionModel: a torchvision classifier on synthetic images."""

    arch: str
    image_size: int
    num_classes: int

    def problem(self) -> str | None:
        """The first argument no model can be built or fed with (`key=value is invalid; ...`)."""
        return _below_one(self, "image_size", "num_classes")


@dataclass(frozen=True)
class BertArgs:
    """models.nlp.BertModel: BERT pre-training from a BertConfig."""

    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    seq_len: int
    vocab_size: int = 30522
    dropout: float = 0.1

    def problem(self) -> str | None:
        """The first argument no model can be built or fed with (`key=value is invalid; ...`)."""
        low = _below_one(self, "hidden_size", "num_layers", "num_heads", "intermediate_size",
                         "seq_len", "vocab_size")
        if low:
            return low
        if self.hidden_size % self.num_heads:
            fit = -(-self.hidden_size // self.num_heads) * self.num_heads
            return (f"hidden_size={self.hidden_size} is invalid with num_heads={self.num_heads}; "
                    f"it must be a multiple of it, e.g. {fit}")
        if not 0 <= self.dropout < 1:
            return f"dropout={self.dropout} is invalid; it must be in [0, 1)"
        return None


def _below_one(args: object, *keys: str) -> str | None:
    for key in keys:
        if getattr(args, key) < 1:
            return f"{key}={getattr(args, key)} is invalid; it must be >= 1"
    return None


@dataclass(frozen=True)
class Family:
    target: str   # "module:class", imported on first use (transformers alone takes seconds)
    params: type  # dataclass of the arguments of `build`
    library: str  # the module `build` imports, seconds of it

    def modules(self) -> list[str]:
        """What building a model of this family imports (harness.launch.zygote, once)."""
        return [self.target.split(":")[0], self.library]

    def accepted(self) -> list[str]:
        """The arguments `build` takes, in the constructor's order."""
        return [f.name for f in fields(self.params)]


FAMILIES: dict[str, Family] = {
    "vision": Family("models.vision:VisionModel", VisionArgs, "torchvision"),
    "bert": Family("models.nlp:BertModel", BertArgs, "transformers.models.bert.modeling_bert"),
}


def __getattr__(name: str) -> Any:
    if name == "Batch":  # the synthetic batch type, with torch
        from models.synthetic import Batch

        return Batch
    raise AttributeError(f"module 'models' has no attribute {name!r}")


def entry(family: str) -> Family:
    """The registered `family`."""
    if family not in FAMILIES:
        raise ValueError(f"model family {family!r} is unknown; choose one of: {sorted(FAMILIES)}")
    return FAMILIES[family]


def family_class(family: str) -> type[nn.Module]:
    """The model class of `family` (imports torch)."""
    module, name = entry(family).target.split(":")
    return getattr(importlib.import_module(module), name)


def build(family: str, build_args: Mapping[str, Any], *, seed: int) -> nn.Module:
    """Build a model of `family` with random weights drawn from `seed`."""
    import torch

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
    import torch
    from torch.utils.flop_counter import FlopCounterMode

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
