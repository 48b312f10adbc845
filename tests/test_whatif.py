"""Any cluster from any machine (issue 41): the machine-fit limits only for what is
measured here, one profiling process for a cluster that is not this machine, the GPU
table and its calibration by one measured 1-GPU row, the fabrics."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pandas as pd
import pytest

from harness import config
from harness.config import gpus
from harness.config.ranks import profile_processes
from harness.measure import provenance, results
from harness.predict import network, profile
from tests.conftest import REPO, run_module

CLUSTER = ["cluster.nodes=2", "cluster.workers_per_node=4"]


def test_a_2x4_ib_simulation_on_the_default_cluster_profiles_one_process() -> None:
    cfg = config.load(["model=bert_tiny", "method=wfbp_ps", "network=ib100_rdma", *CLUSTER],
                      simulate=True)
    assert cfg.cluster.name == "local" and profile_processes(cfg) == 1
    # a cluster of 2,048 workers is no more than this machine takes: nothing of it runs here
    big = config.load(["model=bert_tiny", "network=ib_ndr", "cluster.nodes=256",
                       "cluster.workers_per_node=8"], simulate=True)
    assert profile_processes(big) == 1
    # this machine's own run is profiled in as many processes as it has workers, and its
    # limits hold for them
    ours = config.load(["model=bert_tiny", "network=loopback", "cluster.workers_per_node=3"],
                       simulate=True)
    assert profile_processes(ours) == 3
    with pytest.raises(config.ConfigError, match="64 local processes .* are more than"):
        config.load(["network=loopback", "cluster.workers_per_node=64"], simulate=True)


def test_the_issues_simulation_runs_one_profile_and_says_its_cpu_is_no_gpu(tmp_path) -> None:
    # ib_edr names no GPU of its own: simulate.compute=auto profiles this machine
    out = run_module("harness.simulate", "model=bert_tiny", "method=wfbp_ps",
                     "network=ib_edr", *CLUSTER, "simulate.profile_iters=1",
                     f"results_dir={tmp_path}")
    assert out.returncode == 0, out.stderr
    assert "profiling bert_tiny on this machine (1 process(es)" in out.stdout
    notes = [line for line in out.stderr.splitlines() if "note:" in line]
    assert len(notes) == 1 and "measured on this machine's CPU" in notes[0]
    assert "simulate.compute=<gpu> (a100_40g" in notes[0]
    row = results.load(tmp_path).iloc[0]
    assert json.loads(row.plan_json)["calibrated"] == "no" and row.device == "measured:cpu"


def test_plans_profile_of_16_workers_is_one_process(tmp_path) -> None:
    out = run_module("harness.plan", "model=bert_tiny", "method=mgwfbp", "network=ib_edr",
                     "cluster.nodes=4", "cluster.workers_per_node=4", "simulate.profile_iters=1")
    assert out.returncode == 0, out.stderr
    assert "profiling bert_tiny on this machine (1 process(es)" in out.stdout
    assert "16 workers" in out.stdout and "groups merged on" in out.stdout


def test_a_study_network_predicts_its_own_gpu_without_profiling() -> None:
    """simulate.compute=auto on the study's networks counts the study's GPU (the issue's
    16-worker ResNet-50 plan in seconds: nothing is profiled); set, it is the user's."""
    out = run_module("harness.plan", "model=resnet50", "method=mgwfbp", "network=ib100_rdma",
                     "cluster.nodes=4", "cluster.workers_per_node=4")
    assert out.returncode == 0, out.stderr
    assert "profiling" not in out.stdout and "note:" not in out.stderr
    assert "compute: resnet50 on rtx2080ti" in out.stdout
    assert "the GPU network=ib100_rdma was measured between" in out.stdout
    assert "16 workers" in out.stdout and "groups merged on" in out.stdout
    chosen = config.load(["network=ib100_rdma", "simulate.compute=h100_sxm"], simulate=True)
    assert chosen.simulate.compute == "h100_sxm"
    assert config.load(["network=ib_ndr"], simulate=True).simulate.compute == "measured"


def test_the_gpu_table_has_the_issues_gpus_with_their_facts() -> None:
    table = gpus.table()
    assert {"v100", "a100_40g", "a100_80g", "h100_sxm", "h100_pcie", "h200", "l40s",
            "rtx3090", "rtx4090", "rtx2080ti"} <= set(table)
    for gpu in table.values():  # every file says where its numbers come from
        assert "Source:" in (gpus.GPU_DIR / f"{gpu.name}.yaml").read_text(), gpu.name
        assert gpu.flop_s("fp32") > 0 and gpu.byte_s > 0 and gpu.names
    assert table["h100_sxm"].flop_s("bf16") == pytest.approx(989.4e12)
    assert table["rtx2080ti"].flop_s("fp32") / table["rtx2080ti"].byte_s == pytest.approx(
        21.8, abs=0.05)  # the balance the study's validation was made with
    assert gpus.matching("NVIDIA H100 80GB HBM3") == "h100_sxm"
    assert gpus.matching("NVIDIA H100 PCIe") == "h100_pcie"
    assert gpus.matching("NVIDIA GeForce RTX 2080 Ti") == "rtx2080ti"
    assert gpus.matching("Intel Xeon") is None


def test_a_gpu_of_the_table_is_predicted_without_torch(tmp_path) -> None:
    args = ["model=resnet50", "method=bsp_a2a,wfbp_a2a", "network=ib_ndr", *CLUSTER,
            "simulate.compute=h100_sxm,rtx2080ti"]
    for run in range(2):  # the first may count resnet50's work (torch), once for every GPU
        out = subprocess.run([sys.executable, "-X", "importtime", "-m", "harness.simulate",
                              *args, f"results_dir={tmp_path / str(run)}"], cwd=REPO,
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
    assert not [line for line in out.stderr.splitlines()
                if re.search(r"\b(torch|torchvision|transformers)\b", line)]
    assert re.search(r"compute: resnet50 on h100_sxm \(fp32: 67 TFLOP/s, 3350 GB/s.*\) at "
                     r"80% of its peaks, not calibrated", out.stdout)
    assert "resnet50 on rtx2080ti" in out.stdout and "calibrated by simulate.gpus" in out.stdout
    frame = results.load(tmp_path / "1")
    plans = frame.plan_json.map(json.loads)
    by_gpu = dict(zip(frame.device, plans.map(lambda p: p["calibrated"])))
    assert by_gpu == {"counted:h100_sxm:fp32": "no", "counted:rtx2080ti:fp32": "yes"}
    speed = frame.groupby("device").throughput.max()
    assert speed["counted:h100_sxm:fp32"] > 3 * speed["counted:rtx2080ti:fp32"]
    best = pd.read_csv(next((tmp_path / "1").glob("sim-*_best.csv")))
    assert len(best) == 2 and set(best.calibrated) == {"yes", "no"}  # a cell per GPU


def test_a_measured_1_gpu_row_calibrates_its_gpu(tmp_path) -> None:
    """One row of harness.run's shape on one RTX 4090 (its device name as torch reports
    it): the 1-GPU prediction on that GPU is that row's throughput, the 2-node one is
    calibrated by it."""
    measured = tmp_path / "measured"
    cfg = config.load(["model=resnet50", "cluster.workers_per_node=1"])
    row = {**provenance.identity(cfg, run_id="one", repeat=0), "throughput": 700.0,
           "status": "ok", "device": "NVIDIA GeForce RTX 4090"}
    results.write_shard(results.shard_path(measured, "one", 0), [row])
    out = run_module("harness.simulate", "model=resnet50", "method=bsp_a2a",
                     "network=ib_hdr", "cluster.nodes=1,2", "cluster.workers_per_node=1",
                     "simulate.compute=rtx4090", f"simulate.calibrate={measured}",
                     f"results_dir={tmp_path / 'out'}")
    assert out.returncode == 0, out.stderr
    assert "1-GPU rows calibrate: rtx4090 on resnet50 (700.0 samples/s)" in out.stdout
    assert "calibrated by a measured 1-GPU row" in out.stdout
    frame = results.load(tmp_path / "out").sort_values("world_size")
    assert frame.throughput.iloc[0] == pytest.approx(700.0, rel=1e-6)
    assert set(frame.plan_json.map(lambda p: json.loads(p)["calibrated"])) == {"yes"}
    assert 700 < frame.throughput.iloc[1] < 1400


def test_the_efficiency_of_a_measured_throughput_gives_it_back() -> None:
    cfg = config.load(["model=resnet50_small", "simulate.compute=l40s"], simulate=True)
    gpu = gpus.table()["l40s"]
    eff = profile.efficiency(cfg.model, gpu=gpu, precision="fp32", throughput=500.0)
    timed = profile.counted(cfg.model, gpu=gpu, precision="fp32", efficiency=eff)
    assert timed.total_s == pytest.approx(cfg.model.local_batch_size / 500.0)
    faster = profile.counted(cfg.model, gpu=gpu, precision="bf16", efficiency=eff)
    assert faster.total_s < timed.total_s  # its matrix products at the tensor cores' peak


def test_a_fabric_takes_the_gpus_own_link_within_a_node() -> None:
    def net(*overrides: str) -> network.Network:
        return network.network(config.load(list(overrides), simulate=True))

    nvlink = net("network=ib_ndr", "simulate.compute=h100_sxm")
    pcie = net("network=ib_ndr", "simulate.compute=rtx3090")
    assert nvlink.intra.beta < pcie.intra.beta / 5
    assert nvlink.inter == pcie.inter and nvlink.allreduce == "best"
    # the faster the fabric, the cheaper its bytes; the study's network keeps its own facts
    edr, hdr, ndr = (net(f"network={n}", "simulate.compute=h100_sxm").inter.beta
                     for n in ("ib_edr", "ib_hdr", "ib_ndr"))
    assert ndr < hdr < edr
    study = net("network=ib100_rdma", "simulate.compute=h100_sxm")
    assert study.intra.beta == pytest.approx(0.441 / (1.5 * 1.34e9))


def test_advise_ranks_every_method_and_says_where_the_winners_time_goes(tmp_path) -> None:
    out = run_module("harness.simulate", "advise", "model=bert_large", "gpu=h100_sxm",
                     "network=ib_ndr", "nodes=4", "gpus_per_node=8", f"results_dir={tmp_path}")
    assert out.returncode == 0, out.stderr
    head = "bert_large on 4 node(s) x 8 worker(s), ib_ndr, h100_sxm (compute calibrated: no):"
    assert head in out.stdout
    ranked = re.findall(r"^  (\d)\. (\w+) ", out.stdout, re.M)
    assert len(ranked) == len(config.choices("method"))
    best = re.search(r"^  best: (\w+), [\d.]+% over \w+, not validated on h100_sxm and ib_ndr: "
                     r"spec sheets and facts alone", out.stdout, re.M)
    assert best and best.group(1) == ranked[0][1]
    goes = re.search(rf"^  where {best.group(1)}'s ([\d.]+) ms go: compute ([\d.]+) .*"
                     r"exposed communication ([\d.]+); busy per iteration \(ms\): \w+ [\d.]+",
                     out.stdout, re.M)
    assert goes, out.stdout
    total, compute, exposed = map(float, goes.groups())
    assert total == pytest.approx(compute + exposed, abs=0.11)


def test_the_gpu_what_if_spans_models_methods_gpus_fabrics_and_scale(tmp_path) -> None:
    assert len(config.sweep(["experiment=whatif_gpus"])) == 3 * 9 * 10 * 6 * 8
    out = run_module("harness.simulate", "experiment=whatif_gpus", "model=resnet50",
                     "simulate.compute=h100_sxm,a100_80g", "network=ib_ndr",
                     "method=mgwfbp,wfbp_ps", f"results_dir={tmp_path}")
    assert out.returncode == 0, out.stderr
    best = pd.read_csv(next(tmp_path.glob("sim-*_best.csv")))
    assert len(best) == 2 * 8 and set(best.gpus) == {8 * 2**i for i in range(8)}
    assert set(best.calibrated) == {"no"}
    assert re.search(r"^  resnet50 \(counted:h100_sxm:fp32\) on ib_ndr \(GPUs: best method\)",
                     out.stdout, re.M)


def test_a_gpu_profile_of_a_cluster_elsewhere_is_one_process_on_gpu_0(monkeypatch) -> None:
    """Issue 38's rule for what is measured: process k on GPU k, no more processes than
    GPUs; a cluster that is not this machine needs one (torch.cuda mocked: no GPU here)."""
    import torch

    from harness.predict import trace

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    cfg = config.load(["network=ib100_rdma", *CLUSTER, "cluster.device=cuda"], simulate=True)
    assert trace.devices("cuda", profile_processes(cfg)) == ["cuda:0"]
    with pytest.raises(config.ConfigError, match="profiles the 8 workers .* has 1 GPUs"):
        config.load(["network=loopback", *CLUSTER, "cluster.device=cuda", "run.force=true"],
                    simulate=True)
