"""Method registry: a method config names a transport, a planner and a scheduler.

The names users type are the file stems of conf/method/; each file composes the
pieces registered in methods/params.py, so a new combination is a new YAML file, not
new code. Checking a method reads those tables and imports no torch; `build` imports
the pieces' classes (and torch with them). Parameter servers run `serve`; workers call
`stop_servers` when they are done.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from methods.costmodel import COSTS
from methods.layout import ASSIGNMENTS, NODE_REDUCES
from methods.params import DDP, PLANNERS, SCHEDULERS, TRANSPORTS, Piece, wrong_type

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

    from methods.base import Method

BYTES_PER_ELEMENT = 4  # fp32, to compare sizes given in different units before launch
# torch-side names, imported on first use (`methods.Engine`, `methods.serve`, ...)
LAZY = {"Method": "methods.base", "Engine": "methods.engine", "on_engine": "methods.params",
        "serve": "methods.ps.server", "stop_servers": "methods.ps.transport"}

__all__ = ["Method", "Engine", "build", "check", "on_engine", "serve", "stop_servers",
           "uses_servers", "wrong_type"]


def __getattr__(name: str) -> Any:
    if name in LAZY:
        return getattr(importlib.import_module(LAZY[name]), name)
    raise AttributeError(f"module 'methods' has no attribute {name!r}")


def _split(part: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    args = dict(part)
    return args.pop("name"), args


def uses_servers(method: Mapping[str, Any], *, nodes: int) -> bool:
    """Whether the method needs parameter-server processes on `nodes` nodes: PS methods do,
    except with node-local aggregation (the default) on one node (methods/ps/transport.py)."""
    transport = method["transport"]
    return transport["name"] == "ps" and not (transport.get("local_reduce", True) and nodes == 1)


def _check_args(method: Mapping[str, Any], kind: str, piece: Piece, name: str) -> None:
    """Every argument of `method[kind]` is one `piece` takes, of its type."""
    _, args = _split(method[kind])
    accepted = piece.accepted()
    for key, value in args.items():
        if key not in accepted:
            raise ValueError(f"method {method['name']!r}: method.{kind}.{key} is not an "
                             f"argument of {kind} {name!r}; it takes: "
                             f"{', '.join(sorted(accepted)) or 'nothing'}")
        expected = wrong_type(piece.params, key, value)
        if expected:
            raise ValueError(f"method {method['name']!r}: method.{kind}.{key}={value!r} is "
                             f"invalid; it must be {expected}")


def check(method: Mapping[str, Any]) -> None:
    """Raise ValueError naming the bad piece or value if `method` does not compose."""
    if method["transport"]["name"] == "ddp":
        _check_args(method, "planner", DDP, "ddp")
        _positive(method, "planner", "bucket_cap_mb")
        return
    for kind, registry in (("transport", TRANSPORTS), ("planner", PLANNERS),
                           ("scheduler", SCHEDULERS)):
        name, _ = _split(method[kind])
        if registry.get(name) is None:
            raise ValueError(
                f"method {method['name']!r}: {kind} {name!r} is unknown; "
                f"choose one of: {', '.join(sorted(k for k, v in registry.items() if v))}"
            )
        _check_args(method, kind, registry[name], name)
    _check_sizes(method)


def _positive(method: Mapping[str, Any], kind: str, key: str) -> int | None:
    value = method[kind].get(key)
    if value is not None and not 0 < value < math.inf:
        raise ValueError(f"method {method['name']!r}: method.{kind}.{key}={value} is invalid; "
                         "it must be a finite number > 0")
    return value


def _elements(method: Mapping[str, Any], kind: str, stem: str) -> int | None:
    """A size given as <stem>_elements or <stem>_bytes, in (fp32) elements; None if absent."""
    elements = _positive(method, kind, f"{stem}_elements")
    nbytes = _positive(method, kind, f"{stem}_bytes")
    if elements is not None and nbytes is not None:
        raise ValueError(f"method {method['name']!r}: give method.{kind}.{stem}_elements or "
                         f"method.{kind}.{stem}_bytes, not both")
    return elements if nbytes is None else max(1, nbytes // BYTES_PER_ELEMENT)


def _check_sizes(method: Mapping[str, Any]) -> None:
    """Partitions, credits and fusion sizes must be positive (a credit smaller than a
    partition is fine: ByteScheduler lets one piece go whenever any credit is left)."""
    _positive(method, "transport", "partition_bytes")
    _positive(method, "transport", "engine_threads")
    for key in ("profile_iters", "fit_repeats"):
        _positive(method, "planner", key)
    partition = _elements(method, "planner", "partition")
    if method["planner"]["name"] == "partition" and partition is None:
        raise ValueError(f"method {method['name']!r}: planner 'partition' needs "
                         "method.planner.partition_elements or method.planner.partition_bytes")
    _elements(method, "scheduler", "credit")
    _positive(method, "scheduler", "fusion_bytes")
    for key, known in (("assignment", ASSIGNMENTS), ("node_reduce", NODE_REDUCES)):
        value = method["transport"].get(key)
        if value is not None and value not in known:
            raise ValueError(f"method {method['name']!r}: method.transport.{key}={value!r} is "
                             f"unknown; choose one of: {', '.join(known)}")
    cost = method["planner"].get("cost")
    if cost is not None and cost not in COSTS:
        raise ValueError(f"method {method['name']!r}: method.planner.cost={cost!r} is unknown; "
                         "choose fitted (measured on the run) or study (the study's table)")
    cycle = method["scheduler"].get("cycle_s")
    if cycle is not None and not 0 <= cycle < math.inf:
        raise ValueError(f"method {method['name']!r}: method.scheduler.cycle_s={cycle} is "
                         "invalid; it must be >= 0 (0: no cycle, every piece alone)")


def build(method: Mapping[str, Any], *, group: dist.ProcessGroup | None, device: torch.device,
          timeout_s: float = 300.0, workers_per_node: int = 1,
          node_groups: tuple | None = None, network: str | None = None) -> Method:
    """Instantiate the method described by a conf/method/ entry on the workers' group.

    `timeout_s` bounds every wait of the method that torch.distributed does not; PS
    methods aggregate inside nodes of `workers_per_node` workers on `node_groups`
    (harness.launch.node_groups); `network` names the run's network (MG-WFBP's
    cost=study reads its family's table). Imports the pieces' classes, and torch with them.
    """
    from methods.engine import Engine

    transport, t_args = _split(method["transport"])
    if transport == "ddp":
        _, p_args = _split(method["planner"])
        return DDP.load()(device_ids=[device.index] if device.type == "cuda" else None,
                          process_group=group, **p_args)
    planner, p_args = _split(method["planner"])
    scheduler, s_args = _split(method["scheduler"])
    return Engine(
        name=method["name"],
        transport=_injected(TRANSPORTS[transport], t_args, group=group, timeout_s=timeout_s,
                            workers_per_node=workers_per_node, node_groups=node_groups),
        planner=_injected(PLANNERS[planner], p_args, network=network),
        scheduler=_injected(SCHEDULERS[scheduler], s_args, timeout_s=timeout_s),
        timeout_s=timeout_s,
    )


def _injected(piece: Piece, args: dict[str, Any], **injected: Any) -> Any:
    """`piece` built from its YAML `args`, plus those of `injected` it declares."""
    return piece.load()(**args, **{k: v for k, v in injected.items() if k in piece.injected})
