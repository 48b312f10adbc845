"""Nothing left behind: the launcher is killed with SIGKILL mid-run, and what it left (its
run folder; on an emulated cluster, the namespaces, bridge and veths) is removed by the
next run or by `python -m harness.check --clean`. Real processes, real namespaces."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.config import checks
from harness.launch import leftovers, netem
from tests.conftest import REPO, TINY, live_processes, run_module


def _kill_mid_run(scratch: Path, results: Path, *overrides: str) -> Path:
    """Start a long run whose scratch is `scratch`, SIGKILL its launcher once its ranks
    train, wait for the ranks to die with it; the run folder it left."""
    launcher = subprocess.Popen(
        [sys.executable, "-m", "harness.run", "run.warmup_iters=1", "run.timed_iters=10000",
         "run.repeats=1", "model=bert_tiny", f"results_dir={results}", *overrides],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env={**os.environ, "TMPDIR": str(scratch)})
    deadline = time.monotonic() + 120
    while not list(scratch.glob("ddlbench-*/beat.rank0")) and time.monotonic() < deadline:
        time.sleep(0.05)  # rank 0 has said where it is: the network and ranks are up
    launcher.send_signal(signal.SIGKILL)
    launcher.wait()
    while live_processes(str(scratch)) and time.monotonic() < deadline:
        time.sleep(0.05)  # the ranks get SIGKILL when their launcher dies
    assert not live_processes(str(scratch))
    [folder] = scratch.glob(f"ddlbench-*.pid{launcher.pid}-*")
    return folder


def _env(scratch: Path) -> dict:
    return {"TMPDIR": str(scratch)}


def test_the_next_run_removes_the_folder_a_killed_launcher_left(tmp_path: Path) -> None:
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    folder = _kill_mid_run(scratch, tmp_path / "killed", "cluster.workers_per_node=2")
    assert leftovers.stale(scratch) == [folder]
    out = run_module("harness.run", *TINY, "model=bert_tiny", f"results_dir={tmp_path}/next",
                     env=_env(scratch))
    assert out.returncode == 0, out.stderr
    assert f"removed what killed runs left behind: folder {folder}" in out.stderr
    assert list(scratch.glob("ddlbench-*")) == []  # the next run removed its own folder too


@pytest.mark.network
@pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")
@pytest.mark.skipif(bool(checks.missing_net_tools()), reason="ip/tc (iproute2) are missing")
def test_check_clean_removes_a_killed_emulated_runs_namespaces_and_links(tmp_path: Path
                                                                         ) -> None:
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    folder = _kill_mid_run(scratch, tmp_path / "killed", "cluster=emulated",
                           "network=eth100m")
    token = (folder / leftovers.NETWORK).read_text()
    left = netem.leftovers(token)
    assert len(left) == 1 + 2 + 2, left  # the bridge, two namespaces and their veths
    out = run_module("harness.check", "--clean", env=_env(scratch))
    assert out.returncode == 0, out.stderr
    for name in (n for n in left if n.removeprefix(netem.PREFIX + token).startswith("n")):
        assert f"namespace {name}" in out.stdout, out.stdout
    assert f"link {netem.PREFIX}{token}br" in out.stdout and f"folder {folder}" in out.stdout
    assert netem.leftovers(token) == [] and not folder.exists()
    again = run_module("harness.check", "--clean", env=_env(scratch))
    assert "nothing left behind by killed runs" in again.stdout
