"""Progress of long work with an estimate of the time left, drawn by tqdm.

On a terminal `Progress` is tqdm's bar (shown once the work has taken `delay_s`, cleared
when done). Anywhere else (Slurm logs, CI, pipes) it is a plain line, with no control
characters, at most every `every_s` seconds. `line` formats one plain line, for work whose
steps print lines of their own (the jobs of a sweep, methodbench's runs).

The cost is an `update` per step: under a microsecond (a clock read and a comparison)
between draws, far under 0.1% of any timed iteration (tests/test_progress.py measures it).
"""

from __future__ import annotations

import sys
import time
from typing import IO

from tqdm import tqdm

FORMAT = "{desc}: {n_fmt}/{total_fmt} {unit} [{elapsed} elapsed, ~{remaining} left]"


def line(desc: str, done: int, total: int, elapsed_s: float, unit: str = "") -> str:
    """`desc: 3/8 jobs [01:12 elapsed, ~02:00 left]`: the time left at the mean rate so
    far ('?' before the first step is done)."""
    return tqdm.format_meter(done, total, elapsed_s, prefix=desc, unit=unit,
                             bar_format=FORMAT)


class Progress:
    """`total` steps of `desc`; `update()` after each, `close()` at the end (or `with`)."""

    def __init__(self, total: int, desc: str, *, unit: str = "", file: IO[str] | None = None,
                 delay_s: float = 0.0, every_s: float = 30.0) -> None:
        self.file = sys.stderr if file is None else file
        self.total, self.desc, self.unit, self.every_s = total, desc, unit, every_s
        self.done = 0
        self.start = time.perf_counter()
        self.next = self.start + max(delay_s, every_s)
        self.bar = None
        if _isatty(self.file):
            self.bar = tqdm(total=total, desc=desc, unit=f" {unit}" if unit else "it",
                            file=self.file, delay=delay_s, leave=False, dynamic_ncols=True)

    def update(self, n: int = 1) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
            return
        now = time.perf_counter()
        if now >= self.next and self.done < self.total:
            self.next = now + self.every_s
            print(line(self.desc, self.done, self.total, now - self.start, self.unit),
                  file=self.file, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _isatty(file: IO[str]) -> bool:
    try:
        return file.isatty()
    except (AttributeError, ValueError):  # no isatty, or closed
        return False
