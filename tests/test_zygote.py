"""A local CPU run's ranks are forks of one zygote (harness.launch.zygote) that imported
their libraries once: each fork is what `python -m` would have started (its arguments,
environment, standard streams, session and command line), its end is told as a child's
would be, and nothing outlives the launcher."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.launch import zygote
from tests.conftest import REPO

TINY = ["model=bert_tiny", "run.warmup_iters=1", "run.timed_iters=1", "run.repeats=1",
        "run.timeout_s=60", "cluster.device=cpu"]


@pytest.fixture
def zyg():
    z = zygote.Zygote.start()
    yield z
    z.close()


def _wait(fork: zygote.Fork, timeout_s: float = 60) -> int:
    deadline = time.monotonic() + timeout_s
    while (code := fork.poll()) is None:
        assert time.monotonic() < deadline, f"fork {fork.pid} still running"
        time.sleep(0.05)
    return code


def _gone(pid: int, timeout_s: float = 10) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z":
                return True
        except OSError:
            return True
        time.sleep(0.05)
    return False


def test_a_fork_is_the_module_run_with_the_arguments_environment_and_streams_given(
        zyg, capfd) -> None:
    fork = zyg.fork("tests.zygote_child", ["3"], env=dict(os.environ, ZYGOTE_VALUE="v1"),
                    preload=["json"], timeout_s=60)
    assert _wait(fork) == 3
    out = capfd.readouterr().out  # this process's stdout, which the fork was given
    assert f"child pid={fork.pid} sid={fork.pid} value=v1 argv=['3']" in out


def test_a_killed_fork_reads_as_subprocess_tells_a_signal_and_shows_its_own_command(
        zyg) -> None:
    fork = zyg.fork("tests.zygote_child", ["sleep"], env=dict(os.environ), preload=[],
                    timeout_s=60)
    deadline = time.monotonic() + 30
    while "tests.zygote_child sleep" not in (cmd := Path(f"/proc/{fork.pid}/cmdline")
                                             .read_bytes().replace(b"\0", b" ").decode()):
        assert time.monotonic() < deadline, cmd
        time.sleep(0.05)
    assert cmd.split()[:2] == [sys.executable, "-m"]  # not the zygote's own command line
    assert fork.poll() is None
    os.killpg(fork.pid, signal.SIGKILL)  # its own session, as a spawned rank's
    assert _wait(fork) == -signal.SIGKILL


def test_a_zygote_that_does_not_fork_in_time_is_ended_and_said_so(monkeypatch) -> None:
    monkeypatch.setenv("ZYGOTE_SLOW_IMPORT", "30")  # the zygote's own imports: too slow
    z = zygote.Zygote.start()
    with pytest.raises(zygote.ZygoteGone, match="did not fork within 1 s"):
        z.fork("tests.zygote_child", ["0"], env=dict(os.environ), preload=["tests.zygote_child"],
               timeout_s=1)
    assert not z.alive()  # the launcher then spawns the rank itself


def test_forks_die_with_the_zygote(zyg) -> None:
    fork = zyg.fork("tests.zygote_child", ["sleep"], env=dict(os.environ), preload=[],
                    timeout_s=60)
    zyg.close()
    assert _gone(fork.pid)
    assert fork.poll() == -signal.SIGKILL


def test_nothing_outlives_a_launcher_killed_by_sigkill(tmp_path) -> None:
    script = ("import os, sys, time; from harness.launch import zygote; z = zygote.zygote(); "
              "f = z.fork('tests.zygote_child', ['sleep'], env=dict(os.environ), preload=[], "
              "timeout_s=60); "
              "print(z.proc.pid, f.pid, flush=True); time.sleep(600)")
    launcher = subprocess.Popen([sys.executable, "-c", script], cwd=REPO,
                                stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in launcher.stdout.readline().split()]
    finally:
        launcher.kill()
        launcher.wait()
    assert len(pids) == 2 and all(_gone(pid) for pid in pids)


def test_a_local_cpu_runs_ranks_are_forks_of_one_zygote_that_outlives_each_run(
        tmp_path) -> None:
    # two runs from one process: every rank of both is a child of the same zygote, the
    # launcher itself imports no torch, and no rank of either run is left
    code = ("import sys; from harness.launch.launcher import command; "
            "from harness.launch import zygote; "
            "codes = [command(sys.argv[2:] + [f'results_dir={sys.argv[1]}/{i}'], "
            "name='harness.run', entry='tests.env_entry') for i in range(2)]; "
            "print(zygote._ZYGOTE.proc.pid, 'torch' in sys.modules, codes)")
    for i in range(2):
        (tmp_path / str(i)).mkdir()
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path), *TINY,
                          "cluster.workers_per_node=2"],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    zygote_pid, torch_imported, codes = out.stdout.split(maxsplit=2)
    assert (torch_imported, codes.strip()) == ("False", "[0, 0]")
    parents = {json.loads((tmp_path / str(i) / f"env_rank{r}.json").read_text())["parent"]
               for i in range(2) for r in range(2)}
    assert parents == {int(zygote_pid)}
    assert _gone(int(zygote_pid))  # with its launcher (not any zygote: another test's may run)
