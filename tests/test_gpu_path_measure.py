"""The measurement's GPU path through its CPU twins (issue 28): the timed window opens with
the device idle on every rank at once, and the microbenchmark times the network between
two nodes, with the link inside a node apart. Issue 38: the simulator's measured profile
runs process k on GPU k, is refused where the GPUs are too few, and times a GPU by events
read once the last iteration is queued (GPU checklist step 14); the trace watcher waits on
a condition while nothing is pending.
"""

from __future__ import annotations

import queue
import threading
import time

import pandas as pd
import pytest
import torch
from torch import nn

from harness import config
from harness.measure import microbench, timing
from harness.predict import trace
from tests.conftest import run_main, run_module


def test_the_window_synchronizes_then_meets_at_the_barrier_then_reads_the_clock(
        monkeypatch) -> None:
    log: list[str] = []
    monkeypatch.setattr(timing, "device_sync", lambda device: log.append("synchronize"))
    monkeypatch.setattr(timing.dist, "barrier", lambda group=None: log.append("barrier"))
    clock = timing.time.perf_counter
    monkeypatch.setattr(timing.time, "perf_counter", lambda: log.append("clock") or clock())
    window = timing.timed_window(lambda c: log.append("step"), iters=2,
                                 drain=lambda: log.append("drain"), device=torch.device("cpu"))
    # the start: own device idle, then everyone, then the clock; the end: drained, idle
    assert log[:3] == ["synchronize", "barrier", "clock"]
    assert log[log.index("drain"):] == ["drain", "clock", "synchronize", "clock"]
    assert window.seconds > 0 and len(window.iter_times) == 2


@pytest.mark.parametrize("nodes, per_node, links", [
    (2, 4, {"p2p": (0, 4), "p2p_intra": (0, 1)}),  # rank 0 and 1 share node 0
    (3, 1, {"p2p": (0, 1)}),
    (1, 2, {"p2p": (0, 1)}),  # one node: its only link
    (1, 1, {}),
])
def test_the_network_is_timed_between_nodes_and_the_node_link_apart(nodes, per_node,
                                                                    links) -> None:
    assert microbench.pairs(nodes=nodes, workers_per_node=per_node) == links


def test_microbench_times_both_links_of_two_nodes_of_two(results_dir) -> None:
    out = run_module("harness.microbench", "cluster.nodes=2", "cluster.workers_per_node=2",
                     "cluster.device=cpu", "microbench.min_bytes=1024",
                     "microbench.max_bytes=4096", "microbench.repeats=2", "run.force=true",
                     f"results_dir={results_dir}", timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    frame = pd.read_parquet(next((results_dir / "microbench").glob("*.parquet")))
    # the link between the nodes (ranks 0 and 2), the one inside a node (0 and 1), and the
    # PS wire over the link between the nodes (host tensors, cluster.ps_wire: gloo here)
    assert sorted(set(zip(frame.kind, frame.ranks))) == [
        ("allreduce", "all"), ("p2p", "0-2"), ("p2p_intra", "0-1"), ("wire", "0-2")]
    assert (frame.seconds > 0).all() and set(frame.ps_wire) == {"gloo"}


# -- issue 38: the measured profile's GPUs and clock, the trace watcher ----------------------


class _Event:
    """torch.cuda.Event on a host without GPUs: the clock when recorded; readable once an
    event recorded no earlier has been waited for (they share one stream)."""

    made, waited, until, made_at_first_wait = 0, 0, -1.0, None

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        _Event.made += 1
        self.at = None

    def record(self) -> None:
        self.at = time.perf_counter()

    def synchronize(self) -> None:
        if _Event.made_at_first_wait is None:
            _Event.made_at_first_wait = _Event.made
        _Event.waited += 1
        _Event.until = max(_Event.until, self.at)

    def elapsed_time(self, end: _Event) -> float:
        assert end.at <= _Event.until, "read before it had happened"
        return (end.at - self.at) * 1e3


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x)).sum()


def test_a_gpu_profile_reads_its_events_after_the_last_iteration_never_between(
        monkeypatch) -> None:
    from harness.measure import bench

    model = _Tiny()
    chosen: list = []

    def no_sync(*_):
        raise AssertionError("the profile synchronized the device inside an iteration")

    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "synchronize", no_sync)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setattr(bench, "plain_training", lambda cfg, *, seed, device: (
        model, torch.optim.SGD(model.parameters(), lr=0.1), torch.ones(2, 4)))
    _Event.made = _Event.waited = 0
    _Event.made_at_first_wait = None
    steps = trace._measured({}, iters=3, device="cuda:1")
    assert chosen == [torch.device("cuda", 1)]  # its events on the stream of its own GPU
    # 2 + 3 iterations, each: 4 marks, 2 modules' forward ends, 4 gradients, then one
    # without hooks (4 marks); one wait each, the first once every iteration is queued: a
    # wait between two leaves the GPU idle while the host queues the next forward (an
    # H100's resnet50: 42.7 ms against 38.8)
    made = 5 * (10 + 4)
    assert (_Event.made, _Event.waited, _Event.made_at_first_wait) == (made, 10, made)
    assert steps["source"] == "measured:cuda" and len(steps["backward_s"]) == 4
    assert all(t >= 0 for t in [*steps["backward_s"], steps["update_s"]])
    cpu = trace._measured({}, iters=1, device="cpu")  # the CPU twin: the clock, no event
    assert _Event.made == made and cpu["source"] == "measured:cpu"
    # cluster.device=cuda names no GPU: the current one, by index (GPU checklist step 10,
    # where torch 2.11's set_device refused torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    trace._measured({}, iters=1, device="cuda")
    assert chosen[-1] == torch.device("cuda", 0)


def test_the_layers_split_the_lengths_an_iteration_without_hooks_has() -> None:
    # the hooks' stamps cost host time: resnet50 on an H200 took 33.3-37.4 ms an iteration
    # stamped layer by layer and 32.8 without hooks (GPU checklist step 10)
    model = _Tiny()
    ends = [((0, 1), 2.0), ((2, 3), 10.0)]  # forward 10: layer a 2, layer b 8
    ready = [12.0, 15.0, 20.0, 30.0]        # backward 20: 2, 3, 5, 10
    marks = [0.0, 10.0, 30.0, 34.0]
    hooked = trace._steps(model, ends, ready, marks, scale=1.0, source="x")
    assert [t for _, t in hooked["forward"]] == [2.0, 8.0] and hooked["update_s"] == 4.0
    steps = trace._steps(model, ends, ready, marks, scale=1.0, source="x",
                         plain=[0.0, 5.0, 15.0, 16.0])
    assert [t for _, t in steps["forward"]] == [1.0, 4.0]      # forward 5, split 1:4
    assert steps["backward_s"] == [1.0, 1.5, 2.5, 5.0]           # backward 10, split alike
    assert steps["update_s"] == 1.0


class _Threads:
    """multiprocessing's spawn context, with threads: the profile's processes, here."""

    Barrier, Queue = threading.Barrier, queue.Queue

    def Value(self, kind: str, value: int):  # noqa: N802 - multiprocessing's name
        lock = threading.Lock()
        return type("Value", (), {"value": value, "get_lock": lambda self: lock})()

    def Process(self, *, target, args, daemon):  # noqa: N802
        return threading.Thread(target=target, args=args, daemon=daemon)


@pytest.mark.parametrize("device, expected", [("cuda", ["cuda:0", "cuda:1", "cuda:2"]),
                                              ("cpu", ["cpu"] * 3)])
def test_profiling_process_k_runs_on_gpu_k(monkeypatch, device: str, expected: list) -> None:
    import multiprocessing

    used: list[str] = []

    def measured(cfg, *, iters, device, seed, start, keep_busy, iterations):
        start()
        while keep_busy():
            time.sleep(0.001)
        used.append(device)
        iterations += [2.0 if device.endswith("1") else 1.0]  # the second process: slower
        return {"sizes": [1], "backward_s": [1.0], "layer_of": [0], "forward": [((0,), 1.0)],
                "update_s": 1.0, "source": f"measured:{device.split(':')[0]}"}

    monkeypatch.setattr(multiprocessing, "get_context", lambda method: _Threads())
    monkeypatch.setattr(trace, "_measured", measured)
    steps = trace.measure(config.load([]).model, processes=3, threads=1, iters=1,
                          device=device)
    assert sorted(used) == expected
    assert steps["source"] == f"measured:{device} x3 processes"
    # the slowest's iteration over their mean: 2 / (4 / 3) on GPUs, 1 on the CPU's
    assert steps["straggle"] == pytest.approx(1.5 if device == "cuda" else 1.0)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the crash
def test_a_profiling_process_that_dies_ends_the_profile_at_once(monkeypatch) -> None:
    import multiprocessing

    def measured(cfg, **_):
        raise MemoryError("out of memory")  # a crash before its first iteration

    monkeypatch.setattr(multiprocessing, "get_context", lambda method: _Threads())
    monkeypatch.setattr(trace, "_measured", measured)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="a profiling process ended without its profile"):
        trace.measure(config.load([]).model, processes=2, threads=1, iters=1, device="cpu")
    assert time.monotonic() - started < 30  # not the 600 s it waits for a live one


def test_a_gpu_profile_needing_more_gpus_than_there_are_is_refused(monkeypatch,
                                                                   tmp_path) -> None:
    import harness.simulate  # noqa: F401 - imported here, inherited by run_main's fork

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    args = ["simulate.compute=measured", "cluster.workers_per_node=2", "run.force=true",
            f"results_dir={tmp_path}"]
    out = run_main("harness.simulate", *args)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert ("simulate.compute=measured profiles the 2 workers of cluster.nodes=1 x "
            "cluster.workers_per_node=2 at once, one GPU each, and this machine has 1 "
            "GPUs") in out.stderr
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    config.load(args, simulate=True)  # two GPUs: one each
    config.load([*args, "cluster=slurm"], simulate=True)  # a cluster elsewhere: one process
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(config.ConfigError, match="shows none; use cluster.device=cpu"):
        config.load(["simulate.compute=measured", "cluster.device=cuda"], simulate=True)


class _Handle:
    def __init__(self, polls: int) -> None:
        self.polls = polls

    def finished(self) -> bool:
        self.polls -= 1
        return self.polls < 0


class _Transport:
    def start(self, chunk: torch.Tensor, *, key: int) -> _Handle:
        return _Handle(20)


def test_the_trace_watcher_waits_while_no_unit_is_pending(monkeypatch) -> None:
    from harness.measure import timeline

    pauses: list[float] = []
    sleep = time.sleep

    def counted(seconds: float) -> None:
        if threading.current_thread().name == "ddlbench-trace-watcher":
            pauses.append(seconds)
        sleep(seconds)

    monkeypatch.setattr(timeline.time, "sleep", counted)
    method = type("Method", (), {"transport": _Transport(), "units": []})()
    units = timeline._Units(method, torch.device("cpu"))
    sleep(0.3)
    assert pauses == []  # nothing pending: it slept on the condition, not every 20 us
    method.transport.start(torch.zeros(4), key=0)
    deadline = time.monotonic() + 10
    while not units.events and time.monotonic() < deadline:
        sleep(0.01)
    units.close(5)
    assert not units.watcher.is_alive()
    assert len(pauses) >= 20 and max(pauses) == timeline.WATCH_S
    assert [e["args"] for e in units.events] == [{"unit": 0, "bytes": 16}]
