"""The rules every composed configuration must keep, checked before anything starts.

`validate` reads a DictConfig (a run) or a Frozen one (a simulated sweep) alike. The
jobs of a simulated sweep share the subtrees their swept values leave alone (Frozen), so
it checks the model, the method and the network once per distinct subtree, given the
same `checked` set for the whole sweep; every other rule runs per job.
"""

from __future__ import annotations

import dataclasses
import math

from omegaconf import DictConfig

from harness.config import checks, gpus, paths
from harness.config.frozen import Config, Frozen, assign, select, thaw
from harness.config.ranks import num_workers, profile_processes
from harness.config.schema import (
    CLOCKS,
    FAULT_KINDS,
    OPTIMIZERS,
    PS_WIRES,
    RATES,
    ConfigError,
    cuda_gpus,
    first_line,
    resolve_device,
    step_ending,
)


def _positive(name: str, value: float, *, zero_ok: bool = False) -> None:
    if not math.isfinite(value) or value < 0 or (value == 0 and not zero_ok):
        bound = ">= 0" if zero_ok else "> 0"
        raise ConfigError(f"{name}={value} is invalid; it must be a finite number {bound}")


def _one_of(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{name}={value!r} is invalid; choose one of: {', '.join(allowed)}")


def validate(cfg: Config, *, simulate: bool = False, checked: set | None = None) -> None:
    """Raise ConfigError for the first rule `cfg` breaks (`simulate`: the job is only
    simulated, so it may name a real network and an emulated cluster need not be makeable
    here). `checked`: the ids of the Frozen subtrees already checked in this sweep."""
    for name in ("model.local_batch_size", "cluster.nodes", "cluster.workers_per_node",
                 "run.timed_iters", "run.repeats", "run.timeout_s", "verify.steps"):
        _positive(name, select(cfg, name))
    if cfg.run.timeout_s < 1:
        raise ConfigError(f"run.timeout_s={cfg.run.timeout_s:g} is too short for a rank to meet "
                          "its peers or finish a collective; give at least 1 second")
    for name in ("run.warmup_iters", "run.threads", "verify.atol", "verify.rtol"):
        _positive(name, select(cfg, name), zero_ok=True)
    _positive("microbench.repeats", cfg.microbench.repeats)
    if not 4 <= cfg.microbench.min_bytes <= cfg.microbench.max_bytes:
        raise ConfigError(f"microbench.min_bytes={cfg.microbench.min_bytes} and max_bytes="
                          f"{cfg.microbench.max_bytes} are invalid; need 4 <= min <= max")
    if cfg.cluster.servers is not None:
        _positive("cluster.servers", cfg.cluster.servers, zero_ok=True)
    _one_of("cluster.device", cfg.cluster.device, ("auto", "cpu", "cuda"))
    _one_of("cluster.backend", cfg.cluster.backend, ("auto", "gloo", "nccl"))
    _one_of("cluster.ps_wire", cfg.cluster.ps_wire, PS_WIRES)
    _one_of("model.optimizer.name", cfg.model.optimizer.name, OPTIMIZERS)
    for name in ("model.optimizer.lr", "model.optimizer.momentum", "model.optimizer.weight_decay"):
        _positive(name, select(cfg, name), zero_ok=True)
    if step_ending(cfg.run) not in CLOCKS:
        raise ConfigError(f"run.sync_each_step={cfg.run.sync_each_step!r} is invalid; choose "
                          "one of: false (ours), device (the study's torch.cuda.synchronize), "
                          "drain (every piece and update done, then synchronized)")
    _one_of("run.rate", cfg.run.rate, RATES)
    _one_of("run.fault.kind", cfg.run.fault.kind, FAULT_KINDS)
    _positive("run.fault.at_iter", cfg.run.fault.at_iter, zero_ok=True)
    _once(checked, _check_model, cfg.model)
    _once(checked, _check_method, cfg.method)
    _check_servers(cfg.method, cfg.cluster)
    _check_study_cost(cfg, simulate=simulate)
    checks.check_cluster(cfg)
    checks.check_engine(cfg, load=not simulate)
    _once(checked, checks.check_network, cfg.network)
    _once(checked, _results_dir, cfg.results_dir)
    if simulate:  # only a measured profile runs processes here (ranks.profile_processes)
        _check_simulate(cfg)
        measured = cfg.simulate.compute == "measured"
        checks.check_fit(cfg, here=profile_processes(cfg) if measured else None)
        return
    checks.check_fit(cfg, here=sum(checks.processes(cfg)) if checks.spawns_here(cfg) else None)
    _check_profile(cfg.method.planner, cfg.run)
    checks.check_devices(cfg.cluster, local=checks.spawns_here(cfg))
    checks.check_ps_wire(cfg.cluster)
    checks.check_links(cfg)


def _once(checked: set | None, check, node) -> None:
    """`check(node)`, unless this sweep checked this very (read-only) subtree already."""
    if checked is None or isinstance(node, DictConfig):
        check(node)
        return
    key = (check.__name__, id(node))
    if key not in checked:
        check(node)
        checked.add(key)


def _results_dir(path: str) -> None:
    paths.output_dir("results_dir", path)


def _check_model(model: Config) -> None:
    import methods
    import models

    if model.family not in models.FAMILIES:
        raise ConfigError(f"model.family={model.family!r} is unknown; "
                          f"choose one of: {', '.join(sorted(models.FAMILIES))}")
    family = models.entry(model.family)
    accepted = family.accepted()
    for key, value in model.build.items():
        if key not in accepted:
            raise ConfigError(f"model.build.{key} is not an argument of the {model.family} "
                              f"family; it takes: {', '.join(accepted)}")
        expected = methods.wrong_type(family.params, key, value)
        if expected:
            raise ConfigError(f"model.build.{key}={value!r} is invalid; it must be {expected}")
    missing = [f.name for f in dataclasses.fields(family.params)
               if f.default is dataclasses.MISSING and f.name not in model.build]
    if missing:
        raise ConfigError(f"model.build lacks {', '.join(missing)}, which the {model.family} "
                          f"family needs; add +model.build.{missing[0]}=<value>")
    problem = family.params(**model.build).problem()
    if problem:
        raise ConfigError(f"model.build.{problem}")


def _check_method(method: Config) -> None:
    import methods

    try:
        methods.check(thaw(method))
    except (ValueError, KeyError) as exc:
        raise ConfigError(first_line(exc, type(exc).__name__)) from None


def _check_servers(method: Config, cluster: Config) -> None:
    """A parameter-server method needs at least one server, unless it runs on one node with
    node-local aggregation: then it has none (as BytePS on one machine)."""
    import methods

    if method.transport.get("name") != "ps" or cluster.servers is None:
        return
    if not methods.uses_servers(method, nodes=cluster.nodes):
        if cluster.servers:
            raise ConfigError(
                f"method {method.name!r} on cluster.nodes=1 runs without parameter servers "
                f"(node-local aggregation: BytePS on one machine all-reduces), but "
                f"cluster.servers={cluster.servers}; drop cluster.servers, or set "
                "method.transport.local_reduce=false to push every worker's gradients to them")
    elif cluster.servers == 0:
        raise ConfigError(f"method {method.name!r} uses parameter servers but cluster.servers=0; "
                          "set cluster.servers >= 1, or null for one per node")


def as_simulated(cfg: Frozen) -> Frozen:
    """`cfg` as the simulator reads it: `simulate.compute=auto` resolved (the GPU its network
    profile was measured on, else `measured`), MG-WFBP planning with `simulate.mgwfbp_cost`
    when that is set (experiment=paper: the study's table, as its merges were)."""
    from methods.costmodel import COSTS

    if cfg.simulate.compute == "auto":
        cfg = assign(cfg, "simulate.compute", cfg.network.get("gpu") or "measured")
    cost = cfg.simulate.mgwfbp_cost
    if cost is None:
        return cfg
    _one_of("simulate.mgwfbp_cost", cost, (*COSTS, "null (method.planner.cost)"))
    if cfg.method.planner.get("name") != "mgwfbp":
        return cfg
    # simulated, the study's table is the one of the network simulated (its --rdma flag)
    return assign(assign(cfg, "method.planner.cost", cost), "method.planner.table", None)


def _check_study_cost(cfg: Config, *, simulate: bool) -> None:
    """MG-WFBP's cost=study has the study's table for this many workers."""
    if cfg.method.planner.get("cost") != "study":
        return
    from methods.costmodel import study_cost

    by_simulate = simulate and cfg.simulate.mgwfbp_cost == "study"  # experiment=paper sets it
    fix = {"fix": "set simulate.mgwfbp_cost=fitted to merge on the fitted cost"}
    try:
        study_cost(cfg.network.name, num_workers(cfg), table=cfg.method.planner.get("table"),
                   **(fix if by_simulate else {}))
    except ValueError as exc:
        where = "simulate.mgwfbp_cost=study: " if by_simulate else ""
        raise ConfigError(f"{where}{exc}") from None


def _check_profile(planner: Config, run: Config) -> None:
    """A planner that profiles the first iterations (MG-WFBP) does so inside the warm-up:
    a profiled iteration runs one bucket after backward, not the method being timed."""
    profiled = planner.get("profile_iters") or 0
    if profiled > run.warmup_iters:
        raise ConfigError(
            f"method.planner.profile_iters={profiled} profiles iterations that "
            f"run.warmup_iters={run.warmup_iters} would leave inside the timed window; set "
            f"run.warmup_iters>={profiled} or method.planner.profile_iters<={run.warmup_iters}")


def _check_simulate(cfg: Config) -> None:
    sim = cfg.simulate
    for name in ("simulate.profile_iters", "simulate.iterations"):
        _positive(name, select(cfg, name))
    for count in sim.calibrate_gpus or []:
        if count < 2:
            raise ConfigError(f"simulate.calibrate_gpus has {count}; fit on GPU counts above 1 "
                              "(one GPU sends nothing), e.g. simulate.calibrate_gpus=[4]")
    rate = cfg.network.get("rate_mbit")
    if rate is not None:
        _positive("network.rate_mbit", rate)
    _one_of("simulate.precision", sim.precision, gpus.PRECISIONS)
    if not 0 < sim.efficiency <= 1:
        raise ConfigError(f"simulate.efficiency={sim.efficiency} is invalid; give the share "
                          "of its peaks a GPU reaches, in (0, 1], e.g. 0.5")
    if sim.compute == "measured":
        _check_profile_gpus(cfg)
        return
    table = gpus.table()
    if sim.compute not in table:
        raise ConfigError(f"simulate.compute={sim.compute!r} is unknown; choose auto, measured "
                          f"or a GPU of conf/gpu/: {', '.join(table)}")
    table[sim.compute].flop_s(sim.precision)  # it has the unit asked for
    throughput = sim.gpus.get(sim.compute, {}).get(cfg.model.name)
    if throughput is not None and (isinstance(throughput, bool) or not isinstance(
            throughput, (int, float)) or not 0 < throughput < math.inf):
        raise ConfigError(f"simulate.gpus.{sim.compute}.{cfg.model.name}={throughput!r} is "
                          "invalid; it must be a number of samples/s > 0")


def _check_profile_gpus(cfg: Config) -> None:
    """A measured profile on GPUs gives each of its processes a GPU of its own, as a run
    would: there must be as many (no override lifts it)."""
    if resolve_device(cfg.cluster) != "cuda":
        return
    need, have = profile_processes(cfg), cuda_gpus()
    if have == 0:
        raise ConfigError("simulate.compute=measured with cluster.device=cuda profiles on a "
                          "GPU, and this machine shows none; use cluster.device=cpu or auto "
                          "to profile here, or predict GPUs with simulate.compute=<gpu> "
                          f"({', '.join(gpus.table())}: conf/gpu/)")
    if need > have:
        raise ConfigError(
            f"simulate.compute=measured profiles the {need} workers of cluster.nodes="
            f"{cfg.cluster.nodes} x cluster.workers_per_node={cfg.cluster.workers_per_node} "
            f"at once, one GPU each, and this machine has {have} GPUs; lower them to {have} "
            "workers at most, predict them with simulate.compute=<gpu> (conf/gpu/), or "
            "profile on cluster.device=cpu")
