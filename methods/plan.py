"""Planners: turn the gradient sizes (backward order) into communication units.

A unit is a contiguous (start, end) element range of the flat gradient buffer,
together with the parameter indices whose gradients it needs before it can go.
Every planner has `plan(sizes, *, element_size, rows) -> list[Unit]` (`rows`: each
tensor's size along dimension 0, for planners that slice along it) and `describe()`;
a planner that needs measurements of the running job (MG-WFBP) also has
`profile_iters` and `plan_measured(...)`, and the engine feeds it.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any

from methods.costmodel import COSTS, STUDY_COSTS, Cost

SMALL_TENSOR_ELEMENTS = 8192  # MG-WFBP always merges groups smaller than this


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


def size_in_elements(*, elements: int | None, nbytes: int | None, element_size: int,
                     what: str) -> int:
    """A size given either in elements or in bytes, as elements (at least 1)."""
    if (elements is None) == (nbytes is None):
        raise ValueError(f"{what}: give exactly one of the element and the byte form")
    if elements is not None:
        return elements
    return max(1, nbytes // element_size)


CREDIT_ELEMENTS = 16_000_000  # the study's ByteScheduler-A2A credit


def credit_in_elements(*, elements: int | None, nbytes: int | None, element_size: int) -> int:
    """The priority scheduler's credit given in elements or bytes (neither: the study's)."""
    if elements is None and nbytes is None:
        elements = CREDIT_ELEMENTS
    return size_in_elements(elements=elements, nbytes=nbytes, element_size=element_size,
                            what="scheduler credit")


class Bucket:
    """All gradients in one unit (BSP, the study's 512 MB fusion buffer)."""

    def plan(self, sizes: list[int], *, element_size: int = 4,
             rows: list[int] | None = None) -> list[Unit]:
        return groups_to_units(sizes, [list(range(len(sizes)))])

    def describe(self) -> dict[str, Any]:
        return {"planner": "bucket"}


class PerTensor:
    """One unit per gradient tensor (WFBP without fusion)."""

    def plan(self, sizes: list[int], *, element_size: int = 4,
             rows: list[int] | None = None) -> list[Unit]:
        return groups_to_units(sizes, [[i] for i in range(len(sizes))])

    def describe(self) -> dict[str, Any]:
        return {"planner": "per_tensor"}


def slices(numel: int, rows: int, limit: int) -> list[tuple[int, int]]:
    """ByteScheduler's cut of one tensor (its `_partition_tensor`): whole if it has at most
    `limit` elements, else k = ceil(numel / limit) slices of whole rows along dimension 0
    (k at most the rows): rows // k rows each, the last rows % k slices one row more.
    (start, end) within the tensor."""
    if numel <= limit:
        return [(0, numel)]
    rows = rows if rows and numel % rows == 0 else numel
    row = numel // rows
    k = min(math.ceil(numel / limit), rows)
    per, extra = divmod(rows, k)
    bounds = list(itertools.accumulate([per] * (k - extra) + [per + 1] * extra, initial=0))
    return [(a * row, b * row) for a, b in zip(bounds, bounds[1:])]


class Partition:
    """Tensors larger than `partition` elements cut into near-equal slices (ByteScheduler).

    The size is given in elements (`partition_elements`, the A2A default
    4,000,000) or in bytes (`partition_bytes`, BytePS's 4,096,000).
    """

    def __init__(self, *, partition_elements: int | None = None,
                 partition_bytes: int | None = None) -> None:
        for name, value in (("partition_elements", partition_elements),
                            ("partition_bytes", partition_bytes)):
            if value is not None and value <= 0:
                raise ValueError(f"planner {name}={value} is invalid; it must be > 0")
        self.elements, self.nbytes = partition_elements, partition_bytes
        self.size: int | None = None

    def plan(self, sizes: list[int], *, element_size: int = 4,
             rows: list[int] | None = None) -> list[Unit]:
        self.size = size_in_elements(elements=self.elements, nbytes=self.nbytes,
                                     element_size=element_size, what="planner partition")
        rows = rows or sizes
        return [Unit(start + s, start + e, (i,))
                for i, (start, _) in enumerate(_tensor_ranges(sizes))
                for s, e in slices(sizes[i], rows[i], self.size)]

    def describe(self) -> dict[str, Any]:
        return {"planner": "partition", "partition_elements": self.size}


def fuse_pieces(numels: list[int], limit: int) -> list[list[int]]:
    """Horovod's fusion of the pieces issued in one cycle (in issue order): consecutive
    ones share a group while its elements stay within `limit` (0: each alone).
    Returns groups of indices into `numels`."""
    groups: list[list[int]] = []
    filled = 0
    for i, n in enumerate(numels):
        if groups and filled + n <= limit:
            groups[-1].append(i)
            filled += n
        else:
            groups.append([i])
            filled = n
    return groups


def mgwfbp_groups(sizes: list[int], backward_s: list[float], cost: Cost, *,
                  element_size: int = 4) -> list[list[int]]:
    """MG-WFBP's merge of consecutive tensors (Shi et al., INFOCOM 2019, Algorithm 1).

    `sizes` and `backward_s` (each tensor's backward time) are in backward
    order, output side first. Walking from the output to the input, tensor l is
    merged into the next one, l-1, when the all-reduce before it would still run
    when l-1's gradient is ready, when waiting for l-1 costs less than the
    start-up alpha it saves, or when the group so far is under 8192 elements.
    Returns groups of backward indices, in backward order.
    """
    n = len(sizes)
    p, tb = sizes[::-1], backward_s[::-1]  # index 0 = input side, as in the paper
    ready = [0.0] * n  # when each gradient is ready, from the start of backward
    elapsed = 0.0
    for layer in range(n - 1, -1, -1):
        elapsed += tb[layer]
        ready[layer] = elapsed
    tc = [cost.seconds(k * element_size) if k else 0.0 for k in p]
    groups, group = [], []
    start = ready[n - 1]  # when layer's all-reduce starts: it is ready and the one before is done
    for layer in range(n - 1, 0, -1):
        group.append(layer)
        merge = ready[layer - 1] < start + tc[layer] and (
            start > ready[layer - 1] or ready[layer - 1] - start < cost.alpha)
        if merge or p[layer] < SMALL_TENSOR_ELEMENTS:
            p[layer - 1] += p[layer]
            p[layer], tc[layer] = 0, 0.0
            tc[layer - 1] = cost.seconds(p[layer - 1] * element_size)
        else:
            groups.append(group)
            group = []
        # the next layer's start, from what is final now: the merge decisions of the
        # layers after it never change again (the paper recomputes every start each step)
        start = max(start + tc[layer], ready[layer - 1])
    groups.append([*group, 0])
    return [[n - 1 - layer for layer in g] for g in groups]


class MergedGroups:
    """MG-WFBP: consecutive tensors merged from measured backward times and all-reduce cost.

    The engine runs the first `profile_iters` iterations with one bucket after
    backward while it records when each gradient is ready, takes the all-reduce cost
    (`cost`: fitted on the workers' group, or the study's `table`, by default the
    `network`'s, for the worker count), agrees on both across ranks, and then asks
    `plan_measured` for the groups.
    """

    def __init__(self, *, profile_iters: int = 5, fit_sizes: list[int] | None = None,
                 fit_repeats: int = 10, cost: str = "fitted", table: str | None = None,
                 network: str | None = None) -> None:
        if profile_iters < 1:
            raise ValueError(f"planner profile_iters={profile_iters} is invalid; it must be >= 1")
        if cost not in COSTS:
            raise ValueError(f"planner cost={cost!r} is invalid; choose fitted (measured on "
                             "the run) or study (the study's alpha and beta table)")
        if table not in (None, *STUDY_COSTS):
            raise ValueError(f"planner table={table!r} is invalid; choose ib, tcp, or null "
                             "(the network's: the study's own choice for its networks)")
        self.cost_from, self.network, self.table = cost, network, table
        self.profile_iters = profile_iters
        self.fit_sizes = fit_sizes
        self.fit_repeats = fit_repeats
        self.groups: list[list[int]] | None = None
        self.cost: Cost | None = None
        self.backward_s: list[float] | None = None

    def plan(self, sizes: list[int], *, element_size: int = 4,
             rows: list[int] | None = None) -> list[Unit]:
        """The plan while profiling: one bucket."""
        return Bucket().plan(sizes)

    def plan_measured(self, sizes: list[int], *, backward_s: list[float], cost: Cost,
                      element_size: int = 4) -> list[Unit]:
        self.backward_s, self.cost = backward_s, cost
        self.groups = mgwfbp_groups(sizes, backward_s, cost, element_size=element_size)
        return groups_to_units(sizes, self.groups)

    def describe(self) -> dict[str, Any]:
        return {
            "planner": "mgwfbp", "profile_iters": self.profile_iters, "groups": self.groups,
            "cost": self.cost_from,
            "alpha_s": self.cost.alpha if self.cost else None,
            "beta_s_per_byte": self.cost.beta if self.cost else None,
            "backward_s": self.backward_s,
        }


PLANNERS = {"bucket": Bucket, "per_tensor": PerTensor, "partition": Partition,
            "mgwfbp": MergedGroups}
