"""Read-only configurations for the simulator: plain nested dicts that read as attributes.

A DictConfig takes about 25 us per attribute read and milliseconds per copy; a simulated
sweep of thousands of configurations reads and copies far too often for that. A
`Frozen` is the container of a validated DictConfig (`OmegaConf.to_container`) whose
keys also read as attributes (`cfg.cluster.nodes`, `cfg.method.get("cycle_s")`), so the
code that reads a DictConfig reads it too. `assign` makes a job's configuration from
its group's by copying only the path to the changed key: the jobs of a sweep share every
other subtree, so none may be changed (mappings refuse; lists are shared as they are).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, TypeAlias

from omegaconf import DictConfig, ListConfig, OmegaConf


class Frozen(dict):
    """A read-only mapping whose keys read as attributes too (a DictConfig's interface)."""

    __slots__ = ()

    def __getattr__(self, key: str) -> Any:
        try:
            return self[key]
        except KeyError:
            raise AttributeError(f"the configuration has no key {key!r}") from None

    def _read_only(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("a simulated sweep's configuration is read-only (its jobs share it)")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = _read_only
    __ior__ = _read_only

    def __reduce__(self) -> tuple:  # pickle and copy: rebuilt from its container
        return freeze, (thaw(self),)


Config: TypeAlias = "DictConfig | Frozen"  # what validation and the simulator read


def freeze(tree: Any) -> Any:
    """`tree` (a container: dicts, lists, scalars) with every dict made Frozen."""
    if isinstance(tree, Mapping):
        return Frozen({k: freeze(v) for k, v in tree.items()})
    if isinstance(tree, list):
        return [freeze(v) for v in tree]
    return tree


def thaw(node: Any) -> Any:
    """A plain container (dicts, lists, scalars) of a configuration node of either kind."""
    if isinstance(node, (DictConfig, ListConfig)):
        return OmegaConf.to_container(node, resolve=True)
    if isinstance(node, Mapping):
        return {k: thaw(v) for k, v in node.items()}
    if isinstance(node, list):
        return [thaw(v) for v in node]
    return node


def assign(cfg: Frozen, key: str, value: Any) -> Frozen:
    """`cfg` with the dotted `key` set to `value`: the path to it copied, the rest shared."""
    head, _, rest = key.partition(".")
    new = dict(cfg)
    new[head] = assign(cfg[head], rest, value) if rest else freeze(value)
    return Frozen(new)


def select(cfg: Config, key: str, default: Any = None) -> Any:
    """The value at the dotted `key` of `cfg` (of either kind), `default` if there is none."""
    if not isinstance(cfg, Frozen):  # (checked first: isinstance of a DictConfig is slow)
        return OmegaConf.select(cfg, key, default=default)
    node: Any = cfg
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node


def to_json(cfg: Config) -> str:
    """The configuration as sorted JSON (a result row's `config_json`)."""
    return json.dumps(cfg if isinstance(cfg, Frozen) else thaw(cfg), sort_keys=True)


def leaves(tree: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """Every leaf of a tree of dicts and lists as (dotted key, value)."""
    if isinstance(tree, dict):
        return [leaf for k, v in tree.items() for leaf in leaves(v, f"{prefix}{k}.")]
    if isinstance(tree, list):
        return [leaf for i, v in enumerate(tree) for leaf in leaves(v, f"{prefix}{i}.")]
    return [(prefix.rstrip("."), tree)]
