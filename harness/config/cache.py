"""Results that depend only on their inputs, the library versions and the project files
they are made from (the model code in models/, the configs in conf/), kept as JSON under
$XDG_CACHE_HOME/ddlbench (or ~/.cache/ddlbench) between runs. A cache that cannot be
written is no error: the result is made again."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata
import json
import os
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout
MODELS = ("models", "*.py")  # the model code: an edit to it makes every model entry again
MODEL_LIBRARIES = ("torch", "transformers", "torchvision")


def directory() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ddlbench"


@functools.cache  # reading a package's metadata takes milliseconds; it stays put
def installed_version(dist: str) -> str | None:
    """An installed distribution's version, from its metadata (None: not installed)."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.lru_cache(maxsize=8)
def _digest(source: tuple[str, str]) -> str:
    """The content of the files `pattern` matches in the project folder `folder`
    (`source`: (folder, pattern))."""
    folder, pattern = source
    digest = hashlib.sha256()
    for path in sorted((ROOT / folder).glob(pattern)):
        digest.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def cached(kind: str, key: object, make: Callable[[], dict], *,
           sources: tuple[tuple[str, str], ...] = (MODELS,),
           libraries: tuple[str, ...] = MODEL_LIBRARIES) -> dict:
    """`make()`, or what it returned before for the same `kind`, `key` (JSON-able), files of
    `sources` (each a folder and a glob pattern) and versions of `libraries` (read from
    their installed metadata: nothing is imported)."""
    versions = {d: installed_version(d) for d in libraries}
    text = json.dumps([key, versions, [_digest(s) for s in sources]], sort_keys=True)
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
