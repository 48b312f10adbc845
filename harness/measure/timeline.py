"""run.trace: a training iteration of each repeat as a Chrome/Perfetto trace, measured.

After the timed window (never inside it) every worker runs two more iterations: a
lead-in, which starts from the drained method the window left, and the traced one, in
steady state (communication of the lead-in may still be in flight when it starts).
Rank 0 and the repeat's slowest rank record both under torch.profiler and add the
harness's own lanes, aligned with the profiler's events by a `ddlbench:trace` range:

- compute: each iteration and its phases (forward, backward, synchronize, update) on
  the training thread's host clock, with the method's blocking waits inside them (a
  ByteScheduler forward waiting for its layer's update; run.method_host=true). On a GPU
  the profiler's own device lanes show when the kernels ran.
- comm: each communication unit from its issue to its real completion (a watcher
  thread polls the handle's `finished()`), named as the plan names it: unit index, its
  tensors (count, first and last), bytes.

The file is `<results_dir>/traces/<run_id>_r<repeat>_rank<rank>.trace.json`, in the
format of harness/measure/traces.py, which the simulator's prediction of the same
configuration shares (harness/predict/timeline.py).
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from harness.measure import traces
from harness.measure.timing import Clock
from harness.measure.traces import COMM, COMPUTE
from methods.base import side_stream, start_thread

HOST = torch.device("cpu")  # a Clock of it reads perf_counter, on every device
MARKER = "ddlbench:trace"
MIN_WAIT_S = 10e-6  # shorter waits (a gate whose update was already in) are not drawn
WATCH_S = 20e-6  # between two polls of the pending units' handles


class _Units:
    """Stamps every unit the transport starts, and (from a watcher thread) when it is done."""

    def __init__(self, method: Any, device: torch.device) -> None:
        self.transport = getattr(method, "transport", None)  # None: DDP keeps its buckets
        self.units = getattr(method, "units", [])
        buffer = getattr(method, "buffer", None)
        self.names = buffer.names if buffer is not None else []
        self.events: list[dict] = []  # finished units: issue, done, args
        self.pending: list[tuple[Any, float, dict]] = []
        self.lock = threading.Lock()
        self.woken = threading.Condition(self.lock)  # a unit started, or the end
        self.stop = threading.Event()
        self.watcher = None
        if self.transport is not None:
            self.issue = self.transport.start
            self.transport.start = self._start  # shadows the method for these iterations
            self.watcher = start_thread(self._watch, name="ddlbench-trace-watcher",
                                        device=device,
                                        stream=side_stream(device, "trace-watcher"))

    def _start(self, chunk: torch.Tensor, *, key: int):
        issued = time.perf_counter()
        handle = self.issue(chunk, key=key)
        unit = self.units[key] if key < len(self.units) else None
        args = {"unit": key, "bytes": chunk.numel() * chunk.element_size()}
        if unit is not None:
            args.update(tensors=len(unit.params), first=self.names[unit.params[0]],
                        last=self.names[unit.params[-1]],
                        merged_with_next=chunk.numel() > unit.numel)
        with self.lock:
            self.pending.append((handle, issued, args))
            self.woken.notify()
        return handle

    def _watch(self) -> None:
        """Poll the pending units' handles every WATCH_S; with none pending, wait until a
        unit starts or the trace ends."""
        while True:
            with self.lock:
                while not self.pending and not self.stop.is_set():
                    self.woken.wait()
                stopping = self.stop.is_set()
                pending = list(self.pending)
            now = time.perf_counter()
            for item in pending:
                handle, issued, args = item
                try:
                    done = handle.finished()
                except Exception:  # noqa: BLE001 - a failed unit is over; its owner raises
                    done = True
                if done or stopping:
                    if not done:
                        args["unfinished"] = True
                    self.events.append({"issue": issued, "done": now, "args": args})
                    with self.lock:
                        self.pending.remove(item)
            if stopping:
                return
            time.sleep(WATCH_S)

    def close(self, timeout_s: float) -> None:
        if self.transport is not None:
            del self.transport.start
            with self.lock:
                self.stop.set()
                self.woken.notify()
            self.watcher.join(timeout_s)


def record(iteration: Callable[[Clock], None], *, method: Any, device: torch.device,
           profile: bool, timeout_s: float) -> dict | None:
    """Run the lead-in and the traced iteration (`iteration(clock)` marks a host clock
    after forward, backward and synchronize); on a rank that `profile`s, return the
    merged trace, else None."""
    spans: list[list[float]] = []  # per iteration, host times: start, phases' ends, end

    def lead_in_and_traced() -> None:
        for _ in range(2):
            clock = Clock(HOST)
            clock.mark()
            iteration(clock)
            clock.mark()
            spans.append(clock.moments)
        method.drain()

    if not profile:
        lead_in_and_traced()
        return None
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    else:  # no "gpuGetDeviceCount failed" on stderr: no GPU is what a CPU run expects
        os.environ.setdefault("KINETO_LOG_LEVEL", "5")
    units = _Units(method, device)
    waits: list[tuple[str, float, float]] = []
    method.meter.log = waits
    try:
        with torch.profiler.profile(activities=activities) as prof:
            with torch.profiler.record_function(MARKER):
                origin = time.perf_counter()
                lead_in_and_traced()
    finally:
        method.meter.log = None
        units.close(timeout_s)
    with tempfile.TemporaryDirectory() as tmp:
        prof.export_chrome_trace(f"{tmp}/trace.json")
        trace = json.loads(Path(f"{tmp}/trace.json").read_text())
    base = next(e["ts"] for e in trace["traceEvents"] if e.get("name") == MARKER)
    events = lanes(spans, waits, units.events, us=lambda t: base + (t - origin) * 1e6)
    trace["traceEvents"].extend(events)
    trace["ddlbench"] = {"traced_us": [base + (spans[-1][0] - origin) * 1e6,
                                       base + (spans[-1][-1] - origin) * 1e6]}
    return trace


PHASES = ("forward", "backward", "synchronize", "update")
WAITS = {"wait_for_updates": "update", "drain": "drain"}  # HostMeter.wait's fn names; else


def lanes(spans: list[list[float]], waits: list, units: list[dict], *,
          us: Callable[[float], float]) -> list[dict]:
    """The harness's events: per iteration its phases (`spans`: host times at its start,
    after each phase, at its end), the waits, the units (traces.py's lanes)."""
    events = [traces.meta("process_name", 0, "ddlbench (host clock)"),
              traces.meta("thread_name", COMPUTE, "compute"),
              traces.meta("thread_name", COMM, "comm")]
    for i, marks in enumerate(spans):
        label = "traced iteration" if i == len(spans) - 1 else "lead-in iteration"
        events.append(traces.span(label, us(marks[0]), us(marks[-1])))
        events += [traces.span(name, us(a), us(b)) for name, a, b in zip(PHASES, marks, marks[1:])]
    events += [traces.span(f"wait: {WAITS.get(name, 'communication')}", us(a), us(b))
               for name, a, b in waits if b - a >= MIN_WAIT_S]
    for n, u in enumerate(sorted(units, key=lambda u: u["issue"])):
        args = dict(u["args"])
        events += traces.unit(n, args.pop("unit"), us(u["issue"]), us(u["done"]), args)
    return events
