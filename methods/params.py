"""The pieces a method's YAML names, and the arguments each takes, declared as data.

A method config (conf/method/) names a transport, a planner and a scheduler; each is a
`Piece`: where its class lives (imported only when a method is built, since the classes
need torch) and a dataclass of the arguments the YAML may give it, with their types and
defaults. Validation reads these tables, never the classes, so checking a configuration
imports no torch. tests/test_params.py checks that every table matches its class's
constructor, so the two cannot drift apart.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from methods.layout import PARTITION_BYTES

TYPE_WORDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


@dataclass(frozen=True)
class Piece:
    """A registered transport, planner or scheduler."""

    target: str                    # "module:Class", imported by `load`
    params: type                   # dataclass of the arguments a method's YAML may set
    injected: tuple[str, ...] = ()  # arguments methods.build passes itself, never the YAML

    def load(self) -> type:
        """The class (importing its module, and torch with it)."""
        import importlib

        module, name = self.target.split(":")
        return getattr(importlib.import_module(module), name)

    def accepted(self) -> list[str]:
        """The argument names a method's YAML may give, in the constructor's order."""
        return [f.name for f in dataclasses.fields(self.params)]


# -- transports ----------------------------------------------------------------------------

@dataclass(frozen=True)
class NoArgs:
    """A piece whose YAML gives nothing but its name."""


@dataclass(frozen=True)
class PSArgs:
    """methods.ps.transport.PSTransport: BytePS's switches (its module docstring)."""

    partition_bytes: int = PARTITION_BYTES
    local_reduce: bool = True
    assignment: str = "hash"
    server_schedule: bool = False
    node_reduce: str = "scatter"
    engine_threads: int = 1  # BytePS's default is 4; the study's PS method files set 8


# -- planners ------------------------------------------------------------------------------

@dataclass(frozen=True)
class PartitionArgs:
    """methods.plan.Partition: the slice size in elements or in bytes."""

    partition_elements: int | None = None
    partition_bytes: int | None = None


@dataclass(frozen=True)
class MergedGroupsArgs:
    """methods.plan.MergedGroups: MG-WFBP's profile and its all-reduce fit."""

    profile_iters: int = 5
    fit_sizes: list[int] | None = None
    fit_repeats: int = 10
    cost: str = "fitted"  # fitted on the run, or study: the study's alpha/beta table
    table: str | None = None  # cost=study: ib or tcp; None: the network's (costmodel.py)


@dataclass(frozen=True)
class DDPArgs:
    """methods.ddp.DDPMethod: torch DDP's settings (a ddp method's `planner`)."""

    bucket_cap_mb: float = 25.0
    gradient_as_bucket_view: bool = True


# -- schedulers ----------------------------------------------------------------------------

@dataclass(frozen=True)
class HookArgs:
    """methods.sched.AfterBackward and OnReady: the tests' random hook delay."""

    hook_delay_s: float = 0.0
    delay_seed: int = 0


@dataclass(frozen=True)
class PriorityArgs:
    """methods.priority.Priority: ByteScheduler's credit, Horovod's cycle and fusion."""

    credit_elements: int | None = None
    credit_bytes: int | None = None
    cycle_s: float = 0.0
    fusion_bytes: int | None = None
    hook_delay_s: float = 0.0
    delay_seed: int = 0


TRANSPORT_INJECTED = ("group", "timeout_s", "workers_per_node", "node_groups")
TRANSPORTS: dict[str, Piece | None] = {
    "allreduce": Piece("methods.allreduce:AllreduceTransport", NoArgs, ("group", "timeout_s")),
    "horovod": Piece("methods.horovod:HorovodTransport", NoArgs, ("group", "timeout_s")),
    "ps": Piece("methods.ps.transport:PSTransport", PSArgs, TRANSPORT_INJECTED),
    "ddp": None,  # torch DDP is a whole method (DDP below), not a transport of the engine
}
PLANNERS: dict[str, Piece] = {
    "bucket": Piece("methods.plan:Bucket", NoArgs),
    "per_tensor": Piece("methods.plan:PerTensor", NoArgs),
    "partition": Piece("methods.plan:Partition", PartitionArgs),
    "mgwfbp": Piece("methods.plan:MergedGroups", MergedGroupsArgs, ("network",)),
}
SCHEDULERS: dict[str, Piece] = {
    "after_backward": Piece("methods.sched:AfterBackward", HookArgs, ("timeout_s",)),
    "on_ready": Piece("methods.sched:OnReady", HookArgs, ("timeout_s",)),
    "priority": Piece("methods.priority:Priority", PriorityArgs, ("timeout_s",)),
}
DDP = Piece("methods.ddp:DDPMethod", DDPArgs, ("device_ids", "process_group"))


@functools.cache
def _hints(params: type) -> dict[str, Any]:
    return typing.get_type_hints(params)


def wrong_type(params: type, key: str, value: Any) -> str | None:
    """What argument `key` of the dataclass `params` must be (e.g. "an integer") when
    `value` is not that, from its scalar type; None when it fits or the type says nothing."""
    hint = _hints(params).get(key)
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    options = typing.get_args(hint) if union else (hint,)
    kinds = [t for t in options if t in TYPE_WORDS]
    if len(kinds) != 1 or (value is None and type(None) in options):
        return None
    kind = kinds[0]
    fits = isinstance(value, (int, float) if kind is float else kind) and not (
        isinstance(value, bool) and kind is not bool)
    return None if fits else TYPE_WORDS[kind]


# -- engines -------------------------------------------------------------------------------

EMULATED = ("cycle_s", "fusion_bytes")  # a scheduler's stand-ins for Horovod's cycle and fusion


def on_engine(method: Mapping[str, Any], engine: str) -> dict[str, Any]:
    """`method` (a conf/method/ entry) as it runs on `engine`.

    native: as written. horovod: its all-reduce transport becomes Horovod's, and the
    scheduler's emulation of Horovod's cycle and fusion (`cycle_s`, `fusion_bytes`) is
    dropped: Horovod's real ones (method.horovod, applied at hvd.init) do that job, and
    doing it twice would delay and copy every piece twice. ValueError for any other
    engine, or a method whose transport is not the all-reduce.
    """
    if engine == "native":
        return dict(method)
    if engine != "horovod":
        raise ValueError(f"engine={engine!r} is unknown; choose native or horovod")
    transport = method["transport"]["name"]
    if transport != "allreduce":
        raise ValueError(f"engine=horovod swaps a method's all-reduce for Horovod's, but method "
                         f"{method['name']!r} uses transport {transport!r}; use engine=native "
                         "with it, or an all-reduce method")
    scheduler = {k: v for k, v in method["scheduler"].items() if k not in EMULATED}
    return {**method, "transport": {"name": "horovod"}, "scheduler": scheduler}
