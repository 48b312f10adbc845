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

STAGES lists the stages of each path for `harness.plan` (`stage_lines`).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

from methods.base import side_stream, start_thread

PULL_WAITERS = 8  # the root's pulls waited on at once: they land in any order within these
ORDERS = {"scatter": "ps-reduce's partition order and the root's landing order",
          "root": "ps-reduce's unit order, ps-broadcast in unit order"}
# (thread, what it runs per item, who runs it); the order of a partition's way through
STAGES = {
    "scatter": [
        ("ps-reduce", "per partition: reduce-scatter in the node (leftover: reduce to root)",
         "every worker"),
        ("ps-copy-out", "per partition: own slice -> the node's shared host buffer",
         "every worker"),
        ("ps-push", "per partition: slices there? push it, post its pull (others: tell root)",
         "root / others"),
        ("ps-pull", "per partition, as each completes: the pull lands (others: root's word)",
         "root: PULL_WAITERS threads / others: one"),
        ("ps-copy-in", "per partition, in landing order: own slice <- shared buffer",
         "every worker"),
        ("ps-gather", "per partition, in landing order: all-gather (leftover: broadcast)",
         "every worker"),
    ],
    "root": [
        ("ps-reduce", "per unit: reduce to the node's root", "every worker"),
        ("ps-copy-out", "per unit: device -> pinned host mirror (CPU: none)", "root"),
        ("ps-push", "per server: header; per partition: push, post its pull", "root"),
        ("ps-pull", "per partition, as each completes: the pull lands",
         "root: PULL_WAITERS threads"),
        ("ps-copy-in", "per partition, in landing order: host -> device", "root"),
        ("ps-broadcast", "per unit, in unit order: broadcast from the root", "every worker"),
    ],
}


def stage_lines(node_reduce: str, per_node: int) -> list[str]:
    """The stages a PS worker runs (`harness.plan`): thread, work per item, who runs it."""
    path = node_reduce if per_node > 1 else "root"
    rows = [(t, w, "every worker" if per_node == 1 else who) for t, w, who in STAGES[path]]
    if per_node == 1:  # a node of one worker: no collective, it is its own root
        rows = [(t, w.replace("reduce to the node's root", "wait for the gradients")
                 .replace("broadcast from the root", "the unit has landed"), who)
                for t, w, who in rows]
    rows = [(t, w, who.replace("PULL_WAITERS", str(PULL_WAITERS))) for t, w, who in rows]
    head = f"PS pipeline ({path} path, {per_node} worker(s) a node), a thread per stage:"
    order = [f"  the node's collectives go in the root's order: {ORDERS[path]}"] \
        if per_node > 1 else []
    return [head] + [f"  {t:<13} {w}  [{who}]" for t, w, who in rows] + order


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
