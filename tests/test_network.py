"""Emulated clusters: real namespaces, veth pairs, a bridge and tbf-limited links."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pandas as pd
import pytest

from harness.config import checks
from harness.launch import netem
from harness.measure import cpumeter, results
from tests.conftest import REPO, TINY, run_module

pytestmark = [
    pytest.mark.network,
    pytest.mark.serial,  # link rates, and the CPU a shaped link costs, measured machine-wide
    pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root"),
    pytest.mark.skipif(bool(checks.missing_net_tools()), reason="ip/tc (iproute2) are missing"),
]

# Receives for a while on one host, sends as fast as possible from the other.
SINK = textwrap.dedent("""
    import socket, sys, time
    s = socket.create_server(("0.0.0.0", 5999)); c, _ = s.accept(); n = 0
    while b := c.recv(1 << 20):
        if n == 0: t = time.perf_counter()
        n += len(b)
    print(n * 8 / (time.perf_counter() - t) / 1e6)
""")
SOURCE = textwrap.dedent("""
    import socket, sys, time
    for _ in range(50):
        try: c = socket.create_connection((sys.argv[1], 5999)); break
        except OSError: time.sleep(0.1)
    end = time.perf_counter() + 3
    while time.perf_counter() < end: c.sendall(b"x" * (1 << 16))
""")


@pytest.mark.parametrize("rate_mbit", [50, 200])
def test_link_bandwidth_matches_the_configured_rate(rate_mbit: int) -> None:
    with netem.EmulatedNetwork(hosts=2, rate_mbit=rate_mbit) as net:
        sink = subprocess.Popen(net.command(1, [sys.executable, "-c", SINK]),
                                stdout=subprocess.PIPE, text=True)
        subprocess.run(net.command(0, [sys.executable, "-c", SOURCE, net.address(1)]),
                       check=True, timeout=60)
        measured = float(sink.communicate(timeout=60)[0])
    assert abs(measured - rate_mbit) / rate_mbit < 0.15, f"{measured:.1f} Mbit/s"
    assert netem.leftovers(net.token) == []


def test_a_shaped_link_keeps_no_core_busy_cutting_packets() -> None:
    """A 1 Gbit/s link whose bucket held less than a GSO packet kept a core busy in softirq
    (tbf cutting every packet in software: 1.06 cores); one that holds it, 0.16-0.18."""
    with netem.EmulatedNetwork(hosts=2, rate_mbit=1000) as net:
        sink = subprocess.Popen(net.command(1, [sys.executable, "-c", SINK]),
                                stdout=subprocess.PIPE, text=True)
        before, start = cpumeter.busy_seconds(), time.monotonic()
        subprocess.run(net.command(0, [sys.executable, "-c", SOURCE, net.address(1)]),
                       check=True, timeout=60)
        cores = (cpumeter.busy_seconds() - before) / (time.monotonic() - start)
        measured = float(sink.communicate(timeout=60)[0])
    assert measured > 800, f"{measured:.1f} Mbit/s"
    assert cores < 0.7, f"{cores:.2f} cores busy while 1 Gbit/s went over the link"


# A worker posts 16 pulls and pushes at once; a server takes the pushes one at a time, as
# its stream does, answering each. Prints the seconds on one connection, then on two.
EXCHANGE = textwrap.dedent("""
    import sys, time, torch, torch.distributed as dist
    from methods.ps import wire
    rank, peer = int(sys.argv[1]), 1 - int(sys.argv[1])
    dist.init_process_group("gloo", init_method=f"tcp://{sys.argv[2]}:29591", rank=rank,
                            world_size=2)
    chunks = [torch.ones(1 << 18) for _ in range(16)]  # 1 MiB each
    def exchange(w):
        dist.barrier(); start = time.perf_counter()
        if rank == 0:
            works = [w.irecv(torch.empty_like(c), peer, 1000 + i) for i, c in enumerate(chunks)]
            works += [w.isend(c, peer, 100 + i) for i, c in enumerate(chunks)]
        else:
            works = []
            for i, c in enumerate(chunks):
                w.irecv(c, peer, 100 + i).wait()
                works.append(w.isend(c, peer, 1000 + i))
        for work in works: work.wait()
        dist.barrier(); return time.perf_counter() - start
    shared, split = wire.Gloo(), wire.Gloo(timeout_s=60)
    times = [(exchange(shared), exchange(split)) for _ in range(2)]
    if rank == 0: print(min(a for a, _ in times), min(b for _, b in times))
    dist.destroy_process_group()
""")


def test_pushes_and_pulls_share_a_link_at_once_on_the_started_gloo_wire() -> None:
    """Gloo sends once the receiver said it is ready, a word that waits on the pair's one
    connection behind the data queued the other way: a server's next "ready" behind its
    last answer, so pushes and pulls took turns. The started wire sends each direction on
    a connection of its own (methods/ps/wire.py `Gloo`)."""
    with netem.EmulatedNetwork(hosts=2, rate_mbit=200) as net:
        def rank(r: int) -> subprocess.Popen:
            env = {**os.environ, **net.environment(r), "PYTHONPATH": str(REPO)}
            return subprocess.Popen(net.command(r, [sys.executable, "-c", EXCHANGE, str(r),
                                                    net.address(0)]),
                                    env=env, stdout=subprocess.PIPE, text=True)
        ranks = [rank(0), rank(1)]
        out = ranks[0].communicate(timeout=120)[0]
        assert ranks[1].wait(timeout=60) == 0 and ranks[0].returncode == 0
    shared, split = map(float, out.split())
    one_way = 16 * (1 << 20) * 8 / 200e6  # the pushes at the link's rate
    assert split > 0.8 * one_way, f"{split:.3f} s: the link is not limiting ({one_way:.3f} s)"
    assert split < 0.75 * shared, f"a connection a direction {split:.3f} s, one {shared:.3f} s"


def test_network_is_removed_after_an_error() -> None:
    with pytest.raises(RuntimeError), netem.EmulatedNetwork(hosts=3, rate_mbit=100) as net:
        assert len(netem.leftovers(net.token)) == 1 + 3 + 3  # bridge, namespaces, veths
        raise RuntimeError("boom")
    assert netem.leftovers(net.token) == []


@pytest.mark.parametrize("method", ["bsp_a2a", "ddp"])
def test_two_node_run_on_a_slow_link(method: str, results_dir) -> None:
    before = netem.leftovers()
    out = run_module("harness.run", *TINY, "cluster=emulated", "network=eth100m",
                     "model=bert_tiny", f"method={method}", f"results_dir={results_dir}")
    assert out.returncode == 0, out.stderr
    row = results.load(results_dir).iloc[0]
    assert (row.status, row.network, row.nodes, row.world_size) == ("ok", "eth100m", 2, 2)
    # 17.7 MB of gradients cross a 100 Mb/s link at least once per iteration
    assert row.timed_s > 2 * 17.7e6 * 8 / 100e6
    assert netem.leftovers() == before


def test_killed_worker_leaves_no_namespace_behind(results_dir) -> None:
    before = netem.leftovers()
    started = time.monotonic()
    out = run_module("harness.run", *TINY, "cluster=emulated", "network=eth100m",
                     "model=bert_tiny", "run.fault.rank=1", "run.fault.at_iter=1",
                     "run.fault.kind=exit", f"results_dir={results_dir}")
    assert out.returncode != 0 and time.monotonic() - started < 120
    assert results.load(results_dir).status.tolist() == ["failed"]
    assert netem.leftovers() == before


def test_rate_limited_network_needs_an_emulated_cluster(capsys, results_dir) -> None:
    from harness import run

    assert run.main([*TINY, f"results_dir={results_dir}", "network=eth100m"]) == 2
    assert "cluster=emulated" in capsys.readouterr().err


def test_microbench_sees_the_link_rate(results_dir) -> None:
    out = run_module("harness.microbench", "cluster=emulated", "network=eth100m",
                     "microbench.min_bytes=65536", "microbench.max_bytes=4194304",
                     "microbench.repeats=3", f"results_dir={results_dir}")
    assert out.returncode == 0, out.stderr
    frame = pd.read_parquet(next((results_dir / "microbench").glob("*.parquet")))
    p2p = frame[frame.kind == "p2p"]
    gbit = 8 / p2p.beta_s_per_byte.iloc[0] / 1e9
    assert abs(gbit - 0.1) / 0.1 < 0.25, f"fitted p2p bandwidth {gbit:.3f} Gbit/s"
    # a ring all-reduce of 2 nodes moves each byte over the link once each way
    allreduce = frame[frame.kind == "allreduce"]
    assert allreduce.beta_s_per_byte.iloc[0] > 0.5 * p2p.beta_s_per_byte.iloc[0]
    assert results.load(results_dir).empty, "microbench data is not benchmark shards"


def test_every_rank_of_an_emulated_node_tells_nccl_its_own_host_and_veth(tmp_path) -> None:
    # issue 38: `ip netns exec` changes neither the host name nor the boot id, from which
    # NCCL tells hosts apart; without NCCL_HOSTID every emulated node would be one host
    code = ("import os, sys; from harness.launch.launcher import command; "
            "print(os.getpid(), flush=True); "
            "from harness.launch.process import exit_now; "
            "exit_now(command(sys.argv[1:], name='harness.run', entry='tests.env_entry'))")
    out = subprocess.run(
        [sys.executable, "-c", code, *TINY, "cluster=emulated", "cluster.nodes=3",
         "network=eth100m", "cluster.device=cpu", f"results_dir={tmp_path}"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
        env={**os.environ, "NCCL_SOCKET_IFNAME": "ib0", "NCCL_IB_DISABLE": "0"})
    assert out.returncode == 0, out.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"env_rank{r}.json").read_text()) for r in range(3)]
    hosts = [rank["namespace"] for rank in ranks]
    assert len(set(hosts)) == 3 and all(h.startswith(netem.PREFIX) for h in hosts)
    [zygote] = {rank["parent"] for rank in ranks}  # forks of the launcher's zygote, which
    assert zygote != int(out.stdout.split()[0])  # moved each into its node (netem.enter)
    for rank in ranks:
        env = rank["env"]
        assert env["NCCL_HOSTID"] == rank["namespace"]  # the namespace it really runs in
        assert (env["NCCL_SOCKET_IFNAME"], env["GLOO_SOCKET_IFNAME"]) == ("=eth0", "eth0")
        assert (env["NCCL_IB_DISABLE"], env["NCCL_NET"]) == ("1", "Socket")  # not the site's
