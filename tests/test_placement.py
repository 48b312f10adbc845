"""Where each rank runs and how it talks, for GPU configurations too (no GPU needed),
and that a repeat's model, method and optimizer are gone before the next is built."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from harness import config
from harness.config import ConfigError
from harness.config.ranks import torch_threads
from harness.launch.rank import Seat, group_backend, pick_device, placed_devices
from tests.conftest import REPO, SMALL_BERT, TINY


def test_an_nccl_run_sends_cpu_tensors_over_gloo_and_servers_hold_no_nccl() -> None:
    assert group_backend("nccl", worker=True) == "cpu:gloo,cuda:nccl"
    assert group_backend("nccl", worker=False) == "cpu:gloo"  # no CUDA context, GPUs or not
    assert group_backend("gloo", worker=True) == group_backend("gloo", worker=False) == "gloo"


@pytest.mark.parametrize(("rank", "visible", "expected"), [(0, 4, "cuda:0"), (3, 4, "cuda:3")])
def test_a_local_worker_takes_the_gpu_of_its_rank(rank, visible, expected) -> None:
    assert pick_device("cuda", worker=True, index=rank, visible=visible) == torch.device(expected)


def test_servers_and_cpu_runs_stay_on_the_cpu() -> None:
    assert pick_device("cuda", worker=False, index=2, visible=4).type == "cpu"
    assert pick_device("cpu", worker=True, index=0, visible=4).type == "cpu"


@pytest.mark.parametrize("visible", [0, 1, 2])
def test_a_local_worker_without_a_gpu_of_its_own_is_told_the_fix(visible) -> None:
    with pytest.raises(ConfigError, match=r"worker 2 has no GPU.*cluster.device=cpu"):
        pick_device("cuda", worker=True, index=2, visible=visible)


@pytest.mark.parametrize(("nodes", "per_node", "fits"), [(2, 1, True), (2, 2, True), (3, 2, False),
                                                          (1, 5, False)])
def test_emulated_nodes_on_a_gpu_host_get_gpus_of_their_own(monkeypatch, nodes, per_node,
                                                             fits) -> None:
    """Every emulated node's workers run on this host: worker r takes GPU r, so two nodes
    never share GPU 0, and a layout with more workers than GPUs is refused before a start."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    overrides = [f"cluster.nodes={nodes}", f"cluster.workers_per_node={per_node}",
                 "cluster.device=cuda", "method=ddp"]
    if not fits:
        with pytest.raises(ConfigError, match=rf"= {nodes * per_node} workers.*exceed its 4 GPUs"):
            config.load(overrides)  # validates
        return
    config.load(overrides)
    workers = nodes * per_node
    devices = [pick_device("cuda", worker=True, index=r, visible=4) for r in range(workers)]
    assert len(set(devices)) == workers  # the emulated nodes' GPUs are disjoint


def test_srun_cpus_per_task_are_not_divided_again(monkeypatch) -> None:
    cfg = config.load(["run.threads=0"])
    cores = len(os.sched_getaffinity(0))
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "1")
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    assert torch_threads(cfg, 4, placed=True) == 1
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", str(cores))
    assert torch_threads(cfg, 2, placed=True) == cores
    assert torch_threads(cfg, 2, placed=False) == max(1, cores // 2)


@pytest.mark.parametrize("servers", [False, True], ids=["collectives", "servers"])
def test_nothing_of_a_repeat_is_alive_in_the_next(servers: bool, tmp_path) -> None:
    names = [m for m in config.choices("method") if m.endswith("_ps") == servers]
    # two nodes of one worker: the PS methods push to their two servers
    shape = ["cluster.nodes=2"] if servers else ["cluster.workers_per_node=2"]
    code = ("import sys; from harness.launch.launcher import command; "
            "from harness.launch.process import exit_now; "
            "exit_now(command(sys.argv[1:], name='harness.run', entry='tests.release_entry'))")
    out = subprocess.run(
        [sys.executable, "-c", code, *TINY, *SMALL_BERT, f"method={names[0]}",
         *shape, f"results_dir={tmp_path}"],
        cwd=REPO, capture_output=True, text=True, timeout=600,
        env={**os.environ, "RELEASE_METHODS": ",".join(names)})
    assert out.returncode == 0, out.stderr[-3000:]


# -- ranks placed by torchrun or srun: devices from the launcher's host and local rank ------

def _seats(*spec: tuple[str, int, bool, tuple[str, ...]]) -> list[Seat]:
    return [Seat(rank=r, host=h, local_rank=lr, worker=w, gpus=g)
            for r, (h, lr, w, g) in enumerate(spec)]


FOUR = ("0", "1", "2", "3")


def _devices(seats: list[Seat], **kw) -> list[str]:
    kw = {"workers_per_node": 2, "device_type": "cuda", "backend": "nccl", **kw}
    return [str(d) for d in placed_devices(seats, **kw)]


def test_workers_take_their_place_on_the_host_not_the_launchers_local_rank() -> None:
    # a server first on host a (local rank 0): the workers still get GPUs 0 and 1
    seats = _seats(("a", 1, True, FOUR), ("a", 2, True, FOUR), ("b", 0, True, FOUR),
                   ("b", 1, True, FOUR), ("a", 0, False, ()))
    assert _devices(seats) == ["cuda:0", "cuda:1", "cuda:0", "cuda:1", "cpu"]


def test_two_ranks_of_one_local_rank_get_two_gpus() -> None:
    # two torchrun agents on one host, each numbering its ranks from 0
    seats = _seats(("a", 0, True, FOUR), ("a", 0, True, FOUR))
    assert _devices(seats, workers_per_node=1) == ["cuda:0", "cuda:1"]


def test_a_task_that_sees_one_gpu_uses_it() -> None:
    seats = _seats(("a", 0, True, ("2",)), ("a", 1, True, ("3",)))
    assert _devices(seats) == ["cuda:0", "cuda:0"]


def test_a_node_split_over_two_hosts_fails_naming_the_rank_and_hosts() -> None:
    # srun -N2 -n6 block placement of 2 nodes x 2 workers + 2 servers: rank 2 lands on a
    seats = _seats(("a", 0, True, FOUR), ("a", 1, True, FOUR), ("a", 2, True, FOUR),
                   ("b", 0, True, FOUR), ("b", 1, False, ()), ("b", 2, False, ()))
    with pytest.raises(ConfigError, match=r"rank 3 is a worker of node 1 but runs on host b, "
                                          r"and rank 2 of that node on a"):
        _devices(seats)


def test_more_workers_than_gpus_on_a_host_fails_naming_the_rank() -> None:
    seats = _seats(("a", 0, True, ("0", "1")), ("a", 1, True, ("0", "1")),
                   ("a", 2, True, ("0", "1")))
    with pytest.raises(ConfigError, match="rank 2 is worker 3 of 3 on host a, whose tasks see 2"):
        _devices(seats, workers_per_node=3)


def test_two_nccl_workers_on_one_gpu_fail_but_gloo_may_share_it() -> None:
    # gpu-checklist step 7: two ranks by hand on a one-GPU machine, LOCAL_RANK=0 each
    seats = _seats(("a", 0, True, ("0",)), ("a", 0, True, ("0",)))
    with pytest.raises(ConfigError, match="ranks 0 and 1 would share GPU 0 of host a"):
        _devices(seats, workers_per_node=1)
    assert _devices(seats, workers_per_node=1, backend="gloo") == ["cuda:0", "cuda:0"]


def test_a_server_beside_workers_fails_where_servers_have_nodes_of_their_own() -> None:
    seats = _seats(("a", 0, True, FOUR), ("a", 1, True, FOUR), ("a", 2, False, ()))
    assert _devices(seats) == ["cuda:0", "cuda:1", "cpu"]  # co-located: fine
    with pytest.raises(ConfigError, match="rank 2 is a parameter server but runs on host a "
                                          "with worker rank 1"):
        _devices(seats, dedicated_servers=True)


def test_cpu_runs_check_the_layout_and_use_the_cpu() -> None:
    seats = _seats(("a", 0, True, ()), ("a", 1, True, ()), ("b", 0, False, ()))
    assert _devices(seats, device_type="cpu", backend="gloo") == ["cpu"] * 3
