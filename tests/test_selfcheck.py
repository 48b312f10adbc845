"""The simulator against the harness's own runs (issue 43): `harness.methodbench
--selfcheck` measures a small emulated sweep and predicts it into one folder, and the
comparison's figures are the ones its rows give. Checks the machinery, not the numbers
(the benchmark is the whole experiment=selfcheck; harness/predict/README.md)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pandas as pd
import pytest

from harness import config
from harness.config import checks
from harness.measure import results, traces
from harness.predict import network, psqueues, selfcheck
from methods.costmodel import Cost
from tests.conftest import run_module


def _cells(measured: list[float], simulated: list[float]) -> pd.DataFrame:
    n = len(measured)
    frame = pd.DataFrame({"model": "bert_tiny", "network": "eth1g", "nodes": 2,
                          "workers_per_node": 1, "method": [f"m{i}" for i in range(n)],
                          "measured": measured, "simulated": simulated})
    frame["pct_error"] = 100 * (frame.simulated - frame.measured) / frame.measured
    return frame


def test_scores_are_the_cells_errors_and_rank_agreement() -> None:
    table = selfcheck.scores(_cells([10, 20, 40], [11, 18, 20]))
    row = table.iloc[0]
    assert (row.cells, row.median_abs_pct_error, row.max_abs_pct_error) == (3, 10.0, 50.0)
    assert row.kendall_tau == 1.0  # same order, however far off
    swapped = selfcheck.scores(_cells([10, 20], [20, 10])).iloc[0]
    assert swapped.kendall_tau == -1.0
    text = selfcheck.verdict(table)
    assert "missed" in text and "max_abs_pct_error=50.0" in text
    assert "met" in selfcheck.verdict(selfcheck.scores(_cells([10, 20], [10.5, 21])))


def test_plan_measures_each_link_once_then_runs_and_predicts(tmp_path: Path) -> None:
    p = selfcheck.plan(["model=bert_tiny", "method=bsp_a2a,wfbp_ps", "network=eth1g,eth100m",
                        "cluster.nodes=2", "cluster.workers_per_node=1", "run.trace=true",
                        "simulate.trace=true", f"results_dir={tmp_path}"])
    steps = selfcheck.commands(p)
    assert [s[0] for s in steps] == ["harness.microbench"] * 2 + ["harness.run",
                                                                  "harness.simulate"]
    assert {s[2] for s in steps[:2]} == {"network=eth1g", "network=eth100m"}
    assert {tuple(s[3:5]) for s in steps[:2]} == {("cluster.nodes=2", "cluster.workers_per_node=1")}
    assert p.out.parent == tmp_path and not p.out.exists()  # nothing made before it starts
    assert f"simulate.reference={p.out}" in steps[-1] and f"results_dir={p.out}" in steps[-1]
    assert "simulate.trace=true" not in steps[2] and "run.trace=true" in steps[2]  # what each reads
    assert "simulate.trace=true" in steps[3]


@pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")
@pytest.mark.skipif(bool(checks.missing_net_tools()), reason="ip/tc (iproute2) are missing")
def test_selfcheck_measures_and_predicts_into_one_folder(tmp_path: Path) -> None:
    sweep = ["model=bert_tiny", "method=bsp_a2a,wfbp_ps", "network=eth1g", "cluster.nodes=2",
             "cluster.workers_per_node=1", "run.warmup_iters=1", "run.timed_iters=3",
             "run.repeats=1", "run.timeout_s=120",  # the machinery, not the numbers:
             "microbench.max_bytes=262144", "simulate.profile_iters=2"]
    out = run_module("harness.methodbench", "--selfcheck", *sweep, f"results_dir={tmp_path}",
                     timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    [folder] = [f for f in tmp_path.iterdir() if f.is_dir()]
    rows = results.load(folder)
    assert sorted(rows.source.unique()) == ["measured", "simulated"]
    assert set(rows.method) == {"bsp_a2a", "wfbp_ps"} and (rows.status == "ok").all()
    [bench] = results.load_microbench(folder / results.OTHER_DATA)
    assert {"p2p", "allreduce", "ps"} <= set(bench.kind)  # ps: through the real server
    assert (bench[bench.kind == "ps"].seconds > 0).all()
    table = pd.read_csv(folder / "selfcheck.csv")
    assert table[["nodes", "workers_per_node", "cells"]].values.tolist() == [[2, 1, 2]]
    assert "validation, uncalibrated: median_abs_pct_error=" in out.stdout
    assert "selfcheck: clusters=1" in out.stdout
    assert (folder / "selfcheck_bert_tiny.png").stat().st_size > 10_000
    # the machine's CPU an iteration, read and predicted: no more than the cores give
    cells = pd.read_csv(folder / "selfcheck_cells.csv")
    assert (cells.cpu_measured_s > 0).all() and (cells.cpu_predicted_s > 0).all(), cells
    ran = rows[rows.source == "measured"]
    per_iteration = ran.timed_s / ran.timed_iters
    assert (ran.machine_cpu_s <= checks.cores() * per_iteration * 1.05 + 0.02).all(), ran
    again = run_module("harness.methodbench", "--selfcheck", "--predict", str(folder), *sweep,
                       timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "harness.run" not in again.stdout  # nothing measured again
    assert pd.read_csv(folder / "selfcheck.csv").cells.tolist() == [2]  # the newest prediction


def _microbench(folder: Path, *, nodes: int, per_node: int, allreduce: tuple[float, float],
                name: str) -> None:
    """A microbenchmark table as harness.microbench writes it (its fits only)."""
    kinds = [("p2p", 1e-3, 8e-9), ("p2p_intra", 5e-5, 1e-10), ("allreduce", *allreduce),
             ("ps", 5e-3, 4e-8)]
    frame = pd.DataFrame([{"kind": k, "ranks": "0-1", "bytes": 1024, "seconds": a,
                           "alpha_s": a, "beta_s_per_byte": b} for k, a, b in kinds])
    frame = frame.assign(run_id=name, cluster="emulated", network="eth1g",
                         world_size=nodes * per_node, nodes=nodes, workers_per_node=per_node)
    (folder / results.OTHER_DATA).mkdir(parents=True, exist_ok=True)
    frame.to_parquet(folder / results.OTHER_DATA / f"{name}.parquet")


def test_what_was_timed_on_the_shape_predicted_is_its_cost(tmp_path: Path) -> None:
    _microbench(tmp_path, nodes=2, per_node=2, allreduce=(2e-3, 2e-8), name="a")
    _microbench(tmp_path, nodes=3, per_node=1, allreduce=(3e-3, 3e-8), name="b")
    cfg = config.load(["cluster=emulated", "network=eth1g", f"results_dir={tmp_path}"],
                      simulate=True)
    net = network.network(cfg)
    assert (net.inter, net.intra) == (Cost(1e-3, 8e-9), Cost(5e-5, 1e-10))  # node's loopback
    mb = 1 << 20
    assert network.allreduce_s(net, mb, nodes=2, per_node=2) == pytest.approx(2e-3 + 2e-8 * mb)
    assert network.allreduce_s(net, mb, nodes=3, per_node=1) == pytest.approx(3e-3 + 3e-8 * mb)
    ring = 2 * 1e-3 + 8e-9 * mb  # a shape not measured: the ring over the link
    assert network.allreduce_s(net, mb, nodes=2, per_node=1) == pytest.approx(ring)
    # a PS round trip through the real server: the server's handling is what the two
    # messages over the link (2 pushes in, 2 answers out) leave of it; unmeasured, nothing
    handling = psqueues._handling(net, (2, 2), senders=2)
    assert (handling.alpha, handling.beta) == pytest.approx((5e-3 - 2e-3, 4e-8 - 4 * 8e-9))
    assert psqueues._handling(net, (2, 1), senders=2) == Cost(0.0, 0.0)
    served = psqueues.ParameterServers(net, [[(mb, 0)]], 2, 2, 1, True)
    bare = psqueues.ParameterServers(dataclasses.replace(net, ps=()), [[(mb, 0)]], 2, 2, 1,
                                     True)
    assert served.issue(0, mb, 0.0) - bare.issue(0, mb, 0.0) == pytest.approx(
        handling.seconds(mb))  # on the server's in-link, the partition's critical path


def _timeline(source: str, backward_end: float, unit_ends: list[float]) -> traces.Timeline:
    bars = [traces.Bar("compute", "backward", 0.1, backward_end, {})]
    bars += [traces.Bar("comm", f"unit {u}", 0.2, end, {"unit": u})
             for u, end in enumerate(unit_ends)]
    return traces.Timeline({"source": source}, 1.0, ["compute", "comm"], bars)


def test_unit_completion_gap_with_and_without_the_compute() -> None:
    measured = _timeline("measured", 0.5, [0.6, 0.7, 0.9])
    predicted = _timeline("simulated", 0.7, [0.8, 0.9, 1.0])  # backward 0.2 s late
    gap, n = traces.unit_gap(measured, predicted)
    assert n == 3 and gap == pytest.approx(0.2)  # median of 0.2, 0.2, 0.1 over 1 s
    late, _ = traces.unit_gap(measured, predicted, after_backward=True)
    assert late == pytest.approx(0.0)  # the same once each is counted from its backward


def _pieces(source: str, pieces: list[tuple[int, float, float]]) -> traces.Timeline:
    """A traced iteration of 1 s whose comm lane holds (unit, issue, completion) pieces."""
    bars = [traces.Bar("comm", f"unit {u}", start, end, {"unit": u}) for u, start, end in pieces]
    return traces.Timeline({"source": source}, 1.0, ["compute", "comm"], bars)


def test_unit_issue_gap_beside_the_completion_gap() -> None:
    measured = _pieces("measured", [(0, 0.2, 0.4), (0, 0.3, 0.6), (1, 0.3, 0.7),
                                    (2, 0.5, 0.9), (3, -0.2, 0.1)])  # 3: the iteration before
    predicted = _pieces("simulated", [(0, 0.2, 0.8), (1, 0.4, 0.9), (2, 0.8, 1.0), (3, 0.1, 0.2)])
    issue, n = traces.unit_gap(measured, predicted, at="issue")
    assert n == 3 and issue == pytest.approx(0.1)  # median of 0, 0.1, 0.3
    done, _ = traces.unit_gap(measured, predicted, at="completion")
    assert done == pytest.approx(0.2)  # unit 0 completes with its last piece: 0.2, 0.2, 0.1
    assert done == traces.unit_gap(measured, predicted)[0]  # completion, as before
    assert traces.gap_text(measured, predicted).endswith(
        "issue 10.0%, completion 20.0% (3 units)")
    pieces = _pieces("measured", [(0, 0.3, 0.6), (0, 0.2, 0.4)])  # a unit in two pieces
    whole = _pieces("simulated", [(0, 0.2, 0.6)])
    assert traces.unit_gap(pieces, whole, at="issue") == (0.0, 1)  # its first issue
    assert traces.unit_gap(pieces, whole) == (0.0, 1)  # its last completion
    with pytest.raises(ValueError, match="at='start'"):
        traces.unit_gap(measured, predicted, at="start")


def _write_trace(folder: Path, source: str, backward_end_s: float,
                 units: list[tuple[float, float]]) -> None:
    """A trace file as run.trace / simulate.trace write it: an iteration of 1 s."""
    events = [traces.meta("thread_name", traces.COMPUTE, "compute"),
              traces.meta("thread_name", traces.COMM, "comm"),
              traces.span("backward", 0.1e6, backward_end_s * 1e6)]
    for u, (start, end) in enumerate(units):
        events += traces.unit(u, u, start * 1e6, end * 1e6, {"bytes": 4})
    about = {"source": source, "model": "bert_tiny", "method": "wfbp_ps", "workers": 2,
             "network": "eth1g", "local_batch_size": 8, "traced_us": [0, 1e6], "rank": 0}
    traces.write({"traceEvents": events}, folder / traces.FOLDER / f"{source}.trace.json",
                  about)


def test_trace_lines_print_the_issue_and_completion_gaps(tmp_path: Path) -> None:
    _write_trace(tmp_path, "measured", 0.5, [(0.2, 0.6), (0.3, 0.7), (0.5, 0.9)])
    _write_trace(tmp_path, "simulated", 0.7, [(0.2, 0.8), (0.4, 0.9), (0.8, 1.0)])
    [line] = selfcheck.trace_lines(tmp_path)
    assert line.startswith("trace bert_tiny wfbp_ps 2 eth1g 8: iteration measured 1000 ms, "
                           "predicted 1000 ms; ")
    assert ("as a share of the measured iteration: issue 10.0%, completion 20.0% (3 units); "
            "completion 0.0% counted from the end of backward") in line
