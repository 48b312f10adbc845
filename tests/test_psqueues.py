"""The PS path in the simulator (harness/predict/psqueues.py): a node's threads as stages,
at full depth (BytePS's, what runs) or in order (the path before), the server's in-order stream as
psbench's flight measured it, and the wire a network profile names (issue 43, issue 40
items 4 and 6)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from harness import config
from harness.config import checks
from harness.measure import results
from harness.predict import fastsweep, network, psqueues
from harness.predict.model import predict
from harness.predict.sweep import inputs
from methods.costmodel import Cost

ALPHA, BETA = 1e-4, 8e-9  # a 1 Gb/s link
MB4 = 4_000_000


def _net(**kw) -> network.Network:
    """CPU nodes (no bus, no summing timed), the test's link between nodes."""
    return network.Network("test", Cost(0.0, 0.0), Cost(ALPHA, BETA), "ring", False, **kw)


def _issue(path: str, parts: list[list[tuple[int, int]]], net: network.Network,
           per_node: int = 1) -> list[float]:
    """Every unit issued at t = 0, in plan order, on 2 nodes and 2 servers: when each lands."""
    ps = psqueues.ParameterServers(net, parts, 2, per_node, 2, True,
                                   path=psqueues.PATHS[path])
    return ps.issue_all([0] * len(parts), [0.0] * len(parts))


def test_a_small_unit_lands_behind_a_large_one_in_order_but_not_at_full_depth() -> None:
    # the embeddings' 16 MB in 4 partitions on server 1, then a 512-byte unit on server 0
    parts = [[(MB4, 1)] * 4, [(512, 0)]]
    inorder = _issue("inorder", parts, _net())
    full = _issue("full", parts, _net())
    assert inorder[1] == inorder[0]  # the lander waits for the large unit's pulls first
    assert full[0] == pytest.approx(inorder[0])  # the large unit's way is the same
    # at full depth the small unit's pull lands as it comes, behind the large unit's
    # pushes on the node's uplink and its answers on the downlink so far, not its last
    assert full[1] < full[0] - MB4 * BETA / 2  # the large one's last answer still out


def test_at_full_depth_the_stages_still_share_the_nodes_bus() -> None:
    # 2 nodes of 3 GPUs copying to the host: at full depth a thread per stage, but the
    # reduce-scatter and the copy out move their bytes over the same PCIe bus, so 10
    # partitions take 10 of both, as in order (a lane per stage made the study's PS
    # methods up to 25% too fast)
    gpu = network.Network("test", Cost(0.0, 1e-10), Cost(0.0, 0.0), "ring", True)
    unit = [[(MB4, i % 2) for i in range(10)]]
    ways = {path: psqueues.ParameterServers(gpu, unit, 2, 3, 2, True, path=psqueues.PATHS[path])
            for path in psqueues.PATHS}
    done = {path: ps.issue(0, 10 * MB4, 0.0) for path, ps in ways.items()}
    rs, copy = 2 * 2 / 3 * MB4 * 1e-10, 2 / 3 * MB4 * 1e-10  # bus seconds per partition
    for path in psqueues.PATHS:
        assert ways[path].busy["bus_up"] == pytest.approx(10 * (rs + copy))
        # the wire is free here: the way out, then the last partition's way back
        assert done[path] == pytest.approx(10 * (rs + copy) + rs + copy)


def test_a_flight_through_the_model_takes_what_psbench_measured() -> None:
    # psbench: 16 partitions of one unit in flight, each 0.5 ms + 34 ns a byte (on Gloo
    # pushes and answers take turns: 4 x 8 ns of the server's link per byte, 2 roots)
    fit, k = Cost(5e-4, 34e-9), 16
    net = _net(ps_flight=(((2, 1), (fit, k)),))
    # with or without a round trip's handling beyond its messages (on the server's in-link)
    handled = _net(ps_flight=net.ps_flight, ps=(((2, 1), Cost(4e-4, 36e-9)),))
    for size in (4096, 262_144):
        unit = [[(size, 0)] * k]
        for flown in (net, handled):
            done = psqueues.ParameterServers(flown, unit, 2, 1, 1, True).issue(0, 0, 0.0)
            assert done == pytest.approx(k * fit.seconds(size), rel=1e-9)
        bare = psqueues.ParameterServers(_net(), unit, 2, 1, 1, True).issue(0, 0, 0.0)
        assert bare < 0.7 * done  # the links alone let the pushes follow one another
    # the stream is the shape's and the wire's: another shape does not take it
    assert psqueues._stream(net, (3, 1), senders=3) == Cost(0.0, 0.0)


def test_the_fast_path_runs_the_same_stages(monkeypatch) -> None:
    jobs = [[f"model={m}", f"method={meth}", "network=eth10_tcp", "simulate.compute=rtx2080ti",
             "cluster.nodes=2", f"cluster.workers_per_node={g}"]
            for m in ("resnet50", "bert_base") for meth in ("wfbp_ps", "bsp_ps") for g in (1, 4)]
    for path in psqueues.PATHS:  # both node paths: BytePS's (what runs) and the in-order one
        monkeypatch.setattr(psqueues, "DEFAULT_PATH", path)
        cfgs = config.load_all(jobs, simulate=True)
        given = inputs(cfgs)
        full = [predict(c, comp, given.networks[network.key(c)]) for c, comp in
                zip(cfgs, given.computes)]
        assert {p.plan["ps_path"] for p in full} == {path}
        groups = [fastsweep.Group(c, np.array([c.cluster.nodes]),
                                  np.array([c.cluster.workers_per_node])) for c in cfgs]
        fast = fastsweep.predict_groups(groups)
        slow = pd.DataFrame([{"model": c.model.name, "method": c.method.name,
                              "workers_per_node": c.cluster.workers_per_node,
                              "slow": p.throughput} for c, p in zip(cfgs, full)])
        both = slow.merge(fast, on=["model", "method", "workers_per_node"])
        assert len(both) == len(jobs)
        assert (both.throughput / both.slow - 1).abs().max() <= 0.01, (path, both)


def test_a_profile_names_its_ps_wire_and_this_machines_take_the_runs(tmp_path: Path) -> None:
    for name, wire in (("ib100_rdma", "rdma"), ("eth10_tcp", "tcp"), ("ib_ndr", "rdma")):
        cfg = config.load([f"network={name}"], simulate=True)
        assert network.network(cfg).ps_wire == wire
    # this machine's network: the run's wire (gloo); a flight measured on another wire is
    # not this run's
    folder = tmp_path / results.OTHER_DATA
    folder.mkdir(parents=True)
    for i, (wire, alpha) in enumerate((("gloo", 1e-3), ("ucx", 2e-4))):
        frame = pd.DataFrame([{"kind": kind, "ranks": ranks, "bytes": 1024, "seconds": a,
                               "alpha_s": a, "beta_s_per_byte": b}
                              for kind, ranks, a, b in (("p2p", "0-1", 1e-4, 8e-9),
                                                        ("allreduce", "all", 2e-4, 2e-8),
                                                        ("ps_flight", "roots-2x16", alpha, 3e-8))])
        frame.assign(run_id=f"r{i}", cluster="emulated", network="eth1g", world_size=2,
                     nodes=2, workers_per_node=1, ps_wire=wire).to_parquet(folder / f"r{i}.parquet")
    cfg = config.load(["cluster=emulated", "network=eth1g", f"results_dir={tmp_path}"],
                      simulate=True)
    net = network.network(cfg)
    assert net.ps_wire == "gloo"
    assert dict(net.ps_flight) == {(2, 1): (Cost(1e-3, 3e-8), 16)}


def test_a_profiles_ps_wire_is_one_a_real_network_has() -> None:
    profile = {"name": "x", "inter_node": {"gbit_per_s": [[1024, 1.0]]}, "ps_wire": "gloo"}
    with pytest.raises(config.ConfigError, match="network.ps_wire='gloo' is invalid"):
        checks.check_network(profile)
    checks.check_network({**profile, "ps_wire": "rdma"})
    with pytest.raises(config.ConfigError, match="network.ps_wire"):  # this machine's: the run's
        checks.check_network({"name": "y", "rate_mbit": 100.0, "ps_wire": "tcp"})
