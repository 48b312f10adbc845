"""The fault battery: every way a run can die ends it in time, as one failed row naming
the cause, with earlier shards intact and nothing left behind.

Each run has two repeats (a sweep of two jobs for the signals to the launcher); the
fault strikes in the second, after the first repeat's shard was written. `make test`
runs each fault once, with one of the three kinds of method; `make faults` runs
every fault with every kind (the `faults` marker).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from harness.config import checks
from harness.config import engine as horovod
from harness.launch import failure, launcher, leftovers, netem
from harness.measure import results
from tests.conftest import REPO, live_processes, run_module

WARMUP, TIMED = 1, 3
RUN = ["model=bert_tiny", f"run.warmup_iters={WARMUP}", f"run.timed_iters={TIMED}",
       "run.repeats=2"]
SECOND_REPEAT = WARMUP + TIMED + 2  # run.fault.at_iter of an iteration in the second repeat
METHODS = ("bsp_a2a", "wfbp_ps", "bytescheduler_a2a")  # all-reduce, PS, ByteScheduler
HOROVOD = "@horovod"  # a method on engine=horovod
UCX = "@ucx"  # a PS method on cluster.ps_wire=ucx (methods/ps/ucx.py)
UCX_IN_MAKE_TEST = ("worker-stop", "server-exit")  # a worker frozen, a server killed
HANG_TIMEOUT_S = 20  # run.timeout_s of hangs: short, yet above a loaded machine's start-up skew


@dataclass(eq=False)  # hashable by identity: a key of FAULTS
class Fault:
    name: str
    overrides: list[str]
    expect: list[str]           # fragments of the failed row's error
    action: str = ""            # "", "SIGINT"/"SIGTERM" (to the launcher), "kill1" (SIGKILL rank 1)
    code: int | None = None     # the exit code, where it is fixed
    timeout_s: int = 60         # run.timeout_s
    workers: int = 2
    methods: tuple[str, ...] = METHODS  # those it applies to


def _inject(rank: int, kind: str, at: int = SECOND_REPEAT) -> list[str]:
    return [f"run.fault.rank={rank}", f"run.fault.at_iter={at}", f"run.fault.kind={kind}"]


FAULTS = {  # each with the method `make test` runs it with
    Fault("worker-raise", _inject(1, "raise"), ["rank 1", "injected fault"]): "bsp_a2a",
    Fault("worker-exit", _inject(1, "exit"), ["rank 1 exited with code 3", "repeat 1"]):
        "bytescheduler_a2a",
    Fault("worker-hang", _inject(1, "hang"), ["rank 1 hung", "repeat 1"],
          timeout_s=HANG_TIMEOUT_S, methods=(*METHODS, f"wfbp_ps{UCX}")): "wfbp_ps",
    # SIGSTOP: every thread of the rank frozen (Gloo's, the method's), then SIGKILLed and reaped
    Fault("worker-stop", _inject(1, "stop"), ["rank 1 hung", "repeat 1", "timed out"],
          timeout_s=HANG_TIMEOUT_S, methods=(*METHODS, f"wfbp_ps{UCX}")): "bsp_a2a",
    # SIGABRT without a word (a C++ crash): its silent peer, beating a moment ago, is not blamed
    Fault("worker-abort", _inject(1, "abort"), ["rank 1 was killed by signal SIGABRT",
                                                "repeat 1"]): "bytescheduler_a2a",
    # no peer to time out on it (a PS worker has its server): the launcher's watchdog, after
    # run.timeout_s and its grace (a lone rank has no start-up skew to allow for)
    Fault("lone-worker-hang", _inject(0, "hang"), ["no rank made progress", "iteration 2"],
          timeout_s=5, workers=1, methods=("bsp_a2a", "bytescheduler_a2a")):
        "bsp_a2a",
    Fault("server-exit", _inject(2, "exit"), ["rank 2 exited with code 3"],
          methods=("wfbp_ps", f"wfbp_ps{UCX}")): "wfbp_ps",
    Fault("server-hang", _inject(2, "hang"), ["rank 2 hung", "parameter server rank 2"],
          timeout_s=HANG_TIMEOUT_S, methods=("wfbp_ps", f"wfbp_ps{UCX}")): "wfbp_ps",
    Fault("launcher-sigint", [], ["interrupted (SIGINT"], action="SIGINT", code=130):
        "wfbp_ps",
    Fault("launcher-sigterm", [], ["SIGTERM"], action="SIGTERM", code=143):
        "bytescheduler_a2a",
    Fault("rank-sigkill", [], ["rank 1 was killed by signal SIGKILL"], action="kill1"):
        "bsp_a2a",
    # Horovod's engine: its background thread must not make rank 0 look like the culprit
    Fault("horovod-worker-hang", _inject(1, "hang"), ["rank 1 hung", "repeat 1"],
          timeout_s=HANG_TIMEOUT_S, methods=(f"wfbp_a2a{HOROVOD}",)): f"wfbp_a2a{HOROVOD}",
    Fault("horovod-rank-sigkill", [], ["rank 1 was killed by signal SIGKILL"], action="kill1",
          methods=(f"bsp_a2a{HOROVOD}",)): f"bsp_a2a{HOROVOD}",
    # ... nor Horovod's "has been shut down" when its background thread timed out on a rank
    # frozen whole (SIGSTOP: Horovod's thread too)
    Fault("horovod-worker-stop", _inject(1, "stop"), ["rank 1 hung", "repeat 1"],
          timeout_s=HANG_TIMEOUT_S, methods=(f"bsp_a2a{HOROVOD}", f"wfbp_a2a{HOROVOD}")):
        f"bsp_a2a{HOROVOD}",
}
NO_HOROVOD = pytest.mark.skipif(horovod.problem(device="cpu") is not None,
                                reason=f"{horovod.problem(device='cpu')}")
CASES = [pytest.param(fault, method, id=f"{fault.name}-{method}",
                      marks=([] if method == FAULTS[fault] or (
                          method.endswith(UCX) and fault.name in UCX_IN_MAKE_TEST)
                          else [pytest.mark.faults])
                      + ([NO_HOROVOD] if method.endswith(HOROVOD) else []))
         for fault in FAULTS for method in fault.methods]


class Run:
    """`python -m harness.run` in the background, its temporary files in `tmp`."""

    def __init__(self, tmp: Path, *overrides: str, timeout_s: int,
                 results_dir: Path | None = None) -> None:
        self.results, self.tmp = results_dir or tmp / "results", tmp / "tmp"
        self.tmp.mkdir()
        self.out, self.err = tmp / "stdout", tmp / "stderr"
        self.started = time.monotonic()
        with self.out.open("w") as out, self.err.open("w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "harness.run", *RUN, f"results_dir={self.results}",
                 f"run.timeout_s={timeout_s}", *overrides],
                cwd=REPO, stdout=out, stderr=err, env={**os.environ, "TMPDIR": str(self.tmp)},
                # a shell's background job (nohup make test &) ignores SIGINT, and so would
                # Python's Ctrl-C handling in the launcher
                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))

    def run_dirs(self) -> list[Path]:
        return list(self.tmp.glob("ddlbench-*"))

    def wait_for_second_repeat(self, timeout: float = 120) -> None:
        """Until rank 1 iterates in the second repeat and the first one's shard is written.
        Rank 0 writes that shard while the others build the second repeat's model, and
        joins their first collective only then: from here on the second repeat has all of
        its iterations to go."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for run_dir in self.run_dirs():
                try:
                    if (run_dir / "beat.rank1").read_text().startswith("1\titeration") and \
                            any(self.results.glob("*_r0.parquet")):
                        return
                except OSError:
                    pass
            assert self.proc.poll() is None, self.err.read_text()
            time.sleep(0.05)
        raise AssertionError("the run never reached its second repeat")

    def rank_pid(self, rank: int) -> int:
        [run_dir] = self.run_dirs()
        for proc in Path("/proc").iterdir():
            try:
                cmd = (proc / "cmdline").read_bytes()
                env = (proc / "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if str(run_dir).encode() in cmd and f"DDLBENCH_RANK={rank}".encode() in env:
                return int(proc.name)
        raise AssertionError(f"no process of rank {rank}")

    def finish(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"the run did not end within {timeout:.0f} s") from None


def _act(run: Run, action: str) -> None:
    if not action:
        return
    run.wait_for_second_repeat()
    if action == "kill1":
        os.kill(run.rank_pid(1), signal.SIGKILL)
    else:
        run.proc.send_signal(getattr(signal, action))


def _assert_failed_cleanly(run: Run, fault: Fault, code: int) -> None:
    elapsed = time.monotonic() - run.started
    stderr = run.err.read_text()
    assert code != 0, stderr
    if fault.code is not None:
        assert code == fault.code, stderr
    assert run.results.exists(), stderr
    frame = results.load(run.results).sort_values(["run_id", "repeat"])
    first = frame[frame.run_id == frame.run_id.iloc[0]]
    assert first.status.tolist() == ["ok", "failed"], stderr
    error = first.error.iloc[1]
    for fragment in fault.expect:
        assert fragment in error, error
    assert elapsed < fault.timeout_s + 120, f"took {elapsed:.0f} s"
    assert run.run_dirs() == [], "the run's temporary folder was left behind"
    assert live_processes(str(run.tmp)) == [], "processes of the run were left behind"


@pytest.mark.parametrize(("fault", "method"), CASES)
def test_fault_ends_the_run_with_one_row_naming_the_cause(fault: Fault, method: str,
                                                          tmp_path: Path) -> None:
    sweep = ["-m", "run.seed=0,1"] if fault.action.startswith("SIG") else []
    method, on_ucx, _ = method.partition(UCX)
    # PS methods with every worker pushing: one node then has its server (rank 2)
    ps = ["method.transport.local_reduce=false"] if method.endswith("_ps") else []
    ps += ["cluster.ps_wire=ucx"] if on_ucx else []
    method, on_horovod, _ = method.partition(HOROVOD)
    engine = ["engine=horovod"] if on_horovod else []
    run = Run(tmp_path, *sweep, f"method={method}", *ps, *engine,
              f"cluster.workers_per_node={fault.workers}", *fault.overrides,
              timeout_s=fault.timeout_s)
    _act(run, fault.action)
    code = run.finish(timeout=fault.timeout_s + 180)
    _assert_failed_cleanly(run, fault, code)
    if on_ucx:  # the rows say which wire carried the PS messages
        assert set(results.load(run.results).ps_wire) == {"ucx"}
    if sweep:  # a signal stops the whole sweep: the second job never starts
        assert "job 2/2" not in run.out.read_text()
        assert results.load(run.results).run_id.nunique() == 1


@contextlib.contextmanager
def _small_disk(folder: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` mounted at `folder` (made), unmounted afterwards."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    folder.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                   check=True)
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=True)


def test_full_disk_while_writing_a_shard_fails_the_repeat(tmp_path: Path) -> None:
    """A small tmpfs fills up after the first shard: the second repeat's shard cannot be
    written, the partial file is removed, the (smaller) failed row still fits."""
    with _small_disk(tmp_path / "disk", "1m") as disk:
        # wfbp_a2a: a measured row (~23 KB, with a unit per tensor in its plan) is bigger
        # than a failed one (~19 KB) by more than a tmpfs page
        run = Run(tmp_path, "cluster.workers_per_node=2", "method=wfbp_a2a", timeout_s=60,
                  results_dir=disk)
        run.wait_for_second_repeat()
        [shard] = disk.glob("*.parquet")
        room = shard.stat().st_size // 4096 * 4096  # whole pages, less than a measured row
        free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
        (disk / "filler").write_bytes(b"\0" * (free - room))
        code = run.finish(timeout=180)
        _assert_failed_cleanly(run, Fault("disk", [], ["No space left on device", "rank 0"]),
                               code)
        assert sorted(p.name for p in disk.iterdir() if p.name != "filler") == sorted(
            [shard.name, shard.name.replace("_r0", "_r1")]), "a partial file was left"


@pytest.mark.network
@pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")
@pytest.mark.skipif(bool(checks.missing_net_tools()), reason="ip/tc (iproute2) are missing")
def test_sigint_during_an_emulated_run_removes_the_network(tmp_path: Path) -> None:
    run = Run(tmp_path, "cluster=emulated", "network=eth1g", "cluster.workers_per_node=2",
              timeout_s=60)
    run.wait_for_second_repeat()
    [run_dir] = run.run_dirs()
    token = (run_dir / leftovers.NETWORK).read_text().strip()  # this run's, not another test's
    assert len(netem.leftovers(token)) == 1 + 2 + 2  # bridge, namespaces, veths
    run.proc.send_signal(signal.SIGINT)
    code = run.finish(timeout=120)
    _assert_failed_cleanly(run, Fault("emulated", [], ["interrupted"], code=130), code)
    assert netem.leftovers(token) == []


# -- every fault ends with a row, or with one line -------------------------------------------

FREEZE_AND_ABORT = """
import os, sys, time
from pathlib import Path
from omegaconf import OmegaConf
from harness.launch import failure
from harness.measure.bench import inject_fault
run_dir, rank, wait_s = Path(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
failure.beat(run_dir, rank, 1, "iteration 4")
if rank == 0:  # as NCCL's watchdog does once a collective waited past its timeout
    while not (run_dir / "beat.rank1").exists():
        time.sleep(0.05)
    time.sleep(wait_s)
fault = OmegaConf.create({"rank": rank, "at_iter": 4, "kind": "abort" if rank == 0 else "stop"})
inject_fault(fault, rank=rank, iteration=4)
"""


def test_a_rank_aborted_while_another_is_frozen_blames_the_frozen_one(tmp_path: Path) -> None:
    """Real processes under the launcher's watch: rank 1 stops itself (SIGSTOP), rank 0
    dies of SIGABRT without a word run.timeout_s later, as NCCL's watchdog ends it; the
    frozen rank is blamed, and it is killed and reaped."""
    timeout_s = 2.0
    procs = [subprocess.Popen([sys.executable, "-c", FREEZE_AND_ABORT, str(tmp_path), str(r),
                               str(timeout_s + 1)], cwd=REPO, start_new_session=True)
             for r in (0, 1)]
    ending = launcher._watch(procs, tmp_path, idle_s=120)
    assert ending.exits == {0: -signal.SIGABRT} and ending.alive == [1], ending
    text, repeat = failure.cause(tmp_path, ending, workers=2, timeout_s=timeout_s)
    assert text.startswith("rank 1 hung at repeat 1, iteration 4: rank 0 was killed by signal "
                           "SIGABRT at repeat 1, iteration 4 waiting on it"), text
    assert repeat == 1
    assert procs[1].returncode == -signal.SIGTERM  # continued after SIGTERM: it ended at once
    assert live_processes(str(tmp_path)) == []


def _process_of(entry: str, marker: str, timeout: float = 300) -> None:
    """Until a rank of `entry` runs with `marker` in its environment."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for proc in Path("/proc").iterdir():
            try:
                cmd = (proc / "cmdline").read_bytes()
                env = (proc / "environ").read_bytes()
            except OSError:
                continue
            if f"harness.launch.rank\0{entry}".encode() in cmd and marker.encode() in env:
                return
        time.sleep(0.2)
    raise AssertionError(f"no rank of {entry} started")


@pytest.mark.parametrize("entry, method", [("harness.measure.plain", "plain"),
                                           ("harness.measure.bench", "bsp_a2a")])
def test_sigterm_to_methodbench_records_the_run_in_flight(tmp_path: Path, entry: str,
                                                         method: str) -> None:
    res, tmp = tmp_path / "results", tmp_path / "tmp"
    tmp.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-m", "harness.methodbench", "--models", "bert_tiny", "--methods",
         "bsp_a2a", "--workers", "1", "--engines", "native", "--rounds", "1",
         "--warmup-iters", "1", "--timed-iters", "100000" if method == "plain" else "3",
         "--results-dir", str(res)],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "TMPDIR": str(tmp)})
    _process_of(entry, str(tmp))  # the plain loop runs first
    time.sleep(1)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 143, stderr
    frame = results.load(res)
    failed = frame[frame.status == "failed"]
    assert failed.method.tolist() == [method], stderr
    assert "SIGTERM" in failed.error.iloc[0], failed.error.iloc[0]
    assert len(frame) == (1 if method == "plain" else 2)  # before it: the plain loop's row
    assert live_processes(str(tmp)) == [] and list(tmp.glob("ddlbench-*")) == []


def test_report_on_a_full_disk_ends_in_one_line_and_leaves_nothing_half_written(
        tmp_path: Path) -> None:
    res = tmp_path / "results"
    for i, (method, workers, tput) in enumerate([("ddp", 1, 10.0), ("ddp", 2, 18.0),
                                                 ("bsp_a2a", 2, 17.0)]):
        row = {"run_id": f"r{i}", "model": "toy", "method": method, "world_size": workers,
               "repeat": 0, "throughput": tput, "status": "ok", "source": "measured",
               "network": "loopback", "local_batch_size": 8}
        results.write_shard(results.shard_path(res, f"r{i}", 0), [row])
    with _small_disk(tmp_path / "disk", "64k") as disk:
        kept = disk / "kept" / "notes.md"  # an earlier file in out_dir stays as it was
        kept.parent.mkdir()
        kept.write_text("mine\n")
        for out in (disk / "new", kept.parent):
            done = run_module("harness.report", f"results_dir={res}", f"out_dir={out}")
            last = done.stderr.strip().splitlines()[-1]
            assert done.returncode == 1, done.stderr
            assert "Traceback" not in done.stderr
            assert last.startswith(f"ddlbench: error: could not write the report to out_dir "
                                   f"'{out}': No space left on device"), done.stderr
        assert sorted(p.relative_to(disk) for p in disk.rglob("*")) == [
            Path("kept"), Path("kept/notes.md")], "a half-written file was left"
        assert kept.read_text() == "mine\n"
