"""Node-local aggregation on the scatter path (methods/ps/scatter.py), with real processes:
two workers of one node and a gated parameter server of the test's own, over Gloo.

The server answers no pull before it has every partition's push, so the pipeline passes
only if each partition's reduce-scatter and push go out while the partitions before it are
still on the wire (the old path, one unit at a time through the root, would be no
different here, but a pipeline that waited for each partition to land before the next
would hang). The partitions have 7, 8 and 1 elements on a node of 2: a leftover of 1, none,
and a partition that is all leftover.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from methods.layout import Part
from methods.ps import order as ps_order
from methods.ps.node import HostStaging, _Exchange, _Pipeline
from methods.ps.order import ALL_GATHER, BROADCAST, REDUCE, REDUCE_SCATTER, Node
from methods.ps.scatter import ScatterPipeline, split
from methods.ps.shared import share
from methods.ps.wire import CTRL_TAG, HEADER, KEY_TAG, SHM_TAG
from tests.test_methods import _free_port, _spawn

SERVER, ITERATIONS, ANSWER = 2, 2, 100.0
PARTS = [Part(0, 0, 7, SERVER), Part(1, 7, 15, SERVER), Part(2, 15, 16, SERVER)]
NAMES = {REDUCE: "reduce", BROADCAST: "broadcast", REDUCE_SCATTER: "reduce-scatter",
         ALL_GATHER: "all-gather"}


def _init(rank: int, world: int, port: int) -> tuple | None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=dt.timedelta(seconds=60))
    mine = [dist.new_subgroups_by_enumeration([[0, 1]])[0] for _ in range(2)]
    return tuple(mine) if mine[0] is not None else None


def _gated_server() -> None:
    """Per iteration: take every partition's push from the root, then answer each pull with
    the push + ANSWER, in order."""
    for _ in range(ITERATIONS):
        pushed = []
        for _ in PARTS:
            head = torch.zeros(HEADER, dtype=torch.int64)
            dist.recv(head, src=0, tag=CTRL_TAG)
            key = int(head[3])
            data = torch.empty(PARTS[key].numel)
            dist.recv(data, src=0, tag=KEY_TAG + key)
            pushed.append((key, data))
        for key, data in pushed:
            dist.send(data + ANSWER, dst=0, tag=KEY_TAG + key)


def _pipeline_rank(rank: int, world: int, port: int, folder: str, out: str) -> None:
    groups = _init(rank, world, port)
    if rank == SERVER:
        _gated_server()
        os._exit(0)
    node = Node(rank, 2, groups)
    issued: list[str] = []
    collective = ps_order.Node.collective

    def logged(self, kind, chunk):  # what the node thread issues, in its order
        issued.append(f"{NAMES[kind]}:{chunk.numel()}")
        return collective(self, kind, chunk)

    ps_order.Node.collective = logged
    flat = torch.zeros(16)
    staging = HostStaging(flat, host=share(16, flat.dtype, node=node, timeout_s=30,
                                           folder=Path(folder)))
    left = os.listdir(folder)  # the file is gone once every worker has mapped it
    pipeline, results = ScatterPipeline([SERVER], node), []
    for it in range(ITERATIONS):
        flat.copy_(torch.arange(16.0) * (rank + 1) + it)
        job = _Exchange(PARTS, staging=staging, ready=None, timeout_s=30)
        pipeline.put(job)
        job.complete()
        results.append(flat.tolist())
    pipeline.stop(30)
    Path(f"{out}.{rank}").write_text(json.dumps({"results": results, "issued": issued,
                                                 "left": left}))
    os._exit(0)  # skip the process group's teardown: nothing of it is under test


def test_scatter_pipeline_overlaps_partitions_and_sums_every_leftover(tmp_path) -> None:
    out, folder = str(tmp_path / "out"), tmp_path / "shm"
    folder.mkdir()
    assert _spawn(_pipeline_rank, 3, _free_port(), str(folder), out, timeout_s=120) == [0] * 3
    got = [json.loads(Path(f"{out}.{r}").read_text()) for r in (0, 1)]
    for it in range(ITERATIONS):
        want = torch.arange(16.0) * 3 + 2 * it + ANSWER  # the node's sum, as the server adds
        for g in got:
            torch.testing.assert_close(torch.tensor(g["results"][it]), want, rtol=0, atol=0)
    # every partition reduce-scattered (its leftover reduced) before the first all-gather:
    # partition k + 1 went out while k was on the wire; the gathers in the root's landing
    # order (the pulls complete nearly at once: any order), and every worker issued the same
    reduces = ["reduce-scatter:6", "reduce:1", "reduce-scatter:8", "reduce:1"]
    gathers = [["all-gather:6", "broadcast:1"], ["all-gather:8"], ["broadcast:1"]]
    assert got[0]["issued"] == got[1]["issued"]
    for it in range(ITERATIONS):
        issued = got[0]["issued"][8 * it : 8 * (it + 1)]
        assert issued[:4] == reduces, issued
        rest = issued[4:]  # each partition's gather collectives together, in its own order
        assert sorted(rest) == sorted(sum(gathers, [])), issued
        assert rest.index("all-gather:6") + 1 < len(rest) \
            and rest[rest.index("all-gather:6") + 1] == "broadcast:1", issued
    assert got[0]["left"] == []  # the root returns from `share` once it has removed it
    assert os.listdir(folder) == []


def test_a_partition_is_cut_into_equal_slices_and_a_leftover_at_its_end() -> None:
    node = Node(1, 3, ("reduce", "broadcast"))
    assert split(Part(0, 10, 21, 0), node) == (19, 13, 16)  # 3 slices of 3, leftover 2
    assert split(Part(0, 10, 12, 0), node) == (10, 10, 10)  # all leftover, no slice
    assert Node(5, 3, ("r", "b")).own(torch.arange(6)).tolist() == [4, 5]


def _unmapped_rank(rank: int, world: int, port: int, folder: str, out: str) -> None:
    """Worker 1 takes the buffer's name but never maps it (it fails): the root gives up."""
    groups = _init(rank, world, port)
    if rank == 0:
        try:
            share(16, torch.float32, node=Node(0, 2, groups), timeout_s=2, folder=Path(folder))
            error = None
        except RuntimeError as exc:
            error = str(exc)
        Path(out).write_text(json.dumps({"error": error, "left": os.listdir(folder)}))
    elif rank == 1:
        dist.recv(torch.zeros(1, dtype=torch.int64), src=0, tag=SHM_TAG)
    deadline = time.monotonic() + 60  # Gloo closes the pair that timed out: no barrier
    while not os.path.exists(out) and time.monotonic() < deadline:
        time.sleep(0.05)
    os._exit(0)


def test_the_shared_buffer_is_removed_when_a_worker_fails_to_map_it(tmp_path) -> None:
    out, folder = str(tmp_path / "out"), tmp_path / "shm"
    folder.mkdir()
    assert _spawn(_unmapped_rank, 3, _free_port(), str(folder), out, timeout_s=120) == [0] * 3
    got = json.loads(Path(out).read_text())
    assert got["error"] and "worker rank 1" in got["error"], got
    assert got["left"] == [] and os.listdir(folder) == []


def test_a_worker_refuses_a_shared_buffer_that_is_not_there(tmp_path, monkeypatch) -> None:
    from methods.ps import shared as ps_shared

    monkeypatch.setattr(ps_shared, "_exchange", lambda msg, peer, *, send, timeout_s: None)
    with pytest.raises(RuntimeError, match="shared buffer .* is missing"):
        share(4, torch.float32, node=Node(1, 2, ("r", "b")), timeout_s=1, folder=tmp_path)
    assert os.listdir(tmp_path) == []


# -- the pipeline's depth (issue 40 item 4): a thread per stage, pulls land as they complete

DEEP = [Part(0, 0, 6, SERVER), Part(1, 6, 14, SERVER), Part(2, 14, 24, SERVER)]  # no leftover


def _reversing_server() -> None:
    """Take every partition's push from the root, then answer the pulls last key first, a
    pause between answers: the later partitions' pulls complete first."""
    pushed = {}
    while len(pushed) < len(DEEP):
        head = torch.zeros(HEADER, dtype=torch.int64)
        dist.recv(head, src=0, tag=CTRL_TAG)
        for key in head[3 : 3 + int(head[1])].tolist():
            pushed[key] = torch.empty(DEEP[key].numel)
            dist.recv(pushed[key], src=0, tag=KEY_TAG + key)
    for key in sorted(pushed, reverse=True):
        dist.send(pushed[key] + ANSWER, dst=0, tag=KEY_TAG + key)
        time.sleep(0.3)


class _SlowOut(HostStaging):
    """Partition 0's copy to the host takes 0.5 s (a slow device-to-host copy)."""

    def to_host(self, start: int, end: int):
        if start < DEEP[0].end:
            time.sleep(0.5)
        return super().to_host(start, end)


def _deep_rank(rank: int, world: int, port: int, folder: str, out: str) -> None:
    groups = _init(rank, world, port)
    if rank == SERVER:
        _reversing_server()
        os._exit(0)
    node, issued, trace = Node(rank, 2, groups), [], []
    collective = ps_order.Node.collective

    def logged(self, kind, chunk):
        issued.append(f"{NAMES[kind]}:{chunk.numel()}")
        return collective(self, kind, chunk)

    ps_order.Node.collective = logged
    flat = torch.arange(24.0) * (rank + 1)
    staging = _SlowOut(flat, host=share(24, flat.dtype, node=node, timeout_s=30,
                                        folder=Path(folder)))
    pipeline = ScatterPipeline([SERVER], node, trace=trace)
    job = _Exchange(DEEP, staging=staging, ready=None, timeout_s=30)
    pipeline.put(job)
    job.complete()
    pipeline.stop(30)
    alive = sorted(t.name for t in threading.enumerate() if t.name.startswith("ps-"))
    Path(f"{out}.{rank}").write_text(json.dumps({"result": flat.tolist(), "issued": issued,
                                                 "trace": trace, "alive": alive}))
    os._exit(0)


def test_the_next_partitions_reduce_overlaps_a_slow_copy_and_pulls_land_as_they_complete(
        tmp_path) -> None:
    out, folder = str(tmp_path / "out"), tmp_path / "shm"
    folder.mkdir()
    assert _spawn(_deep_rank, 3, _free_port(), str(folder), out, timeout_s=120) == [0] * 3
    got = [json.loads(Path(f"{out}.{r}").read_text()) for r in (0, 1)]
    for g in got:
        torch.testing.assert_close(torch.tensor(g["result"]), torch.arange(24.0) * 3 + ANSWER,
                                   rtol=0, atol=0)
        trace = [tuple(t) for t in g["trace"]]
        # partition 1's reduce-scatter started while partition 0's copy out still ran
        assert trace.index(("ps-reduce", "start", 1)) < trace.index(("ps-copy-out", "end", 0))
        # the pulls landed last key first, as the server answered, and every later stage
        # took them in that order (the others: in the order the root told them)
        for stage, what in (("ps-pull", "end"), ("ps-copy-in", "start"),
                            ("ps-gather", "start")):
            assert [k for s, w, k in trace if (s, w) == (stage, what)] == [2, 1, 0], trace
        assert g["alive"] == []  # stop joined every stage thread
    # the same collectives in the same order on both workers: all-gathers as landed
    want = ["reduce-scatter:6", "reduce-scatter:8", "reduce-scatter:10",
            "all-gather:10", "all-gather:8", "all-gather:6"]
    assert got[0]["issued"] == got[1]["issued"] == want


def _root_path_rank(rank: int, world: int, port: int, out: str) -> None:
    """A node of one worker (rank 0) and the reversing server (rank 1): two units, the
    first (keys 0, 1) slow to copy out, the second (key 2) landing first."""
    _init(rank, world, port)
    if rank == 1:
        _reversing_server()
        os._exit(0)
    trace: list = []
    parts = [Part(p.key, p.start, p.end, 1) for p in DEEP]
    flat = torch.arange(24.0)
    staging, pipeline = _SlowOut(flat), _Pipeline([1], Node(0, 1, None), trace=trace)
    jobs = [_Exchange(ps, staging=staging, ready=None, timeout_s=30)
            for ps in (parts[:2], parts[2:])]
    for job in jobs:
        pipeline.put(job)
    for job in jobs:
        job.complete()
    pipeline.stop(30)
    alive = sorted(t.name for t in threading.enumerate() if t.name.startswith("ps-"))
    Path(out).write_text(json.dumps({"result": flat.tolist(), "trace": trace, "alive": alive}))
    os._exit(0)


def test_on_the_root_path_units_overlap_and_partitions_land_as_they_complete(
        tmp_path) -> None:
    out = str(tmp_path / "out")
    assert _spawn(_root_path_rank, 2, _free_port(), out, timeout_s=120) == [0] * 2
    got = json.loads(Path(out).read_text())
    torch.testing.assert_close(torch.tensor(got["result"]), torch.arange(24.0) + ANSWER,
                               rtol=0, atol=0)
    trace = [tuple(t) for t in got["trace"]]
    # unit 2 (key 2) was on its way while unit 1's copy out still ran
    assert trace.index(("ps-reduce", "start", 2)) < trace.index(("ps-copy-out", "end", 0))
    for stage, what in (("ps-pull", "end"), ("ps-copy-in", "start")):
        assert [k for s, w, k in trace if (s, w) == (stage, what)] == [2, 1, 0], trace
    # the units land in unit order (the node's order), the first once all of it is back
    assert [k for s, w, k in trace if (s, w) == ("ps-broadcast", "end")] == [0, 2]
    assert got["alive"] == []
