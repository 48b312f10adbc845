"""Random per-rank delays in gradient hooks: how tests shake the timing of ranks."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any


class HookDelay:
    """Sleep a random 0..max_s seconds per call (0 = off), reproducible per (seed, rank)."""

    __slots__ = ("max_s", "rng")

    def __init__(self, max_s: float, *, seed: int, rank: int) -> None:
        if max_s < 0:
            raise ValueError(f"scheduler hook_delay_s={max_s} is invalid; it must be >= 0")
        self.max_s = max_s
        self.rng = random.Random(seed * 1_000_003 + rank)

    def __call__(self) -> None:
        if self.max_s:
            time.sleep(self.rng.uniform(0.0, self.max_s))

    def wrap(self, hook: Callable[..., Any]) -> Callable[..., Any]:
        """`hook` itself when off (nothing added to a call), else `hook` after the delay."""
        if not self.max_s:
            return hook

        def delayed(*args: Any) -> Any:
            self()
            return hook(*args)
        return delayed
