"""Which failure a run's row names, and which repeat gets it (the evidence the ranks and
the launcher leave, written by hand), and the timeouts of the groups the harness makes
(one real launch)."""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from harness import config
from harness.launch import failure, launcher
from harness.launch import rank as ranks
from harness.launch.failure import Ending
from harness.measure import bench, results
from tests.conftest import REPO

WORKERS = 2


def _evidence(run_dir: Path, *, beats: dict[int, tuple[int, str]],
              errors: dict[int, tuple[Exception, float]]) -> None:
    for rank, (repeat, where) in beats.items():
        failure.beat(run_dir, rank, repeat, where)
    for rank, (exc, _) in sorted(errors.items(), key=lambda kv: kv[1][1]):
        failure.write_error(run_dir, rank, exc, f"rank {rank}: {type(exc).__name__}: {exc}")


RESET = RuntimeError("[pair.cc:545] Read error: Connection reset by peer")
TIMEOUT = RuntimeError("[unbound_buffer.cc:78] Timed out waiting 10000ms for recv operation")
SERVER = RuntimeError("parameter server rank 2 failed or did not answer")
SERVER.__cause__ = TIMEOUT
BOUND = RuntimeError("The server socket has failed to listen on any local network address. "
                     "port: 29517, useIpv6: false, code: -98, name: EADDRINUSE, message: "
                     "address already in use")
LOST = RuntimeError("parameter server rank 2 (key 0) failed or did not answer: [pair.cc:561] "
                    "Connection closed by peer")  # its side of the pair timed out first


@pytest.mark.parametrize("ending, errors, expect, repeat", [
    # a rank killed from outside, its peer saw the connection close
    (Ending(1, {1: -9, 0: 1}), {0: (RESET, 1)}, "rank 1 was killed by signal SIGKILL", 1),
    # a rank's own error wins over its peer's symptom, even when the symptom came first
    (Ending(1, {0: 1, 1: 1}), {0: (RESET, 1), 1: (ValueError("bad shape"), 2)},
     "rank 1: ValueError: bad shape", 1),
    # a silent rank that kept running while its peers timed out on it hung
    (Ending(1, {0: 1}, alive=[1]), {0: (TIMEOUT, 1)}, "rank 1 hung at repeat 1, iteration 4", 1),
    # a server that hung: the workers timed out on it (wrapped errors), and it saw them go
    (Ending(1, {0: 1, 1: 1}, alive=[2]), {0: (SERVER, 1), 1: (SERVER, 2)},
     "rank 2 hung", 1),
    # ... or lost their connections to it: a silent rank whose peers only saw it go
    (Ending(1, {0: 1, 1: 1}, alive=[2]), {0: (LOST, 1), 1: (LOST, 2)},
     "rank 2 hung at repeat 0, serving round 40: its peers lost their connection to it; "
     "rank 0: RuntimeError: parameter server rank 2", 1),
    (Ending(1, {0: 1, 1: 1, 2: 1}), {0: (RESET, 1), 1: (SERVER, 2), 2: (RESET, 2.1)},
     "rank 2 hung at repeat 0, serving round 40: its peers timed out", 1),
    # rank 0 could not listen: a port collision, not a rank's failure, though it came first
    (Ending(1, {0: 1, 1: 1}), {0: (BOUND, 1), 1: (TIMEOUT, 2)},
     "port collision: the rendezvous port was taken by another program or run as rank 0 "
     "started", 1),
    # the launcher's own reason comes first
    (Ending(130, {}, alive=[0, 1, 2], interrupt="the launcher was interrupted"), {},
     "the launcher was interrupted", 1),
])
def test_the_row_names_the_first_cause(tmp_path: Path, ending, errors, expect, repeat) -> None:
    _evidence(tmp_path, beats={0: (1, "iteration 4"), 1: (1, "iteration 4"),
                               2: (0, "serving round 40")}, errors=errors)
    text, got = failure.cause(tmp_path, ending, workers=WORKERS)
    assert expect in text
    assert got == repeat


def test_symptoms_are_told_from_causes() -> None:
    assert failure.symptom(RESET) == "closed" and failure.symptom(TIMEOUT) == "timeout"
    assert failure.symptom(SERVER) == "timeout"  # through its __cause__
    assert failure.symptom(TimeoutError("unit 3 not complete within 5 s")) == "timeout"
    assert failure.symptom(RuntimeError("injected fault at iteration 4")) == ""
    assert failure.symptom(OSError(28, "No space left on device")) == ""


def _cfg(tmp_path: Path):
    return config.load(["model=bert_tiny", "run.repeats=2", f"results_dir={tmp_path}"])


def _shard(cfg, run_id: str, repeat: int, status: str = "ok") -> None:
    row = {**bench.identity(cfg, run_id=run_id, repeat=repeat), "status": status}
    results.write_shard(results.shard_path(cfg.results_dir, run_id, repeat), [row])


@pytest.mark.parametrize("written, repeat, expect", [
    ([], None, [("failed", 0)]),                  # failed before any shard
    ([0], None, [("ok", 0), ("failed", 1)]),      # the first repeat without a shard
    ([0], 1, [("ok", 0), ("failed", 1)]),
    ([0], 0, [("ok", 0)]),                        # after repeat 0's shard: no phantom row
    ([0, 1], None, [("ok", 0), ("ok", 1)]),       # every repeat measured: nothing to add
])
def test_no_row_for_a_repeat_that_has_its_shard(tmp_path: Path, written, repeat,
                                                expect) -> None:
    cfg = _cfg(tmp_path)
    for r in written:
        _shard(cfg, "run", r)
    failure.record(cfg, entry="harness.measure.bench", run_id="run", repeat=repeat, error="boom")
    frame = results.load(tmp_path).sort_values("repeat")
    assert list(zip(frame.status, frame.repeat)) == expect


def test_a_run_with_a_failed_row_gets_no_second(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    _shard(cfg, "run", 0, status="failed")
    failure.record(cfg, entry="harness.measure.bench", run_id="run", repeat=None, error="again")
    assert len(results.load(tmp_path)) == 1


def test_the_error_line_of_a_task_log_is_sruns_first_word_on_a_task(tmp_path: Path) -> None:
    log = tmp_path / "task.out"
    log.write_text("ddlbench: task 0 on vm\nTraceback (most recent call last):\n"
                   "RuntimeError: Connection reset by peer\n"
                   "srun: error: vm: task 1: Exited with exit code 3\n"
                   "srun: error: vm: task 0: Terminated\n")
    assert failure.error_line(log) == "srun: error: vm: task 1: Exited with exit code 3"
    log.write_text("loading\nRuntimeError: CUDA out of memory\ndone?\n")
    assert failure.error_line(log) == "RuntimeError: CUDA out of memory"
    assert "no log" in failure.error_line(tmp_path / "missing.out")


# -- Horovod's shut down, NCCL's abort and srun's signals: the frozen rank is blamed -------

SHUT_DOWN = RuntimeError("Horovod has been shut down. This was caused by an exception on one "
                         "of the ranks or an attempt to allreduce, allgather or broadcast a "
                         "tensor after one of the ranks finished execution.")


class HorovodInternalError(RuntimeError):
    """Named as Horovod's (horovod.common.exceptions), whose message may say anything."""


def test_horovods_shut_down_is_a_peers_failure() -> None:
    assert failure.symptom(SHUT_DOWN) == "timeout"
    assert failure.symptom(HorovodInternalError("ncclCommInitRank failed")) == "timeout"


@pytest.mark.parametrize("ending, errors, timeout_s, expect", [
    # rank 1 frozen (SIGSTOP): rank 0's Horovod timed out on it and shut down
    (Ending(1, {0: 1}, alive=[1]), {0: (SHUT_DOWN, 1)}, 60,
     "rank 1 hung at repeat 1, iteration 4: its peers timed out waiting on it; rank 0: "
     "RuntimeError: Horovod has been shut down"),
    # rank 1 frozen for longer than run.timeout_s: NCCL's watchdog aborted rank 0
    (Ending(1, {0: -6}, alive=[1], silence={1: 75.0}), {}, 60,
     "rank 1 hung at repeat 1, iteration 4: rank 0 was killed by signal SIGABRT at repeat 1, "
     "iteration 4 waiting on it (NCCL's watchdog"),
    # rank 0 aborted by itself while rank 1, beating a moment ago, waited on it
    (Ending(1, {0: -6}, alive=[1], silence={1: 0.5}), {}, 60,
     "rank 0 was killed by signal SIGABRT at repeat 1, iteration 4"),
    # ... and without run.timeout_s known, an abort is never a symptom
    (Ending(1, {0: -6}, alive=[1], silence={1: 75.0}), {}, math.inf,
     "rank 0 was killed by signal SIGABRT"),
])
def test_a_frozen_rank_is_blamed_not_the_peer_that_waited(tmp_path: Path, ending, errors,
                                                          timeout_s, expect) -> None:
    _evidence(tmp_path, beats={0: (1, "iteration 4"), 1: (1, "iteration 4")}, errors=errors)
    text, repeat = failure.cause(tmp_path, ending, workers=WORKERS, timeout_s=timeout_s)
    assert text.startswith(expect), text
    assert repeat == 1


@pytest.mark.parametrize("said, ends", [
    ("srun: error: vm: task 1: Exited with exit code 3", {1: 3}),
    ("srun: error: vm: task 0: Aborted (core dumped)", {0: -signal.SIGABRT}),
    ("srun: error: vm: task 0: Aborted", {0: -signal.SIGABRT}),
    ("srun: error: vm: task 2: Killed", {2: -signal.SIGKILL}),
    ("srun: error: vm: task 1: Segmentation fault", {1: -signal.SIGSEGV}),
    ("srun: error: vm: task 0: Terminated", {}),  # Slurm ends tasks so: no cause
    ("slurmstepd: error: *** STEP 4.0 CANCELLED AT 2026-01-01T00:00:00 ***", {}),
])
def test_sruns_word_on_a_task_is_read(said: str, ends: dict) -> None:
    assert failure.srun_ends(said) == ends


def test_an_abort_under_srun_while_a_rank_is_frozen_blames_the_frozen_one(tmp_path: Path
                                                                           ) -> None:
    _evidence(tmp_path, beats={0: (1, "iteration 4"), 1: (1, "iteration 4")}, errors={})
    long_ago = time.time() - 90
    os.utime(tmp_path / "beat.rank1", (long_ago, long_ago))  # frozen for 90 s
    log = tmp_path / "task.out"
    log.write_text("srun: error: vm: task 0: Aborted (core dumped)\n"
                   "srun: error: vm: task 1: Killed\n")
    said = failure.error_line(log)
    assert said == "srun: error: vm: task 0: Aborted (core dumped)"
    text, repeat = failure.srun_cause(tmp_path, said, code=134, workers=WORKERS, timeout_s=60)
    assert text.startswith("rank 1 hung at repeat 1, iteration 4: rank 0 was killed by signal "
                           "SIGABRT"), text
    # srun said nothing of its tasks and no rank left a word: named as unknown, not a crash
    text, _ = failure.srun_cause(tmp_path, "srun: error: job cancelled", code=143,
                                 workers=WORKERS, timeout_s=60)
    assert text == "unknown"


# -- the process groups' timeouts: Gloo's is run.timeout_s, NCCL's longer ------------------

def test_every_group_the_harness_makes_times_out_after_run_timeout_s(tmp_path: Path) -> None:
    """A real launch of 4 workers on 2 nodes and 2 servers (a workers' group, node groups),
    the groups' Gloo timeouts read back on every rank."""
    code = ("import sys; from harness.launch.launcher import command; "
            "from harness.launch.process import exit_now; "
            "exit_now(command(sys.argv[1:], name='harness.run', entry='tests.timeouts_entry'))")
    out = subprocess.run(
        [sys.executable, "-c", code, "model=bert_tiny", "method=bsp_ps", "cluster.nodes=2",
         "cluster.workers_per_node=2", "run.timeout_s=77", f"results_dir={tmp_path}"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
        env={**os.environ, "TIMEOUTS_OUT": str(tmp_path)})
    assert out.returncode == 0, out.stderr[-3000:]
    seen = {p.stem: json.loads(p.read_text()) for p in tmp_path.glob("rank*.json")}
    assert sorted(seen) == [f"rank{r}" for r in range(6)]
    for worker in range(4):  # the default group, the workers' group, two node groups
        assert seen[f"rank{worker}"] == {"default": 77, "workers": 77, "node0": 77, "node1": 77}
    assert seen["rank5"] == {"default": 77}  # a server: the default group alone


class _Backend:
    def __init__(self) -> None:
        self.timeouts: list[dt.timedelta] = []

    def set_timeout(self, timeout: dt.timedelta) -> None:
        self.timeouts.append(timeout)


class _Group:
    """A process group as ranks.lengthen_nccl sees it: a backend per device type."""

    def __init__(self, config: str) -> None:
        self.config, self.backends = config, {"cpu": _Backend(), "cuda": _Backend()}

    def _get_backend(self, device: torch.device) -> _Backend:
        return self.backends[device.type]


def test_nccls_timeout_outlasts_the_harnesss_own_waits(monkeypatch) -> None:
    """GPU-only line (NCCL's backend faked: no GPU here) beside its CPU twin (Gloo's)."""
    gpu, cpu = _Group("cpu:gloo,cuda:nccl"), _Group("cpu:gloo,cuda:gloo")
    monkeypatch.setattr(dist, "get_backend_config", lambda group: group.config)
    ranks.lengthen_nccl([gpu, cpu], 20)
    assert gpu.backends["cuda"].timeouts == [ranks.nccl_timeout(20)]
    assert gpu.backends["cpu"].timeouts == cpu.backends["cpu"].timeouts == []  # Gloo: 20 s
    assert cpu.backends["cuda"].timeouts == []
    for timeout_s in (1, 20, 300, 3600):  # beyond the waits and the launcher's watchdog
        assert ranks.nccl_timeout(timeout_s).total_seconds() > 2 * timeout_s
        assert ranks.nccl_timeout(timeout_s).total_seconds() > timeout_s + launcher.STALL_GRACE_S
