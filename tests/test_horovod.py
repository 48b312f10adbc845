"""engine=horovod: every all-reduce method on Horovod's all-reduce, lossless and recorded.

The tests marked `horovod` start real ranks that start Horovod 0.28.1 themselves (its
Gloo rendezvous, no horovodrun); they need it built into the venv (`make horovod`, which
`make test` runs first) and skip, naming why, where it cannot be loaded. The others check
what needs no Horovod: the slot plan, and that asking for Horovod where it cannot run is
one line and exit code 2 before anything starts.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from harness.config import checks
from harness.config import engine as horovod
from harness.launch.horovod import slots
from harness.measure import results
from harness.methodbench import run_list
from tests.conftest import TINY, run_module
from tests.test_methods import BERT, _method_overrides

PROBLEM = horovod.problem(device="cpu")
loads_horovod = pytest.mark.skipif(PROBLEM is not None, reason=f"{PROBLEM}")
A2A = ["bsp_a2a", "wfbp_a2a", "mgwfbp", "bytescheduler_a2a"]
FRAGMENTS = {
    "bsp_ps": ["engine=horovod runs all-reduce methods only", "'bsp_ps'", "transport 'ps'",
               "engine=native", "bsp_a2a"],
    "ddp": ["engine=horovod runs all-reduce methods only", "'ddp' is torch DDP", "engine=native"],
}


def test_slots_are_horovodruns() -> None:
    """Local ranks count a host's workers, cross ranks the hosts with that local rank."""
    plan = slots(["a", "a", "b", "b", "a"])
    assert [(s.rank, s.local_rank, s.local_size, s.cross_rank, s.cross_size) for s in plan] == [
        (0, 0, 3, 0, 2), (1, 1, 3, 0, 2), (2, 0, 2, 1, 2), (3, 1, 2, 1, 2), (4, 2, 3, 0, 1)]
    assert {s.size for s in plan} == {5}


def test_methodbench_adds_horovod_twins_above_one_worker() -> None:
    runs = run_list(["bsp_a2a", "bsp_ps", "ddp"], engines=["native", "horovod"], counts=[1, 2])
    assert runs == {1: ["bsp_a2a", "bsp_ps", "ddp"],
                    2: ["bsp_a2a", "bsp_ps", "ddp", "bsp_a2a@horovod"]}
    assert run_list(["bsp_a2a"], engines=["native"], counts=[2]) == {2: ["bsp_a2a"]}
    # with emulated nodes, each PS method's twin on the node path through the root
    assert run_list(["bsp_ps", "ddp", "wfbp_ps"], engines=["native"], counts=[2],
                    roots=True) == {2: ["bsp_ps", "ddp", "wfbp_ps", "bsp_ps@root", "wfbp_ps@root"]}
    # and with both PS wires, each PS method's twin on the UCX wire
    assert run_list(["bsp_ps", "ddp"], engines=["native"], counts=[1],
                    ucx=True) == {1: ["bsp_ps", "ddp", "bsp_ps@ucx"]}


def _one_line_error(out, tmp_path: Path) -> str:
    assert out.returncode == 2, out.stdout + out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ddlbench: error: "), out.stderr
    assert not (tmp_path / "results").exists(), "nothing may be written"
    return lines[0]


@pytest.mark.parametrize("method", sorted(FRAGMENTS))
def test_horovod_with_a_method_it_cannot_run_is_a_config_error(method: str, tmp_path) -> None:
    out = run_module("harness.run", "engine=horovod", f"method={method}",
                     f"results_dir={tmp_path}/results", *TINY, timeout=120)
    line = _one_line_error(out, tmp_path)
    assert all(f in line for f in FRAGMENTS[method]), line


def test_missing_horovod_is_a_one_line_error_saying_how_to_install(tmp_path) -> None:
    shadow = tmp_path / "shadow" / "horovod"  # a `horovod` that cannot be imported
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('No module named horovod')\n")
    env = {"PYTHONPATH": str(shadow.parent)}
    out = run_module("harness.run", "engine=horovod", "model=bert_tiny",
                     f"results_dir={tmp_path}/results", *TINY, env=env, timeout=120)
    line = _one_line_error(out, tmp_path)
    assert "engine=horovod needs Horovod" in line and "make horovod" in line, line
    out = run_module("harness.methodbench", "--models", "bert_tiny", "--methods", "bsp_a2a",
                     "--workers", "2", "--results-dir", f"{tmp_path}/results", env=env,
                     timeout=120)
    line = _one_line_error(out, tmp_path)
    assert "make horovod" in line and "--engines native" in line, line


@pytest.mark.horovod
@loads_horovod
@pytest.mark.parametrize("method", A2A)
def test_harness_verify_passes_on_horovod(method: str) -> None:
    """Two workers sum exactly, so Horovod's result must equal the reference bit for bit,
    with tensors split (bytescheduler_a2a), merged (mgwfbp, after one profiled step) and
    gradients ready at random times per rank."""
    out = run_module("harness.verify", "engine=horovod", *BERT, *_method_overrides(method, "bert"),
                     "cluster.workers_per_node=2", "run.timeout_s=120", timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    line = out.stdout.strip().splitlines()[-1]
    assert line == "max_abs_diff=0.000e+00 max_rank_diff=0.000e+00", line


@pytest.mark.horovod
@loads_horovod
@pytest.mark.parametrize(("method", "settings", "cycle_ms"), [
    ("bytescheduler_a2a", (64 << 20, 0.005, 1024), "5"),  # Horovod's defaults of the time
    ("wfbp_a2a", (0, 0.0, 0), "0"),  # the study's own optimizer: no fusion, cycle or cache
])
def test_a_run_on_horovod_records_its_version_and_settings(results_dir: Path, method: str,
                                                          settings: tuple, cycle_ms: str) -> None:
    out = run_module("harness.run", "engine=horovod", f"method={method}", *BERT,
                     "cluster.workers_per_node=2", f"results_dir={results_dir}", *TINY,
                     timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    row = results.load(results_dir).iloc[0]
    assert row.status == "ok" and row.throughput > 0
    assert (row.engine, row.horovod_version) == ("horovod", horovod.VERSION)
    assert (row.horovod_fusion_threshold_bytes, row.horovod_cycle_time_s,
            row.horovod_cache_capacity) == settings
    plan = json.loads(row.plan_json)
    assert plan["transport"] == "horovod" and plan["horovod_version"] == horovod.VERSION
    if method == "bytescheduler_a2a":
        assert plan["cycle_s"] == 0.0 and plan["fusion_bytes"] is None  # Horovod's job
        # as the plug-in: rank 0 schedules, announcing nothing (the others submit at once)
        assert plan["order"] == "leader" and plan["credit_elements"] == 16_000_000
    env = json.loads(row.comm_env_json)
    assert (env["HOROVOD_CYCLE_TIME"], env["HOROVOD_CACHE_CAPACITY"]) == (cycle_ms,
                                                                          str(settings[2]))


@pytest.mark.horovod
@pytest.mark.network
@loads_horovod
@pytest.mark.skipif(os.geteuid() != 0 or bool(checks.missing_net_tools()),
                    reason="network namespaces need root and iproute2")
def test_ranks_in_network_namespaces_meet_on_their_interface(results_dir: Path) -> None:
    """One host name, two namespaces: Horovod's contexts must bind eth0, not the address
    the host name resolves to (harness.install_horovod.fix_gloo_iface)."""
    out = run_module("harness.run", "engine=horovod", "method=wfbp_a2a", "cluster=emulated",
                     "network=eth1g", "cluster.nodes=2", "cluster.device=cpu", *BERT,
                     f"results_dir={results_dir}", *TINY, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    row = results.load(results_dir).iloc[0]
    assert row.status == "ok" and json.loads(row.comm_env_json)["HOROVOD_GLOO_IFACE"] == "eth0"


# -- harness.install_horovod: when to rebuild, and where NCCL is (no build here) ------------

TORCH = "2.14.1+cu130"


def _installed(monkeypatch, tmp_path: Path, *, built_nccl: int, record: dict | None) -> Path:
    from harness import install_horovod as inst

    monkeypatch.setattr(inst, "probe", lambda: [horovod.VERSION, True, TORCH, built_nccl])
    if record is not None:
        (tmp_path / "installed.json").write_text(json.dumps(record))
    return tmp_path


@pytest.mark.parametrize("built, asked, kept", [
    (0, 0, True), (0, 23007, False),  # a CPU build no longer blocks the NCCL build
    (23007, 23007, True), (23007, 0, False), (22005, 23007, False)])
def test_horovod_is_rebuilt_when_its_nccl_differs_from_the_one_asked(
        monkeypatch, tmp_path, built: int, asked: int, kept: bool) -> None:
    from harness import install_horovod as inst

    work = _installed(monkeypatch, tmp_path, built_nccl=built,
                      record=inst._record(TORCH, built))
    assert inst.installed_for(TORCH, work, nccl=asked) is kept


def test_a_record_from_before_nccl_was_recorded_counts_as_the_loaded_library(
        monkeypatch, tmp_path) -> None:
    from harness import install_horovod as inst

    old = {"horovod": horovod.VERSION, "torch": TORCH, "patches": inst.PATCHES}
    assert inst.installed_for(TORCH, _installed(monkeypatch, tmp_path, built_nccl=0,
                                                record=old), nccl=0)
    assert not inst.installed_for(TORCH, tmp_path, nccl=23007)
    assert not inst.installed_for(TORCH, _installed(monkeypatch, tmp_path / "none", built_nccl=0,
                                                    record=None))


def _pip_nccl(root: Path, *, code: int = 23007) -> Path:
    package = root / "site" / "nvidia" / "nccl"
    (package / "include").mkdir(parents=True)
    (package / "lib").mkdir()
    (package / "include" / "nccl.h").write_text(
        f"#define NCCL_MAJOR 2\n#define NCCL_MINOR 30\n#define NCCL_PATCH 7\n"
        f"#define NCCL_VERSION_CODE {code}\n")
    (package / "lib" / "libnccl.so.2").write_bytes(b"")
    return package


def test_an_nccl_build_is_pointed_at_the_pip_package(monkeypatch, tmp_path) -> None:
    from harness import install_horovod as inst

    package = _pip_nccl(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    assert inst.nccl_build({}, tmp_path / "work") == ({}, 0)  # no NCCL asked: none
    env, code = inst.nccl_build({"HOROVOD_GPU_OPERATIONS": "NCCL"}, tmp_path / "work")
    home = tmp_path / "work" / "nccl"
    assert (env, code) == ({"HOROVOD_NCCL_HOME": str(home), "HOROVOD_NCCL_LINK": "SHARED"}, 23007)
    # Horovod's CMake finds include/nccl.h and lib/libnccl.so under HOROVOD_NCCL_HOME
    assert (home / "lib" / "libnccl.so").resolve() == (package / "lib" / "libnccl.so.2").resolve()
    assert (home / "include" / "nccl.h").is_file()
    assert inst.nccl_build({"HOROVOD_GPU_OPERATIONS": "NCCL"}, tmp_path / "work")[1] == 23007
    assert inst.build_env(None, env)["HOROVOD_NCCL_LINK"] == "SHARED"


def test_an_nccl_named_by_the_user_wins_and_a_missing_one_says_how(monkeypatch,
                                                                  tmp_path) -> None:
    from harness import install_horovod as inst

    mine = _pip_nccl(tmp_path / "mine", code=22005)
    env = {"HOROVOD_GPU_ALLREDUCE": "NCCL", "HOROVOD_NCCL_HOME": str(mine)}
    assert inst.nccl_build(env, tmp_path / "work") == ({}, 22005)
    monkeypatch.setattr(inst, "pip_nccl", lambda paths=None: None)
    with pytest.raises(inst.InstallError, match="HOROVOD_NCCL_HOME"):
        inst.nccl_build({"HOROVOD_GPU_OPERATIONS": "NCCL"}, tmp_path / "work")
