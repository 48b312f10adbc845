"""What a method will communicate, without training: a model's tensors (from the meta
device, cached), the plan of the method's own planners, layouts and schedules
(`plan_of`: methods.plan, methods.layout) and its description. The simulator and
`python -m harness.plan` both plan through here."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from typing import Any

from harness import config
from harness.config.cache import cached
from harness.config.frozen import Config, thaw
from harness.config.ranks import num_servers, num_workers
from harness.predict import profile
from harness.predict.network import Network, fitted_cost, network
from methods import layout
from methods import plan as plans
from methods.costmodel import Cost, study_cost
from methods.layout import PARTITION_BYTES, plan_summary
from methods.plan import Unit

ELEMENT_SIZE = 4  # fp32 gradients


@dataclass(frozen=True)
class Tensors:
    """A model's trainable tensors in backward order (output side first)."""

    names: list[str]
    sizes: list[int]
    rows: list[int]  # size along dimension 0


@functools.cache
def _tensors(family: str, build_json: str) -> Tensors:
    def build() -> dict:
        import torch

        import models
        from methods.base import backward_named

        with torch.device("meta"):
            model = models.family_class(family)(**json.loads(build_json))
        named = backward_named(model)
        return {"names": [n for n, _ in named], "sizes": [p.numel() for _, p in named],
                "rows": [p.shape[0] if p.dim() else 1 for _, p in named]}

    return Tensors(**cached("tensors", [family, json.loads(build_json)], build))


def tensors(model: Config) -> Tensors:
    """`model`'s tensors, built once per configuration on the meta device (and cached)."""
    return _tensors(model.family, json.dumps(thaw(model.build), sort_keys=True))


@dataclass
class Plan:
    """What a method communicates: its units, and for PS their partitions."""

    units: list[Unit]
    planner: dict[str, Any]
    parts: list[list[layout.Part]] = field(default_factory=list)  # PS: per unit
    servers: int = 0
    notes: list[str] = field(default_factory=list)


def ddp_buckets(sizes: list[int], cap_bytes: int, first_bytes: int = 1 << 20) -> list[list[int]]:
    """torch DDP's buckets: consecutive tensors (backward order) up to 1 MiB, then `cap_bytes`."""
    groups, group, filled, cap = [], [], 0, first_bytes
    for i, n in enumerate(sizes):
        group.append(i)
        filled += n * ELEMENT_SIZE
        if filled >= cap:
            groups.append(group)
            group, filled, cap = [], 0, cap_bytes
    return groups + ([group] if group else [])


def plan_of(cfg: Config, model: Tensors, *, backward_s: list[float] | None = None,
            cost: Cost | None = None) -> Plan:
    """The plan `cfg.method` makes for `model` on `cfg.cluster`, from the methods' own
    planners; MG-WFBP needs `backward_s` (per tensor) and the all-reduce `cost`. Made
    once per distinct input (a sweep asks for the same plan on every network and GPU
    count): the Plan is shared, read it only."""
    method = cfg.method
    measured = method.planner.name == "mgwfbp" and backward_s is not None and cost is not None
    return _plan(json.dumps(thaw(method), sort_keys=True),
                 (tuple(model.names), tuple(model.sizes), tuple(model.rows)),
                 num_servers(cfg) if method.transport.name == "ps" else 0,
                 (tuple(backward_s), cost) if measured else None)


@functools.lru_cache(maxsize=1024)
def _plan(method_json: str, model: tuple[tuple, tuple, tuple], servers: int,
          measured: tuple[tuple[float, ...], Cost] | None) -> Plan:
    method = json.loads(method_json)
    names, sizes, rows = (list(v) for v in model)
    planner, transport = method["planner"], method["transport"]
    if transport["name"] == "ddp":
        cap = int(planner.get("bucket_cap_mb", 25) * (1 << 20))
        groups = ddp_buckets(sizes, cap)
        return Plan(plans.groups_to_units(sizes, groups),
                    {"planner": "ddp", "buckets": len(groups)})
    chosen = plans.PLANNERS[planner["name"]](**{k: v for k, v in planner.items() if k != "name"})
    notes = []
    if measured is not None:
        units = chosen.plan_measured(sizes, backward_s=list(measured[0]), cost=measured[1],
                                     element_size=ELEMENT_SIZE)
    else:
        units = chosen.plan(sizes, element_size=ELEMENT_SIZE, rows=rows)
        if planner["name"] == "mgwfbp":
            notes.append("MG-WFBP's groups need backward times and an all-reduce cost: shown "
                         "is the one bucket it profiles with (give a real network=, e.g. "
                         "ib100_rdma, or measure this one: python -m harness.microbench)")
    out = Plan(units, chosen.describe(), notes=notes)
    if transport["name"] == "ps":
        out.servers = servers
        part = max(1, transport.get("partition_bytes", PARTITION_BYTES) // ELEMENT_SIZE)
        out.parts = layout.partitions(units, names, part_elements=part, servers=servers,
                                      rule=transport.get("assignment", "hash"))
    return out


def mgwfbp_inputs(cfg: Config) -> tuple[list[float] | None, Cost | None]:
    """Backward times and all-reduce cost as the simulator has them, or (None, None)."""
    try:
        net = network(cfg)
    except config.ConfigError:
        return None, None
    return profile.ComputeProfiles()(cfg).backward_s, mgwfbp_cost(cfg, net)


def mgwfbp_cost(cfg: Config, net: Network) -> Cost:
    """The all-reduce cost MG-WFBP merges with: the study's table for the network's family
    and worker count (method.planner.cost=study), else alpha/beta fitted on `net`'s
    modelled all-reduce."""
    if cfg.method.planner.get("cost") == "study":
        return study_cost(net.name, num_workers(cfg), table=cfg.method.planner.get("table"))
    return fitted_cost(net, nodes=cfg.cluster.nodes, per_node=cfg.cluster.workers_per_node)


def describe(cfg: Config, model: Tensors, plan: Plan) -> dict[str, Any]:
    """The plan as data (what --json writes)."""
    n = len(model.sizes)
    units = []
    for i, unit in enumerate(plan.units):
        entry = {"unit": i, "tensors": [model.names[p] for p in unit.params],
                 "elements": unit.numel, "bytes": unit.numel * ELEMENT_SIZE,
                 "priority": n - 1 - unit.params[0]}  # 0 = input side, issued first
        if plan.parts:
            entry["partitions"] = [{"key": p.key, "elements": p.numel, "server": p.server}
                                   for p in plan.parts[i]]
        units.append(entry)
    out = {"model": cfg.model.name, "method": cfg.method.name,
           "cluster": {"nodes": cfg.cluster.nodes,
                       "workers_per_node": cfg.cluster.workers_per_node,
                       "workers": num_workers(cfg), "servers": plan.servers},
           "tensors": n, "elements": sum(model.sizes),
           "transport": thaw(cfg.method.transport), "planner": plan.planner,
           "scheduler": thaw(cfg.method.scheduler), "units": units, "notes": plan.notes}
    if plan.parts:
        t = cfg.method.transport
        out["ps"] = plan_summary(plan.parts, plan.servers, ELEMENT_SIZE,
                                 per_node=cfg.cluster.workers_per_node
                                 if t.get("local_reduce", True) else 1,
                                 node_reduce=t.get("node_reduce", "scatter"))
    return out


def _mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:,.2f} MB"


def render(data: dict[str, Any]) -> str:
    """The plan as text."""
    c, t = data["cluster"], data["transport"]
    lines = [f"{data['model']} with {data['method']} on {c['nodes']} node(s) x "
             f"{c['workers_per_node']} worker(s) = {c['workers']} workers, {c['servers']} "
             f"parameter server(s); {data['tensors']} tensors, {data['elements']:,} elements",
             "transport: " + ", ".join(f"{k}={v}" for k, v in t.items()),
             "scheduler: " + ", ".join(f"{k}={v}" for k, v in data["scheduler"].items()),
             f"{len(data['units'])} units, in the order they are issued"
             + (" (the priority scheduler reorders ready ones: lowest priority number first)"
                if data["scheduler"].get("name") == "priority" else ""), ""]
    planner = data["planner"]
    if planner.get("planner") == "mgwfbp" and planner.get("groups") is not None:
        source = ("the study's table for this worker count and network family"
                  if planner["cost"] == "study" else "fitted on the modelled all-reduce")
        lines.insert(3, f"planner: mgwfbp, {len(planner['groups'])} groups merged on alpha="
                        f"{planner['alpha_s']:.3g} s, beta={planner['beta_s_per_byte']:.3g} "
                        f"s/byte (cost={planner['cost']}: {source})")
    lines.append(f"{'unit':>5}  {'elements':>11}  {'bytes':>12}  {'prio':>4}  tensors"
                 + ("  -> partitions key@server" if "ps" in data else ""))
    for u in data["units"]:
        names = u["tensors"]
        shown = names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]} ({len(names)})"
        row = (f"{u['unit']:>5}  {u['elements']:>11,}  {u['bytes']:>12,}  {u['priority']:>4}  "
               f"{shown}")
        if "partitions" in u and data["cluster"]["servers"]:
            row += "  -> " + " ".join(f"{p['key']}@{p['server']}" for p in u["partitions"])
        elif "partitions" in u:
            row += f"  -> {len(u['partitions'])} partition(s), all-reduced in the node"
        lines.append(row)
    if data.get("ps", {}).get("server_bytes"):
        ps = data["ps"]
        lines += ["", f"bytes per server and iteration, from each of {c['nodes']} node(s) "
                      f"({t.get('assignment', 'hash')} assignment):"]
        lines += [f"  server {s}: {_mb(b)}" for s, b in enumerate(ps["server_bytes"])]
        lines.append(f"busiest/mean = {ps['busiest_over_mean']:.2f}")
        if ps.get("stages"):
            lines.append(f"per partition: {ps['stages']}")
    lines += [f"note: {n}" for n in data["notes"]]
    return "\n".join(lines)
