"""Overrides as users type them: Hydra's parse of each (cached), the first one that does
not parse named with a fix, group choices checked against conf/<group>/, and the kinds a
sweep's loader tells apart (a group choice, a plain value)."""

from __future__ import annotations

import difflib
import functools

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import OverrideType

from harness.config import diagnose
from harness.config.schema import CONF_DIR, GROUPS, ConfigError, first_line


def choices(group: str) -> list[str]:
    """The names users can type for a config group: the file stems in conf/<group>/."""
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


@functools.lru_cache(maxsize=4096)
def parse_one(override: str):
    """Hydra's parse of one override (about 1 ms: a sweep's jobs repeat the same few)."""
    return OverridesParser.create().parse_overrides([override])[0]


def parse(overrides: list[str]) -> list:
    """Hydra's parse of each override, deletions of keys every configuration has refused
    (diagnose.deleted); ConfigError names the first override that does not parse."""
    try:
        parsed = [parse_one(o) for o in overrides]
    except Exception:  # noqa: BLE001 - a bad one: named below, with Hydra's message
        raise ConfigError(unparsable(overrides)) from None
    for ov in parsed:
        if ov.type == OverrideType.DEL and ov.package is None:
            diagnose.deleted(ov.input_line, ov.key_or_group, choices)
    return parsed


def unparsable(overrides: list[str]) -> str:
    """The message for the first override Hydra cannot parse: only that one, and where it
    follows a text value, the hint that the shell split a value with a space in it."""
    for i, override in enumerate(overrides):
        try:
            parse_one(override)
            continue
        except Exception as exc:  # noqa: BLE001 - Hydra's parse errors become one line
            error = first_line(exc, type(exc).__name__)
        if repr(override) not in error:
            error = f"cannot parse {override!r}: {error}"
        before = parse_one(overrides[i - 1]) if i and "=" in overrides[i - 1] else None
        if "=" not in override and before is not None and isinstance(before.value(), str) \
                and before.key_or_group not in GROUPS:  # `key=a b`: a value with a space
            return (f"{error}; if {override!r} belongs to "
                    f"{before.input_line}, quote the value with its spaces: "
                    f"'{before.input_line} {override}'")
        fix = "" if "=" in override else "; give key=value overrides (a list: --help)"
        return f"{error}{fix}"
    return f"cannot parse overrides {overrides}"


def check_choices(overrides: list[str]) -> None:
    for ov in parse(overrides):
        key = ov.key_or_group
        if key.startswith(("hydra/launcher", "hydra.launcher")):
            raise ConfigError(f"{ov.input_line}: Hydra's launchers are not used; sweeps go to "
                              "Slurm with python -m harness.submit (job arrays, resumable, "
                              "one failed row per failure)")
        if key not in GROUPS:
            continue
        values = list(ov.sweep_string_iterator()) if ov.is_sweep_override() else [ov.value()]
        for value in values:
            if value is not None and str(value) not in choices(key):
                close = difflib.get_close_matches(str(value), choices(key), n=1, cutoff=0.6)
                hint = f"did you mean {close[0]}? " if close else ""
                raise ConfigError(f"{key} {str(value)!r} is unknown; {hint}"
                                  f"choose one of: {', '.join(choices(key))}")


def is_choice(override) -> bool:
    """`group=option` for a group whose option fills one subtree (not the experiment)."""
    return (override.type == OverrideType.CHANGE and override.package is None
            and not override.is_sweep_override()
            and override.key_or_group in GROUPS and override.key_or_group != "experiment")


def is_plain(override) -> bool:
    """`key=value` on a key of the config (not a group choice, sweep, addition or deletion)."""
    return (override.type == OverrideType.CHANGE and override.package is None
            and not override.is_sweep_override() and "/" not in override.key_or_group
            and override.key_or_group not in GROUPS
            and override.key_or_group.split(".")[0] != "hydra")
