"""Every config option composes; bad input is one line and exit code 2, before anything runs."""

from __future__ import annotations

import os

import pytest

from harness import config, run
from tests.conftest import TINY, run_module


@pytest.mark.parametrize("group", ["model", "method", "cluster", "network"])
def test_every_choice_composes_and_validates(group: str) -> None:
    # rate-limited network profiles belong to emulated clusters (which need root)
    # real networks are for the simulator
    extra = ["cluster=emulated"] if group == "network" and os.geteuid() == 0 else []
    for name in config.choices(group):
        real = config.is_real_network(config.compose_raw([f"{group}={name}"]).network)
        if real:
            cfg = config.load([f"{group}={name}"], simulate=True)
        elif group == "network" and not extra:
            cfg = config.compose_raw([f"{group}={name}"])
        else:
            cfg = config.load([f"{group}={name}", *extra])
        assert cfg[group].name == name, f"conf/{group}/{name}.yaml must say name: {name}"


def test_real_networks_are_for_the_simulator_only() -> None:
    assert {"eth10_tcp", "eth100_tcp", "ib100_rdma"} <= set(config.choices("network"))
    with pytest.raises(config.ConfigError, match="network=ib100_rdma is a real network"):
        config.load(["network=ib100_rdma"])


def test_sweep_jobs_load_as_if_composed_one_by_one() -> None:
    jobs = config.sweep(["experiment=paper", "network=ib100_rdma"])
    assert len(jobs) == 3 * 7 * 4 + 3  # and the three 1-GPU baselines
    fast = config.load_all(jobs, simulate=True)
    for job, cfg in list(zip(jobs, fast))[::10]:
        one = config._typed(config.compose_raw(job))  # Hydra applies every override itself
        assert config.to_json(one) == config.to_json(cfg), job


def test_every_experiment_expands_to_valid_jobs() -> None:
    for name in config.choices("experiment"):
        jobs = config.expand([f"experiment={name}"])
        assert jobs, name
        for job in jobs:
            config.load(job)


def test_smoke_sweep_order_is_baseline_first() -> None:
    jobs = config.expand(["experiment=smoke"])
    loaded = [config.load(j) for j in jobs]
    sizes = [c.cluster.workers_per_node for c in loaded]
    assert sizes == sorted(sizes) and sizes[0] == 1
    assert {c.method.name for c in loaded} == {"bsp_a2a", "ddp"}


def test_command_line_sweep_wins_over_experiment() -> None:
    jobs = config.expand(["experiment=smoke", "method=ddp", "cluster.workers_per_node=1,3"])
    loaded = [config.load(j) for j in jobs]
    assert [(c.method.name, c.cluster.workers_per_node) for c in loaded] == [("ddp", 1),
                                                                             ("ddp", 3)]


def test_defaults() -> None:
    cfg = config.load([])
    assert (cfg.run.warmup_iters, cfg.run.timed_iters, cfg.run.repeats) == (10, 100, 5)
    assert cfg.run.timeout_s == 300 and cfg.results_dir == "results"
    assert cfg.cluster.servers is None


@pytest.mark.parametrize(
    "override, words",
    [
        ("model=resnet", ["model 'resnet' is unknown", "resnet50_small"]),
        ("method=wfbp", ["method 'wfbp' is unknown", "bsp_a2a", "ddp"]),
        ("cluster=moon", ["cluster 'moon' is unknown", "local"]),
        ("method=bsp_a2a,nope", ["method 'nope' is unknown"]),
        ("run.timed_iters=0", ["run.timed_iters=0", "> 0"]),
        ("run.repeats=-1", ["run.repeats=-1"]),
        ("run.warmup_iters=-2", ["run.warmup_iters=-2", ">= 0"]),
        ("cluster.workers_per_node=0", ["cluster.workers_per_node=0"]),
        ("cluster.nodes=0", ["cluster.nodes=0"]),
        ("model.local_batch_size=0", ["model.local_batch_size=0"]),
        ("run.timeout_s=0", ["run.timeout_s=0"]),
        ("run.timed_iters=abc", ["run.timed_iters"]),
        ("cluster.device=tpu", ["cluster.device='tpu'", "auto, cpu, cuda"]),
        ("cluster.device=cuda", ["no GPU", "cluster.device=cpu"]),
        ("cluster.backend=nccl", ["nccl", "gloo"]),
        ("model.optimizer.name=lamb", ["model.optimizer.name='lamb'", "sgd"]),
        ("+model.build.depth=3", ["model.build.depth"]),
        ("run.nope=1", ["run.nope"]),
    ],
)
def test_bad_input_is_one_line_and_exit_2(override: str, words: list[str], capsys,
                                          tmp_path) -> None:
    # tiny and in a scratch folder, so that a missed check costs seconds, not a benchmark
    assert run.main([*TINY, f"results_dir={tmp_path}", override]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    for word in words:
        assert word in err


def test_bad_input_exits_2_without_traceback_as_a_command(tmp_path) -> None:
    out = run_module("harness.run", "method=wfbp", f"results_dir={tmp_path}", timeout=120)
    assert out.returncode == 2
    assert "Traceback" not in out.stderr and "choose one of" in out.stderr
    assert not list(tmp_path.glob("*")), "nothing may start on bad input"
    out = run_module("harness.verify", "cluster.workers_per_node=0", timeout=120)
    assert out.returncode == 2 and "cluster.workers_per_node=0" in out.stderr
