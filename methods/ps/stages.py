"""The stage threads of a PS worker's pipeline, as BytePS's core loops (common/core_loops.cc):
one thread, one queue, one stream per stage; what each stage does is methods/ps/node.py
(the root path) and methods/ps/scatter.py (the scatter path).

A `Stage` runs its step on each item put to it (a unit, `_Exchange`, or one of its
partitions, `_Piece`), in the order put, on `threads` threads (1 but for the root's
pull waiters, which queue nothing on the GPU and share the stage's stream). Each thread
starts with the first item, on that item's device, and on a GPU on the stage's stream
(`side_stream(device, role)`: the copy stages on the host staging's way-out and way-back
streams); what a stage queues on the GPU is ordered
against other stages by events only, which items carry from one stage to the next.
After its first error a stage fails every later item with it (the unit's handle raises
it, naming the peer). `stop` lets every item put so far through, then joins the threads.

The stages of each path, as `harness.plan` prints them: methods/ps/stage_table.py.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

from methods.base import side_stream, start_thread


class Stage:
    """One stage of the pipeline (module docstring): `step(item)` on each item put."""

    def __init__(self, step: Callable[[Any], None], *, name: str, role: str,
                 threads: int = 1, trace: list | None = None) -> None:
        self.step, self.name, self.role, self.count = step, name, role, threads
        self.trace = trace  # tests: (stage, "start" | "end", key) appended as it runs
        self.items: queue.SimpleQueue = queue.SimpleQueue()
        self.error: BaseException | None = None
        self.threads: list[threading.Thread] = []
        self.lock = threading.Lock()

    def put(self, item: Any) -> None:
        """Queue `item` (anything with `staging`, `key` and `fail`)."""
        with self.lock:
            if not self.threads:
                device = item.staging.flat.device
                names = [self.name] if self.count == 1 else [f"{self.name}-{i}"
                                                             for i in range(self.count)]
                self.threads = [start_thread(self._run, name=n, device=device,
                                             stream=side_stream(device, self.role))
                                for n in names]
        self.items.put(item)

    def note(self, what: str, key: int) -> None:
        if self.trace is not None:
            self.trace.append((self.name, what, key))

    def _run(self) -> None:
        while (item := self.items.get()) is not None:
            with self.lock:
                error = self.error
            if error is None:
                try:
                    self.note("start", item.key)
                    done = self.step(item) or item  # the others' ps-pull: the one landed
                    self.note("end", done.key)
                    continue
                except BaseException as exc:  # noqa: BLE001 - handed to the item's waiter
                    with self.lock:
                        self.error = error = self.error or exc
            item.fail(error)

    def stop(self, timeout_s: float) -> None:
        """Finish every item put so far, then end the threads."""
        with self.lock:
            threads = list(self.threads)
        for _ in threads:
            self.items.put(None)
        for thread in threads:
            thread.join(timeout_s)
            if thread.is_alive():
                raise TimeoutError(f"the {thread.name} thread did not finish within "
                                   f"{timeout_s:g} s")
