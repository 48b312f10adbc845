"""Planners: turn the gradient sizes (backward order) into communication units.

A unit is a contiguous (start, end) element range of the flat gradient buffer,
together with the parameter indices whose gradients it needs before it can go.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Unit:
    start: int
    end: int
    params: tuple[int, ...]  # indices (backward order) of the tensors it covers

    @property
    def numel(self) -> int:
        return self.end - self.start


def _tensor_ranges(sizes: list[int]) -> list[tuple[int, int]]:
    return [(e - n, e) for e, n in zip(itertools.accumulate(sizes), sizes)]


def groups_to_units(sizes: list[int], groups: list[list[int]]) -> list[Unit]:
    """Units for groups of consecutive tensor indices (backward order)."""
    ranges = _tensor_ranges(sizes)
    return [Unit(ranges[g[0]][0], ranges[g[-1]][1], tuple(g)) for g in groups]


class Bucket:
    """All gradients in one unit (BSP, the study's 512 MB fusion buffer)."""

    def plan(self, sizes: list[int]) -> list[Unit]:
        return groups_to_units(sizes, [list(range(len(sizes)))])

    def describe(self) -> dict[str, Any]:
        return {"planner": "bucket"}


class PerTensor:
    """One unit per gradient tensor (WFBP without fusion)."""

    def plan(self, sizes: list[int]) -> list[Unit]:
        return groups_to_units(sizes, [[i] for i in range(len(sizes))])

    def describe(self) -> dict[str, Any]:
        return {"planner": "per_tensor"}


PLANNERS = {"bucket": Bucket, "per_tensor": PerTensor}
