"""Results that depend only on a model's configuration and the library versions, kept
as JSON under $XDG_CACHE_HOME/ddlbench (or ~/.cache/ddlbench) between runs."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
from collections.abc import Callable
from pathlib import Path


def directory() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ddlbench"


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def cached(kind: str, key: object, make: Callable[[], dict]) -> dict:
    """`make()`, or what it returned before for the same `kind`, `key` (JSON-able) and
    versions of torch, transformers and torchvision."""
    versions = {d: _version(d) for d in ("torch", "transformers", "torchvision")}
    text = json.dumps([key, versions], sort_keys=True)
    path = directory() / f"{kind}-{hashlib.sha256(text.encode()).hexdigest()[:16]}.json"
    if path.exists():
        try:
            return json.loads(path.read_text())
        except ValueError:  # a torn file from a killed writer: make it again
            pass
    data = make()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)
    return data
