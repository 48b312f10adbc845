"""Output paths, checked before anything starts: never made here, never the current folder
by accident, never through a symbolic link to nothing. `config.validate` checks
results_dir; commands with outputs of their own (report's out_dir, submit's jobs_dir,
methodbench's --results-dir, plan's --json) call these before they start. And the input
files the project carries, by short name (`reference=study`)."""

from __future__ import annotations

import os
from pathlib import Path

from harness.config.schema import CONF_DIR, ConfigError

# files of the project a user names by a short name: the study's published numbers
NAMED = {"study": CONF_DIR / "reference" / "shi2020_ib100.csv"}


def named_file(value: str | os.PathLike) -> str:
    """`value` as a path: a short name of NAMED is the project's file, anything else a
    path as given."""
    return str(NAMED.get(str(value), value))


def output_dir(key: str, path: str | os.PathLike, *, example: str = "results") -> None:
    """`path` can take output: a writable directory, or one the nearest existing ancestor
    (a writable directory) can hold. Creates nothing. An empty path is refused: it would
    mean the current folder, and results would be scattered there."""
    if path is None or not str(path).strip():
        shown = f"{key} {example}" if key.startswith("--") else f"{key}={example}"
        raise ConfigError(f"{key} is empty; give a folder to write to (e.g. {shown})")
    full = Path(os.path.abspath(path))
    existing = _nearest(f"{key}={path}", full)
    if not existing.is_dir():
        where = "is a file" if existing == full else f"cannot be made: {existing} is a file"
        raise ConfigError(f"{key}={path} {where}; choose another {key}")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{key}={path} is not writable ({existing} is read-only here); "
                          f"choose another {key}")


def output_file(flag: str, path: str | os.PathLike) -> None:
    """`path` can be written as a file: no folder, and the nearest existing path above it a
    writable folder (the folders between are made when it is written)."""
    full = Path(os.path.abspath(path))
    existing = _nearest(f"{flag} {path}", full)
    if existing == full and full.is_dir():
        raise ConfigError(f"{flag} {path} is a folder; give a file name, e.g. "
                          f"{flag} {Path(path) / 'plan.json'}")
    folder = full.parent if existing == full else existing  # the file's, or the nearest above
    if not folder.is_dir() or not os.access(folder, os.W_OK | os.X_OK):
        why = "a file" if not folder.is_dir() else "read-only here"
        raise ConfigError(f"{flag} {path} cannot be written: {folder} is {why}; give "
                          "another file name")


def _nearest(given: str, full: Path) -> Path:
    """The nearest path of `full` and its parents that exists (a link included)."""
    existing = next(p for p in (full, *full.parents) if os.path.lexists(p))
    if existing.is_symlink() and not existing.exists():  # dangling, or a loop
        raise ConfigError(f"{given}: {existing} is a symbolic link to nothing (or to itself); "
                          "remove it or choose another path")
    return existing
