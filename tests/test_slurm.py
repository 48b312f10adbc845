"""Sweeps as Slurm job arrays, against a real single-host Slurm started by the tests."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness import config, submit
from harness.config import engine as horovod
from harness.launch import slurm as arrays
from harness.measure import results
from tests import slurm_cluster
from tests.conftest import REPO, TINY, run_main, run_module

ARRAY_TIMEOUT_S = 420
SMOKE = ["experiment=smoke", *TINY]


HOSTILE = "x $(touch pwned) `touch pwned2`; touch pwned3 & \"q\" %A"


def _quoted(path: Path) -> str:
    """`path` as a quoted Hydra override value."""
    return "'" + str(path).replace("'", "\\'") + "'"


def _submit(cluster: slurm_cluster.SlurmCluster | None, *args: str, env: dict | None = None):
    extra = {"SLURM_CONF": cluster.env["SLURM_CONF"]} if cluster else {}
    return run_module("harness.submit", *args, env={**extra, **(env or {})}, timeout=300)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory) -> Iterator[slurm_cluster.SlurmCluster]:
    if os.geteuid() != 0:
        pytest.skip("starting slurmctld/slurmd and installing slurm-wlm needs root")
    slurm_cluster.install()
    cluster = slurm_cluster.start(tmp_path_factory.mktemp("slurm"))
    yield cluster
    cluster.stop()  # the fixture finalizer runs even when a test failed


def _wait_for_queue(cluster: slurm_cluster.SlurmCluster, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = cluster.run("squeue", "--noheader", "--format=%i %T")
        if out.returncode == 0 and not out.stdout.strip():
            return
        time.sleep(2)
    raise AssertionError(f"jobs still queued after {timeout}s: "
                         f"{cluster.run('squeue').stdout}")


@pytest.mark.slurm
def test_smoke_sweep_runs_as_arrays_and_resubmitting_reruns_nothing(slurm, tmp_path) -> None:
    # folders whose names a shell would split and run: quoted, they are only names
    res, jobs = tmp_path / f"results {HOSTILE}", tmp_path / f"jobs {HOSTILE}"
    args = [*SMOKE, f"results_dir={_quoted(res)}", f"cluster.slurm.jobs_dir={_quoted(jobs)}",
            f"cluster.slurm.partition={slurm.partition}", "cluster.slurm.cpus_per_task=1",
            "cluster.slurm.mem=1G"]
    out = _submit(slurm, *args)
    assert out.returncode == 0, out.stderr
    assert "4 to run in 2 job array(s)" in out.stdout  # 1 and 2 workers: two shapes
    # cluster.device=auto on a partition without GPUs: no --gpus-per-node, and one note
    assert out.stderr.strip().splitlines() == [
        f"ddlbench: note: partition {slurm.partition!r} has none (no gpu gres in sinfo; "
        "cluster.slurm.partition), so the runs (cluster.device=auto) use CPUs; set "
        "cluster.device=cpu to say so, or request GPUs"], out.stderr
    scripts = [p.read_text() for p in jobs.rglob("array.sbatch")]
    assert all("--gpus-per-node" not in text and "#SBATCH --mem=1G" in text and
               "--kill-on-bad-exit=1 --cpus-per-task=1" in text for text in scripts)
    assert out.stdout.count("submitted array") == 2
    _wait_for_queue(slurm, ARRAY_TIMEOUT_S)
    logs = "\n".join(p.read_text() for p in jobs.rglob("logs/*.out"))
    frame = results.load(res)
    assert len(frame) == 4, logs
    assert (frame.status == "ok").all(), frame.error.tolist()
    assert len(list(jobs.rglob("logs/*_*.out"))) == 4  # each task's log where it was asked
    assert not [*tmp_path.rglob("pwned*"), *REPO.glob("pwned*")], "a shell ran a name"
    assert sorted(zip(frame.method, frame.world_size)) == [
        ("bsp_a2a", 1), ("bsp_a2a", 2), ("ddp", 1), ("ddp", 2)]
    assert frame.slurm_job_id.notna().all() and frame.slurm_job_id.nunique() == 2
    assert sorted(frame.slurm_array_task_id) == ["0", "0", "1", "1"]
    shards = sorted(res.glob("*.parquet"))

    again = _submit(slurm, *args)
    assert again.returncode == 0, again.stderr
    assert "4 already complete (skipped), 0 to run" in again.stdout
    assert "submitted" not in again.stdout
    assert slurm.run("squeue", "--noheader").stdout.strip() == ""
    assert sorted(res.glob("*.parquet")) == shards

    # a configuration whose shard is gone (or failed) runs again
    shards[0].unlink()
    dry = _submit(slurm, *args, "dry_run=true")
    assert dry.returncode == 0, dry.stderr
    assert "3 already complete (skipped), 1 to run in 1 job array(s)" in dry.stdout


@pytest.mark.slurm
def test_a_rank_that_dies_under_srun_leaves_a_failed_row(slurm, tmp_path) -> None:
    # rank 1 dies by os._exit in the second repeat: it writes nothing, rank 0 only sees a
    # symptom, srun fails, and the array script records the failure
    res, jobs = tmp_path / "results", tmp_path / "jobs"
    out = _submit(slurm, "model=bert_tiny", "method=bsp_a2a", "cluster.workers_per_node=2",
                  *TINY, "run.repeats=2", "run.fault.rank=1", "run.fault.at_iter=4",
                  "run.fault.kind=exit", f"results_dir={res}", f"cluster.slurm.jobs_dir={jobs}",
                  f"cluster.slurm.partition={slurm.partition}")
    assert out.returncode == 0, out.stderr
    _wait_for_queue(slurm, ARRAY_TIMEOUT_S)
    logs = "\n".join(p.read_text() for p in jobs.rglob("logs/*.out"))
    frame = results.load(res).sort_values("repeat")
    assert frame.status.tolist() == ["ok", "failed"], logs
    assert frame.run_id.nunique() == 1 and "slurm" in frame.run_id.iloc[0]
    error = frame.error.iloc[1]
    assert error.startswith("rank 1 exited with code 3 at repeat 1, iteration "), error
    assert "(srun exited with code" in error, error
    assert "task 1: Exited with exit code 3" in error, error  # srun's line about rank 1
    assert not list(jobs.rglob("runs/*")), "the run folder is removed"


@pytest.mark.slurm
@pytest.mark.parametrize("engine", [
    "native",
    pytest.param("horovod", marks=pytest.mark.skipif(
        horovod.problem(device="cpu") is not None, reason=f"{horovod.problem(device='cpu')}")),
])
def test_a_rank_that_freezes_under_srun_is_the_one_blamed(slurm, tmp_path, engine: str) -> None:
    # rank 1 stops itself (SIGSTOP, every thread: Horovod's too) in the second repeat: rank 0
    # times out waiting for it (Horovod shuts down on engine=horovod), srun kills the step,
    # and the failed row must name rank 1, not rank 0
    res, jobs = tmp_path / "results", tmp_path / "jobs"
    out = _submit(slurm, "model=bert_tiny", "method=bsp_a2a", f"engine={engine}",
                  "cluster.workers_per_node=2",
                  *TINY, "run.repeats=2", "run.fault.rank=1", "run.fault.at_iter=4",
                  "run.fault.kind=stop", "run.timeout_s=20", f"results_dir={res}",
                  f"cluster.slurm.jobs_dir={jobs}", f"cluster.slurm.partition={slurm.partition}")
    assert out.returncode == 0, out.stderr
    _wait_for_queue(slurm, ARRAY_TIMEOUT_S)
    logs = "\n".join(p.read_text() for p in jobs.rglob("logs/*.out"))
    frame = results.load(res).sort_values("repeat")
    assert frame.status.tolist() == ["ok", "failed"], logs
    error = frame.error.iloc[1]
    assert error.startswith("rank 1 hung at repeat 1, iteration "), error  # not rank 0
    assert "its peers timed out waiting on it; rank 0: " in error, error
    from tests.conftest import live_processes  # here: the rest of this file is the lead's

    assert live_processes(str(res)) == [], "the stopped rank was left behind"


@pytest.mark.slurm
@pytest.mark.parametrize("override, words", [
    ("cluster.slurm.partition=nope", ["cluster.slurm.partition='nope' is unknown",
                                      "choose one of"]),
    ("cluster.nodes=3", ["needs 3 nodes", "has 1"]),
    ("cluster.slurm.gpus_per_node=1", ["requests --gpus-per-node=1",
                                       "(cluster.slurm.gpus_per_node=1)", "has 0 GPUs"]),
    ("cluster.backend=nccl", ["cluster.backend=nccl needs GPUs", "has none"]),
    # checked against the partition, not against this GPU-less login node
    ("cluster.device=cuda", ["requests --gpus-per-node=1", "(one per worker",
                             "has 0 GPUs per node"]),
])
def test_bad_cluster_request_is_one_line_and_exit_2(slurm, tmp_path, override: str,
                                                   words: list[str]) -> None:
    out = _submit(slurm, *SMOKE, "method=ddp", "cluster.workers_per_node=1",
                  f"results_dir={tmp_path}", f"cluster.slurm.jobs_dir={tmp_path}", override)
    assert out.returncode == 2
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    for word in words:
        assert word in out.stderr
    assert "submitted" not in out.stdout and not list(Path(tmp_path).rglob("*.sbatch"))


def test_no_sbatch_on_path_is_one_line_and_exit_2(tmp_path) -> None:
    path = os.pathsep.join(str(Path(p)) for p in os.environ["PATH"].split(os.pathsep)
                           if not (Path(p) / "sbatch").exists() and not
                           (Path(p) / "sinfo").exists())
    out = _submit(None, *SMOKE, "method=ddp", "cluster.workers_per_node=1",
                  f"results_dir={tmp_path}", env={"PATH": path})
    assert out.returncode == 2
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "not on PATH" in out.stderr and "dry_run=true" in out.stderr


def test_paper_dry_run_groups_the_study_by_resource_shape(tmp_path) -> None:
    out = _submit(None, "experiment=paper", "dry_run=true", f"results_dir={tmp_path}",
                  env={"PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    # 3 models x 7 methods x 4 sizes + 3 one-GPU baselines
    assert "87 configurations: 0 already complete (skipped), 87 to run" in out.stdout
    # shapes: baselines 1x1; a2a 1x4 ... 8x4, one GPU per worker (gpus_per_node: null): gN;
    # PS from 2 nodes with one server per node on machines of their own, as the study's:
    # a heterogeneous job each (on one node BytePS needs no server: 1x4 like a2a)
    for shape, count in [("n1x1g1", 3), ("n1x4g4", 21), ("n8x4g4", 12)]:
        assert f"array DRY-RUN-{shape}: {count} tasks" in out.stdout, shape
    for nodes in (2, 4, 8):
        assert (f"heterogeneous jobs DRY-RUN-n{nodes}x4g4+s{nodes}n{nodes}: 9 tasks of "
                f"{nodes} node(s) x 4 ranks, 4 GPUs per node, and {nodes} servers on {nodes} "
                "node(s) without GPUs") in out.stdout
    assert "n1x5g4" not in out.stdout and "n2x5g4" not in out.stdout
    assert "#SBATCH --nodes=8" in out.stdout and "srun" in out.stdout
    assert "#SBATCH --gpus-per-node=4" in out.stdout and "--mem" not in out.stdout
    assert "dry run, Slurm not asked" in out.stderr
    assert "bert_large bytescheduler_ps nodes=8 workers=32 servers=8 repeats=5" in out.stdout
    assert not list(tmp_path.glob("*"))


def _srun_env(slurm: slurm_cluster.SlurmCluster) -> dict[str, str]:
    """The cluster's environment without a rendezvous of torchrun or of the tests' caller."""
    drop = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK",
            "LOCAL_WORLD_SIZE")
    return {k: v for k, v in slurm.env.items() if k not in drop and not
            (k.startswith("SLURM_") and k != "SLURM_CONF")}


@pytest.mark.slurm
@pytest.mark.parametrize("method, layout", [
    ("bsp_a2a", ["cluster.workers_per_node=2"]),
    ("bsp_ps", ["cluster.workers_per_node=1", "cluster.servers=1",
                "method.transport.local_reduce=false"]),
])
def test_srun_in_an_allocation_starts_one_run_of_its_tasks(slurm, tmp_path, method: str,
                                                           layout: list[str]) -> None:
    # each srun task is one rank, recognised from SLURM_* alone: no MASTER_ADDR exported
    res = tmp_path / "results"
    argv = ["salloc", "-N1", "-n2", "srun", "-n", "2", sys.executable, "-m", "harness.run",
            "model=bert_tiny", f"method={method}", *layout, *TINY, f"results_dir={res}"]
    out = subprocess.run(argv, cwd=REPO, env=_srun_env(slurm), capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    frame = results.load(res)
    assert len(frame) == 1, frame[["run_id", "world_size"]]  # not one run per task
    assert frame.status.tolist() == ["ok"], frame.error.tolist()
    workers = 2 if method == "bsp_a2a" else 1
    assert frame.world_size.tolist() == [workers]
    assert frame.servers.tolist() == [2 - workers]
    assert frame.slurm_job_id.notna().all()


def test_gres_strings_count_gpus_per_node() -> None:
    assert arrays.gres_gpus("(null)") == 0
    assert arrays.gres_gpus("gpu:4") == 4
    assert arrays.gres_gpus("gpu:a100:4(S:0-1)") == 4
    assert arrays.gres_gpus("gpu:a100:2(S:0,1),gpu:v100:2,shard:8") == 4
    assert arrays.gres_gpus("craynetwork:4") == 0


@pytest.mark.parametrize("device, asked, partition_gpus, gpus", [
    ("auto", None, 8, 4), ("auto", None, 0, 0), ("auto", None, None, 4),
    ("cuda", None, 0, 4), ("cpu", None, 8, 0), ("auto", 0, 8, 0), ("cpu", 2, 0, 2),
])
def test_null_gpus_per_node_is_one_per_worker_where_runs_use_gpus(
        device: str, asked: int | None, partition_gpus: int | None, gpus: int) -> None:
    cfg = config.load(["cluster=slurm", "cluster.workers_per_node=4"])
    cfg.cluster.device, cfg.cluster.slurm.gpus_per_node = device, asked
    assert arrays.gpus_for(cfg, partition_gpus) == gpus


def test_cuda_without_gpus_is_one_line_and_exit_2(tmp_path) -> None:
    cfg = config.load(["cluster=slurm", f"cluster.slurm.jobs_dir={tmp_path}"])
    cfg.cluster.device, cfg.cluster.slurm.gpus_per_node = "cuda", 0
    with pytest.raises(config.ConfigError, match="cluster.slurm.gpus_per_node=0 requests no"):
        arrays.check_settings(cfg, cfg.cluster.slurm)


@pytest.mark.parametrize("override, words", [
    ("cluster.slurm.mem=64 GB", ["cluster.slurm.mem='64 GB' is invalid", "64G"]),
    ("cluster.slurm.gpus_per_node=-1", ["cluster.slurm.gpus_per_node=-1 is invalid"]),
])
def test_bad_slurm_settings_are_one_line_and_exit_2(tmp_path, override: str,
                                                   words: list[str]) -> None:
    out = _submit(None, *SMOKE, "dry_run=true", f"results_dir={tmp_path}",
                  f"cluster.slurm.jobs_dir={tmp_path}", override)
    assert out.returncode == 2, out.stdout
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert all(word in out.stderr for word in words), out.stderr


def test_dry_run_requests_memory_cpus_for_srun_and_cpu_nodes(tmp_path) -> None:
    out = _submit(None, *SMOKE, "dry_run=true", f"results_dir={tmp_path}",
                  f"cluster.slurm.jobs_dir={tmp_path}", "cluster.slurm.gpus_per_node=0",
                  "cluster.slurm.cpus_per_task=3", "cluster.slurm.mem=64G",
                  env={"PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    assert "#SBATCH --mem=64G" in out.stdout and "#SBATCH --cpus-per-task=3" in out.stdout
    assert "--kill-on-bad-exit=1 --cpus-per-task=3 \\" in out.stdout  # srun does not inherit
    assert "--gpus-per-node" not in out.stdout and "DRY-RUN-n1x2 " not in out.stdout
    assert "array DRY-RUN-n1x2: 2 tasks" in out.stdout
    assert out.stderr.strip().splitlines() == [
        "ddlbench: note: cluster.slurm.gpus_per_node=0 requests none, so the runs "
        "(cluster.device=auto) use CPUs; set cluster.device=cpu to say so, or request GPUs"]


def test_cuda_is_checked_on_the_partition_not_on_this_machine(tmp_path) -> None:
    out = _submit(None, *SMOKE, "dry_run=true", "cluster.device=cuda",
                  f"results_dir={tmp_path}", f"cluster.slurm.jobs_dir={tmp_path}",
                  env={"CUDA_VISIBLE_DEVICES": ""})  # no GPU here, whatever the machine
    assert out.returncode == 0, out.stderr
    assert "#SBATCH --gpus-per-node=1" in out.stdout and "#SBATCH --gpus-per-node=2" in out.stdout
    assert "array DRY-RUN-n1x2g2: 2 tasks" in out.stdout


def test_a_configuration_done_is_not_done_on_horovod_or_with_other_method_settings(
        tmp_path) -> None:
    from harness.measure import bench

    cfg = config.load(["model=bert_tiny", "method=bsp_a2a", f"results_dir={tmp_path}"])
    row = {**bench.identity(cfg, run_id="r", repeat=0), "status": "ok", "throughput": 1.0}
    assert results.write_shard(results.shard_path(tmp_path, "r", 0), [row])
    done = submit.completed(tmp_path)
    assert done == {submit.identity(cfg): 1}
    for other in (["engine=horovod"], ["method.horovod.cycle_time_s=0.005"],
                  ["model.build.seq_len=16"], ["run.sync_each_step=true"],
                  ["cluster.ps_wire=ucx"]):
        twin = config.load(["model=bert_tiny", "method=bsp_a2a", f"results_dir={tmp_path}",
                            *other])
        assert submit.identity(twin) not in done, other
    # what does not change the measurement leaves it done
    same = config.load(["model=bert_tiny", "method=bsp_a2a", f"results_dir={tmp_path}",
                        "run.timeout_s=99", "run.repeats=1"])
    assert submit.completed(tmp_path).get(submit.identity(same)) == 1


# -- GPUs for workers only (issue 28) ---------------------------------------------------------

def test_dedicated_server_nodes_ask_for_no_gpus_in_a_heterogeneous_job(tmp_path) -> None:
    out = _submit(None, *SMOKE, "method=bsp_ps", "cluster.nodes=2", "cluster.workers_per_node=2",
                  "cluster.slurm.colocate_servers=false", "cluster.slurm.gpus_per_node=2",
                  "cluster.slurm.cpus_per_task=2", "dry_run=true", f"results_dir={tmp_path}",
                  f"cluster.slurm.jobs_dir={tmp_path}", env={"PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    script = out.stdout.split("=== heterogeneous jobs DRY-RUN-n2x2g2+s2n2: 1 tasks")[1]
    workers, servers = script.split("#SBATCH hetjob\n")
    assert "#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=2\n" in workers
    assert "#SBATCH --gpus-per-node=2" in workers and "#SBATCH --array" not in workers
    servers = servers.split("set -euo")[0]
    assert "#SBATCH --nodes=2\n#SBATCH --ntasks=2\n" in servers
    assert "--gpus" not in servers and "#SBATCH --cpus-per-task=2" in servers
    assert "step=(--het-group=0,1)" in script and 'bash -c "$rank_env" rank' in script


def test_co_located_servers_stay_an_array_and_bind_each_worker_a_gpu(tmp_path) -> None:
    out = _submit(None, *SMOKE, "method=bsp_ps", "cluster.nodes=2", "cluster.workers_per_node=2",
                  "cluster.slurm.gpus_per_node=2", "dry_run=true", f"results_dir={tmp_path}",
                  f"cluster.slurm.jobs_dir={tmp_path}", env={"PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    assert "=== array DRY-RUN-n2x3g2: 1 tasks" in out.stdout and "hetjob" not in out.stdout
    assert "#SBATCH --array=0-0" in out.stdout and "--distribution=arbitrary" in out.stdout


def _rank_env(**env: str) -> str:
    out = subprocess.run(["bash", "-c", arrays.RANK_ENV, "rank", "bash", "-c",
                          'echo "${RANK-}|${LOCAL_RANK-}|${CUDA_VISIBLE_DEVICES-unset}"'],
                         env={"PATH": "/usr/bin:/bin", "DDLBENCH_WORKERS": "3", **env},
                         capture_output=True, text=True, timeout=10)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_each_worker_task_sees_one_gpu_and_each_server_none() -> None:
    gpus = {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}  # the node's GPUs of the step
    assert _rank_env(SLURM_PROCID="1", SLURM_LOCALID="1", **gpus) == "||5"
    assert _rank_env(SLURM_PROCID="2", SLURM_LOCALID="0", **gpus) == "||4"  # node 1's first
    assert _rank_env(SLURM_PROCID="3", SLURM_LOCALID="2", **gpus) == "||"  # a server
    assert _rank_env(SLURM_PROCID="0", SLURM_LOCALID="3", CUDA_VISIBLE_DEVICES="0,1") \
        == "||none"  # no GPU at its place: the rank says so at start
    assert _rank_env(SLURM_PROCID="0", SLURM_LOCALID="0") == "||unset"  # a CPU run
    # a heterogeneous step: the rank from the step, over both components
    assert _rank_env(SLURM_PROCID="4", SLURM_LOCALID="0", WORLD_SIZE="6") == "4|0|unset"


def test_heterogeneous_jobs_are_submitted_once_per_task(monkeypatch, tmp_path) -> None:
    calls: list[list[str]] = []
    monkeypatch.setattr(arrays, "slurm_command",
                        lambda argv: calls.append(argv) or f"{100 + len(calls)}\n")
    monkeypatch.setattr(submit, "sbatch", arrays.sbatch)
    tasks = submit.load_tasks(["cluster=slurm", "experiment=smoke", "method=bsp_ps,wfbp_ps",
                               "cluster.workers_per_node=1", "cluster.nodes=2",
                               "cluster.slurm.colocate_servers=false",
                               "cluster.slurm.gpus_per_node=2", f"results_dir={tmp_path}",
                               f"cluster.slurm.jobs_dir={tmp_path}"])
    submit.check_gpus(tasks, partition_gpus=2, label="p")
    assert len(tasks) == 2 and all(t.shape.hetero for t in tasks)
    assert len(arrays.group(tasks)) == 1  # one shape, one script, a job per task
    assert submit._submit(arrays.group(tasks), []) == 0
    assert len(calls) == len(tasks)
    for i, argv in enumerate(calls):
        assert argv[:2] == ["sbatch", "--parsable"] and argv[-1] == str(i)
        assert argv[2].startswith("--output=") and argv[2].endswith(f"/logs/%j_{i}.out")
    script = Path(calls[0][-2])
    assert (script.parent / "workers.txt").read_text() == "2\n2\n"


# -- nothing a user typed reaches a shell (issue 37) ----------------------------------------

def _directives(script: str) -> list[list[str]]:
    """The #SBATCH lines sbatch reads (those before the first command), each split into
    arguments as sbatch's parser splits them: quotes group, a backslash escapes."""
    found = []
    for line in script.splitlines()[1:]:
        if line.strip() and not line.startswith("#"):
            break  # sbatch stops at the first command
        if line.startswith("#SBATCH "):
            found.append([m.group(0) for m in re.finditer(r'(?:"(?:\\.|[^"\\])*"|\S)+',
                                                          line[8:])])
    return [[re.sub(r'\\(.)|"', lambda m: m.group(1) or "", arg) for arg in args]
            for args in found]


def test_hostile_values_reach_no_shell_and_every_directive_survives(tmp_path) -> None:
    jobs, res = tmp_path / f"jobs {HOSTILE}", tmp_path / f"res {HOSTILE}"
    overrides = ["cluster=slurm", "experiment=smoke", "method=bsp_a2a,ddp",
                 "cluster.workers_per_node=1", f"results_dir={_quoted(res)}",
                 f"cluster.slurm.jobs_dir={_quoted(jobs)}",
                 "cluster.slurm.partition=gpu", "cluster.slurm.account=proj_1",
                 "cluster.slurm.qos=high", "cluster.slurm.constraint='a100&ib'",
                 "cluster.slurm.time=1-00:00:00", "cluster.slurm.cpus_per_task=2",
                 "cluster.slurm.mem=8G", f"cluster.slurm.extra=['--comment={HOSTILE}']"]
    tasks = submit.load_tasks(overrides)
    submit.check_gpus(tasks, partition_gpus=0, label="p")
    [(shape, group)] = arrays.group(tasks).items()
    script = arrays.write_array(group, shape, root=jobs, name="t")
    options = dict(a[0].split("=", 1) for a in _directives(script.read_text()) if "=" in a[0])
    assert len(_directives(script.read_text())) == script.read_text().count("#SBATCH ") == 13
    assert all(len(a) == 1 for a in _directives(script.read_text()))  # one argument a line
    assert options["--comment"] == HOSTILE and options["--qos"] == "high"
    assert options["--output"] == str(script.parent / "logs").replace("%", "%%") + "/%A_%a.out"
    assert {"--partition", "--account", "--time", "--constraint", "--cpus-per-task", "--mem",
            "--array", "--job-name", "--nodes", "--ntasks-per-node"} <= set(options)

    stubs = tmp_path / "bin"  # srun records what it would start; scontrol names this host
    stubs.mkdir()
    (stubs / "srun").write_text('#!/bin/bash\nprintf "%s\\0" "$@" > "$SRUN_ARGV"\n')
    (stubs / "scontrol").write_text("#!/bin/bash\necho localhost\n")
    for stub in stubs.iterdir():
        stub.chmod(0o755)
    work = tmp_path / "cwd"
    work.mkdir()
    env = {"PATH": f"{stubs}:/usr/bin:/bin", "SRUN_ARGV": str(tmp_path / "argv"),
           "SLURM_ARRAY_TASK_ID": "1", "SLURM_ARRAY_JOB_ID": "7", "SLURM_JOB_ID": "8",
           "SLURM_JOB_NODELIST": "localhost"}
    out = subprocess.run(["bash", str(script)], cwd=work, env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    argv = (tmp_path / "argv").read_text().split("\0")[:-1]
    assert argv[argv.index("harness.run") + 1:] == group[1].overrides  # intact, task 1's
    assert not [p for p in [*tmp_path.rglob("pwned*"), *REPO.glob("pwned*")]], "a shell ran"


@pytest.mark.parametrize("override, words", [
    ("cluster.slurm.partition='gpu\ntouch /tmp/x'", ["cluster.slurm.partition=", "is invalid",
                                                     "a partition name"]),
    ("cluster.slurm.account='a;b'", ["cluster.slurm.account='a;b' is invalid"]),
    ("cluster.slurm.qos='$(id)'", ["cluster.slurm.qos='$(id)' is invalid"]),
    ("cluster.slurm.time=-1", ["cluster.slurm.time='-1' is invalid", "01:30:00"]),
    ("cluster.slurm.time=forever", ["cluster.slurm.time='forever' is invalid"]),
    ("cluster.slurm.max_parallel=-1", ["cluster.slurm.max_parallel=-1 is invalid"]),
    ("cluster.slurm.cpus_per_task=0", ["cluster.slurm.cpus_per_task=0 is invalid"]),
    ("cluster.slurm.servers_per_node=0", ["cluster.slurm.servers_per_node=0 is invalid"]),
    ("cluster.slurm.extra=['--comment=a\nb']", ["extra item", "one sbatch option per item"]),
    ("cluster.slurm.extra=[touch]", ["extra item 'touch' is invalid"]),
    ("cluster.slurm.extra=['-t 5']", ["sets --time", "set cluster.slurm.time instead"]),
    ("cluster.slurm.extra=['--array=0-3']", ["sets --array", "remove it"]),
    ("cluster.slurm.jobs_dir='{tmp}/a\nb'", ["cluster.slurm.jobs_dir=", "control character"]),
])
def test_bad_slurm_values_are_refused_before_rendering(tmp_path, override: str,
                                                      words: list[str]) -> None:
    out = run_main("harness.submit", *SMOKE, "dry_run=true", f"results_dir={tmp_path}/r",
                   f"cluster.slurm.jobs_dir={tmp_path}/j", override.format(tmp=tmp_path))
    assert out.returncode == 2, out.stdout
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert all(word in out.stderr for word in words), out.stderr
    assert "#SBATCH" not in out.stdout and not list(tmp_path.iterdir())


def test_a_template_placeholder_left_unfilled_is_refused(tmp_path) -> None:
    template = REPO / "slurm" / f"test-{os.getpid()}.sbatch"
    template.write_text("#!/bin/bash\n#SBATCH {{job_name}}\ncd {{log_dir}}\n")
    try:
        out = run_main("harness.submit", *SMOKE, "dry_run=true", f"results_dir={tmp_path}/r",
                       f"cluster.slurm.template=slurm/{template.name}")
    finally:
        template.unlink()
    assert out.returncode == 2 and "has {{log_dir}}, which harness.submit does not fill in" \
        in out.stderr, out.stderr
