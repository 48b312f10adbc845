"""Where parameter-server traffic goes: BytePS's partitions, keys and servers.

One module for the PS transport (methods/ps/transport.py), the plan viewer (harness/plan.py) and
the simulator, so a run, its printed plan and its prediction place every byte alike.

As BytePS v0.2.x: each communication unit is cut into pieces of at most
`partition_bytes` (fixed pieces plus a remainder). A unit is declared under the name of
its first tensor, units in sorted name order (BytePS declares its tensors sorted by
parameter name), and a piece's key is `declared << 16 | piece`, pieces counted per
declared name in buffer order. A key's server is either

- `hash`: djb2 of the key's decimal string, modulo the server count (BytePS's rule: the
  busiest server gets about 1.43x the mean load for ResNet-50 on 4 servers), or
- `balanced`: the least-loaded server so far, partitions in plan order (lowest on ties).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any

from methods.plan import Unit

PARTITION_BYTES = 4_096_000  # BytePS's partition size in the study
ASSIGNMENTS = ("hash", "balanced")
NODE_REDUCES = ("scatter", "root")  # node-local aggregation (methods/ps/transport.py)
STAGES = {  # one partition's way on a node of several workers, per node_reduce
    "scatter": "reduce-scatter in node (leftover to root) -> slice to shared host -> "
               "push/pull by root -> slice back -> all-gather (leftover broadcast)",
    "root": "reduce to root -> host copy -> push/pull by root -> device copy -> "
            "broadcast from root (per unit)"}
PIECE_BITS = 16
UINT64 = (1 << 64) - 1


@dataclass(frozen=True)
class Part:
    """One server partition: elements [start, end) of the flat buffer, sent under `key`."""

    key: int
    start: int
    end: int
    server: int  # index among the servers (0 .. servers - 1)

    @property
    def numel(self) -> int:
        return self.end - self.start


def cut(units: list[Unit], part_elements: int) -> list[list[tuple[int, int]]]:
    """Each unit's (start, end) partitions of at most `part_elements` elements."""
    return [[(s, min(s + part_elements, u.end)) for s in range(u.start, u.end, part_elements)]
            for u in units]


def djb2(key: int) -> int:
    """BytePS's Hash_DJB2: djb2 over the decimal digits of `key`, in 64-bit arithmetic."""
    h = 5381
    for c in str(key):
        h = (h * 33 + ord(c)) & UINT64
    return h


def keys(units: list[Unit], ranges: list[list[tuple[int, int]]],
         names: list[str]) -> list[list[int]]:
    """BytePS's key of each partition of `ranges` (per unit; `names` per tensor)."""
    first = [names[u.params[0]] for u in units]
    declared = {name: i for i, name in enumerate(sorted(set(first)))}
    pieces: collections.Counter = collections.Counter()
    out: list[list[int]] = [[] for _ in units]
    for u in sorted(range(len(units)), key=lambda u: units[u].start):
        for _ in ranges[u]:
            out[u].append(declared[first[u]] << PIECE_BITS | pieces[first[u]])
            pieces[first[u]] += 1
    name, most = max(pieces.items(), key=lambda item: item[1], default=("", 0))
    if most > 1 << PIECE_BITS:  # the piece would run into the next tensor's keys
        raise ValueError(f"tensor {name!r} is cut into {most} partitions; BytePS's keys hold "
                         f"at most {1 << PIECE_BITS} per tensor: raise "
                         "method.transport.partition_bytes")
    return out


def assign(keys_: list[int], numels: list[int], servers: int, rule: str = "hash") -> list[int]:
    """The server (index) of each partition (in plan order), by `rule` (module docstring)."""
    if rule not in ASSIGNMENTS:
        raise ValueError(f"transport assignment={rule!r} is unknown; choose one of: "
                         f"{', '.join(ASSIGNMENTS)}")
    if rule == "hash":
        return [djb2(k) % servers for k in keys_]
    load, owners = [0] * servers, []
    for n in numels:
        owners.append(min(range(servers), key=lambda s: (load[s], s)))
        load[owners[-1]] += n
    return owners


def partitions(units: list[Unit], names: list[str], *, part_elements: int, servers: int,
               rule: str = "hash") -> list[list[Part]]:
    """Every unit's partitions with their keys and servers (none when `servers` is 0)."""
    ranges = cut(units, part_elements)
    unit_keys = keys(units, ranges, names)
    flat = [(k, s, e) for ks, rs in zip(unit_keys, ranges) for k, (s, e) in zip(ks, rs)]
    owners = iter(assign([k for k, _, _ in flat], [e - s for _, s, e in flat], servers, rule)
                  if servers else [0] * len(flat))
    return [[Part(k, s, e, next(owners)) for k, (s, e) in zip(ks, rs)]
            for ks, rs in zip(unit_keys, ranges)]


def server_bytes(parts: list[list[Part]], servers: int, element_size: int) -> list[int]:
    """Bytes each server receives from one node per iteration."""
    load = [0] * servers
    for p in (p for ps in parts for p in ps):
        load[p.server] += p.numel * element_size
    return load


def imbalance(load: list[int]) -> float:
    """Busiest server over the mean (1.0: perfectly even)."""
    mean = sum(load) / len(load) if load else 0
    return max(load) / mean if mean else 1.0


def plan_summary(parts: list[list[Part]], servers: int, element_size: int, *,
                 per_node: int = 1, node_reduce: str = "scatter") -> dict[str, Any]:
    """Partitions, and with servers the bytes each receives from a node and busiest / mean,
    and with nodes of `per_node` > 1 aggregating workers the `stages` of a partition."""
    out: dict[str, Any] = {"partitions": sum(len(ps) for ps in parts)}
    if servers:
        load = server_bytes(parts, servers, element_size)
        out |= {"server_bytes": load, "busiest_over_mean": round(imbalance(load), 4)}
        if per_node > 1:
            out["stages"] = STAGES[node_reduce]
    return out
