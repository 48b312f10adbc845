"""What went wrong in a composition, said in the user's terms: the YAML file that does
not parse (Hydra's message names neither the file nor the line), and the required value
that a deleted group left without one."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import yaml
from omegaconf import DictConfig, OmegaConf

from harness.config.schema import ConfigError, first_line


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
