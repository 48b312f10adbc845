"""Compose, expand and validate configurations before any process starts.

Every command composes conf/bench.yaml with the user's overrides through Hydra's
Compose API, expands sweeps (comma lists, `hydra.sweeper.params` of an
experiment) into one override list per job, and checks each composed config
against typed schemas and the rules below. A `ConfigError` carries a one-line
message naming the bad value and the fix; entry points print it and exit 2.
"""

from __future__ import annotations

import copy
import difflib
import functools
import inspect
import itertools
import os

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import OverrideType
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError

from harness.config import cache, checks
from harness.config.schema import (
    CONF_DIR,
    GROUPS,
    OPTIMIZERS,
    BenchConf,
    ConfigError,
    first_line,
)


def choices(group: str) -> list[str]:
    """The names users can type for a config group: the file stems in conf/<group>/."""
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def _parse(overrides: list[str]) -> list:
    try:
        return OverridesParser.create().parse_overrides(overrides)
    except Exception as exc:  # noqa: BLE001 - Hydra's parse errors become one line
        raise ConfigError(f"cannot parse overrides {overrides}: "
                          f"{first_line(exc, type(exc).__name__)}") from None


def _check_choices(overrides: list[str]) -> None:
    for ov in _parse(overrides):
        key = ov.key_or_group
        if key not in GROUPS:
            continue
        values = list(ov.sweep_string_iterator()) if ov.is_sweep_override() else [ov.value()]
        for value in values:
            if value is not None and str(value) not in choices(key):
                close = difflib.get_close_matches(str(value), choices(key), n=1, cutoff=0.6)
                hint = f"did you mean {close[0]}? " if close else ""
                raise ConfigError(f"{key} {str(value)!r} is unknown; {hint}"
                                  f"choose one of: {', '.join(choices(key))}")


def compose_raw(overrides: list[str], *, hydra_node: bool = False) -> DictConfig:
    """Compose conf/bench.yaml with `overrides` (no sweeps), unvalidated."""
    _check_choices(overrides)
    return copy.deepcopy(_compose(tuple(overrides), hydra_node))


@functools.lru_cache(maxsize=256)
def _compose(overrides: tuple[str, ...], hydra_node: bool) -> DictConfig:
    """Hydra's compose. It takes ~0.2 s, so each distinct one is done once per process, and
    once for as long as conf/ and Hydra stay the same (harness/cache.py): the paper sweep
    composes 12 times. Hydra's node records the working directory, so it keys that too."""
    key = [list(overrides), hydra_node, os.getcwd() if hydra_node else None]
    cfg = OmegaConf.create(cache.cached(
        "compose", key, lambda: _hydra_compose(overrides, hydra_node),
        source=("conf", "**/*.yaml"), libraries=("hydra-core", "omegaconf")))
    OmegaConf.set_struct(cfg, True)  # as Hydra leaves it: unknown keys are errors
    return cfg


def _hydra_compose(overrides: tuple[str, ...], hydra_node: bool) -> dict:
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            cfg = compose("bench", overrides=list(overrides), return_hydra_config=hydra_node)
        return OmegaConf.to_container(cfg, resolve=False, enum_to_str=True)
    except Exception as exc:  # noqa: BLE001 - any compose error is bad input
        key = getattr(exc.__cause__, "full_key", None)
        if isinstance(exc.__cause__, (ConfigAttributeError, ConfigKeyError)) and key:
            raise ConfigError(_unknown_key(key, overrides)) from None
        raise ConfigError(f"bad configuration {list(overrides)}: "
                          f"{first_line(exc, type(exc).__name__)}") from None
    finally:
        GlobalHydra.instance().clear()


def _unknown_key(key: str, overrides: tuple[str, ...]) -> str:
    """The message for an override of a key the config lacks, with the closest valid keys
    of the config composed without it."""
    rest = tuple(o for o in overrides if o.split("=", 1)[0].lstrip("+~") != key)
    try:
        cfg = _compose(rest, False)
    except ConfigError:
        cfg = OmegaConf.structured(BenchConf)
    return checks.unknown_key(key, cfg)


def _values(override: str) -> list[str]:
    """The values an override takes: several for a sweep, else one."""
    ov = _parse([override])[0]
    if ov.is_sweep_override():
        return [str(v).strip() for v in ov.sweep_string_iterator()]
    return [str(ov.value())]


def expand(overrides: list[str]) -> list[list[str]]:
    """One override list per job: the product of every sweep, first key slowest.

    Sweeps come from the experiment's `hydra.sweeper.params` and from comma
    lists on the command line; a key given on the command line wins over the
    experiment's sweep of it.
    """
    overrides = [o for o in overrides if o not in ("-m", "--multirun")]
    parsed = _parse(overrides)
    fixed = [o.input_line for o in parsed if not o.is_sweep_override()]
    sweeps = {o.key_or_group: _values(o.input_line) for o in parsed if o.is_sweep_override()}
    base = compose_raw(fixed, hydra_node=True)
    params = dict(base.hydra.sweeper.get("params") or {})
    given = {o.key_or_group for o in parsed}
    swept = {k: _values(f"{k}={v}") for k, v in params.items() if k not in given}
    swept.update(sweeps)
    keys = list(swept)
    return [fixed + [f"{k}={v}" for k, v in zip(keys, combo)]
            for combo in itertools.product(*(swept[k] for k in keys))]


def sweep(overrides: list[str]) -> list[list[str]]:
    """Every job of a sweep: the main product, then each `hydra.sweeper.extra` product.

    Keys given in `overrides` win over both; duplicates are dropped.
    """
    jobs = expand(overrides)
    base = compose_raw([o for o in overrides if "," not in o], hydra_node=True)
    given = {o.split("=", 1)[0].lstrip("+~") for o in overrides}
    for entry in base.hydra.sweeper.get("extra") or []:
        extra = [f"{k}={v}" for k, v in entry.items() if k not in given]
        jobs += expand([*overrides, *extra])
    unique: list[list[str]] = []
    for job in jobs:
        if job not in unique:
            unique.append(job)
    return unique


def load(overrides: list[str], *, simulate: bool = False) -> DictConfig:
    """Compose one job's config, apply the schema and check every rule.

    `simulate`: the job is only simulated (harness.simulate), so it may name a real
    network and an emulated cluster need not be makeable here.
    """
    return load_all([overrides], simulate=simulate)[0]


def load_all(jobs: list[list[str]], *, simulate: bool = False) -> list[DictConfig]:
    """`load` of every job, composing as little as possible (Hydra takes ~0.2 s a compose).

    Jobs of a sweep share a context (experiment, fixed overrides) and differ in group
    choices (model=..., method=...) and plain values (cluster.nodes=4). Each context is
    composed once, each group choice once within it (its subtree is spliced in), and
    plain values are set last, as Hydra sets them after composing.
    """
    composed: dict[tuple[str, ...], DictConfig] = {}

    def typed(overrides: tuple[str, ...]) -> DictConfig:
        if overrides not in composed:
            composed[overrides] = _typed(compose_raw(list(overrides)))
        return composed[overrides]

    out = []
    for job in jobs:
        parsed = _parse(job)
        plain = [o for o in parsed if _is_plain(o)]
        choices = [o for o in parsed if _is_choice(o)]
        context = tuple(o.input_line for o in parsed if o not in plain and o not in choices)
        cfg = copy.deepcopy(typed(context))
        for o in choices:
            cfg[o.key_or_group] = typed((*context, o.input_line))[o.key_or_group]
        for o in plain:
            if OmegaConf.select(cfg, o.key_or_group, default=_ABSENT) is _ABSENT:
                    raise ConfigError(checks.unknown_key(o.key_or_group, cfg))
            _schema_errors(OmegaConf.update, cfg, o.key_or_group, o.value(), merge=False)
        validate(cfg, simulate=simulate)
        out.append(cfg)
    return out


_ABSENT = object()


def _is_choice(override) -> bool:
    """`group=option` for a group whose option fills one subtree (not the experiment)."""
    return (override.type == OverrideType.CHANGE and override.package is None
            and not override.is_sweep_override()
            and override.key_or_group in GROUPS and override.key_or_group != "experiment")


def _is_plain(override) -> bool:
    """`key=value` on a key of the config (not a group choice, sweep, addition or deletion)."""
    return (override.type == OverrideType.CHANGE and override.package is None
            and not override.is_sweep_override() and "/" not in override.key_or_group
            and override.key_or_group not in GROUPS
            and override.key_or_group.split(".")[0] != "hydra")


def _typed(cfg: DictConfig) -> DictConfig:
    return _schema_errors(OmegaConf.merge, OmegaConf.structured(BenchConf), cfg)


def _schema_errors(func, *args, **kwargs):
    """`func(*args, **kwargs)`, its omegaconf type errors as ConfigError naming the key."""
    try:
        return func(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - omegaconf type errors
        msg = first_line(exc, type(exc).__name__)
        key = getattr(exc, "full_key", None)
        if isinstance(exc, (ConfigAttributeError, ConfigKeyError)) and key:
            raise ConfigError(checks.unknown_key(key, OmegaConf.structured(BenchConf))) from None
        raise ConfigError(f"{key}: {msg}" if key else msg) from None


def _positive(name: str, value: float, *, zero_ok: bool = False) -> None:
    if value < 0 or (value == 0 and not zero_ok):
        bound = ">= 0" if zero_ok else "> 0"
        raise ConfigError(f"{name}={value} is invalid; it must be {bound}")


def _one_of(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{name}={value!r} is invalid; choose one of: {', '.join(allowed)}")


def validate(cfg: DictConfig, *, simulate: bool = False) -> None:
    """Raise ConfigError for the first rule `cfg` breaks (`simulate`: see `load`)."""
    for name in ("model.local_batch_size", "cluster.nodes", "cluster.workers_per_node",
                 "run.timed_iters", "run.repeats", "run.timeout_s", "verify.steps"):
        _positive(name, OmegaConf.select(cfg, name))
    for name in ("run.warmup_iters", "run.threads", "verify.atol", "verify.rtol"):
        _positive(name, OmegaConf.select(cfg, name), zero_ok=True)
    _positive("microbench.repeats", cfg.microbench.repeats)
    if not 4 <= cfg.microbench.min_bytes <= cfg.microbench.max_bytes:
        raise ConfigError(f"microbench.min_bytes={cfg.microbench.min_bytes} and max_bytes="
                          f"{cfg.microbench.max_bytes} are invalid; need 4 <= min <= max")
    if cfg.cluster.servers is not None:
        _positive("cluster.servers", cfg.cluster.servers, zero_ok=True)
    _one_of("cluster.device", cfg.cluster.device, ("auto", "cpu", "cuda"))
    _one_of("cluster.backend", cfg.cluster.backend, ("auto", "gloo", "nccl"))
    _one_of("model.optimizer.name", cfg.model.optimizer.name, OPTIMIZERS)
    _one_of("run.fault.kind", cfg.run.fault.kind, ("raise", "exit", "hang"))
    _positive("run.fault.at_iter", cfg.run.fault.at_iter, zero_ok=True)
    _check_model(cfg.model)
    _check_method(cfg.method)
    _check_servers(cfg.method, cfg.cluster)
    checks.check_cluster(cfg)
    checks.check_engine(cfg)
    checks.check_network(cfg.network)
    checks.output_dir("results_dir", cfg.results_dir)
    if simulate:  # only measured compute runs processes here (as many as the run has)
        _check_simulate(cfg)
        checks.check_fit(cfg, local=cfg.simulate.compute == "measured" and checks.spawns_here(cfg))
        return
    checks.check_fit(cfg, local=checks.spawns_here(cfg))
    checks.check_devices(cfg.cluster, local=checks.spawns_here(cfg))
    checks.check_links(cfg)


def _check_model(model: DictConfig) -> None:
    import methods
    import models

    if model.family not in models.FAMILIES:
        raise ConfigError(f"model.family={model.family!r} is unknown; "
                          f"choose one of: {', '.join(sorted(models.FAMILIES))}")
    family = models.family_class(model.family)
    accepted = inspect.signature(family).parameters
    for key, value in model.build.items():
        if key not in accepted:
            raise ConfigError(f"model.build.{key} is not an argument of the {model.family} "
                              f"family; it takes: {', '.join(accepted)}")
        expected = methods.wrong_type(family, key, value)
        if expected:
            raise ConfigError(f"model.build.{key}={value!r} is invalid; it must be {expected}")


def _check_method(method: DictConfig) -> None:
    import methods

    try:
        methods.check(OmegaConf.to_container(method, resolve=True))
    except (ValueError, KeyError) as exc:
        raise ConfigError(first_line(exc, type(exc).__name__)) from None


def _check_servers(method: DictConfig, cluster: DictConfig) -> None:
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


def _check_simulate(cfg: DictConfig) -> None:
    sim = cfg.simulate
    for name in ("simulate.profile_iters", "simulate.iterations"):
        _positive(name, OmegaConf.select(cfg, name))
    for gpus in sim.calibrate_gpus or []:
        if gpus < 2:
            raise ConfigError(f"simulate.calibrate_gpus has {gpus}; fit on GPU counts above 1 "
                              "(one GPU sends nothing), e.g. simulate.calibrate_gpus=[4]")
    rate = cfg.network.get("rate_mbit")
    if rate is not None:
        _positive("network.rate_mbit", rate)
    if sim.compute == "measured":
        return
    if sim.compute not in sim.gpus:
        raise ConfigError(f"simulate.compute={sim.compute!r} is unknown; choose measured or a "
                          f"GPU of simulate.gpus: {', '.join(sim.gpus) or 'none defined'}")
    if cfg.model.name not in sim.gpus[sim.compute]:
        raise ConfigError(f"simulate.gpus.{sim.compute} has no 1-GPU throughput of model "
                          f"{cfg.model.name!r}; add simulate.gpus.{sim.compute}."
                          f"{cfg.model.name}=<samples/s> or use simulate.compute=measured")
    throughput = sim.gpus[sim.compute][cfg.model.name]
    if isinstance(throughput, bool) or not isinstance(throughput, (int, float)) or throughput <= 0:
        raise ConfigError(f"simulate.gpus.{sim.compute}.{cfg.model.name}={throughput!r} is "
                          "invalid; it must be a number of samples/s > 0")


def to_json(cfg: DictConfig) -> str:
    import json

    return json.dumps(OmegaConf.to_container(cfg, resolve=True), sort_keys=True)


def from_json(text: str) -> DictConfig:
    import json

    return OmegaConf.merge(OmegaConf.structured(BenchConf), json.loads(text))
