"""Checks of a composed config and of a command's inputs, before anything starts.

Against this machine (processes, memory, threads), the key names (the closest valid
ones) and the types of free-form keys; output paths are checked by harness/config/paths.py,
input tables by harness/config/tables.py. Each raises `ConfigError` with one line naming
the value, the limit or the problem, and the fix. `config.validate` runs the config checks
on every job.
"""

from __future__ import annotations

import difflib
import importlib.util
import os
import shutil
import socket
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from harness.config.frozen import Config, leaves, select, thaw
from harness.config.ranks import external_rank, num_servers, num_workers
from harness.config.schema import (
    CONF_DIR,
    ENGINES,
    GROUPS,
    BenchConf,
    ConfigError,
    cuda_gpus,
    first_line,
    is_real_network,
    resolve_device,
)

FORCE = "add run.force=true to run it anyway"
# Sane bounds of counts and sizes (machine-fit limits: run.force=true lifts them).
BOUNDS = {
    "run.warmup_iters": 100_000, "run.timed_iters": 100_000, "run.repeats": 1_000,
    "verify.steps": 100_000, "microbench.repeats": 1_000, "microbench.max_bytes": 1 << 30,
    "simulate.profile_iters": 1_000, "simulate.iterations": 10_000,
}
PROCESS_MB = 300  # a floor per local process: Python, torch and Gloo, before any model
MAX_EMULATED_HOSTS = 250  # one /24 subnet (harness.launch.netem)
TYPE_WORDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string",
              dict: "a mapping", list: "a list"}
# Keys of network profiles: the emulated link's rate, and the facts of a real network.
NETWORK_KEYS = {"name": str, "rate_mbit": float, "inter_node": dict, "intra_node": dict,
                "allreduce": str, "ps_host_copy": bool, "ps_wire": str, "gpu": str}
REAL_PS_WIRES = ("rdma", "tcp")  # a real network's PS wire (this machine's: cluster.ps_wire)
ALLREDUCE = ("ring", "tree", "hierarchical", "best", "nccl24")
METHOD_DIR = CONF_DIR / "method"


def cores() -> int:
    return len(os.sched_getaffinity(0))


def max_processes() -> int:
    """Local processes this machine takes: oversubscribed up to 4 per core, at least 8."""
    return max(8, 4 * cores())


def available_mb() -> float | None:
    """MemAvailable of /proc/meminfo in MB; None where there is none."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def processes(cfg: Config) -> tuple[int, int]:
    """(workers, parameter servers) of the run."""
    return num_workers(cfg), num_servers(cfg)


def spawns_here(cfg: Config) -> bool:
    """Whether the harness itself starts every process of the run on this machine."""
    return cfg.cluster.name in ("local", "emulated") and external_rank() is None


def check_cluster(cfg: Config) -> None:
    """Rules no override lifts: the port, the fault's rank, the emulated subnet."""
    port = cfg.cluster.master_port
    if not 0 <= port <= 65535:
        raise ConfigError(f"cluster.master_port={port} is invalid; use a port in 0..65535 "
                          "(0 = pick a free one)")
    workers, servers = processes(cfg)
    rank, last = cfg.run.fault.rank, workers + servers - 1
    if rank != -1 and not 0 <= rank <= last:
        raise ConfigError(f"run.fault.rank={rank} is not a rank of this run (0..{last}: {workers} "
                          f"workers, then {servers} servers); use one, or -1 for no fault")
    hosts = cfg.cluster.nodes + servers
    if cfg.cluster.name == "emulated" and hosts > MAX_EMULATED_HOSTS:
        raise ConfigError(f"cluster=emulated with cluster.nodes={cfg.cluster.nodes} and {servers} "
                          f"parameter servers needs {hosts} emulated hosts, more than the "
                          f"{MAX_EMULATED_HOSTS} of one subnet; lower cluster.nodes")


def methods_on(transport: str) -> list[str]:
    """The methods of conf/method/ whose transport is `transport` (e.g. allreduce: those
    engine=horovod runs on Horovod; ps)."""
    return sorted(p.stem for p in METHOD_DIR.glob("*.yaml")
                  if OmegaConf.select(OmegaConf.load(p), "transport.name") == transport)


def check_engine(cfg: Config, *, load: bool = True) -> None:
    """The engine is known and fits the method: Horovod runs all-reduce methods only, with
    sane settings, and (`load`: the run starts here) must load here
    (harness.config.engine.problem)."""
    import methods
    from harness.config import engine as horovod

    transport = cfg.method.transport.name
    if cfg.engine not in ENGINES:
        raise ConfigError(f"engine={cfg.engine!r} is unknown; choose one of: {', '.join(ENGINES)}")
    if transport == "horovod":
        raise ConfigError(f"method {cfg.method.name!r} names transport 'horovod', which only "
                          "engine=horovod chooses; write transport: {name: allreduce} and add "
                          "engine=horovod")
    if cfg.engine == "native":
        return
    if transport != "allreduce":
        what = "is torch DDP" if transport == "ddp" else f"uses transport {transport!r}"
        raise ConfigError(f"engine=horovod runs all-reduce methods only, and method "
                          f"{cfg.method.name!r} {what}; use engine=native with it, or one of: "
                          f"{', '.join(methods_on('allreduce'))}")
    _check_horovod_settings(cfg.method.horovod)
    try:
        methods.check(methods.on_engine(thaw(cfg.method), cfg.engine))
    except (ValueError, KeyError) as exc:
        raise ConfigError(first_line(exc)) from None
    reason = horovod.problem(device=resolve_device(cfg.cluster)) if load else None
    if reason:
        raise ConfigError(reason)


def _check_horovod_settings(settings: Config) -> None:
    if settings.fusion_threshold_bytes < 0:
        raise ConfigError(f"method.horovod.fusion_threshold_bytes={settings.fusion_threshold_bytes}"
                          " is invalid; it must be >= 0 (0: no fusion)")
    if settings.cycle_time_s < 0:
        raise ConfigError(f"method.horovod.cycle_time_s={settings.cycle_time_s} is invalid; it "
                          "must be >= 0 (0: no wait, as the study ran bsp_a2a, wfbp_a2a and "
                          "mgwfbp; Horovod's default of the study's time: 0.005)")
    if settings.cache_capacity < 0:
        raise ConfigError(f"method.horovod.cache_capacity={settings.cache_capacity} is invalid; "
                          "it must be >= 0 (0: the response cache off; Horovod's default: 1024)")


def check_fit(cfg: Config, *, here: int | None) -> None:
    """Machine-fit limits, lifted by run.force=true: sane counts and sizes; with `here`
    (the processes this machine starts: a run's every one, a simulation's measured
    profile), threads, processes and memory."""
    if cfg.run.force:
        return
    for name, limit in BOUNDS.items():
        value = select(cfg, name)
        if value > limit:
            raise ConfigError(f"{name}={value} is above the limit of {limit}; lower it, or {FORCE}")
    if here is None:
        return
    n = cores()
    if cfg.run.threads > n:
        raise ConfigError(f"run.threads={cfg.run.threads} is more than the {n} cores of this "
                          f"machine; use run.threads=0 (auto) or at most {n}, or {FORCE}")
    workers, servers = processes(cfg)
    what = (f"{here} local processes (cluster.nodes={cfg.cluster.nodes} x "
            f"cluster.workers_per_node={cfg.cluster.workers_per_node} workers + {servers} "
            "parameter servers)")
    fix = f"lower cluster.nodes, cluster.workers_per_node or cluster.servers, or {FORCE}"
    if here < workers + servers:  # a simulation's profile of this machine's own run
        what = f"{here} local profiling processes (one per worker of the run predicted)"
        fix = f"lower cluster.nodes or cluster.workers_per_node, or {FORCE}"
    if here > max_processes():
        raise ConfigError(f"{what} are more than this machine takes: {max_processes()} = "
                          f"max(8, 4 x {n} cores); {fix}")
    need, have = here * PROCESS_MB, available_mb()
    if have is not None and need > have:
        raise ConfigError(f"{what} need about {need} MB ({PROCESS_MB} MB each) but this "
                          f"machine has {have:.0f} MB available; {fix}")


def check_devices(cluster: DictConfig, *, local: bool) -> None:
    """The devices and backend the cluster asks for exist on this machine; `local`: the
    harness starts every rank here. Else (a login node, srun, torchrun) nothing of this
    machine is checked: each rank picks the GPU its task sees, or fails naming it."""
    if cluster.gloo_ifname is not None and cluster.name == "emulated":
        raise ConfigError("cluster.gloo_ifname is set by the emulated network itself; "
                          "remove the override")
    if not local:  # a login node, or ranks that torchrun or srun placed (launch.rank)
        return
    names = [name for _, name in socket.if_nameindex()]
    if cluster.gloo_ifname is not None and cluster.gloo_ifname not in names:
        raise ConfigError(f"cluster.gloo_ifname={cluster.gloo_ifname!r} is not an interface "
                          f"of this machine (it has {', '.join(names)}); use one of them or "
                          "leave it out")
    gpus, workers = cuda_gpus(), cluster.nodes * cluster.workers_per_node
    if cluster.device == "cuda" and not gpus:
        raise ConfigError("cluster.device=cuda but no GPU is visible; use cluster.device=cpu")
    device = resolve_device(cluster)
    if cluster.backend == "nccl" and device == "cpu":
        raise ConfigError("cluster.backend=nccl needs GPUs; use cluster.backend=gloo on CPU")
    if device == "cuda" and workers > gpus:  # each emulated node its own GPUs
        raise ConfigError(
            f"cluster.nodes={cluster.nodes} x cluster.workers_per_node={cluster.workers_per_node}"
            f" = {workers} workers, all started on this machine, exceed its {gpus} GPUs (one "
            "each); lower them or use cluster.device=cpu")


def check_ps_wire(cluster: DictConfig) -> None:
    """cluster.ps_wire=ucx needs ucxx (the `.[ucx]` extra) in this environment."""
    if cluster.ps_wire == "ucx" and importlib.util.find_spec("ucxx") is None:
        raise ConfigError("cluster.ps_wire=ucx needs ucxx, which is not installed; install it "
                          "with pip install -e '.[ucx]', or use cluster.ps_wire=gloo")


def missing_net_tools() -> list[str]:
    """What an emulated network (harness/launch/netem.py) needs and this machine lacks."""
    return [tool for tool in ("ip", "tc") if shutil.which(tool) is None]


def check_links(cfg: DictConfig) -> None:
    """A run's network: loopback, or rate-limited links of an emulated cluster made here."""
    if is_real_network(cfg.network):
        raise ConfigError(f"network={cfg.network.name} is a real network, for "
                          "`python -m harness.simulate` only; runs here use network=loopback "
                          "or a rate-limited profile with cluster=emulated")
    rate = cfg.network.get("rate_mbit")
    if rate is not None:
        if rate <= 0:
            raise ConfigError(f"network.rate_mbit={rate} is invalid; it must be > 0")
        if cfg.cluster.name != "emulated":
            raise ConfigError(f"network={cfg.network.name} limits links, which only an emulated "
                              "cluster has; add cluster=emulated (or use network=loopback)")
    if cfg.cluster.name == "emulated":
        if os.geteuid() != 0:
            raise ConfigError("cluster=emulated makes network namespaces and needs root; "
                              "run as root or use cluster=local")
        if missing_net_tools():
            raise ConfigError(f"cluster=emulated needs {' and '.join(missing_net_tools())} "
                              "on PATH; install iproute2 (apt-get install -y iproute2)")
        if cfg.cluster.device != "cpu":
            raise ConfigError("cluster=emulated runs on the CPU; set cluster.device=cpu")


def is_a(value: Any, kind: type) -> bool:
    """isinstance, where a bool is no number and an int is a float."""
    if kind in (int, float) and isinstance(value, bool):
        return False
    return isinstance(value, (int, float) if kind is float else kind)


def check_network(network: Config) -> None:
    """Every key of the profile is known and typed; a real network's facts are numbers."""
    net = thaw(network)
    for key, value in net.items():
        if key not in NETWORK_KEYS:
            raise ConfigError(f"network.{key} is not a key of a network profile; "
                              f"{_did_you_mean(key, list(NETWORK_KEYS))}")
        if not is_a(value, NETWORK_KEYS[key]):
            raise ConfigError(f"network.{key}={value!r} is invalid; it must be "
                              f"{TYPE_WORDS[NETWORK_KEYS[key]]}")
    for path, value in leaves({k: net[k] for k in ("inter_node", "intra_node") if k in net}):
        if not is_a(value, float):
            raise ConfigError(f"network.{path}={value!r} is invalid; it must be a number")
    if net.get("allreduce", "ring") not in ALLREDUCE:
        raise ConfigError(f"network.allreduce={net['allreduce']!r} is invalid; choose one of: "
                          f"{', '.join(ALLREDUCE)}")
    if "gpu" in net:
        from harness.config import gpus

        if net["gpu"] not in gpus.table():
            raise ConfigError(f"network.gpu={net['gpu']!r} is not a GPU of conf/gpu/; choose "
                              f"one of: {', '.join(gpus.table())}")
    if "ps_wire" in net and ("inter_node" not in net or net["ps_wire"] not in REAL_PS_WIRES):
        raise ConfigError(f"network.ps_wire={net['ps_wire']!r} is invalid; a real network's "
                          f"profile names one of: {', '.join(REAL_PS_WIRES)} (this machine's "
                          "networks take the run's cluster.ps_wire)")


def keys(cfg: DictConfig) -> list[str]:
    """Every dotted key of `cfg` (not Hydra's own node)."""
    tree = OmegaConf.to_container(cfg, resolve=False)
    tree.pop("hydra", None)
    found: list[str] = []

    def walk(node: dict, prefix: str) -> None:
        for k, v in node.items():
            found.append(prefix + str(k))
            if isinstance(v, dict):
                walk(v, f"{prefix}{k}.")

    walk(tree, "")
    return found


def _did_you_mean(key: str, candidates: list[str]) -> str:
    close = difflib.get_close_matches(key, candidates, n=3, cutoff=0.8)
    if close:
        return f"did you mean {' or '.join(close)}?"
    return f"valid: {', '.join(candidates[:15])}{', ...' if len(candidates) > 15 else ''}"


def unknown_key(key: str, cfg: DictConfig) -> str:
    """The message for `key=...` where `cfg` has no `key`: the closest valid keys (or the
    parent's), and `+key=` where the parent takes free-form keys."""
    candidates = list(dict.fromkeys([*GROUPS, *keys(cfg)]))
    close = difflib.get_close_matches(key, candidates, n=3, cutoff=0.8)
    parent = key.rpartition(".")[0]
    node = OmegaConf.select(cfg, parent) if parent else None
    if close:
        hint = f"did you mean {' or '.join(close)}?"
    elif isinstance(node, DictConfig):
        hint = f"{parent} has: {', '.join(map(str, node.keys())) or 'nothing'}"
    else:
        hint = f"the configuration has: {', '.join(dict.fromkeys([*GROUPS, *cfg.keys()]))}"
    if _free_form(parent):
        hint += f"; add a new key with +{key}=<value>"
    return f"{key} is not a configuration key; {hint}"


def _free_form(parent: str) -> bool:
    """Whether the schema lets `parent` hold any key (network, method.*, model.build, ...)."""
    schema = OmegaConf.structured(BenchConf)
    parts = parent.split(".") if parent else []
    while parts:
        node = OmegaConf.select(schema, ".".join(parts))
        if node is not None:
            return isinstance(node, DictConfig) and OmegaConf.get_type(node) is dict
        parts.pop()
    return False


# Sections of conf/bench.yaml a command never reads, and the command that does read each:
# an override of one would be silently ignored, so it is refused.
NOT_READ = {
    "harness.run": ("verify", "microbench", "simulate"),
    "harness.submit": ("verify", "microbench", "simulate"),
    "harness.verify": ("microbench", "simulate"),
    "harness.check": ("microbench", "simulate"),
    "harness.microbench": ("verify", "simulate"),
    "harness.simulate": ("verify", "microbench"),
    "harness.plan": ("verify", "microbench"),  # a measured link: results_dir, simulate.*
}
READ_BY = {"verify": "harness.verify and harness.check", "microbench": "harness.microbench",
           "simulate": "harness.simulate and harness.plan"}


def used_by(command: str, overrides: list[str]) -> None:
    """Refuse an override of a section `command` does not read (NOT_READ)."""
    for override in overrides:
        key = override.split("=", 1)[0].lstrip("+~")
        section = key.split(".")[0]
        if section in NOT_READ.get(command, ()):
            raise ConfigError(f"{override}: {command} does not read {key} ({section} is read "
                              f"by {READ_BY[section]}); drop it")
