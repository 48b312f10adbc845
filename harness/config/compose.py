"""Compose, expand and validate configurations before any process starts.

Every command composes conf/bench.yaml with the user's overrides through Hydra's
Compose API, expands sweeps (comma lists, `hydra.sweeper.params` of an
experiment) into one override list per job, and checks each composed config
against typed schemas and the rules of harness/config/rules.py. A `ConfigError`
carries a one-line message naming the bad value and the fix; entry points print it
and exit 2. A simulated sweep's jobs load as read-only Frozen configurations
(harness/config/frozen.py), thousands a second.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import itertools
import os
from collections.abc import Iterator
from typing import Any

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError

from harness.config import cache, checks, diagnose
from harness.config.frozen import Frozen, assign, freeze, select, thaw
from harness.config.overrides import (
    check_choices,
    choices,
    is_choice,
    is_plain,
    parse,
    parse_one,
)
from harness.config.rules import as_simulated, validate
from harness.config.schema import CONF_DIR, BenchConf, ConfigError, first_line


def compose_raw(overrides: list[str], *, hydra_node: bool = False) -> DictConfig:
    """Compose conf/bench.yaml with `overrides` (no sweeps), unvalidated."""
    check_choices(overrides)
    return copy.deepcopy(_compose(tuple(overrides), hydra_node))


@functools.lru_cache(maxsize=256)
def _compose(overrides: tuple[str, ...], hydra_node: bool) -> DictConfig:
    """Hydra's compose. It takes ~0.2 s, so each distinct one is done once per process, and
    once for as long as conf/ and Hydra stay the same (harness/cache.py): the paper sweep
    composes 12 times. Hydra's node records the working directory, so it keys that too."""
    cfg = OmegaConf.create(_composed(overrides, hydra_node))
    OmegaConf.set_struct(cfg, True)  # as Hydra leaves it: unknown keys are errors
    return cfg


def _composed(overrides: tuple[str, ...], hydra_node: bool) -> dict:
    """Hydra's compose as a container, from the cache when there."""
    key = [list(overrides), hydra_node, os.getcwd() if hydra_node else None]
    return cache.cached("compose", key, lambda: _hydra_compose(overrides, hydra_node),
                        sources=(("conf", "**/*.yaml"),), libraries=("hydra-core", "omegaconf"))


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
        broken = diagnose.broken_yaml(CONF_DIR) if diagnose.is_yaml_error(exc) else None
        if broken:
            raise ConfigError(broken) from None
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
    ov = parse([override])[0]
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
    parsed = parse(overrides)
    fixed = [o.input_line for o in parsed if not o.is_sweep_override()]
    sweeps = {o.key_or_group: _values(o.input_line) for o in parsed if o.is_sweep_override()}
    params = dict(_sweeper([o.input_line for o in parsed if not o.is_sweep_override()
                            and not is_plain(o)]).get("params") or {})
    given = {o.key_or_group for o in parsed}
    swept = {k: _values(f"{k}={v}") for k, v in params.items() if k not in given}
    swept.update(sweeps)
    keys = list(swept)
    return [fixed + [f"{k}={v}" for k, v in zip(keys, combo)]
            for combo in itertools.product(*(swept[k] for k in keys))]


def _sweeper(overrides: list[str]) -> dict:
    """The `hydra.sweeper` node of the composition of `overrides`, as data (no
    DictConfig of Hydra's whole node is made to read it). Callers leave out plain
    values and sweeps: a key that only some of the sweep's methods have
    (`method=bsp_ps,wfbp_ps method.transport.engine_threads=4`) is checked job by job."""
    check_choices(overrides)
    return _composed(tuple(overrides), True)["hydra"]["sweeper"]


def sweep(overrides: list[str]) -> list[list[str]]:
    """Every job of a sweep: the main product, then each `hydra.sweeper.extra` product.

    Keys given in `overrides` win over both; duplicates are dropped.
    """
    jobs = expand(overrides)
    given = {o.split("=", 1)[0].lstrip("+~") for o in overrides}
    choices = [o.input_line for o in parse(overrides)
               if not o.is_sweep_override() and not is_plain(o)]
    for entry in _sweeper(choices).get("extra") or []:
        extra = [f"{k}={v}" for k, v in entry.items() if k not in given]
        jobs += expand([*overrides, *extra])
    return [list(job) for job in dict.fromkeys(map(tuple, jobs))]


def load(overrides: list[str], *, simulate: bool = False) -> DictConfig | Frozen:
    """Compose one job's config, apply the schema and check every rule.

    `simulate`: the job is only simulated (harness.simulate), so it may name a real
    network and an emulated cluster need not be makeable here; its config is Frozen.
    """
    return load_all([overrides], simulate=simulate)[0]


def load_all(jobs: list[list[str]], *, simulate: bool = False) -> list[DictConfig] | list[Frozen]:
    """`load` of every job, composing as little as possible (Hydra takes ~0.2 s a compose).

    Jobs of a sweep share a context (experiment, fixed overrides) and differ in group
    choices (model=..., method=...) and plain values (cluster.nodes=4). Each context is
    composed once, each group choice once within it (its subtree is spliced in), and
    plain values are set last, as Hydra sets them after composing. With `simulate` every
    job is a Frozen configuration: `_load_frozen`.
    """
    if simulate:
        return _load_frozen(jobs)
    composed: dict[tuple[str, ...], DictConfig] = {}

    def typed(overrides: tuple[str, ...]) -> DictConfig:
        if overrides not in composed:
            composed[overrides] = _typed(compose_raw(list(overrides)))
        return composed[overrides]

    out = []
    for job in jobs:
        parsed = parse(job)
        plain = [o for o in parsed if is_plain(o)]
        choices = [o for o in parsed if is_choice(o)]
        context = tuple(o.input_line for o in parsed if o not in plain and o not in choices)
        cfg = copy.deepcopy(typed(context))
        for o in choices:
            cfg[o.key_or_group] = typed((*context, o.input_line))[o.key_or_group]
        with _naming_job([o.input_line for o in choices], len(jobs) > 1):
            _set_plain(cfg, plain)
        validate(cfg, simulate=simulate)
        out.append(cfg)
    return out


@contextlib.contextmanager
def _naming_job(choices: list[str], sweep: bool) -> Iterator[None]:
    """A ConfigError inside names the sweep's job by its group choices (a key that only
    some of the swept methods have is refused for the jobs that lack it)."""
    try:
        yield
    except ConfigError as exc:
        if not sweep or not choices:
            raise
        raise ConfigError(f"{exc} (in the sweep's job {' '.join(choices)})") from None


def _set_plain(cfg: DictConfig, plain: list) -> None:
    """Set the plain values on `cfg`, typed by its schema."""
    for o in plain:
        if OmegaConf.select(cfg, o.key_or_group, default=_ABSENT) is _ABSENT:
            raise ConfigError(checks.unknown_key(o.key_or_group, cfg))
        _schema_errors(OmegaConf.update, cfg, o.key_or_group, o.value(), merge=False)


_ABSENT = object()


# -- a simulated sweep: Frozen configurations ---------------------------------------------

def _load_frozen(jobs: list[list[str]]) -> list[Frozen]:
    """Every job as a Frozen configuration, checked by every rule.

    Each distinct group choice is composed and typed once (and kept in the cache as
    data); a job is its group's tree with its plain values set, sharing every subtree it
    does not change, and the rules check each shared subtree once. A job whose plain
    values the schema alone cannot type (a key the tree lacks, an interpolation) loads
    as `load_all` loads a run's, then freezes.
    """
    groups: dict[tuple, Frozen] = {}
    checked: set = set()
    out = []
    for job in jobs:
        parse(job)  # Hydra's message for a list with a bad override
        kinds = [_kind(o) for o in job]
        plain = [o for o, kind in zip(job, kinds) if kind == "plain"]
        choices = tuple(o for o, kind in zip(job, kinds) if kind == "choice")
        context = tuple(o for o, kind in zip(job, kinds) if kind == "context")
        if (context, choices) not in groups:
            groups[context, choices] = _group_tree(context, choices)
        cfg = groups[context, choices]
        for override in plain:
            typed = _typed_value(override)
            if typed is None or select(cfg, typed[0], _ABSENT) is _ABSENT:
                with _naming_job(list(choices), len(jobs) > 1):
                    cfg = _frozen_slowly(context, choices, plain)
                break
            cfg = assign(cfg, *typed)
        cfg = as_simulated(cfg)
        validate(cfg, simulate=True, checked=checked)
        out.append(cfg)
    return out


@functools.lru_cache(maxsize=4096)
def _kind(override: str) -> str:
    """"plain", "choice" or "context" (everything else: the experiment, additions, ...)."""
    parsed = parse_one(override)
    return "plain" if is_plain(parsed) else "choice" if is_choice(parsed) else "context"


def _group_tree(context: tuple[str, ...], choices: tuple[str, ...]) -> Frozen:
    """The typed tree of `context` with each group choice's subtree spliced in."""
    tree = dict(_typed_tree(context))
    for choice in choices:
        group = choice.split("=", 1)[0]
        tree[group] = _typed_tree((*context, choice))[group]
    return freeze(tree)


@functools.lru_cache(maxsize=256)
def _typed_tree(overrides: tuple[str, ...]) -> dict:
    """`_typed(compose_raw(overrides))` as a container, kept in the cache (the typing takes
    ~60 ms) for as long as conf/, the schema, Hydra and omegaconf stay the same."""
    def typed() -> dict:
        return thaw(_typed(compose_raw(list(overrides))))

    return cache.cached("typed", list(overrides), typed,
                        sources=(("conf", "**/*.yaml"), ("harness/config", "schema.py")),
                        libraries=("hydra-core", "omegaconf"))


@functools.lru_cache(maxsize=4096)
def _typed_value(override: str) -> tuple[str, Any] | None:
    """(key, value) of a plain override as the schema types it (a typed field converted,
    ConfigError if it cannot be; a free-form key's value as given), or None where only
    the whole configuration can tell (a key below a null field, an interpolation)."""
    parsed = parse_one(override)
    key, value = parsed.key_or_group, parsed.value()
    if "${" in repr(value):
        return None
    kind = diagnose.schema_kind(key)
    if kind == "free":
        return key, value
    if kind != "typed":
        return None
    _schema_errors(OmegaConf.update, _scratch(), key, value, merge=False)
    return key, thaw(OmegaConf.select(_scratch(), key))


@functools.cache
def _scratch() -> DictConfig:
    """A typed configuration to convert plain values on (each conversion sets one field)."""
    return OmegaConf.structured(BenchConf)


def _frozen_slowly(context: tuple[str, ...], choices: tuple[str, ...], plain: list[str]
                   ) -> Frozen:
    """One job composed as a run's is (`load_all`'s own path), then frozen."""
    cfg = _typed(compose_raw(list(context)))
    for choice in choices:
        group = choice.split("=", 1)[0]
        cfg[group] = _typed(compose_raw([*context, choice]))[group]
    _set_plain(cfg, parse(plain))
    return freeze(thaw(cfg))


def _typed(cfg: DictConfig) -> DictConfig:
    """`cfg` typed by the schema, with every required value given (ConfigError else)."""
    typed = _schema_errors(OmegaConf.merge, OmegaConf.structured(BenchConf), cfg)
    diagnose.required(typed, choices)
    return typed


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


def from_json(text: str) -> DictConfig:
    import json

    return OmegaConf.merge(OmegaConf.structured(BenchConf), json.loads(text))
