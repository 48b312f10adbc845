"""End to end: real worker processes over Gloo, shards on disk, failures brought down."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

import models
from harness import config
from harness.measure import results
from tests import soak
from tests.conftest import REPO, SMALL_BERT, TINY, live_processes, run_module


def _run(results_dir, *overrides: str, timeout: float = 300):
    return run_module("harness.run", *TINY, f"results_dir={results_dir}", *overrides,
                      timeout=timeout)


def test_the_studys_clock_and_rate_are_recorded(results_dir) -> None:
    """run.sync_each_step=true (= drain): ByteScheduler's pieces and per-layer updates,
    which otherwise overlap the next forward, are done when each step ends; run.rate=study:
    the row's throughput is the study's statistic, ours beside it; the row says both."""
    out = _run(results_dir, "method=bytescheduler_a2a", "cluster.workers_per_node=2",
               "run.sync_each_step=true", "run.rate=study", "model=bert_tiny")
    assert out.returncode == 0, out.stderr
    row = results.load(results_dir).iloc[0]
    assert row.status == "ok" and row.sync_each_step == "drain" and row.rate == "study"
    assert row.throughput == row.throughput_study > 0 and row.throughput_window > 0
    # two timed steps, one round: rank 0's samples of the cluster over its host time
    assert row.throughput_study == pytest.approx(row.throughput_window, rel=0.5)


def test_without_the_host_meter_the_row_says_not_measured(results_dir) -> None:
    out = _run(results_dir, "method=wfbp_a2a", "cluster.workers_per_node=2",
               "run.method_host=false", "model=bert_tiny")
    assert out.returncode == 0, out.stderr
    row = results.load(results_dir).iloc[0]
    assert row.status == "ok" and pd.isna(row.method_host_s) and pd.isna(row.method_wait_s)
    assert "hook_s_per_unit" not in json.loads(row.plan_json)


def test_the_launcher_starts_ranks_without_importing_torch(results_dir) -> None:
    """Only the ranks need torch: the command's own process validates, spawns, watches and
    summarizes without it, so no import of seconds sits before the ranks start."""
    code = ("import sys, harness.run; code = harness.run.main(sys.argv[1:]); "
            "print('torch imported:', 'torch' in sys.modules); sys.exit(code)")
    out = subprocess.run(
        [sys.executable, "-c", code, *TINY, "model=bert_tiny", "method=bsp_a2a",
         "cluster.workers_per_node=2", f"results_dir={results_dir}"],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "torch imported: False" in out.stdout, out.stdout
    assert results.load(results_dir).iloc[0].status == "ok"


def _assert_no_orphans(frame) -> None:
    for run_id in frame.run_id.unique():
        assert live_processes(run_id) == [], f"processes of run {run_id} were left behind"


@pytest.fixture(scope="module")
def every_method(tmp_path_factory) -> tuple[pd.DataFrame, str]:
    """The small soak: one sweep of 2-worker runs of the small BERT, every method once
    (tests/soak.py's round: 5 warm-up iterations, MG-WFBP profiles 5), none failed or
    aborted; its rows and what it printed."""
    folder = tmp_path_factory.mktemp("every_method")
    runs, problems, stdout = soak.sweep(1, folder, *SMALL_BERT[1:])  # [0]: model=bert_tiny
    assert runs == len(config.choices("method")) and problems == []
    return results.load(folder), stdout


@pytest.mark.parametrize("method", config.choices("method"))
def test_two_worker_run_writes_a_valid_shard(method: str, every_method) -> None:
    frame, stdout = every_method
    [row] = [r for _, r in frame.iterrows() if r.method == method]
    assert (row.world_size, row.status, row.source) == (2, "ok", "measured")
    assert row.throughput > 0 and row.timed_s > 0
    assert len(row.iter_times_s) == 2 and len(row.rank_iter_times_s) == 2
    # each rank's iterations fill its window (device clock, from its first iteration to
    # the end of the drain; the window adds clock reads and a synchronize: microseconds,
    # a few ms when the loaded machine deschedules the rank; an iteration here is ~20 ms)
    windows = [sum(times) for times in row.rank_iter_times_s]
    assert row.timed_s - 5e-3 < max(windows) <= row.timed_s
    assert list(row.iter_times_s) == [max(ts) for ts in zip(*row.rank_iter_times_s)]
    expected = 2 * row.local_batch_size * 2 / row.timed_s
    assert row.throughput == pytest.approx(expected)
    for phase in ("forward_s", "backward_s", "comm_s", "update_s"):
        assert row[phase] >= 0
    assert row.forward_s > 0 and row.backward_s > 0
    cfg = config.load(["model=bert_tiny"]).model
    described = models.describe(cfg.family, dict(cfg.build))
    assert row.model_intensity > 0 and row.model_tensors == described["model_tensors"]
    assert len(row.hostnames) == 2 and row.backend == "gloo" and row.torch_version
    # every iteration's phases add up to its time, the final drain counted as communication
    phases = row.forward_s + row.backward_s + row.comm_s + row.update_s
    assert phases == pytest.approx(np.mean([np.mean(t) for t in row.rank_iter_times_s]),
                                   rel=0.02)
    # what changes GPU throughput, recorded (torch's default numerics)
    assert len(row.devices) == 2 and row.peak_memory_bytes > 0
    assert (row.tf32_matmul, row.tf32_cudnn, row.cudnn_benchmark) == (False, True, False)
    assert row.sync_each_step == "false"  # ours: nothing synchronizes inside a step
    assert row.rate == "window" and row.throughput == row.throughput_window
    assert row.throughput_study > 0  # the study's statistic, recorded beside ours
    # the method's own host time and its waits: measured, and within the iteration
    assert row.method_host_s > 0 and row.method_wait_s >= 0
    assert row.method_host_s + row.method_wait_s < np.mean(row.iter_times_s)
    plan = json.loads(row.plan_json)
    if method != "ddp":  # its hooks are C++, in its reducer: only its calls are timed
        per_unit = plan["hook_s_per_unit"]
        assert len(per_unit) == len(plan["units"]) and all(s >= 0 for s in per_unit)
        assert sum(per_unit) < row.method_host_s * 2  # rank 0's hooks; the row: the mean
        # BSP has no gradient hooks: it gathers the gradients in synchronize
        assert (sum(per_unit) > 0) == (plan["scheduler"] != "after_backward")
    assert isinstance(json.loads(row.comm_env_json), dict)
    assert re.search(rf"^\[{row.run_id}\] repeat 1/1: [\d.]+ samples/s -> ", stdout, re.M)
    _assert_no_orphans(frame[frame.method == method])


def test_repeats_are_separate_shards_and_summary_shows_speedup(results_dir) -> None:
    # the 1-worker baseline, with the numerics and Gloo's interface changed: recorded
    assert _run(results_dir, "model=bert_tiny", "method=bsp_a2a", "run.tf32_matmul=true",
                "run.tf32_cudnn=false", "run.cudnn_benchmark=true",
                "cluster.gloo_ifname=lo").returncode == 0
    one = results.load(results_dir).iloc[0]
    assert (one.tf32_matmul, one.tf32_cudnn, one.cudnn_benchmark) == (True, False, True)
    assert json.loads(one.comm_env_json)["GLOO_SOCKET_IFNAME"] == "lo"
    out = _run(results_dir, "model=bert_tiny", "method=bsp_a2a", "cluster.workers_per_node=2",
               "run.repeats=2")
    assert out.returncode == 0, out.stderr
    frame = results.load(results_dir)
    two = frame[frame.world_size == 2]
    assert sorted(two.repeat) == [0, 1] and two.run_id.nunique() == 1
    assert len(list(results_dir.glob("*.parquet"))) == 3
    assert "speedup" in out.stdout and "over 1 worker" in out.stdout


def test_verify_fails_when_the_tolerance_is_impossible() -> None:
    # three workers sum in a different order than the reference, so the parameters
    # differ by rounding; a negative tolerance cannot be met, and verify must say so
    out = run_module("harness.verify", "cluster.workers_per_node=3", *SMALL_BERT,
                     "verify.atol=0", "verify.rtol=0")
    diff = float(out.stdout.strip().splitlines()[-1].split()[0].split("=")[1])
    assert (out.returncode == 1) == (diff > 0), out.stdout


def test_torchrun_starts_the_same_workers(results_dir) -> None:
    out = run_module("torch.distributed.run", "--standalone", "--nproc-per-node=2",
                     "-m", "harness.run", *TINY, "cluster.workers_per_node=2",
                     f"results_dir={results_dir}", timeout=300)
    assert out.returncode == 0, out.stderr
    frame = results.load(results_dir)
    assert frame.status.tolist() == ["ok"] and frame.world_size.tolist() == [2]
    assert out.stdout.count("samples/s over") == 1, "only rank 0 reports"


def test_torchrun_size_mismatch_is_bad_input(results_dir) -> None:
    out = run_module("torch.distributed.run", "--standalone", "--nproc-per-node=2",
                     "-m", "harness.run", *TINY, f"results_dir={results_dir}", timeout=300)
    assert out.returncode != 0 and "make them agree" in out.stderr
    assert not results_dir.exists()


def test_microbench_fits_alpha_and_beta_locally(results_dir) -> None:
    out = run_module("harness.microbench", "cluster.workers_per_node=2",
                     "microbench.max_bytes=65536", "microbench.repeats=2",
                     f"results_dir={results_dir}")
    assert out.returncode == 0, out.stderr
    assert "allreduce: alpha=" in out.stdout and "p2p: alpha=" in out.stdout
    files = list((results_dir / "microbench").glob("*.parquet"))
    assert len(files) == 1


def test_methodbench_times_the_plain_loop_and_a_method_and_writes_ratios(results_dir) -> None:
    out = run_module("harness.methodbench", "--models", "bert_tiny", "--methods", "bsp_a2a",
                     "--workers", "1", "--rounds", "1", "--warmup-iters", "1",
                     "--timed-iters", "2", "--results-dir", str(results_dir))
    assert out.returncode == 0, out.stderr
    assert "(bench: 1/2 runs done [" in out.stdout and "left])" in out.stdout
    frame = results.load(results_dir)
    assert sorted(frame.method) == ["bsp_a2a", "plain"]
    assert (frame.status == "ok").all() and (frame.throughput > 0).all()
    plain = frame[frame.method == "plain"].iloc[0]
    assert plain.world_size == 1 and len(plain.iter_times_s) == 2
    assert plain.timed_s - 5e-3 < sum(plain.iter_times_s) <= plain.timed_s  # as above
    [folder] = results_dir.iterdir()
    assert [p.name for p in folder.iterdir() if p.is_dir()] == ["round1"]
    ratio = json.loads((folder / "ratios.json").read_text())["bert_tiny"]["bsp_a2a/plain@1w"]
    bsp = frame[frame.method == "bsp_a2a"].throughput.iloc[0]
    assert ratio["rounds"] == [pytest.approx(bsp / plain.throughput)]
    assert ratio["median"] == ratio["rounds"][0]


def test_methodbench_ratios_pair_each_optimization_with_its_plain_twin() -> None:
    from harness.measure.benchratios import ratios

    rows = [("bsp_ps", 2, 10.0), ("wfbp_ps", 2, 12.0), ("bytescheduler_ps", 2, 11.0),
            ("wfbp_a2a", 2, 20.0), ("bytescheduler_a2a", 2, 15.0), ("wfbp_a2a", 1, 9.0),
            ("plain", 1, 10.0)]
    frame = pd.DataFrame([{"model": "m", "method": m, "engine": "native", "world_size": w,
                           "throughput": t, "status": "ok"} for m, w, t in rows])
    got = ratios(frame, workers=[1, 2])["m"]
    assert got == pytest.approx({"wfbp_ps/bsp_ps@2w": 1.2, "bytescheduler_ps/bsp_ps@2w": 1.1,
                                 "bytescheduler_a2a/wfbp_a2a@2w": 0.75, "wfbp_a2a/plain@1w": 0.9})
    # a PS run on the node path through the root (its config says so) is the method's twin
    rows = [("bsp_ps", "scatter", 10.0), ("bsp_ps", "root", 8.0), ("wfbp_ps", "scatter", 12.0),
            ("wfbp_ps", "root", 10.0)]
    frame = pd.DataFrame([{"model": "m", "method": m, "engine": "native", "world_size": 4,
                           "throughput": t, "status": "ok", "config_json": json.dumps(
                               {"method": {"transport": {"node_reduce": way}}})}
                          for m, way, t in rows])
    assert ratios(frame, workers=[4])["m"] == pytest.approx({
        "wfbp_ps/bsp_ps@4w": 1.2, "wfbp_ps@root/bsp_ps@root@4w": 1.25,
        "bsp_ps/bsp_ps@root@4w": 1.25, "wfbp_ps/wfbp_ps@root@4w": 1.2})
    # a run without its host meter (its config says so) is the method's unmetered twin
    frame = pd.DataFrame([{"model": "m", "method": "mgwfbp", "engine": "native",
                           "world_size": 2, "throughput": t, "status": "ok",
                           "config_json": json.dumps({"method": {"transport": {}},
                                                      "run": {"method_host": on}})}
                          for on, t in ((True, 10.0), (False, 10.5))])
    assert ratios(frame, workers=[2])["m"] == pytest.approx({"mgwfbp@unmetered/mgwfbp@2w": 1.05})
    # a PS run on the UCX wire (its config says so) is the method's ucx twin
    frame = pd.DataFrame([{"model": "m", "method": "wfbp_ps", "engine": "native",
                           "world_size": 2, "throughput": t, "status": "ok",
                           "config_json": json.dumps({"method": {"transport": {}},
                                                      "cluster": {"ps_wire": wire}})}
                          for wire, t in (("gloo", 10.0), ("ucx", 9.0))])
    assert ratios(frame, workers=[2])["m"] == pytest.approx({"wfbp_ps@ucx/wfbp_ps@2w": 0.9})
