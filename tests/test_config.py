"""Every config option composes; bad input is one line and exit code 2, before anything runs."""

from __future__ import annotations

import os
import shutil

import pytest
from omegaconf import OmegaConf

from harness import config, run
from harness.config import checks, paths
from harness.config import compose as composition
from harness.config.frozen import freeze
from harness.config.rules import as_simulated
from harness.predict import fastsweep
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
        one = composition._typed(config.compose_raw(job))  # Hydra applies every override itself
        # as the simulator reads it (MG-WFBP on simulate.mgwfbp_cost: rules.as_simulated)
        one = as_simulated(freeze(OmegaConf.to_container(one)))
        assert config.to_json(one) == config.to_json(cfg), job


STUDY = ["network=ib100_rdma", "simulate.compute=rtx2080ti", "model=resnet50"]


@pytest.mark.parametrize("overrides", [
    ["cluster.nodes=3", "run.timeout_s=60"],  # an int into a float field: 60.0
    ["simulate.calibrate_gpus=[4,8]", "method=wfbp_ps", "method.transport.partition_bytes=8"],
    ["cluster=slurm", "cluster.slurm.partition=x"],  # below a field null by default: composed
    ["model.build={arch: resnet18, image_size: 32, num_classes: 10}", "results_dir=${model.name}"],
])
def test_a_simulated_job_is_the_configuration_hydra_composes(overrides) -> None:
    cfg = config.load([*STUDY, *overrides], simulate=True)
    assert isinstance(cfg, config.Frozen)
    one = composition._typed(config.compose_raw([*STUDY, *overrides]))
    assert config.to_json(one) == config.to_json(cfg)


@pytest.mark.parametrize("override, fragment", [
    ("cluster.nodes=abc", "cluster.nodes: Value 'abc' of type 'str' could not be converted"),
    ("cluster.nodes=0", "cluster.nodes=0 is invalid; it must be a finite number > 0"),
    ("network.rate_mbt=3", "network.rate_mbt is not a configuration key; network has: name,"),
    ("network.ps_host_copy=abc", "network.ps_host_copy='abc' is invalid; it must be true or false"),
    ("simulate.calibrate_gpus=[1]", "simulate.calibrate_gpus has 1; fit on GPU counts above 1"),
    ("model.build.image_size=abc", "model.build.image_size='abc' is invalid; it must be an int"),
])
def test_a_simulated_jobs_bad_value_is_the_same_one_line(override, fragment) -> None:
    jobs = [[*STUDY, "cluster.nodes=2"], [*STUDY, override]]  # the first shares its subtrees
    with pytest.raises(config.ConfigError) as err:
        config.load_all(jobs, simulate=True)
    assert fragment in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("overrides, hydra_node", [
    (("experiment=paper",), True),  # Hydra's node: enums, missing values, the sweep's params
    (("model=bert_tiny", "+model.build.vocab_size=1000", "method=bytescheduler_a2a"), False),
])
def test_a_cached_compose_is_hydras_and_an_edit_to_conf_composes_again(
        tmp_path, monkeypatch, overrides: tuple[str, ...], hydra_node: bool) -> None:
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    from harness.config import cache

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(config.CONF_DIR), version_base=None):
        hydra = compose("bench", overrides=list(overrides), return_hydra_config=hydra_node)
    GlobalHydra.instance().clear()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    composition._compose.cache_clear()
    first = composition._compose(overrides, hydra_node)  # composed by Hydra, then kept
    composition._compose.cache_clear()
    calls = []
    monkeypatch.setattr(composition, "_hydra_compose", lambda *a: calls.append(a) or {"x": 1})
    again = composition._compose(overrides, hydra_node)  # read back
    assert calls == [] and OmegaConf.is_struct(again)
    assert OmegaConf.to_yaml(first) == OmegaConf.to_yaml(again) == OmegaConf.to_yaml(hydra)
    assert OmegaConf.to_container(again, resolve=True) == OmegaConf.to_container(
        hydra, resolve=True, enum_to_str=True)  # Hydra's mode: RunMode.MULTIRUN
    # the key covers conf/'s files: an edited copy of them is composed anew
    monkeypatch.setattr(cache, "ROOT", tmp_path)
    shutil.copytree(config.CONF_DIR, tmp_path / "conf")
    (tmp_path / "conf" / "bench.yaml").write_text(
        (tmp_path / "conf" / "bench.yaml").read_text() + "\n# edited\n")
    cache._digest.cache_clear()
    composition._compose.cache_clear()
    try:
        assert composition._compose(overrides, hydra_node) == OmegaConf.create({"x": 1})
        assert len(calls) == 1
    finally:
        cache._digest.cache_clear()
        composition._compose.cache_clear()


def test_every_experiment_expands_to_valid_jobs() -> None:
    # valid where they are submitted; the paper's 32 workers do not fit this machine
    # (test_smoke_sweep_order_is_baseline_first runs smoke's jobs here); an experiment
    # on the study's real networks (whatif) is valid where it is simulated
    real = [f"network={n}" for n in config.choices("network")
            if config.is_real_network(config.compose_raw([f"network={n}"]).network)]
    for name in config.choices("experiment"):
        jobs = config.sweep([f"experiment={name}"])
        assert jobs, name
        simulated = [job for job in jobs if set(job) & set(real)]
        if fastsweep.wanted(simulated):  # the fast path loads one job per shape's group
            assert sum(len(g.nodes) for g in fastsweep.load(simulated)) == len(simulated)
            continue
        assert len(config.load_all(simulated, simulate=True)) == len(simulated)
        if config.compose_raw([f"experiment={name}"]).cluster.name == "emulated":
            # selfcheck: emulated nodes of this machine (namespaces made when it runs)
            assert len(config.load_all(jobs, simulate=True)) == len(jobs)
            continue
        # as harness.submit loads them
        config.load_all([[*job, "cluster=slurm"] for job in jobs if job not in simulated])


def _settings(experiment: str) -> dict[tuple[str, str], set[tuple]]:
    """Per (model, method) of an experiment's sweep, the settings its jobs run with."""
    found: dict[tuple[str, str], set[tuple]] = {}
    for cfg in config.load_all(config.sweep([f"experiment={experiment}", "cluster=slurm"])):
        opt = cfg.model.optimizer
        found.setdefault((cfg.model.name, cfg.method.name), set()).add((
            opt.name, opt.momentum, opt.weight_decay, cfg.engine,
            str(cfg.run.sync_each_step).lower(), cfg.run.rate,
            cfg.model.build.get("vocab_size"), cfg.method.planner.get("cost")))
    return found


def test_the_paper_runs_each_method_as_the_studys_scripts_did() -> None:
    found = _settings("paper")
    ps, hvd = ("bsp_ps", "wfbp_ps", "bytescheduler_ps"), ("bsp_a2a", "wfbp_a2a", "mgwfbp")
    sgd = ("sgd", 0.0, 0.0)
    for model in ("resnet50", "bert_base", "bert_large"):
        vocab = None if model == "resnet50" else 30528  # padded to a multiple of 8
        bert = model != "resnet50"
        for method in ps:  # byteps/: plain SGD, no synchronize
            assert found[(model, method)] == {(*sgd, "native", "false", "study", vocab, None)}
        for method in hvd:  # mgwfbp/: AdamW on BERT, torch.cuda.synchronize() each step
            opt = ("adamw", 0.0, 0.0) if bert else sgd  # transformers' AdamW: no decay
            cost = "study" if method == "mgwfbp" else None
            assert (*opt, "horovod", "device", "study", vocab, cost) in found[(model, method)]
        opt = ("adam", 0.0, 0.0) if bert else sgd  # bytescheduler/: Adam on BERT
        assert found[(model, "bytescheduler_a2a")] == {
            (*opt, "horovod", "device", "study", vocab, None)}
    cfg = config.load(["experiment=paper", "cluster=slurm"])
    assert not cfg.run.tf32_cudnn and not cfg.run.tf32_matmul and cfg.run.cudnn_benchmark
    assert cfg.cluster.slurm.colocate_servers is False  # servers on machines of their own
    mgwfbp = config.load(["experiment=paper", "cluster=slurm", "method=mgwfbp",
                          "engine=horovod", "method.planner.cost=study",
                          "method.planner.table=ib"])
    assert mgwfbp.method.planner.table == "ib"


def test_the_fair_paper_is_one_optimizer_per_model_on_our_engines_and_clock() -> None:
    found = _settings("paper_fair")
    assert len(found) == 3 * 7
    for (model, _), settings in found.items():
        name = "sgd" if model == "resnet50" else "adamw"
        assert {(s[0], s[3], s[4], s[5]) for s in settings} == {(name, "native", "false",
                                                                 "window")}


def test_mgwfbp_merges_on_the_table_each_study_network_read() -> None:
    from methods.costmodel import STUDY_COSTS, Cost, study_cost

    ib, tcp = STUDY_COSTS["ib"][8], STUDY_COSTS["tcp"][8]
    # the 100GbE runs passed --rdma: the IB table, as the InfiniBand runs; 10GbE, TCP
    assert study_cost("eth100_tcp", 8) == study_cost("ib100_rdma", 8) == Cost(*ib)
    assert study_cost("eth10_tcp", 8) == Cost(*tcp) != Cost(*ib)
    assert study_cost("loopback", 8, table="ib") == Cost(*ib)  # a real run names its table
    # simulated, the study's table is the network's, whatever a run named
    sim = config.load(["experiment=paper", "network=eth10_tcp", "method=mgwfbp",
                       "engine=horovod", "method.planner.cost=study", "method.planner.table=ib",
                       "cluster.nodes=2"], simulate=True)
    assert sim.method.planner.table is None and sim.method.planner.cost == "study"


def test_the_what_if_sweep_is_every_model_method_network_and_gpu_count() -> None:
    jobs = config.sweep(["experiment=whatif_study"])
    cfgs = config.load_all(jobs, simulate=True)
    assert len(cfgs) >= 10_000
    gpus = {c.cluster.nodes * c.cluster.workers_per_node for c in cfgs}
    assert min(gpus) == 1 and max(gpus) == 1024
    assert {c.model.name for c in cfgs} == {"resnet50", "bert_base", "bert_large"}
    assert {c.method.name for c in cfgs} == set(config.choices("method"))
    assert {c.network.name for c in cfgs} >= {"ib100_rdma", "eth100_tcp", "eth10_tcp"}
    assert {c.simulate.compute for c in cfgs} == {"rtx2080ti"}  # no profile measured: no torch


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
        # TINY warms up 1 iteration: MG-WFBP's 5 profiled ones would reach the timed window
        ("method=mgwfbp", ["method.planner.profile_iters=5", "run.warmup_iters=1",
                           "run.warmup_iters>=5"]),
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


def test_the_tests_largest_local_runs_fit_this_machine() -> None:
    config.load(["method=bsp_ps", "cluster.workers_per_node=3", "cluster.servers=2",
                 "method.transport.local_reduce=false"])
    config.load(["cluster.workers_per_node=4"])


def test_run_force_lifts_machine_fit_limits_only() -> None:
    with pytest.raises(config.ConfigError, match="run.force=true"):
        config.load(["cluster.workers_per_node=10000"])
    cfg = config.load(["run.force=true", "cluster.workers_per_node=10000",
                       "run.timed_iters=1000000000", f"run.threads={checks.cores() + 1}"])
    assert cfg.run.force
    with pytest.raises(config.ConfigError, match="0..65535"):
        config.load(["run.force=true", "cluster.master_port=70000"])


def test_machine_limits_apply_only_where_this_machine_runs_every_process(monkeypatch) -> None:
    many = ["cluster.nodes=100", "cluster.workers_per_node=4"]
    config.load(["cluster=slurm", *many])  # submitted: the nodes are elsewhere
    config.load([*many, "model=resnet50", "network=ib100_rdma", "simulate.compute=rtx2080ti"],
                simulate=True)  # predicted from the study's GPU: nothing runs here
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "400")
    config.load(many)  # under torchrun: each process is one rank of a bigger cluster


def test_unknown_keys_get_the_closest_valid_ones() -> None:
    cfg = config.load([])
    assert checks.unknown_key("run.timed_iter", cfg).endswith("did you mean run.timed_iters?")
    assert "+network.rate_mbit=" in checks.unknown_key("network.rate_mbit", cfg)
    assert "run has:" in checks.unknown_key("run.zzz", cfg)


def test_output_dir_is_checked_without_being_made(tmp_path) -> None:
    target = tmp_path / "a" / "b"
    paths.output_dir("results_dir", target)
    assert not (tmp_path / "a").exists()
    (tmp_path / "f").write_text("")
    for bad in (tmp_path / "f", tmp_path / "f" / "x"):
        with pytest.raises(config.ConfigError, match="is a file"):
            paths.output_dir("results_dir", bad)


def test_a_yaml_error_names_its_file_and_line() -> None:
    """Hydra's own message names neither; a broken method file is the user's to fix."""
    broken = config.CONF_DIR / "method" / f"zz_broken_{os.getpid()}.yaml"
    broken.write_text("name: broken\ntransport: {name: allreduce\nplanner: {name: per_tensor}\n")
    try:
        with pytest.raises(config.ConfigError) as err:
            config.load([f"method={broken.stem}"])
    finally:
        broken.unlink()
    assert str(err.value).startswith(f"conf/method/{broken.name} line 3, column 8: expected ','")
    assert "fix that file" in str(err.value)


def test_a_key_of_some_swept_methods_is_checked_job_by_job() -> None:
    """`method.transport.engine_threads` exists on the PS methods only: beside a sweep of
    PS methods it is set on each job; beside one with an all-reduce method it is refused,
    naming that job, before anything starts."""
    jobs = config.sweep(["method=bsp_ps,wfbp_ps", "method.transport.engine_threads=4",
                         "model=bert_tiny,resnet50_small"])
    loaded = config.load_all(jobs)
    assert sorted((c.method.name, c.model.name) for c in loaded) == [
        ("bsp_ps", "bert_tiny"), ("bsp_ps", "resnet50_small"), ("wfbp_ps", "bert_tiny"),
        ("wfbp_ps", "resnet50_small")]
    assert {c.method.transport.engine_threads for c in loaded} == {4}
    jobs = config.sweep(["method=bsp_a2a,wfbp_ps", "method.transport.engine_threads=4"])
    with pytest.raises(config.ConfigError, match="engine_threads is not a configuration key.*"
                                                 r"in the sweep's job method=bsp_a2a\)"):
        config.load_all(jobs)
    with pytest.raises(config.ConfigError, match=r"in the sweep's job method=bsp_a2a\)"):
        config.load_all(jobs, simulate=True)
