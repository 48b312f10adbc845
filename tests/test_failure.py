"""Which failure a run's row names, and which repeat gets it (no processes: the evidence
the ranks and the launcher leave, written by hand)."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness import config
from harness.launch import failure
from harness.launch.failure import Ending
from harness.measure import bench, results

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
