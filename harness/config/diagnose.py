"""What went wrong in a composition, said in the user's terms: the YAML file that does
not parse (Hydra's message names neither the file nor the line), the required value
that a deleted group left without one, and a deleted key the schema would silently put
back; and what the schema makes of a key (`schema_kind`)."""

from __future__ import annotations

import dataclasses
import functools
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf

from harness.config.schema import GROUPS, BenchConf, ConfigError, first_line


def is_yaml_error(exc: BaseException | None) -> bool:
    while exc is not None:
        if isinstance(exc, yaml.YAMLError):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def broken_yaml(conf_dir: Path) -> str | None:
    """Which file of conf/ YAML cannot parse, where, and why (Hydra's error names neither
    file nor line); None if every file parses."""
    for path in sorted(conf_dir.rglob("*.yaml")):
        try:
            yaml.safe_load(path.read_text())
        except yaml.MarkedYAMLError as err:
            mark = err.problem_mark
            where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            return (f"{path.relative_to(conf_dir.parent)}{where}: {err.problem or err}"
                    f" ({err.context or 'not valid YAML'}); fix that file")
        except (yaml.YAMLError, OSError) as err:
            return f"{path.relative_to(conf_dir.parent)}: {first_line(err, type(err).__name__)}"
    return None


def required(cfg: DictConfig, choices: Callable[[str], list[str]]) -> None:
    """ConfigError naming the first required key of `cfg` left without a value (`~model`
    deletes the group that gives it) and the choices that would give it one."""
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        key = missing[0]
        group = key.split(".")[0]
        names = choices(group)
        fix = (f"choose one: {group}=<{' | '.join(names)}>" if names
               else f"give it: {key}=<value>")
        raise ConfigError(f"{key} has no value, and it is required (was {group} deleted with "
                          f"~{group}?); {fix}")


def deleted(override: str, key: str, choices: Callable[[str], list[str]]) -> None:
    """ConfigError for `override`, a deletion (`~key`), when `key` is one every configuration
    has: the schema would put its default back without a word (`~run.seed` ran with seed 0).
    Deleting `~model` or `~method` is left to `required`, which names what is missing."""
    if key in ("model", "method", "experiment") or schema_kind(key) != "typed":
        return
    if key in GROUPS:
        names = " | ".join(choices(key))
        raise ConfigError(f"{override}: every configuration needs a {key}; drop {override}, "
                          f"or choose one: {key}=<{names}>")
    section = isinstance(OmegaConf.select(OmegaConf.structured(BenchConf), key), DictConfig)
    what = f"set its keys instead ({key}.<key>=<value>)" if section else f"set it: {key}=<value>"
    raise ConfigError(f"{override}: {key} is required, and deleting it would silently put back "
                      f"its default; drop {override}, or {what}")


def schema_kind(key: str) -> str:
    """"typed": a field of the schema's dataclasses (or a whole free-form mapping);
    "free": a key inside a free-form mapping (model.build, method.*, network,
    simulate.gpus), whose value is kept as given; "unknown": anything else (a key below a
    field that is null by default, or none of the schema's)."""
    node: Any = BenchConf
    parts = key.split(".")
    for i, part in enumerate(parts):
        hint = _hints(node).get(part)
        last = i == len(parts) - 1
        if hint is None:
            return "unknown"
        if last:
            return "typed"
        if typing.get_origin(hint) is dict:
            return "free"
        if not dataclasses.is_dataclass(hint):
            return "unknown"
        node = hint
    return "unknown"


@functools.cache
def _hints(dataclass: type) -> dict[str, Any]:
    return typing.get_type_hints(dataclass) if dataclasses.is_dataclass(dataclass) else {}
