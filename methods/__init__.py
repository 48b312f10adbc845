"""Method registry: a method config names a transport, a planner and a scheduler.

The names users type are the file stems of conf/method/; each file composes the
pieces registered here, so a new combination is a new YAML file, not new code.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from methods.allreduce import AllreduceTransport
from methods.base import Engine, Method
from methods.ddp import DDPMethod
from methods.plan import PLANNERS
from methods.sched import SCHEDULERS

TRANSPORTS = {"allreduce": AllreduceTransport, "ddp": None}


def _split(part: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    args = dict(part)
    return args.pop("name"), args


def check(method: Mapping[str, Any]) -> None:
    """Raise ValueError naming the bad piece if `method` does not compose."""
    for kind, registry in (("transport", TRANSPORTS), ("planner", PLANNERS),
                           ("scheduler", SCHEDULERS)):
        name, _ = _split(method[kind])
        if method["transport"]["name"] == "ddp":
            continue
        if name not in registry:
            raise ValueError(
                f"method {method['name']!r}: {kind} {name!r} is unknown; "
                f"choose one of: {', '.join(sorted(registry))}"
            )


def build(
    method: Mapping[str, Any], *, group: dist.ProcessGroup | None, device: torch.device
) -> Method:
    """Instantiate the method described by a conf/method/ entry on the workers' group."""
    transport, t_args = _split(method["transport"])
    if transport == "ddp":
        _, p_args = _split(method["planner"])
        return DDPMethod(device_ids=[device.index] if device.type == "cuda" else None, **p_args)
    planner, p_args = _split(method["planner"])
    scheduler, s_args = _split(method["scheduler"])
    return Engine(
        name=method["name"],
        transport=TRANSPORTS[transport](group=group, **t_args),
        planner=PLANNERS[planner](**p_args),
        scheduler=SCHEDULERS[scheduler](**s_args),
    )
