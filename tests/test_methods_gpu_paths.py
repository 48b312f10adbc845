"""The pieces that behave differently on a GPU, through their CPU twins (no process group).

- A credit comes back only once a partition's communication has really finished
  (`Handle.complete`), not when `wait` returned (on NCCL: the stream was ordered).
- `until_completed` polls `Work.is_completed()` within the timeout.
- The backward profiler synchronizes the device before every stamp.
- The PS pipeline posts per server the control header before the data, from its own
  threads, surfaces their errors on the caller naming the server, and stops them on close.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from methods import ps_node as ps
from methods.base import GradBuffer, backward_order, until_completed
from methods.plan import PerTensor
from methods.priority import Priority
from methods.profile import BackwardProfiler

STUCK_S = 0.3  # long enough for a wrongly issued partition to show up


class _Gated:
    """A handle whose communication really finishes only when the test says so."""

    def __init__(self, key: int, log: list) -> None:
        self.key, self.log, self.finished = key, log, threading.Event()

    def wait(self) -> None:
        self.log.append(("wait", self.key))

    def complete(self) -> None:
        assert self.finished.wait(10)
        self.log.append(("complete", self.key))


class _GatedTransport:
    ordered, identity, scale, rank, size, group, fuses = True, False, 1.0, 0, 1, None, True

    def __init__(self) -> None:
        self.log: list = []
        self.handles: dict[int, _Gated] = {}

    def start(self, chunk: torch.Tensor, *, key: int) -> _Gated:
        self.log.append(("start", key))
        self.sizes = [*getattr(self, "sizes", []), chunk.numel()]
        self.handles[key] = _Gated(key, self.log)
        return self.handles[key]


def _started(log: list) -> list[int]:
    return [key for what, key in log if what == "start"]


def test_priority_credit_comes_back_only_when_communication_really_finished() -> None:
    model = nn.Sequential(*(nn.Linear(4, 4, bias=False) for _ in range(3)))  # 16 each
    buffer = GradBuffer(backward_order(model))
    units = PerTensor().plan(buffer.sizes)
    transport = _GatedTransport()
    sched = Priority(credit_elements=16, timeout_s=10)  # one 4x4 weight fills the credit
    sched.attach(model, buffer=buffer, units=units, transport=transport)
    sched.step(torch.optim.SGD(model.parameters(), lr=0.1))
    try:
        model(torch.ones(2, 4)).sum().backward()
        sched.synchronize()
        for n in range(1, len(units) + 1):
            deadline = time.monotonic() + 10
            while len(_started(transport.log)) < n and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(STUCK_S)
            started = _started(transport.log)
            assert len(started) == n, f"{started}: issued beyond the credit before complete()"
            transport.handles[started[-1]].finished.set()
        sched.drain()
        for key in _started(transport.log):
            assert transport.log.index(("wait", key)) < transport.log.index(("complete", key))
    finally:
        for h in transport.handles.values():
            h.finished.set()
        sched.close()


@contextlib.contextmanager
def _three_layers(**scheduler) -> Iterator[_GatedTransport]:
    """Three 4x4 weights (16 elements each) under the priority scheduler, backward done;
    on leaving, every communication finishes, the scheduler drains (if all went well)
    and closes."""
    model = nn.Sequential(*(nn.Linear(4, 4, bias=False) for _ in range(3)))
    buffer = GradBuffer(backward_order(model))
    transport = _GatedTransport()
    sched = Priority(timeout_s=10, **scheduler)
    sched.attach(model, buffer=buffer, units=PerTensor().plan(buffer.sizes), transport=transport)
    sched.step(torch.optim.SGD(model.parameters(), lr=0.1))
    try:
        model(torch.ones(2, 4)).sum().backward()
        sched.synchronize()
        yield transport
        _finish_all(transport)
        sched.drain()
    finally:
        _finish_all(transport)
        sched.close()


def _finish_all(transport: _GatedTransport) -> None:
    for h in list(transport.handles.values()):
        h.finished.set()


def _settle(transport: _GatedTransport, at_least: int) -> list[int]:
    deadline = time.monotonic() + 10
    while len(_started(transport.log)) < at_least and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(STUCK_S)
    return _started(transport.log)


@pytest.mark.parametrize("credit, in_flight", [(20, 2), (5, 1), (48, 3)])
def test_priority_issues_while_any_credit_is_left(credit: int, in_flight: int) -> None:
    # ByteScheduler blocks only once the remaining credit is <= 0: 20 lets two 16-element
    # pieces go (32 in flight), 5 still lets one go (never refused), 48 all three
    with _three_layers(credit_elements=credit) as transport:
        assert len(_settle(transport, in_flight)) == in_flight
        while len(_started(transport.log)) < 3:  # finish what is in flight: the rest goes
            _finish_all(transport)
            _settle(transport, len(_started(transport.log)) + 1)


@pytest.mark.parametrize("fusion_bytes, sizes", [(1 << 20, [48]), (128, [32, 16]),
                                                 (None, [16, 16, 16])])
def test_priority_fuses_the_pieces_of_one_cycle(fusion_bytes, sizes) -> None:
    # all three gradients are ready long before the 0.2 s cycle ends: they start together,
    # fused up to fusion_bytes (128 bytes: two 64-byte pieces, then the third alone)
    with _three_layers(credit_elements=1000, cycle_s=0.2,
                       fusion_bytes=fusion_bytes) as transport:
        _settle(transport, len(sizes))
        assert transport.sizes == sizes


class _Work:
    def __init__(self, polls_left: int) -> None:
        self.polls_left, self.waited = polls_left, False

    def is_completed(self) -> bool:
        self.polls_left -= 1
        return self.polls_left < 0

    def wait(self) -> None:
        self.waited = True


def test_until_completed_polls_then_waits_and_times_out() -> None:
    work = _Work(polls_left=5)
    until_completed(work, timeout_s=5, what="unit 0")
    assert work.waited
    with pytest.raises(TimeoutError, match="unit 3 timed out: not complete within 0.05 s"):
        until_completed(_Work(polls_left=10**9), timeout_s=0.05, what="unit 3")


def test_profiler_synchronizes_the_device_before_every_stamp(monkeypatch) -> None:
    calls: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "synchronize", calls.append)
    model = nn.Sequential(*(nn.Linear(4, 4, bias=False) for _ in range(3)))  # 16 each
    params = backward_order(model)
    profiler = BackwardProfiler(model, params, device=torch.device("cuda", 0))
    model(torch.ones(2, 4)).sum().backward()
    profiler.end_iteration()
    profiler.close()
    # the end of forward, the start of backward, then one stamp per gradient
    assert calls == [torch.device("cuda", 0)] * (2 + len(params))
    calls.clear()
    cpu = BackwardProfiler(model, params, device=torch.device("cpu"))
    model(torch.ones(2, 4)).sum().backward()
    cpu.close()
    assert calls == []


class _Message:
    def __init__(self, log: list, what: str, tensor: torch.Tensor, peer: int, tag: int) -> None:
        self.tensor = tensor
        log.append((what, peer, tag))

    def wait(self) -> None:
        pass


def _parts() -> list[ps.Part]:
    return [ps.Part(0, 0, 3, server=5), ps.Part(1, 3, 6, server=6), ps.Part(2, 6, 8, server=5)]


def _pipeline() -> ps._Pipeline:
    return ps._Pipeline([5, 6], ps.Node(0, 1, None))  # a node of one worker: no collectives


def _live_pipeline_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name in ("ps-poster", "ps-lander")]


def test_ps_pipeline_posts_header_before_data_per_server_and_stops(monkeypatch) -> None:
    log: list = []

    def isend(tensor, *, dst, tag):
        return _Message(log, "send", tensor, dst, tag)

    def irecv(tensor, *, src, tag):
        tensor.add_(100.0)  # the server's answer
        return _Message(log, "recv", tensor, src, tag)

    monkeypatch.setattr(ps.dist, "isend", isend)
    monkeypatch.setattr(ps.dist, "irecv", irecv)
    flat = torch.arange(8, dtype=torch.float32)
    staging = ps.HostStaging(flat)
    pipeline = _pipeline()
    jobs = [ps._Exchange(_parts(), staging=staging, ready=staging.ready(), timeout_s=5)
            for _ in range(2)]
    for job in jobs:
        pipeline.put(job)
    for job in jobs:
        job.wait()
        job.complete()
    pipeline.stop(5)
    assert _live_pipeline_threads() == []
    torch.testing.assert_close(flat, torch.arange(8, dtype=torch.float32) + 200)
    for server in (5, 6):
        mine = [(what, tag) for what, peer, tag in log if peer == server]
        keys = [p.key for p in _parts() if p.server == server]
        one = [("send", ps.CTRL_TAG)] + [m for k in keys for m in
                                         (("send", ps.KEY_TAG + k), ("recv", ps.KEY_TAG + k))]
        assert mine == one + one, mine


def test_ps_pipeline_errors_surface_on_the_caller_naming_the_server(monkeypatch) -> None:
    def isend(tensor, *, dst, tag):
        raise RuntimeError("Connection closed by peer\nmore detail")

    monkeypatch.setattr(ps.dist, "isend", isend)
    staging = ps.HostStaging(torch.zeros(8))
    pipeline = _pipeline()
    jobs = [ps._Exchange(_parts(), staging=staging, ready=None, timeout_s=5) for _ in range(2)]
    for job in jobs:
        pipeline.put(job)
    for job in jobs:
        with pytest.raises(RuntimeError, match="parameter server rank 5 failed or did not "
                                               "answer: Connection closed by peer$"):
            job.wait()
        with pytest.raises(RuntimeError, match="parameter server rank 5"):
            job.complete()
    pipeline.stop(5)
    assert _live_pipeline_threads() == []


def test_ps_exchange_that_never_lands_times_out_naming_the_server() -> None:
    staging = ps.HostStaging(torch.zeros(8))
    job = ps._Exchange(_parts(), staging=staging, ready=None, timeout_s=0.05)
    with pytest.raises(RuntimeError, match=r"rank 5 \(key 0\) failed or did not answer: timed "
                                           "out after 0.05 s"):
        job.wait()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_ps_staging_round_trip_on_the_copy_stream() -> None:
    flat = torch.arange(1 << 20, dtype=torch.float32, device="cuda")
    staging = ps.HostStaging(flat)
    ps._finish(staging.to_host(0, flat.numel()))
    assert torch.equal(staging.host, flat.cpu())
    staging.host.mul_(2)
    staging.to_device(0, flat.numel())
    staging.order_after(staging.mark())
    assert torch.equal(flat.cpu(), 2 * torch.arange(1 << 20, dtype=torch.float32))
