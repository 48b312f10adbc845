"""The measurement's GPU path through its CPU twins (issue 28): the timed window opens with
the device idle on every rank at once, and the microbenchmark times the network between
two nodes, with the link inside a node apart."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from harness.measure import microbench, timing
from tests.conftest import run_module


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
    assert sorted(set(zip(frame.kind, frame.ranks))) == [
        ("allreduce", "all"), ("p2p", "0-2"), ("p2p_intra", "0-1")]
    assert (frame.seconds > 0).all()
