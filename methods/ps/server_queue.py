"""A parameter server's engine threads as BytePS v0.2.3 ran them (byteps/server/server.cc,
server.h, queue.h): which thread sums a key, and in what order each thread's queue serves.

- **Binding** (`ThreadBinding`, server.h GetThreadID): every engine thread has a queue of
  its own; a key is bound, the first time one of its pushes is seen, to the thread with
  the fewest bytes bound so far (the lowest index on ties), and stays there. The study ran
  8 threads (BYTEPS_SERVER_ENGINE_THREAD=8; BytePS's default is 4).
- **Order** (`EngineQueue`, queue.h PriorityQueue): FIFO, or with scheduling
  (BYTEPS_SERVER_ENABLE_SCHEDULE) a binary heap under ComparePriority: the message whose
  key has the FEWEST pushes counted goes first, the oldest (message id) on ties. A key's
  count grows on every `put`, is never decremented when served, and is set back to 0 by
  `clear_count` as soon as the key's LAST push arrives (server.cc, right after queueing
  its COPY_MERGED), before its sums run. The heap is not rebuilt when counts change: it is
  libstdc++'s push_heap / pop_heap, written out below, over a comparator whose values move
  under it, so the element on top stays on top until popped. This is what BytePS serves,
  not an idealised sorted order.

Torch-free, so the simulator (harness/predict/network.py) binds keys by the same rule.
"""

from __future__ import annotations

import collections
import itertools
import threading
from typing import Any


class ThreadBinding:
    """GetThreadID: key -> engine thread, the thread with the fewest bytes bound so far."""

    __slots__ = ("load", "thread_of")

    def __init__(self, threads: int) -> None:
        if threads < 1:
            raise ValueError(f"engine_threads={threads} is invalid; it must be >= 1")
        self.load = [0] * threads  # BytePS's acc_load_: bytes of the keys bound to each
        self.thread_of: dict[int, int] = {}

    def bind(self, key: int, nbytes: int) -> int:
        """The thread of `key`, binding it on first sight (`nbytes`: one push's size)."""
        thread = self.thread_of.get(key)
        if thread is None:
            thread = self.thread_of[key] = self.bind_new([nbytes])[0]
        return thread

    def bind_new(self, sizes: list[int]) -> list[int]:
        """The threads of new keys of `sizes` bytes, bound in this order (the rule itself)."""
        load, out = self.load, []
        for nbytes in sizes:
            thread = load.index(min(load))  # the lowest index on ties
            load[thread] += nbytes
            out.append(thread)
        return out


class EngineQueue:
    """One engine thread's queue of messages, each (key, item): FIFO, or for messages put
    with `schedule` BytePS's heap (module docstring). `get` waits for the next one."""

    def __init__(self) -> None:
        self.items: list[tuple[int, int, Any, bool]] = []  # (id, key, item, schedule)
        self.counted: collections.Counter = collections.Counter()  # push_cnt_ per key
        self.ids = itertools.count()  # BytePS's message id (timestamp_): arrival order
        self.cond = threading.Condition()

    def put(self, key: int, item: Any, *, schedule: bool = False) -> None:
        """queue.h Push: append; with `schedule` count the key, then push_heap."""
        with self.cond:
            self.items.append((next(self.ids), key, item, schedule))
            if schedule:
                self.counted[key] += 1
                self._sift_up(len(self.items) - 1, 0, self.items[-1])
            self.cond.notify()

    def clear_count(self, key: int) -> None:
        """queue.h ClearCounter: `key`'s last push arrived; its count starts again at 0."""
        with self.cond:
            self.counted.pop(key, None)

    def get(self, timeout_s: float | None = None) -> Any:
        """queue.h WaitAndPop: the next item (None after `timeout_s` with nothing queued)."""
        with self.cond:
            if not self.cond.wait_for(lambda: self.items, timeout_s):
                return None
            if not self.items[0][3]:
                return self.items.pop(0)[2]
            self._pop_heap()
            return self.items.pop()[2]

    # -- libstdc++'s heap (bits/stl_heap.h), the comparator read at every step ------------

    def _less(self, a: tuple, b: tuple) -> bool:
        """ComparePriority(a, b): `a` ranks below `b` (the heap's top ranks highest)."""
        ca, cb = self.counted[a[1]], self.counted[b[1]]
        return a[0] > b[0] if ca == cb else ca > cb

    def _sift_up(self, hole: int, top: int, value: tuple) -> None:
        """std::__push_heap: move `value` up from `hole` while its parent ranks below it."""
        items = self.items
        parent = (hole - 1) // 2
        while hole > top and self._less(items[parent], value):
            items[hole] = items[parent]
            hole, parent = parent, (parent - 1) // 2
        items[hole] = value

    def _pop_heap(self) -> None:
        """std::pop_heap: the top to the back, the old back sifted in from the top."""
        items, length = self.items, len(self.items) - 1
        if length < 1:
            return
        value, items[length] = items[length], items[0]
        hole = child = 0  # std::__adjust_heap over [0, length)
        while child < (length - 1) // 2:
            child = 2 * (child + 1)
            if self._less(items[child], items[child - 1]):
                child -= 1
            items[hole], hole = items[child], child
        if length % 2 == 0 and child == (length - 2) // 2:
            child = 2 * (child + 1)
            items[hole], hole = items[child - 1], child - 1
        self._sift_up(hole, 0, value)
