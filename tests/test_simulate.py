"""The simulator: closed-form cases and the real CLI (tests/test_calibrate.py validates it
against the study)."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys

import pandas as pd
import pytest

from harness import config
from harness.measure import results
from harness.predict import engines, model, network, priority, psqueues, sweep, trace
from harness.predict.profile import Compute
from methods.costmodel import Cost
from methods.plan import PerTensor
from tests.conftest import REPO, run_module

ALPHA, BETA = 1e-3, 1e-8  # s, s/byte: 100 MB/s links


def net(*, allreduce: str = "ring", name: str = "test") -> network.Network:
    link = Cost(ALPHA, BETA)
    return network.Network(name, link, link, allreduce, False)


def compute(sizes: list[int], backward_s: list[float], *, forward_s: float = 0.1,
            update_s: float = 0.01) -> Compute:
    """Tensors (backward order) of one layer each; one forward step needing every layer."""
    layers = tuple(range(len(sizes)))
    return Compute(sizes, backward_s, list(layers), [(layers, forward_s)], update_s, "test")


def cfg(method: str, *overrides: str):
    return config.load([f"method={method}", "simulate.iterations=4", *overrides], simulate=True)


def test_nccl24_takes_its_tree_below_ncclTreeThreshold_and_its_ring_above() -> None:
    # NCCL 2.4.8 (src/init.cc) on PCIe: 10,000 bytes per us its ring's latency exceeds the
    # tree's; 6 us a ring step, 15 us a level across nodes, 4 us a GPU within one
    assert network.nccl24_tree_below(1, 4) == 0.0
    assert [round(network.nccl24_tree_below(n, 4)) for n in (2, 4, 8)] == [
        150_000, 480_000, 1_290_000]
    nccl, ring = net(allreduce="nccl24"), net()
    depth = 3 * ALPHA + 3 * ALPHA  # log2(8) levels across nodes, a chain of 4 within
    small, big = 100_000, 2_000_000
    moved = 2 * 31 / 32 * small * BETA
    assert network.allreduce_s(nccl, small, nodes=8, per_node=4) == pytest.approx(
        2 * depth + 1.5 * moved)  # the tree: 2/3 of the ring's bandwidth
    for nbytes in (big, small):  # above the threshold, or on one node: the ring
        assert network.allreduce_s(nccl, big, nodes=8, per_node=4) == pytest.approx(
            network.allreduce_s(ring, big, nodes=8, per_node=4))
        assert network.allreduce_s(nccl, nbytes, nodes=1, per_node=4) == pytest.approx(
            network.allreduce_s(ring, nbytes, nodes=1, per_node=4))
    # the study's networks run it
    assert {config.load([f"network={n}"], simulate=True).network.allreduce
            for n in ("ib100_rdma", "eth100_tcp", "eth10_tcp")} == {"nccl24"}


def test_bsp_one_tensor_is_compute_plus_one_allreduce() -> None:
    c = compute([1_000_000], [0.2])
    pred = model.predict(cfg("bsp_a2a", "cluster.workers_per_node=2"), c, net())
    nbytes = 4_000_000
    # a 2-worker ring: 2 start-ups, each link carries the whole buffer once
    assert network.allreduce_s(net(), nbytes, nodes=1, per_node=2) == pytest.approx(
        2 * ALPHA + BETA * nbytes)
    assert pred.iteration_s == pytest.approx(c.total_s + 2 * ALPHA + BETA * nbytes)
    assert pred.bottleneck == "exposed communication"


def test_a_negotiation_cycle_delays_each_all_reduce_to_its_next_tick() -> None:
    c = compute([1_000_000], [0.2])
    # the study ran bsp_a2a (as wfbp_a2a and mgwfbp) with HOROVOD_CYCLE_TIME=0: no tick
    two = cfg("bsp_a2a", "cluster.workers_per_node=2")
    assert two.method.horovod.cycle_time_s == 0
    plain = model.predict(two, c, net()).iteration_s
    # 0.31 s of compute and a 42 ms all-reduce; with 20 ms ticks backward ends at 0.672 s,
    # 1.032 s, ...: each all-reduce waits 8 ms for the next tick, iterations take 0.36 s
    assert plain == pytest.approx(0.352)
    ticking = cfg("bsp_a2a", "cluster.workers_per_node=2", "method.horovod.cycle_time_s=0.02")
    assert model.predict(ticking, c, net()).iteration_s == pytest.approx(0.36)
    # torch DDP has no such cycle
    ddp = model.predict(cfg("ddp", "cluster.workers_per_node=2"), c, net())
    assert ddp.iteration_s == pytest.approx(c.total_s + 2 * ALPHA + BETA * 4_000_000)


def test_wfbp_hides_what_the_remaining_backward_covers() -> None:
    # output-side tensor: 0.4 ms ready, its all-reduce (~2 ms + 40 ms) ends before the
    # 0.5 s of backward left; only the input-side tensor's all-reduce stays exposed
    c = compute([1_000_000, 10_000], [0.0004, 0.5])
    two = cfg("wfbp_a2a", "cluster.workers_per_node=2")
    last = network.allreduce_s(net(), 40_000, nodes=1, per_node=2)
    assert model.predict(two, c, net()).iteration_s == pytest.approx(c.total_s + last)
    bsp = model.predict(cfg("bsp_a2a", "cluster.workers_per_node=2"), c, net())
    assert bsp.iteration_s > model.predict(two, c, net()).iteration_s


def test_one_worker_all_reduce_is_compute_alone() -> None:
    c = compute([1_000_000, 10_000], [0.1, 0.1])
    for method in ("bsp_a2a", "mgwfbp", "bytescheduler_a2a"):
        pred = model.predict(cfg(method), c, net())
        assert pred.iteration_s == pytest.approx(c.total_s), method
        assert pred.speedup == pytest.approx(1.0)


def test_ps_traffic_per_server_divides_by_servers() -> None:
    # 4 workers on separate nodes push 40 MB each: the servers' links are the bottleneck
    c = compute([10_000_000], [0.01])
    busy = {}
    for servers in (1, 2):
        pred = model.predict(cfg("bsp_ps", "cluster.nodes=4", f"cluster.servers={servers}",
                                    "method.transport.assignment=balanced"), c, net())
        busy[servers] = pred.plan["busy_s_per_iteration"]
        assert pred.plan["busiest_link"].startswith("server")
        assert pred.bottleneck == "server link"
    # 40 MB in 4,096,000-byte partitions: 10 partitions, 5 + 5 over two servers
    assert busy[2] == pytest.approx(busy[1] / 2, rel=0.05)


def test_ps_through_the_root_crosses_the_bus_whole_and_scatter_pipelines_it() -> None:
    # 2 nodes of 3 workers, one 40 MB unit of 10 partitions over 2 servers, GPUs that
    # copy to the host
    gpu = network.Network("test", Cost(ALPHA, BETA), Cost(ALPHA, BETA), "ring", True)
    unit = [[(4_000_000, i % 2) for i in range(10)]]
    ps = {way: psqueues.ParameterServers(gpu, unit, 2, 3, 2, True, way)
          for way in ("scatter", "root")}
    done = {way: p.issue(0, 40_000_000, 0.0) for way, p in ps.items()}
    # bus bytes per byte and way: scatter 2 (2 + 1) / 3 = 2, the root 2 (2 / 3 + 1) = 10 / 3
    bus = ps["scatter"].busy["bus_up"]
    assert bus == pytest.approx(2 * 40_000_000 * BETA + 10 * ALPHA)
    assert ps["root"].busy["bus_up"] == pytest.approx(10 / 3 * 40_000_000 * BETA + ALPHA)
    # the root crosses the bus whole before the first push and after the last pull, the
    # wire alone between; the scatter path overlaps the bus with the wire, partition by
    # partition, so it saves more than one whole crossing
    free_bus = network.Network("test", Cost(0.0, 0.0), Cost(ALPHA, BETA), "ring", True)
    wire = psqueues.ParameterServers(free_bus, unit, 2, 3, 2, True, "root").issue(0, 0, 0.0)
    crossing = ps["root"].busy["bus_up"]
    assert done["root"] == pytest.approx(wire + 2 * crossing)
    assert done["scatter"] < done["root"] - crossing
    # and the simulator takes the switch from the configuration
    shape = ("cluster.nodes=2", "cluster.workers_per_node=3", "cluster.servers=2")
    c = compute([10_000_000], [0.01])
    assert model.predict(cfg("bsp_ps", *shape, "method.transport.node_reduce=root"), c,
                         gpu).iteration_s > model.predict(cfg("bsp_ps", *shape), c, gpu).iteration_s


def _summing(memory: float) -> network.Network:
    """Free buses, the test's links, servers with `memory` bytes/s of memory."""
    return network.Network("test", Cost(0.0, 0.0), Cost(ALPHA, BETA), "ring", False, memory)


def test_a_server_sums_on_its_engine_thread_before_it_answers() -> None:
    # one 4 MB partition from 2 nodes; a 1 GB/s server, one engine thread streaming 4 of
    # its 40 cores' share (100 MB/s): one add (3 bytes per byte) and one copy (2), both
    # after the second (last) push is in
    size = 4_000_000
    ps = psqueues.ParameterServers(_summing(1e9), [[(size, 0)]], 2, 1, 1, True)
    pushed = 2 * size * BETA + ALPHA   # both nodes' pushes through the server's link
    summed = pushed + 5 * size / 1e8   # 0.2 s
    assert ps.issue(0, size, 0.0) == pytest.approx(summed + 2 * size * BETA + ALPHA)
    assert ps.busy["server0_engine0"] == pytest.approx(0.2)
    # servers whose summing is not timed (a local network) answer once the pushes are in
    plain = psqueues.ParameterServers(_summing(0.0), [[(size, 0)]], 2, 1, 1, True)
    assert plain.issue(0, size, 0.0) == pytest.approx(pushed + 2 * size * BETA + ALPHA)
    assert not any("engine" in lane for lane in plain.busy)


def test_server_engine_threads_share_the_partitions_by_bytes_bound() -> None:
    # one server, partitions of 4S, S, S, S, S bytes first seen in that order: thread 0 takes
    # 4S, thread 1 the four S's (each time the one with fewer bytes bound), 4S each
    size = 1_000_000
    unit = [[(4 * size, 0)] + [(size, 0)] * 4]
    ps = psqueues.ParameterServers(_summing(1e9), unit, 2, 1, 1, True, engine_threads=2)
    ps.issue(0, 8 * size, 0.0)
    assert ps.busy["server0_engine0"] == pytest.approx(ps.busy["server0_engine1"]) == \
        pytest.approx(5 * 4 * size / 1e8)
    # 8 equal partitions, each in after 20 ms more on the server's link, then 50 ms of
    # summing: one thread sums them one after another from the first's arrival (21 ms),
    # two threads alternate them, the second starting at the second's (41 ms); the last
    # answer leaves 21 ms later
    done = {threads: psqueues.ParameterServers(_summing(1e9), [[(size, 0)] * 8], 2, 1, 1,
                                              True, engine_threads=threads).issue(0, 0, 0.0)
            for threads in (1, 2)}
    assert done[1] == pytest.approx(0.021 + 8 * 0.05 + 0.021)
    assert done[2] == pytest.approx(0.041 + 4 * 0.05 + 0.021)
    # and the simulator takes the method's threads and names the bottleneck
    c = compute([10_000_000], [0.01])
    slow = [model.predict(cfg("bsp_ps", "cluster.nodes=4", f"method.transport.engine_threads={t}"),
                          c, _summing(1e9)) for t in (1, 8)]
    assert slow[0].plan["busiest_link"].startswith("server") and "_engine" in \
        slow[0].plan["busiest_link"] and slow[0].bottleneck == "server engine"
    # eight threads sum a server's five partitions side by side: its link is the limit
    assert slow[1].bottleneck == "server link"
    assert slow[1].iteration_s < 0.7 * slow[0].iteration_s


def test_mgwfbp_merges_small_tensors_and_beats_wfbp_on_start_up_costs() -> None:
    # 200 small tensors ready almost at once: one all-reduce each pays 200 start-ups
    c = compute([20_000] * 200, [0.0001] * 200)
    wfbp = model.predict(cfg("wfbp_a2a", "cluster.nodes=4"), c, net())
    merged = model.predict(cfg("mgwfbp", "cluster.nodes=4"), c, net())
    assert merged.plan["units"] < 200 == wfbp.plan["units"]
    assert merged.iteration_s < wfbp.iteration_s


def test_bytescheduler_overlaps_the_next_forward() -> None:
    # the output-side tensor's 0.48 s all-reduce (3 partitions) cannot hide in backward; with
    # one partition in flight the input-side tensor jumps the queue at the end of backward,
    # so the next forward's long first layer overlaps the output side's remaining partitions
    c = Compute([12_000_000, 10_000], [0.05, 0.05], [0, 1], [((1,), 0.5), ((0,), 0.1)],
                0.0, "test")
    credit = "method.scheduler.credit_elements=4000000", "method.scheduler.cycle_s=0"
    prio = model.predict(cfg("bytescheduler_a2a", "cluster.nodes=2", *credit), c, net())
    wfbp = model.predict(cfg("wfbp_a2a", "cluster.nodes=2"), c, net())
    assert prio.plan["units"] == 4
    assert prio.iteration_s < wfbp.iteration_s - 0.2
    # the study's clock drains each step: the output side no longer overlaps the forward
    drained = model.predict(cfg("bytescheduler_a2a", "cluster.nodes=2", *credit,
                                "run.sync_each_step=true"), c, net())
    assert drained.iteration_s > prio.iteration_s + 0.2
    # the same scheduler on PS with its credit in bytes (priority_ps): one credit, not two
    ps = model.predict(cfg("priority_ps", "cluster.nodes=2"), c, net())
    assert ps.plan["units"] == 12 + 1 and ps.iteration_s > 0  # 4,096,000-byte slices


class _Line:
    """A communication channel whose every issue takes one second, one at a time."""

    def __init__(self) -> None:
        self.calls, self.free = [], 0.0

    def issue(self, unit: int, nbytes: int, t: float) -> float:
        self.calls.append((unit, nbytes, t))
        self.free = max(t, self.free) + 1.0
        return self.free


@pytest.mark.parametrize(("network_name", "gpus", "alpha", "beta"), [
    ("ib100_rdma", 16, 7.075e-4, 4.059e-10), ("eth10_tcp", 16, 9.081e-4, 7.396e-10),
    # the study's 100GbE runs passed --rdma: they merged on the IB table
    ("eth100_tcp", 8, 9.754e-5, 3.057e-10)])
def test_mgwfbp_cost_study_reads_the_studys_table(network_name, gpus, alpha, beta) -> None:
    c = compute([8192] * 6, [0.01] * 6)
    shape = (f"cluster.nodes={gpus // 4}", "cluster.workers_per_node=4", "run.force=true")
    study = cfg("mgwfbp", *shape, "method.planner.cost=study")
    pred = model.predict(study, c, net(name=network_name))
    assert pred.plan["cost"] == "study"
    assert (pred.plan["alpha_s"], pred.plan["beta_s_per_byte"]) == (alpha, beta)
    fitted = model.predict(cfg("mgwfbp", *shape), c, net(name=network_name))
    assert fitted.plan["cost"] == "fitted" and fitted.plan["alpha_s"] != alpha


def test_simulate_mgwfbp_cost_sets_the_planners_cost_of_mgwfbp_alone() -> None:
    shape = ("cluster.nodes=4", "cluster.workers_per_node=4", "run.force=true")
    study = cfg("mgwfbp", *shape, "simulate.mgwfbp_cost=study")
    assert study.method.planner.cost == "study"
    pred = model.predict(study, compute([8192] * 6, [0.01] * 6), net(name="ib100_rdma"))
    assert (pred.plan["alpha_s"], pred.plan["beta_s_per_byte"]) == (7.075e-4, 4.059e-10)
    assert cfg("mgwfbp", *shape, "method.planner.cost=study",
               "simulate.mgwfbp_cost=fitted").method.planner.cost == "fitted"
    assert "cost" not in cfg("wfbp_a2a", *shape, "simulate.mgwfbp_cost=study").method.planner
    # a run reads the method's own cost
    assert config.load(["method=mgwfbp", "simulate.mgwfbp_cost=study"]).method.planner.cost \
        == "fitted"


def test_the_plan_viewer_says_which_cost_mgwfbp_merged_on() -> None:
    shape = ["model=resnet50", "method=mgwfbp", "network=ib100_rdma", "cluster.nodes=8",
             "cluster.workers_per_node=4", "simulate.compute=rtx2080ti"]
    study, fitted = (run_module("harness.plan", *shape, f"simulate.mgwfbp_cost={cost}")
                     for cost in ("study", "fitted"))
    assert study.returncode == fitted.returncode == 0, study.stderr + fitted.stderr
    line = re.search(r"^planner: mgwfbp, (\d+) groups merged on (.*)$", study.stdout, re.M)
    assert line and "alpha=0.000406 s, beta=4.91e-10 s/byte (cost=study: the study's table" \
        in line.group(2), study.stdout
    assert "(cost=fitted: fitted on the modelled all-reduce)" in fitted.stdout


def test_counted_work_weighs_the_bytes_of_operations_without_flops() -> None:
    # a GPU runs normalizations, activations and the optimizer at its memory's speed: the
    # count keeps their bytes beside the FLOPs, so any GPU's balance weighs them
    from harness.predict import trace

    build = {"arch": "resnet18", "image_size": 32, "num_classes": 10}
    sgd = {"name": "sgd", "lr": 0.1, "momentum": 0.9, "weight_decay": 0.0}
    counted = trace.count_work("vision", build, batch=8, optimizer=sgd)
    flops, moved = counted["flops"], counted["bytes"]
    assert flops["update_s"] == 0.0 < moved["update_s"]
    param_bytes = 4 * sum(flops["sizes"])  # at least each parameter read and written and
    assert moved["update_s"] >= 3 * param_bytes  # its gradient read
    norms = [i for i, n in enumerate(flops["sizes"]) if n in (64, 128, 256, 512)]  # BN
    assert sum(flops["backward_s"][i] for i in norms) == 0.0
    assert sum(moved["backward_s"][i] for i in norms) > 0.0
    assert sum(flops["backward_s"]) > 0.0 and flops["sizes"] == moved["sizes"]


def test_mgwfbp_cost_study_without_the_worker_count_is_refused() -> None:
    with pytest.raises(config.ConfigError, match="2, 4, 8, 16, 32, 64 workers, not 3"):
        cfg("mgwfbp", "cluster.workers_per_node=3", "method.planner.cost=study")
    with pytest.raises(config.ConfigError, match="method.planner.cost='guess' is unknown"):
        cfg("mgwfbp", "method.planner.cost=guess")


def test_bytescheduler_issues_while_credit_is_left_and_fuses_one_cycle() -> None:
    units = PerTensor().plan([16, 16, 16])
    # credit 20: two 16-element pieces go at once (credit plus one), the third when one is back
    line = _Line()
    assert priority.issue(units, [0.0] * 3, line, 20) == [3.0, 2.0, 1.0]  # input first
    assert [t for _, _, t in line.calls] == [0.0, 0.0, 1.0]
    # a 0.5 s cycle and room to fuse: all three start together at the first tick, as one
    line = _Line()
    done = priority.issue(units, [0.1] * 3, line, 100, cycle_s=0.5, fusion=48)
    assert done == [1.5] * 3 and line.calls == [(2, 48 * 4, 0.5)]


def test_bad_input_is_one_line_before_anything_runs(tmp_path) -> None:
    out = run_module("harness.simulate", "simulate.compute=h100", f"results_dir={tmp_path}")
    assert out.returncode == 2 and "simulate.compute='h100' is unknown" in out.stderr
    # a network with no facts needs the microbenchmark first, and says how; a sweep that
    # also holds a lone worker (which moves nothing) needs it all the same
    two = ["network=loopback", "cluster.workers_per_node=1,2", "simulate.compute=v100"]
    out = run_module("harness.simulate", *two, f"results_dir={tmp_path}")
    assert out.returncode == 2
    assert "python -m harness.microbench network=loopback" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
    # a lone worker alone crosses no link (GPU checklist step 10: a 1-GPU prediction)
    out = run_module("harness.simulate", "network=loopback", "simulate.compute=v100",
                     f"results_dir={tmp_path / 'lone'}")
    assert out.returncode == 0, out.stderr
    assert results.load(tmp_path / "lone").throughput.iloc[0] > 0
    # ... and a measured link no link could have is no measurement
    (tmp_path / "microbench").mkdir()
    pd.DataFrame({"network": ["loopback"], "kind": ["p2p"], "bytes": [1024],
                  "seconds": [4e-5], "alpha_s": [4e-5], "beta_s_per_byte": [-1e-9]}).to_parquet(
        tmp_path / "microbench" / "one-worker.parquet")
    out = run_module("harness.simulate", *two, f"results_dir={tmp_path}")
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "alpha=4e-05 s and beta=-1e-09 s/byte, which no link has" in out.stderr


def test_measured_compute_on_the_local_loopback(tmp_path) -> None:
    """Measure the link, profile the model here, simulate, and draw the report from it."""
    res = tmp_path / "results"
    out = run_module("harness.microbench", "cluster.workers_per_node=2", f"results_dir={res}",
                     "microbench.max_bytes=65536", "microbench.repeats=3")
    assert out.returncode == 0, out.stderr
    out = run_module("harness.simulate", "model=bert_tiny", "method=bsp_a2a,wfbp_ps",
                     "cluster.workers_per_node=1,2", "simulate.profile_iters=2",
                     "simulate.advise=true", f"results_dir={res}")
    assert out.returncode == 0, out.stderr
    frame = results.load(res)
    assert len(frame) == 4 and set(frame.source) == {"simulated"}
    assert (frame.throughput > 0).all()
    # two local workers share this machine: their compute is profiled in two processes at once
    assert set(frame[frame.world_size == 2].device) == {"measured:cpu x2 processes"}
    assert set(frame[frame.world_size == 1].device) == {"measured:cpu"}
    assert ("bert_tiny on 1 node(s) x 2 worker(s), loopback, measured:cpu x2 processes "
            "(compute calibrated: yes):") in out.stdout
    # ... and the slower of the two in each iteration: what every step of theirs is taken
    [straggle] = re.findall(r"the slowest of the 2 took ([\d.]+)x their mean", out.stdout)
    assert 1.0 <= float(straggle) < 2.0  # printed to 3 places
    plots = tmp_path / "plots"
    out = run_module("harness.report", f"results_dir={res}", f"out_dir={plots}")
    assert out.returncode == 0, out.stderr
    assert (plots / "fig_bert_tiny.png").exists()


def test_the_slowest_of_processes_profiled_together_over_their_mean() -> None:
    # k-th iterations side by side: the longest of each over their mean, 3 / 2 and 2 / 2
    assert trace.slowest([[1.0, 2.0], [3.0, 2.0]]) == pytest.approx(1.25)
    assert trace.slowest([[1.0, 2.0, 9.0], [3.0, 2.0]]) == pytest.approx(1.25)  # rounds of all
    assert trace.slowest([[1.0, 20.0], [3.0, 20.0]]) == pytest.approx(1.25)  # a share, not s
    assert trace.slowest([[1.0, 5.0]]) == 1.0  # one process waits for no one


def test_the_best_method_of_a_cell_names_its_ties_and_its_margin() -> None:
    frame = pd.DataFrame({
        "model": ["m"] * 5, "network": ["n"] * 5, "world_size": [1, 1, 8, 8, 8],
        "method": ["a", "b", "a", "b", "c"], "nodes": [1, 1, 2, 2, 1],
        "workers_per_node": [1, 1, 4, 4, 8], "throughput": [10.0, 10.0, 50.0, 40.0, 60.0],
        "speedup": [1.0] * 5, "bottleneck": ["compute"] * 5})
    best = sweep.best(frame)
    assert best.method.tolist() == ["a", "c"] and best.tied.tolist() == ["a=b", "c"]
    assert best.runner_up.tolist() == ["b", "a"]
    assert best.margin_pct.tolist() == pytest.approx([0.0, 20.0])
    assert (best.nodes.tolist(), best.workers_per_node.tolist()) == ([1, 1], [1, 8])
    assert sweep.summary(best) == "  m on n (GPUs: best method): 1 a=b, 8 c"


def test_a_big_sweep_says_how_far_it_is_and_the_best_method_per_cell(tmp_path) -> None:
    """The what-if sweep on one model and network: a row per configuration in one shard,
    progress instead of a line each, the best methods beside the shard; from the study's
    GPU and a warm cache, no torch."""
    args = ["experiment=whatif_study", "model=resnet50", "network=ib100_rdma"]
    for run in range(2):  # the first may fill the cache of FLOP counts (torch)
        out = subprocess.run([sys.executable, "-X", "importtime", "-m", "harness.simulate",
                              *args, f"results_dir={tmp_path / str(run)}"], cwd=REPO,
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
    assert not [line for line in out.stderr.splitlines()
                if re.search(r"\b(torch|torchvision|transformers)\b", line)]
    frame = results.load(tmp_path / "1")
    assert len(frame) == 9 * 124 and set(frame.source) == {"simulated"}
    assert "simulated 1116 configurations in" in out.stdout
    assert not set("\r\x1b") & set(out.stdout)  # off a terminal: plain lines only
    assert not re.search(r"^\[\d+/1116\]", out.stdout, re.M)  # no line per configuration
    best = pd.read_csv(next((tmp_path / "1").glob("sim-*_best.csv")))
    assert len(best) == frame.world_size.nunique()
    assert re.search(r"^  resnet50 on ib100_rdma \(GPUs: best method\): 1 ", out.stdout, re.M)


def test_the_cache_keeps_a_result_and_a_cache_it_cannot_write_is_no_error(tmp_path,
                                                                           monkeypatch) -> None:
    from harness.config import cache

    calls = []

    def make() -> dict:
        calls.append(1)
        return {"x": 1}

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache.cached("t", [1], make) == cache.cached("t", [1], make) == {"x": 1}
    assert len(calls) == 1
    (tmp_path / "file").write_text("")  # a file where the cache folder would go
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "file"))
    assert cache.cached("t", [1], make) == {"x": 1} and len(calls) == 2


# -- the study's engines (harness/predict/engines.py) -------------------------------------

POLL = 0.001  # conf/bench.yaml simulate.engines.handle_poll_s
GIL = 0.005   # conf/bench.yaml simulate.engines.gil_switch_s: CPython's switch interval


def test_the_study_engines_step_wakes_half_a_poll_after_its_last_handle() -> None:
    # BytePS and Horovod's WaitAndClear sleep 1 ms between polls: on average the step
    # starts half a poll after the all-reduce is done; our native engine has no such poll
    c = compute([1_000_000], [0.2])
    two = "cluster.workers_per_node=2"
    native = model.predict(cfg("bsp_a2a", two), c, net()).iteration_s
    horovod = model.predict(cfg("bsp_a2a", two, "engine=horovod"), c, net()).iteration_s
    assert native == pytest.approx(c.total_s + 2 * ALPHA + BETA * 4_000_000)
    assert horovod == pytest.approx(native + POLL / 2)
    # ByteScheduler's step waits on no handle (its poller thread spins)
    assert engines.engine_of(cfg("bytescheduler_a2a", two, "engine=horovod"),
                             PerTensor().plan([10]), [10], byte_s=0.0, net=net()).poll_s == 0


def test_the_engines_copies_and_divisions_run_on_the_compute_stream() -> None:
    # BSP-A2A on Horovod: the study's optimizer copies each gradient into the fused buffer
    # in its hook (8 bytes moved per element, during the backward), and Horovod divides
    # the reduced buffer by the worker count on the compute stream; the step, launched
    # half a poll after the all-reduce, queues behind the division
    byte_s = 1e-9
    c = dataclasses.replace(compute([1_000_000, 2_000_000], [0.1, 0.1]), byte_s=byte_s)
    two = ("cluster.workers_per_node=2", "engine=horovod")
    copy = 8 * 3_000_000 * byte_s  # both tensors copied into the one buffer
    divide = 8 * 3_000_000 * byte_s
    allreduce = 2 * ALPHA + BETA * 12_000_000
    pred = model.predict(cfg("bsp_a2a", *two), c, net())
    assert pred.iteration_s == pytest.approx(c.total_s + copy + allreduce + divide)
    assert divide > POLL / 2
    # WFBP all-reduces each tensor alone: nothing to copy, a division per tensor; the
    # output-side tensor's all-reduce and division hide in the 0.1 s of backward left
    wfbp = model.predict(cfg("wfbp_a2a", *two), c, net())
    last = 2 * ALPHA + BETA * 8_000_000
    assert wfbp.iteration_s == pytest.approx(c.total_s + last + 8 * 2_000_000 * byte_s)


def test_horovods_negotiation_is_one_round_of_gathers_and_broadcasts() -> None:
    # 8 workers on 2 nodes: log2(8) = 3 tree levels of the inter-node start-up, per
    # collective; the cache off: a Gather, a Gatherv and two Bcasts; on: one Allreduce
    shape = ("cluster.nodes=2", "cluster.workers_per_node=4", "engine=horovod")
    off = cfg("bytescheduler_a2a", *shape, "method.horovod.cache_capacity=0")
    on = cfg("bytescheduler_a2a", *shape)
    assert engines.negotiation_s(off, net()) == pytest.approx(4 * 3 * ALPHA)
    assert engines.negotiation_s(on, net()) == pytest.approx(2 * 3 * ALPHA)


def test_bytescheduler_updates_wait_for_the_poller_and_share_the_compute_stream() -> None:
    # one tensor, one layer, 2 nodes: its all-reduce (A) starts at the end of backward;
    # the poller launches its hand-written SGD update h after it (2 ops and a loop over one
    # parameter), the next forward waits for that launch, and the update's 10 ms run on
    # the compute stream before the forward: each iteration is compute + A + h
    c = compute([1_000_000], [0.05])
    shape = ("cluster.nodes=2", "engine=horovod", "method.scheduler.cycle_s=0",
             "method.horovod.cycle_time_s=0", "model.optimizer.name=sgd")
    # (the piece goes a switch interval after it is ready: the core's scheduler thread,
    # woken by the poller, waits that long for the GIL)
    a = 2 * ALPHA + BETA * 4_000_000
    h = 2 * 1e-5 + 1 * 1.4e-6  # update_ops[sgd] x op_launch_s + scan_s
    for clock in ("false", "device"):
        pred = model.predict(cfg("bytescheduler_a2a", *shape, f"run.sync_each_step={clock}"),
                             c, net())
        assert pred.iteration_s == pytest.approx(c.total_s + GIL + a + h), clock
    # our native engine's ByteScheduler has no hand-written updates: no h
    native = model.predict(cfg("bytescheduler_a2a", *shape[:1], *shape[2:]), c, net())
    assert native.iteration_s == pytest.approx(c.total_s + a)


def test_a_thread_woken_while_the_poller_spins_waits_a_switch_interval_for_the_gil() -> None:
    # the core's scheduler thread, notified by the poller that a piece is ready, submits it
    # once it has the GIL: a switch interval later; here a 1 s cycle and a 0.5 s wait: a
    # piece ready at 0.6 s misses the tick at 1 s and starts at 2 s; without the GIL at 1 s
    units = PerTensor().plan([16])
    for wake, tick in ((0.0, 1.0), (0.5, 2.0)):
        line = _Line()
        assert priority.issue(units, [0.6], line, 100, cycle_s=1.0, wake_s=wake) == [tick + 1]
        assert line.calls == [(0, 64, tick)]
    # the training thread, blocked on the input-side layer's lock (its piece jumped the
    # queue), wakes when the poller launches that update but gets the GIL a switch
    # interval later, as the poller still has the output side's update to come; the
    # output side's lock, released by the poller's last update, costs nothing more (the
    # poller then blocks on its empty queue)
    c = Compute([12_000_000, 10_000], [0.05, 0.05], [0, 1], [((1,), 0.5), ((0,), 0.1)],
                0.0, "test")
    log: list = []
    model.predict(cfg("bytescheduler_a2a", "cluster.nodes=2", "engine=horovod",
                      "method.scheduler.credit_elements=4000000"), c, net(), log=log)
    first = max(i for i, e in enumerate(log) if e[1] == "wait: update") - 1  # last forward's
    (_, one, _, woken, _), (_, other, _, last, _) = log[first:first + 2]
    updates = {e[1]: e[3] for e in log[:first] if e[0] == "updates"}  # the latest launches
    assert one == other == "wait: update"
    assert updates["update tensor 1"] < updates["update tensor 0"]  # input side first
    assert woken == pytest.approx(updates["update tensor 1"] + GIL)
    assert last == pytest.approx(updates["update tensor 0"])


def test_a_slowdown_stretches_communication_only_while_the_gpu_computes() -> None:
    # a 1 s all-reduce starting 0.5 s before the end of the compute, slowed 2x meanwhile:
    # 0.25 s of it done by then, the remaining 0.75 s at full speed
    assert network.stretched(0.0, 1.0, 0.5, 1.0) == pytest.approx(1.25)
    assert network.stretched(0.0, 0.2, 0.5, 1.0) == pytest.approx(0.4)  # all of it slowed
    # WFBP: the output-side tensor's all-reduce (~42 ms) hides in 0.5 s of backward even
    # slowed 3x; the input-side one starts after backward: unchanged either way
    c = compute([1_000_000, 10_000], [0.0004, 0.5])
    two = cfg("wfbp_a2a", "cluster.workers_per_node=2")
    assert model.predict(two, c, net(), slowdown=2.0).iteration_s == pytest.approx(
        model.predict(two, c, net()).iteration_s)
    # BSP's one all-reduce runs after the backward: never slowed
    bsp = cfg("bsp_a2a", "cluster.workers_per_node=2")
    assert model.predict(bsp, c, net(), slowdown=2.0).iteration_s == pytest.approx(
        model.predict(bsp, c, net()).iteration_s)
    # a tensor whose all-reduce (2 ms + 40 ms) starts 10 ms before the end of backward,
    # slowed 2x: 5 ms of it done by then, 37 ms after
    late = compute([1_000_000, 10_000], [0.5, 0.01])
    slowed = model.predict(two, late, net(), slowdown=1.0).iteration_s
    assert slowed - model.predict(two, late, net()).iteration_s == pytest.approx(0.005)


def test_the_simulated_rows_carry_both_rate_statistics() -> None:
    # every simulated iteration of the steady state is alike: the study's mean of 10-step
    # rates on rank 0 equals the window's rate
    c = compute([1_000_000], [0.2])
    one = cfg("bsp_a2a", "cluster.workers_per_node=2", "run.rate=study")
    r = sweep.row(one, model.predict(one, c, net()), c, run_id="t")
    assert r["throughput"] == r["throughput_window"] == r["throughput_study"] > 0


def test_the_studys_synchronize_holds_the_gil_so_no_piece_goes_before_the_backward_ends() -> None:
    # PyTorch 1.4's torch.cuda.synchronize() waits for the GPU holding the GIL: the plug-in's
    # poller and core stand still, so the output-side piece, ready halfway through the
    # backward, starts only once the backward is done (and a switch interval later: the
    # core then waits for the GIL); without the study's clock, or with a synchronize that
    # lets the GIL go, it starts halfway
    c = compute([1_000_000, 1_000_000], [0.05, 0.05])
    shape = ("cluster.nodes=2", "engine=horovod", "method.scheduler.cycle_s=0",
             "method.horovod.cycle_time_s=0", "model.optimizer.name=sgd")

    def starts(*overrides: str) -> tuple[list[float], list[float], float]:
        log: list = []
        pred = model.predict(cfg("bytescheduler_a2a", *shape, *overrides), c, net(), log=log)
        backward = [e[3] for e in log if e[:2] == ("compute", "backward")]
        units = [e[2] for e in log if e[0] == "comm" and e[1].startswith("unit ")]
        return backward, units, pred.iteration_s

    backward, units, held = starts("run.sync_each_step=device")
    assert len(units) == 2 * len(backward)  # two pieces an iteration
    for end, first in zip(backward, units[::2]):
        assert first == pytest.approx(end + GIL)
    for clock in ("run.sync_each_step=false", "simulate.engines.sync_holds_gil=false"):
        backward, units, free = starts("run.sync_each_step=device", clock)
        assert units[-2] == pytest.approx(backward[-1] - 0.05 + GIL), clock
        assert free < held, clock
