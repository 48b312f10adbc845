"""Results that depend only on a model's configuration, the library versions and the
model code (models/), kept as JSON under $XDG_CACHE_HOME/ddlbench (or ~/.cache/ddlbench)
between runs. A cache that cannot be written is no error: the result is made again."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata
import json
import os
from collections.abc import Callable
from pathlib import Path

MODELS = Path(__file__).resolve().parent.parent / "models"


def directory() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ddlbench"


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.lru_cache(maxsize=1)
def _models_digest() -> str:
    """The model code's content: an edit to models/ makes every entry again."""
    digest = hashlib.sha256()
    for path in sorted(MODELS.glob("*.py")):
        digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()


def cached(kind: str, key: object, make: Callable[[], dict]) -> dict:
    """`make()`, or what it returned before for the same `kind`, `key` (JSON-able), model
    code and versions of torch, transformers and torchvision."""
    versions = {d: _version(d) for d in ("torch", "transformers", "torchvision")}
    text = json.dumps([key, versions, _models_digest()], sort_keys=True)
    path = directory() / f"{kind}-{hashlib.sha256(text.encode()).hexdigest()[:16]}.json"
    if path.exists():
        try:
            return json.loads(path.read_text())
        except ValueError:  # a torn file from a killed writer: make it again
            pass
    data = make()
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(data))
        tmp.replace(path)
    except OSError:  # read-only or full: next time it is made again
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
    return data
