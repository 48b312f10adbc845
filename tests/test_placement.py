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
from harness.launch.rank import group_backend, pick_device
from tests.conftest import REPO, TINY


def test_an_nccl_run_sends_cpu_tensors_over_gloo_and_servers_hold_no_nccl() -> None:
    assert group_backend("nccl", worker=True) == "cpu:gloo,cuda:nccl"
    assert group_backend("nccl", worker=False) == "cpu:gloo"  # no CUDA context, GPUs or not
    assert group_backend("gloo", worker=True) == group_backend("gloo", worker=False) == "gloo"


@pytest.mark.parametrize(("local_rank", "visible", "expected"), [
    (0, 4, "cuda:0"), (3, 4, "cuda:3"),
    (3, 1, "cuda:0"),  # srun --gpus-per-task=1: the one GPU the task sees
])
def test_a_gpu_worker_takes_the_gpu_its_task_sees(local_rank, visible, expected) -> None:
    assert pick_device("cuda", worker=True, local_rank=local_rank,
                       visible=visible) == torch.device(expected)


def test_servers_and_cpu_runs_stay_on_the_cpu() -> None:
    assert pick_device("cuda", worker=False, local_rank=2, visible=4).type == "cpu"
    assert pick_device("cpu", worker=True, local_rank=0, visible=4).type == "cpu"


@pytest.mark.parametrize("visible", [0, 2])
def test_a_worker_without_a_gpu_of_its_own_is_told_how_to_bind(visible) -> None:
    with pytest.raises(ConfigError, match="gpus-per-task"):
        pick_device("cuda", worker=True, local_rank=2, visible=visible)


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
            "from harness.launch.rank import exit_now; "
            "exit_now(command(sys.argv[1:], entry='tests.release_entry'))")
    out = subprocess.run(
        [sys.executable, "-c", code, *TINY, "model=bert_tiny", f"method={names[0]}",
         *shape, f"results_dir={tmp_path}"],
        cwd=REPO, capture_output=True, text=True, timeout=600,
        env={**os.environ, "RELEASE_METHODS": ",".join(names)})
    assert out.returncode == 0, out.stderr[-3000:]
