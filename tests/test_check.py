"""`python -m harness.check`: the preflight, on real processes (CPU, Gloo).

Each passing run verifies the methods it is given (one launch each; a user's check, every
method of conf/method/); on a 2-core machine a launch takes seconds, so the model is
bert_tiny shrunk further and the methods one of each kind.
"""

from __future__ import annotations

import re

import pytest
from omegaconf import OmegaConf

from harness import check
from harness.config import engine as horovod
from harness.measure import preflight as rank_side
from tests.conftest import SMALL_BERT, run_module

KINDS = ["bsp_a2a", "wfbp_ps", "bytescheduler_a2a"]  # all-reduce, PS, ByteScheduler
SMALL = [*SMALL_BERT, "run.timeout_s=120", "cluster.device=cpu"]
RUN_TIMEOUT_S = 1200


def preflight(*overrides: str, results_dir, module: str = "harness.check", args=()):
    return run_module(module, *args, *SMALL, f"results_dir={results_dir}", *overrides,
                      timeout=RUN_TIMEOUT_S)


def summary(stdout: str) -> list[str]:
    return stdout.split("== summary\n", 1)[1].splitlines()


@pytest.mark.parametrize("shape, methods, workers, servers", [
    # one node: PS methods need no server (BytePS), the environment check runs none
    ("cluster.workers_per_node=3", ["bsp_ps", "bytescheduler_ps"], 3, 0),
    # two nodes of one worker, one server each: a method of each kind (test_methods.py
    # verifies every method, in its matrix and by harness.verify)
    ("cluster.nodes=2", KINDS, 2, 2),
])
def test_the_methods_asked_for_pass(shape: str, methods: list[str], workers: int, servers: int,
                             results_dir) -> None:
    out = preflight(shape, f"method={','.join(methods)}", results_dir=results_dir)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = summary(out.stdout)
    assert [ln for ln in lines if ln.endswith(": ok")] == [
        "environment: ok", *(f"{m}: ok" for m in methods)]
    # the environment check ran with the parameter servers that PS methods add
    roles = re.findall(r"^(\d+)\s+\S+\s+\d+\s+(worker|server)\s+cpu\s", out.stdout, re.M)
    assert roles == [(str(r), "worker") for r in range(workers)] + [
        (str(workers + s), "server") for s in range(servers)]
    assert "group default (gloo): ok" in out.stdout
    assert f"Horovod {horovod.version() or '-'}" in out.stdout  # what engine=horovod would load
    workers_group = "workers" if servers else "workers (the default group)"
    assert f"group {workers_group} (gloo): ok" in out.stdout
    assert not results_dir.exists(), "the check writes no result shards"


def test_failing_methods_are_named_and_fail_the_check(results_dir) -> None:
    # on two nodes of one worker ranks 2 and 3 are bsp_ps's servers; the small model's one
    # partition (key 0) hashes to rank 3, which fails on purpose in its first round;
    # bsp_a2a has no rank 3, so its configuration does not hold
    out = preflight("cluster.nodes=2", "method=bsp_a2a,bsp_ps", "run.fault.rank=3",
                    results_dir=results_dir)
    assert out.returncode == 1, out.stdout + out.stderr
    lines = summary(out.stdout)
    assert "environment: ok" in lines
    assert "bsp_a2a: FAILED run.fault.rank=3 is not a rank of this run" in "\n".join(lines)
    assert re.search(r"^bsp_ps: FAILED rank 3: .*injected fault at iteration 0$", "\n".join(lines),
                     re.M), lines
    assert lines[-1] == "2 check(s) failed"
    assert not results_dir.exists(), "a failed check writes no failed rows"


def test_the_ucx_wire_is_checked_between_every_worker_and_server(results_dir) -> None:
    """cluster.ps_wire=ucx: a round trip per worker and server over UCX, the transports UCX
    picked in the line, UCX_TLS passed through to UCX (and shown in the table)."""
    out = run_module("harness.check", *SMALL, f"results_dir={results_dir}", "cluster.nodes=2",
                     "method=bsp_ps", "cluster.ps_wire=ucx", timeout=RUN_TIMEOUT_S,
                     env={"UCX_TLS": "tcp"})
    assert out.returncode == 0, out.stdout + out.stderr
    assert re.search(r"^group ps wire worker-server \(ucx: tcp/\S+\): ok$", out.stdout, re.M), \
        out.stdout
    assert "UCX_TLS=tcp" in out.stdout
    assert summary(out.stdout)[-1] == "every check passed"


def test_torchrun_runs_the_same_launches_on_every_rank(results_dir) -> None:
    # two processes: the A2A methods run one after another in the same processes (each
    # on a store of its own); bsp_ps on two nodes needs their two servers and is skipped
    out = preflight("cluster.nodes=2", "method=ddp,bsp_ps,bsp_a2a",
                    results_dir=results_dir, module="torch.distributed.run",
                    args=("--standalone", "--nproc-per-node=2", "-m", "harness.check"))
    assert out.returncode == 0, out.stdout + out.stderr
    lines = summary(out.stdout)
    assert lines[:2] == ["environment: ok", "ddp: ok"] and lines[3] == "bsp_a2a: ok"
    assert lines[2].startswith("bsp_ps: skipped: needs 4 processes")
    assert out.stdout.count("== summary") == 1, "only rank 0 reports"
    assert not results_dir.exists()


@pytest.mark.parametrize("override, message", [
    ("method=bsp_a2a,wfbp", "method 'wfbp' is unknown; choose one of: bsp_a2a"),
    ("cluster.workers_per_node=1,2", "harness.check checks one cluster configuration"),
    ("cluster.workers_per_nod=2", "cluster.workers_per_nod"),
])
def test_bad_input_is_one_line_and_starts_nothing(override: str, message: str, results_dir,
                                                  capsys: pytest.CaptureFixture) -> None:
    assert check.main([*SMALL, f"results_dir={results_dir}", override]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.count("\n") == 1 and message in out.err, out.err


def test_table_and_group_lines() -> None:
    info = {"host": "n1", "local_rank": 0, "role": "worker", "device": "cpu",
            "interfaces": "lo,eth0", "net_env": "-", "versions": {"torch": "2.x"}}
    infos = [{**info, "rank": r} for r in range(3)]
    infos[2] = {**infos[2], "role": "server", "versions": {"torch": "2.y"}}
    lines = rank_side.environment_lines(infos)
    assert "warning: the ranks run different versions" in lines
    assert "torch 2.x  (ranks 0-1)" in lines and "torch 2.y  (ranks 2)" in lines
    assert rank_side.spans([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    gathered = [{"default": ("gloo", ""), "workers": ("gloo", "")},
                {"default": ("gloo", ""), "workers": ("gloo", "rank 1: the sum is 2, expected 3")},
                {"default": ("gloo", "")}]
    assert rank_side.group_lines(gathered) == [
        "group default (gloo): ok", "group workers (gloo): FAILED rank 1: the sum is 2, expected 3"]


def test_a_failure_is_told_in_one_line() -> None:
    cfg = OmegaConf.create({"verify": {"atol": 0.0, "rtol": 0.0}})
    launcher = "ddlbench: run r1 failed: rank 0 exited with code 1 at repeat 0, leaving\n"
    diff = "max_abs_diff=7.1e-08 max_rank_diff=0.000e+00\n"
    assert check.why_failed(1, diff + launcher, cfg) == (
        "max_abs_diff=7.1e-08 max_rank_diff=0.000e+00: beyond verify.atol=0/verify.rtol=0, "
        "or the ranks differ")
    assert check.why_failed(1, launcher, cfg) == "rank 0 exited with code 1 at repeat 0, leaving"
    assert check.why_failed(1, "", cfg) == "exit code 1 (its errors are above)"
