"""The GPU table: one file per GPU in conf/gpu/<name>.yaml, spec-sheet facts the simulator
predicts a GPU from (`simulate.compute=<name>`), read without torch and checked once.

Each file holds its peak dense FLOP/s at FP32, TF32 and BF16 (null: the GPU has no such
unit), its memory's bandwidth and size, and the link between the GPUs of a node (PCIe or
NVLink, with its rate per direction), each with its source in a comment, and `names`: the
device names torch reports for it (a measured row's `device` column), so a 1-GPU row
measured on it can calibrate it (harness/predict/profile.py).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from omegaconf import OmegaConf

from harness.config.schema import CONF_DIR, ConfigError

GPU_DIR = CONF_DIR / "gpu"
PRECISIONS = ("fp32", "tf32", "bf16")
LINKS = ("pcie3", "pcie4", "pcie5", "nvlink2", "nvlink3", "nvlink4")
NUMBERS = ("memory_gb_per_s", "memory_gb", "link_gb_per_s", "fp32_tflops")


@dataclass(frozen=True)
class GPU:
    """One GPU's spec sheet (rates are peaks; FLOP/s dense, without sparsity)."""

    name: str
    fp32_tflops: float
    tf32_tflops: float | None
    bf16_tflops: float | None
    memory_gb_per_s: float
    memory_gb: float
    link: str               # between the GPUs of one node: pcie3..5, nvlink2..4
    link_gb_per_s: float    # that link's rate per GPU and direction
    names: tuple[str, ...]  # what torch.cuda.get_device_name says of it (substrings)

    def flop_s(self, precision: str) -> float:
        """Peak dense FLOP/s at `precision` (ConfigError where it has no such unit)."""
        tflops = getattr(self, f"{precision}_tflops")
        if tflops is None:
            have = [p for p in PRECISIONS if getattr(self, f"{p}_tflops") is not None]
            raise ConfigError(f"simulate.precision={precision} is not a unit of GPU {self.name}"
                              f" (conf/gpu/{self.name}.yaml); choose one of: {', '.join(have)}")
        return tflops * 1e12

    @property
    def byte_s(self) -> float:
        """Peak memory bytes/s."""
        return self.memory_gb_per_s * 1e9


@functools.cache
def table() -> dict[str, GPU]:
    """Every GPU of conf/gpu/, by name (ConfigError naming a file that breaks the rules)."""
    return {p.stem: _read(p.stem) for p in sorted(GPU_DIR.glob("*.yaml"))}


def _read(name: str) -> GPU:
    path = GPU_DIR / f"{name}.yaml"
    data = OmegaConf.to_container(OmegaConf.load(path))
    fields = set(GPU.__dataclass_fields__) - {"name"}
    if not isinstance(data, dict) or set(data) != fields:
        raise ConfigError(f"{path} must have exactly the keys {', '.join(sorted(fields))}; "
                          "see conf/gpu/h100_sxm.yaml")
    for key in ("tf32_tflops", "bf16_tflops", *NUMBERS):
        value = data[key]
        if (value is None and key not in NUMBERS) or (
                isinstance(value, (int, float)) and not isinstance(value, bool)
                and 0 < value < math.inf):
            continue
        raise ConfigError(f"{path}: {key}={value!r} is invalid; give a number > 0"
                          f"{' (or null: no such unit)' if key not in NUMBERS else ''}")
    if data["link"] not in LINKS:
        raise ConfigError(f"{path}: link={data['link']!r} is invalid; choose one of: "
                          f"{', '.join(LINKS)}")
    return GPU(name=name, **{**data, "names": tuple(data["names"] or ())})


def matching(device: str) -> str | None:
    """The GPU of the table whose names `device` (a row's device name) contains, if one."""
    found = [g.name for g in table().values() if any(n in device for n in g.names)]
    return found[0] if len(found) == 1 else None
