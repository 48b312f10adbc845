"""The pieces that behave differently on a GPU, through their CPU twins (no process group).

- A credit comes back only once a partition's communication has really finished
  (`Handle.complete`), not when `wait` returned (on NCCL: the stream was ordered).
- `until_completed` polls `Work.is_completed()` within the timeout.
- The backward profiler stamps a GPU's backward with events, read after the iteration,
  and never synchronizes inside backward.
- The PS pipeline posts per server the control header before the data, from its own
  threads, surfaces their errors on the caller naming the server, and stops them on close.
- Every thread a method starts sets the rank's device before entering a stream of its
  own; streams are ordered by events (the gradient's before its piece goes, the layer's
  update before its next forward); polls sleep tens of microseconds at most.
- Rank 0's announcements keep bounded bookkeeping; a node's collectives go in the root's
  order on every worker of the node.
- Issue 38: ByteScheduler asks one event per parameter per poll, in record order, outside
  its lock; each role's stream is made once per process and device; only the root path's
  root pins a host copy; the scatter path's shared buffer is registered with CUDA while
  its plan is open; a landing unit's copy is polled, never synchronized (a spinning core);
  the node's communicators are made from the main thread, in one order, once.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from methods import base, layerwise, order, priority
from methods.base import GradBuffer, backward_order, until_completed
from methods.plan import Partition, PerTensor
from methods.priority import Priority
from methods.profile import BackwardProfiler
from methods.ps import node as ps
from methods.ps import order as ps_order
from methods.ps import stages as ps_stages

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


def _scheduler(**scheduler) -> tuple[nn.Module, Priority, _GatedTransport]:
    """Three 4x4 weights (16 elements each) under the priority scheduler, attached to a
    gated transport, with an optimizer bound."""
    model = nn.Sequential(*(nn.Linear(4, 4, bias=False) for _ in range(3)))
    buffer = GradBuffer(backward_order(model))
    transport = _GatedTransport()
    sched = Priority(timeout_s=10, **scheduler)
    sched.attach(model, buffer=buffer, units=PerTensor().plan(buffer.sizes), transport=transport)
    sched.step(torch.optim.SGD(model.parameters(), lr=0.1))
    return model, sched, transport


@contextlib.contextmanager
def _three_layers(**scheduler) -> Iterator[_GatedTransport]:
    """Three 4x4 weights (16 elements each) under the priority scheduler, backward done;
    on leaving, every communication finishes, the scheduler drains (if all went well)
    and closes."""
    model, sched, transport = _scheduler(**scheduler)
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


class _FakeEvent:
    """torch.cuda.Event on a host without GPUs: records the clock; counts its reads."""

    made: list[_FakeEvent] = []

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.at, self.synced = None, False
        _FakeEvent.made.append(self)

    def record(self) -> None:
        self.at = time.perf_counter()

    def synchronize(self) -> None:
        self.synced = True

    def elapsed_time(self, end: _FakeEvent) -> float:
        assert end.synced, "read before it was waited for"
        return (end.at - self.at) * 1e3


def test_profiler_times_a_gpus_backward_with_events_not_synchronizes(monkeypatch) -> None:
    def no_sync(*_):
        raise AssertionError("the profiler synchronized the device")

    monkeypatch.setattr(torch.cuda, "synchronize", no_sync)
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    _FakeEvent.made.clear()
    model = nn.Sequential(*(nn.Linear(4, 4, bias=False) for _ in range(3)))  # 16 each
    params = backward_order(model)
    profiler = BackwardProfiler(model, params, device=torch.device("cuda", 0))
    for _ in range(2):
        model(torch.ones(2, 4)).sum().backward()
        profiler.end_iteration()
    profiler.close()
    # per iteration: the end of forward, the start of backward, one per gradient
    assert len(_FakeEvent.made) == 2 * (2 + len(params))
    for ready in profiler.iterations:  # seconds after backward started, in backward order
        assert all(0 <= r < 1 for r in ready) and ready == sorted(ready)
    cpu = BackwardProfiler(model, params, device=torch.device("cpu"))
    model(torch.ones(2, 4)).sum().backward()
    cpu.end_iteration()
    cpu.close()
    assert len(_FakeEvent.made) == 2 * (2 + len(params)) and len(cpu.iterations[0]) == 3


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
    return [t.name for t in threading.enumerate() if t.name.startswith("ps-")]


def test_ps_pipeline_posts_header_before_data_per_server_and_stops(monkeypatch) -> None:
    log: list = []

    def isend(tensor, *, dst, tag, group=None):
        return _Message(log, "send", tensor, dst, tag)

    def irecv(tensor, *, src, tag, group=None):
        tensor.add_(100.0)  # the server's answer
        return _Message(log, "recv", tensor, src, tag)

    monkeypatch.setattr(ps_order.dist, "isend", isend)
    monkeypatch.setattr(ps_order.dist, "irecv", irecv)
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
    def isend(tensor, *, dst, tag, group=None):
        raise RuntimeError("Connection closed by peer\nmore detail")

    monkeypatch.setattr(ps_order.dist, "isend", isend)
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


# -- threads, streams and events (issue 28): the GPU-only calls, mocked ---------------------


def test_a_method_thread_sets_the_ranks_device_before_entering_its_stream(monkeypatch) -> None:
    calls: list = []
    stream = object()

    @contextlib.contextmanager
    def entered(s):
        calls.append(("stream", s, threading.current_thread().name))
        yield

    monkeypatch.setattr(torch.cuda, "set_device",
                        lambda d: calls.append(("set_device", d, threading.current_thread().name)))
    monkeypatch.setattr(torch.cuda, "stream", entered)
    thread = base.start_thread(lambda: calls.append(("run", None, threading.current_thread().name)),
                               name="t1", device=torch.device("cuda", 3), stream=stream)
    thread.join(5)
    assert calls == [("set_device", torch.device("cuda", 3), "t1"), ("stream", stream, "t1"),
                     ("run", None, "t1")]
    calls.clear()
    base.start_thread(lambda: calls.append(("run", None, "cpu")), name="t2",
                      device=torch.device("cpu")).join(5)
    assert calls == [("run", None, "cpu")]  # a CPU rank touches no CUDA at all
    assert base.side_stream(torch.device("cpu"), "issuer") is None


@contextlib.contextmanager
def _cuda_faked(monkeypatch, module) -> Iterator[dict]:
    """`module`'s threads, streams and events, recorded: each stream a token, each event
    the token of where it was recorded; the threads still run (on the CPU)."""
    seen: dict = {"threads": [], "waits": [], "events": 0, "happened": lambda event: True}

    def start(target, *, name, device, stream=None):
        seen["threads"].append((name, device, stream))
        return base.start_thread(target, name=name, device=torch.device("cpu"))

    def record(device):
        seen["events"] += 1
        return ("event", seen["events"], threading.current_thread().name)

    def wait_for(event, device):
        if event is not None:
            seen["waits"].append((threading.current_thread().name, event))

    monkeypatch.setattr(module, "start_thread", start)
    if hasattr(module, "happened"):
        monkeypatch.setattr(module, "happened", lambda event: seen["happened"](event))
    if hasattr(module, "side_stream"):
        monkeypatch.setattr(module, "side_stream", lambda device, role: object())
    for mod in (module, layerwise):
        if hasattr(mod, "record"):
            monkeypatch.setattr(mod, "record", record)
            monkeypatch.setattr(mod, "wait_for", wait_for)
    yield seen


def test_priority_threads_run_on_streams_of_their_own_ordered_by_events(monkeypatch) -> None:
    with _cuda_faked(monkeypatch, priority) as seen, _three_layers(credit_elements=1000) as t:
        _settle(t, 3)
        # the issuer, the completer and the updater, each on a stream of its own, on the
        # buffer's device
        assert [name for name, _, _ in seen["threads"]] == ["issuer", "completer", "updater"]
        streams = [s for _, _, s in seen["threads"]]
        assert all(s is not None for s in streams) and len(set(map(id, streams))) == 3
        assert {d for _, d, _ in seen["threads"]} == {torch.device("cpu")}
    # the issuer waited for each gradient's event (recorded where it was collected, in
    # backward) before its piece went; the updater for the completer's, recorded once the
    # layer's pieces were averaged; the compute side waited for no communication
    issued = [e for name, e in seen["waits"] if name == "issuer"]
    assert len(issued) == 3 and all(e[2] != "issuer" for e in issued)
    assert not [e for name, e in seen["waits"] if name == "completer"]
    updated = [e for name, e in seen["waits"] if name == "updater"]
    assert updated and all(e[2] == "completer" for e in updated)


def test_a_piece_goes_only_once_its_gradients_event_has_happened(monkeypatch) -> None:
    # a GPU's host runs ahead: the hooks have run, the gradients' events have not happened
    released: set = set()
    with _cuda_faked(monkeypatch, priority) as seen:
        seen["happened"] = lambda event: event in released
        model, sched, transport = _scheduler(credit_elements=1000)
        try:
            model(torch.ones(2, 4)).sum().backward()
            sched.synchronize()
            assert _settle(transport, 0) == []  # hooked, none in the buffer yet
            # the output side's two gradients are made; the input side's (unit 2, the
            # highest priority) is not: the two go, best first, and it waits
            released.update(sched.collected[:2])
            assert _settle(transport, 2) == [1, 0]
            released.add(sched.collected[2])
            assert _settle(transport, 3) == [1, 0, 2]
            _finish_all(transport)
            sched.drain()
        finally:
            _finish_all(transport)
            sched.close()


def test_a_layers_update_holds_back_the_credit_of_no_piece() -> None:
    model, sched, transport = _scheduler(credit_elements=16)  # one piece in flight at a time
    update, applied = threading.Event(), []
    apply = sched.layers.apply

    def gated(layer: int) -> None:
        assert update.wait(10)
        applied.append(layer)
        apply(layer)

    sched.layers.apply = gated
    try:
        model(torch.ones(2, 4)).sum().backward()
        sched.synchronize()
        first = _settle(transport, 1)
        assert len(first) == 1
        transport.handles[first[0]].finished.set()
        # its communication done, its layer's update held back: the credit is back already
        second = _settle(transport, 2)
        assert len(second) == 2 and applied == []
        # and the next piece's too: an update being applied holds back no completion
        # (ByteScheduler returns credit in the core's callbacks, steps in the poller)
        transport.handles[second[1]].finished.set()
        assert len(_settle(transport, 3)) == 3 and applied == []
        update.set()
        _finish_all(transport)
        _finish_all(transport)
        sched.drain()
        assert len(applied) == 3
    finally:
        update.set()
        _finish_all(transport)
        sched.close()


def test_the_next_forward_waits_for_its_layers_update_event(monkeypatch) -> None:
    with _cuda_faked(monkeypatch, priority) as seen:
        model, sched, transport = _scheduler(credit_elements=1000)
        try:
            model(torch.ones(2, 4)).sum().backward()
            sched.synchronize()
            _settle(transport, 3)
            _finish_all(transport)
            sched.drain()
            updates = [e for e in sched.layers.applied]
            assert all(e is not None and e[2] == "updater" for e in updates)
            seen["waits"].clear()
            model(torch.ones(2, 4))  # the next forward: each layer waits for its own update
            main = threading.current_thread().name
            assert [e for name, e in seen["waits"] if name == main] == updates
        finally:
            _finish_all(transport)
            sched.close()


def test_ps_threads_start_on_their_jobs_device(monkeypatch) -> None:
    monkeypatch.setattr(ps_order.dist, "isend",
                        lambda tensor, *, dst, tag, group=None: _Message([], "s", tensor, dst, tag))
    monkeypatch.setattr(ps_order.dist, "irecv",
                        lambda tensor, *, src, tag, group=None: _Message([], "r", tensor, src, tag))
    with _cuda_faked(monkeypatch, ps_stages) as seen:
        staging = ps.HostStaging(torch.zeros(8))
        pipeline = _pipeline()
        job = ps._Exchange(_parts(), staging=staging, ready=None, timeout_s=5)
        pipeline.put(job)
        job.complete()
        pipeline.stop(5)
    names = sorted(name for name, _, _ in seen["threads"])
    assert names == sorted(["ps-broadcast", "ps-copy-in", "ps-copy-out", "ps-push", "ps-reduce"]
                           + [f"ps-pull-{i}" for i in range(ps.PULL_WAITERS)]), names
    assert {d for _, d, _ in seen["threads"]} == {torch.device("cpu")}
    assert all(stream is not None for _, _, stream in seen["threads"])  # each on a stream


def test_polls_sleep_at_most_tens_of_microseconds(monkeypatch) -> None:
    pauses: list[float] = []
    monkeypatch.setattr(base.time, "sleep", pauses.append)
    work = _Work(polls_left=40)
    until_completed(work, timeout_s=5, what="unit 0")
    assert len(pauses) == 40 and max(pauses) == base.POLL_MAX_S <= 50e-6


# -- rank 0's announcements: bounded bookkeeping ---------------------------------------------


class _Send:
    """A Gloo send's work: reports completed only once waited on."""

    def __init__(self, log: dict) -> None:
        self.log, self.waited = log, False
        log["sent"] += 1

    def is_completed(self) -> bool:
        self.log["polled"] += 1
        return self.waited

    def wait(self) -> None:
        self.waited = True
        self.log["waited"] += 1


def test_order_leader_bookkeeping_stays_bounded_over_5000_announcements(monkeypatch) -> None:
    log = {"sent": 0, "waited": 0, "polled": 0}
    monkeypatch.setattr(order.dist, "get_world_size", lambda group=None: 3)
    monkeypatch.setattr(order.dist, "isend", lambda msg, *, dst, group, tag: _Send(log))
    leader = order.OrderLeader(None)
    most = 0
    for i in range(5000):
        leader.announce([i] if i % 3 else [i, i + 1, i + 2])  # some groups take two messages
        most = max(most, len(leader.pending))
    assert most <= order.WINDOW
    assert log["polled"] == 0  # no pass over the pending sends per announcement
    assert log["waited"] == log["sent"] - len(leader.pending)
    leader.close()
    assert not leader.pending and log["waited"] == log["sent"]


def _announce_over_gloo(rank: int, path: str, count: int, out: dict) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=2)
    try:
        if rank == 0:
            leader, most = order.OrderLeader(None), 0
            for i in range(count):
                leader.announce([i, i + 1] if i % 7 == 0 else [i])
                most = max(most, len(leader.pending))
            leader.close()
            out["most"] = most
        else:
            follower, got = order.OrderFollower(None), []
            while (group := follower.next()) is not None:
                got.append(group)
            out["got"] = got
    finally:
        dist.destroy_process_group()


def test_order_announcements_over_gloo_arrive_in_order_with_bounded_pending(tmp_path) -> None:
    import torch.multiprocessing as mp

    count = 5000
    with mp.Manager() as manager:
        results = [manager.dict() for _ in range(2)]
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_announce_over_gloo,
                             args=(r, str(tmp_path / "store"), count, results[r]))
                 for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
        assert [p.exitcode for p in procs] == [0, 0]
        assert results[0]["most"] <= order.WINDOW
        assert results[1]["got"] == [[i, i + 1] if i % 7 == 0 else [i] for i in range(count)]


# -- one order for the node's collectives ----------------------------------------------------


class _Channel:
    """rank 0's announcements to one follower, in memory (OrderLeader / OrderFollower)."""

    def __init__(self) -> None:
        self.q: queue.SimpleQueue = queue.SimpleQueue()

    def leader(self, group):
        channel = self

        class Leader:
            def announce(self, units):
                channel.q.put(list(units))

            def close(self):
                channel.q.put(None)
        return Leader()

    def follower(self, group):
        return type("Follower", (), {"next": lambda _self: self.q.get(timeout=10)})()


class _Done:
    def wait(self) -> None:
        pass


def test_every_worker_of_a_node_issues_the_nodes_collectives_in_the_roots_order(
        monkeypatch) -> None:
    channel, issued = _Channel(), {True: [], False: []}
    monkeypatch.setattr(ps_order, "OrderLeader", channel.leader)
    monkeypatch.setattr(ps_order, "OrderFollower", channel.follower)
    monkeypatch.setattr(ps_order, "start_thread", lambda target, *, name, device, stream=None:
                        base.start_thread(target, name=name, device=device))

    def collective(node, kind, chunk):
        issued[node.is_root].append((kind, int(chunk[0])))
        return _Done()

    monkeypatch.setattr(ps.Node, "collective", collective)
    chunks = [torch.full((2,), float(u)) for u in range(3)]
    root, other = (ps.NodeOrder(ps.Node(rank, 2, ("reduce", "broadcast"))) for rank in (0, 1))

    # the other worker's lander asks for each broadcast at once, its poster for the reduces
    # a little later; the root broadcasts only after all three reduces (its pulls are slow)
    def poster():
        for chunk in chunks:
            time.sleep(0.05)
            other.run(ps.REDUCE, chunk, after=None, timeout_s=10)

    def lander():
        for chunk in chunks:
            other.run(ps.BROADCAST, chunk, after=None, timeout_s=10)

    threads = [threading.Thread(target=f) for f in (poster, lander)]
    for t in threads:
        t.start()
    for kind in (ps.REDUCE, ps.BROADCAST):
        for chunk in chunks:
            root.run(kind, chunk, after=None, timeout_s=10)
    for t in threads:
        t.join(10)
    root.stop(10)
    other.stop(10)
    expected = [(kind, u) for kind in (ps.REDUCE, ps.BROADCAST) for u in range(3)]
    assert issued[True] == expected
    assert issued[False] == expected  # not the broadcasts first, as this worker asked


# -- issue 38: the readiness scan, streams per role, host staging, polls, warm-up ----------


def test_the_readiness_scan_asks_each_parameters_event_once_in_order_outside_the_lock(
        monkeypatch) -> None:
    # 24 weights of 4 partitions each; the host ran ahead: every hook ran, no event happened
    model = nn.Sequential(*(nn.Linear(4, 4, bias=False) for _ in range(24)))
    buffer = GradBuffer(backward_order(model))
    units = Partition(partition_elements=4).plan(buffer.sizes, rows=buffer.rows)
    assert len(units) == 4 * 24
    released, polls = set(), []
    with _cuda_faked(monkeypatch, priority) as seen:
        sched = Priority(timeout_s=10, credit_elements=10**6)

        def happened(event) -> bool:
            polls[-1].append((event, sched.cond._is_owned()))
            return event in released

        promote = Priority._promote

        def counted(self):
            polls.append([])
            return promote(self)

        seen["happened"] = happened
        monkeypatch.setattr(Priority, "_promote", counted)
        transport = _GatedTransport()
        sched.attach(model, buffer=buffer, units=units, transport=transport)
        sched.step(torch.optim.SGD(model.parameters(), lr=0.1))
        try:
            model(torch.ones(2, 4)).sum().backward()
            sched.synchronize()
            time.sleep(STUCK_S)
            waiting = [p for p in polls[1:-1] if p]
            assert len(waiting) >= 3  # it kept polling, 50 us apart at most
            first = sched.collected[0]  # the output side's gradient, recorded first
            # one query per poll: the oldest event, which has not happened; never the lock
            assert all(p == [(first, False)] for p in waiting), waiting[:3]
            released.update(sched.collected)
            assert len(_settle(transport, len(units))) == len(units)
            asked = [event for p in polls for event, _ in p]
            # once they happen, one query per parameter, not per partition, in record order
            assert asked[-24:] == sched.collected
            assert all(asked.count(event) == 1 for event in sched.collected[1:])
            assert not any(owned for p in polls for _, owned in p)
            _finish_all(transport)
            sched.drain()
        finally:
            _finish_all(transport)
            sched.close()


class _Stream:
    made = 0

    def __init__(self, device=None) -> None:
        _Stream.made += 1
        self.device = device


def test_each_roles_stream_is_made_once_per_process_and_device(monkeypatch) -> None:
    monkeypatch.setattr(base, "_STREAMS", {})
    monkeypatch.setattr(torch.cuda, "Stream", _Stream)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    _Stream.made = 0
    gpu0, gpu1 = torch.device("cuda", 0), torch.device("cuda", 1)
    issuer = base.side_stream(gpu0, "issuer")
    for _ in range(40):  # 40 repeats, each attaching a scheduler and opening a PS plan
        assert base.side_stream(gpu0, "issuer") is issuer
        assert base.side_stream(torch.device("cuda"), "issuer") is issuer
        staging = ps.HostStaging(_FakeFlat(), mirror=False)
    assert (staging.out, staging.back) == (base.side_stream(gpu0, "ps-out"),
                                           base.side_stream(gpu0, "ps-back"))
    assert len({id(s) for s in (issuer, staging.out, staging.back,
                                base.side_stream(gpu0, "completer"),
                                base.side_stream(gpu1, "issuer"))}) == 5
    assert _Stream.made == 5
    assert base.side_stream(torch.device("cpu"), "issuer") is None


def test_no_module_makes_a_stream_but_side_stream() -> None:
    from tests.conftest import REPO

    files = [*REPO.glob("methods/*.py"), *REPO.glob("harness/**/*.py")]
    makers = [f.relative_to(REPO).as_posix() for f in files
              if "cuda.Stream(" in f.read_text()]
    assert makers == ["methods/base.py"]


class _FakeFlat:
    """A flat gradient buffer on GPU 0, for HostStaging's decisions (no GPU here)."""

    device, dtype = torch.device("cuda", 0), torch.float32

    def numel(self) -> int:
        return 1000


@contextlib.contextmanager
def _gpu_staging(monkeypatch, *, code: int = 0) -> Iterator[dict]:
    """HostStaging on a faked GPU: pinned allocations and cudart calls recorded."""
    log: dict = {"pinned": [], "cudart": []}
    empty = torch.empty

    def fake_empty(*size, pin_memory=False, **kw):
        if pin_memory:
            log["pinned"].append(size)
        return empty(*size, **kw)

    class Runtime:
        def __getattr__(self, name):
            return lambda *args: log["cudart"].append((name, *args)) or code

    monkeypatch.setattr(torch, "empty", fake_empty)
    monkeypatch.setattr(torch.cuda, "cudart", Runtime)
    monkeypatch.setattr(ps, "side_stream", lambda device, role: object())
    monkeypatch.setattr(ps, "share", lambda numel, dtype, *, node, timeout_s:
                        log.setdefault("shared", empty(numel, dtype=dtype)))
    yield log


@pytest.mark.parametrize("rank", [0, 1])
def test_on_the_root_path_only_the_root_pins_a_host_copy(monkeypatch, rank: int) -> None:
    node = ps.Node(rank, 2, ("reduce", "broadcast"))
    with _gpu_staging(monkeypatch) as log:
        staging = ps.node_staging(_FakeFlat(), node=node, scatter=False, timeout_s=5)
    assert log["pinned"] == ([(1000,)] if rank == 0 else [])
    assert (staging.host is None) == (rank == 1) and log["cudart"] == []
    cpu = torch.zeros(8)  # the CPU twin: the buffer is its own mirror on every worker
    assert ps.node_staging(cpu, node=node, scatter=False, timeout_s=5).host is cpu


@pytest.mark.parametrize("rank", [0, 1])
def test_the_shared_buffer_is_registered_with_cuda_while_the_plan_is_open(monkeypatch,
                                                                          rank: int) -> None:
    node = ps.Node(rank, 2, ("reduce", "broadcast"))
    with _gpu_staging(monkeypatch) as log:
        staging = ps.node_staging(_FakeFlat(), node=node, scatter=True, timeout_s=5)
        shared = log["shared"]
        assert staging.host is shared and log["pinned"] == []
        assert log["cudart"] == [("cudaHostRegister", shared.data_ptr(), 4000, 0)]
        staging.close()
        staging.close()
        assert log["cudart"][1:] == [("cudaHostUnregister", shared.data_ptr())]
    with _gpu_staging(monkeypatch, code=2) as log:
        with pytest.raises(RuntimeError, match="cudaHostRegister of the node's shared buffer "
                                               "failed with CUDA error 2"):
            ps.node_staging(_FakeFlat(), node=node, scatter=True, timeout_s=5)
    with _gpu_staging(monkeypatch) as log:  # the CPU twin: the same buffer, nothing pinned
        cpu = ps.node_staging(torch.zeros(1000), node=node, scatter=True, timeout_s=5)
        cpu.close()
        assert cpu.host is log["shared"] and log["cudart"] == []


class _SlowEvent:
    """A copy's event that happens after `polls` queries; synchronizing it spins a core."""

    def __init__(self, polls: int) -> None:
        self.polls = polls

    def query(self) -> bool:
        self.polls -= 1
        return self.polls < 0

    def synchronize(self) -> None:
        raise AssertionError("synchronize() busy-waits on a default event")


def test_a_unit_lands_by_polling_its_copys_event_not_spinning(monkeypatch) -> None:
    pauses: list[float] = []
    monkeypatch.setattr(base.time, "sleep", pauses.append)
    job = ps._Exchange(_parts(), staging=ps.HostStaging(torch.zeros(8)), ready=None,
                       timeout_s=5)
    job.landed = _SlowEvent(30)
    job.done.set()
    job.complete()
    assert len(pauses) == 30 and max(pauses) <= base.POLL_MAX_S
    job.landed = _SlowEvent(10**9)
    job.timeout_s = 0.01
    monkeypatch.setattr(base.time, "sleep", time.sleep)
    with pytest.raises(TimeoutError, match="the unit's copy back to the device timed out"):
        job.complete()


class _CopyEvent:
    """A copy's event: counts synchronize() calls; a query (a poll) fails the test."""

    def __init__(self) -> None:
        self.synchronized = 0

    def query(self) -> bool:
        raise AssertionError("polled: on a GPU each poll takes the GIL the autograd thread "
                             "needs")

    def synchronize(self) -> None:
        self.synchronized += 1


def test_a_stage_thread_waits_for_its_copy_in_cuda_never_polling(monkeypatch) -> None:
    pauses: list[float] = []
    monkeypatch.setattr(base.time, "sleep", pauses.append)
    copy = _CopyEvent()
    ps._finish(copy)
    ps._finish(None)  # the CPU twin: nothing was copied, nothing to wait for
    assert copy.synchronized == 1 and pauses == []


def test_the_nodes_communicators_are_made_from_the_main_thread_in_one_order(
        monkeypatch) -> None:
    log: list = []
    monkeypatch.setattr(ps_order.dist, "all_reduce", lambda tensor, *, group: log.append(
        (group, threading.current_thread().name)))
    ps_order.Node(1, 2, ("reduce", "broadcast")).warm_up(torch.device("cpu"))
    ps_order.Node(0, 1, None).warm_up(torch.device("cpu"))  # a node of one: none to make
    main = threading.current_thread().name
    assert log == [("reduce", main), ("broadcast", main)]


def test_the_transport_warms_the_node_up_once_before_its_first_plans_threads(
        monkeypatch) -> None:
    from methods.ps import transport as transport_module

    group, log = object(), []
    monkeypatch.setattr(transport_module.dist, "get_world_size",
                        lambda g=None: 4 if g is group else 6)  # 2 nodes of 2, 2 servers
    monkeypatch.setattr(transport_module.dist, "get_rank", lambda g=None: 1)
    monkeypatch.setattr(transport_module, "_tell_servers", lambda *a, **k: None)
    monkeypatch.setattr(ps_order.Node, "warm_up", lambda node, device: log.append("warm-up"))
    monkeypatch.setattr(ps, "share", lambda numel, dtype, *, node, timeout_s: torch.zeros(numel))

    class Pipeline:
        def __init__(self, servers, node) -> None:
            log.append(f"threads for servers {servers}")

        def stop(self, timeout_s) -> None:
            log.append("stop")

    monkeypatch.setattr(transport_module, "ScatterPipeline", Pipeline)
    model = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False))
    buffer = GradBuffer(backward_order(model))
    transport = transport_module.PSTransport(group=group, workers_per_node=2,
                                             node_groups=("reduce", "broadcast"), timeout_s=5)
    for _ in range(2):  # MG-WFBP's second plan: the communicators are there
        transport.open(buffer, PerTensor().plan(buffer.sizes))
        assert transport.staging is not None
    transport.close()
    assert transport.staging is None
    assert log == ["warm-up", "threads for servers [4, 5]", "stop", "threads for servers [4, 5]",
                   "stop"]
