"""Who a process is under srun, decided from the SLURM_* variables alone (no Slurm needed;
tests/test_slurm.py runs the same under a real srun)."""

from __future__ import annotations

import pytest

from harness.config import ranks

# The variables Slurm 22.05 sets (trimmed to those that matter), as seen on the test cluster.
STEP = {"SLURM_JOB_ID": "123456", "SLURM_JOB_NODELIST": "node[01-04]", "SLURM_NTASKS": "8",
        "SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_STEP_ID": "0",
        "SLURM_STEP_NODELIST": "node[02-03]", "SLURM_STEP_NUM_TASKS": "8",
        "SLURM_STEP_TASKS_PER_NODE": "4(x2)"}
BATCH_SCRIPT = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "vm", "SLURM_NTASKS": "2",
                "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_TASKS_PER_NODE": "2"}
SALLOC_SHELL = {"SLURM_JOB_ID": "8", "SLURM_JOB_NODELIST": "vm", "SLURM_NTASKS": "2"}
# salloc with LaunchParameters=use_interactive_step: a special step keeping SLURM_NTASKS
INTERACTIVE_STEP = {**SALLOC_SHELL, "SLURM_PROCID": "0", "SLURM_STEP_ID": "4294967290",
                    "SLURM_STEP_NUM_TASKS": "1", "SLURM_STEP_NODELIST": "vm"}
ONE_TASK_STEP = {**SALLOC_SHELL, "SLURM_NTASKS": "1", "SLURM_PROCID": "0",
                 "SLURM_STEP_ID": "1", "SLURM_STEP_NUM_TASKS": "1", "SLURM_STEP_NODELIST": "vm"}


@pytest.mark.parametrize("nodelist, hosts", [
    ("vm", ["vm"]),
    ("node[01-04,07],gpu1", ["node01", "node02", "node03", "node04", "node07", "gpu1"]),
    ("n[8-10]", ["n8", "n9", "n10"]),
    ("a[1-2]-b[3-4],c", ["a1-b3", "a1-b4", "a2-b3", "a2-b4", "c"]),
    ("gpu-a100-[001-002]", ["gpu-a100-001", "gpu-a100-002"]),
])
def test_nodelists_expand_like_scontrol(nodelist: str, hosts: list[str]) -> None:
    assert ranks.parse_nodelist(nodelist) == hosts
    assert ranks.hostnames(nodelist) == hosts  # scontrol where it runs, else the parser


def test_an_srun_step_is_one_rank_and_sets_the_rendezvous() -> None:
    env = dict(STEP)
    assert ranks.external_rank(env) == {"rank": 5, "world_size": 8, "local_rank": 1,
                                        "local_world_size": 4}
    assert env["MASTER_ADDR"] == "node02"  # the step's first node, not the job's
    assert env["MASTER_PORT"] == str(20000 + 123456 % 40000)


def test_an_exported_rendezvous_wins_and_the_job_nodelist_is_the_fallback() -> None:
    env = {**STEP, "MASTER_ADDR": "head", "MASTER_PORT": "1234"}
    assert ranks.external_rank(env)["rank"] == 5
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("head", "1234")
    env = {k: v for k, v in STEP.items() if k != "SLURM_STEP_NODELIST"}
    ranks.external_rank(env)
    assert env["MASTER_ADDR"] == "node01"


@pytest.mark.parametrize("env", [BATCH_SCRIPT, SALLOC_SHELL, INTERACTIVE_STEP, ONE_TASK_STEP, {}],
                         ids=["batch-script", "salloc-shell", "interactive-step",
                              "one-task-step", "no-slurm"])
def test_no_srun_step_of_several_tasks_is_no_external_launch(env: dict[str, str]) -> None:
    # a single-task step runs the harness's local launcher, which starts every rank itself
    before = dict(env)
    assert ranks.external_rank(dict(env)) is None
    assert env == before


def test_torchrun_variables_come_first() -> None:
    env = {**STEP, "RANK": "2", "WORLD_SIZE": "3", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "3"}
    assert ranks.external_rank(env) == {"rank": 2, "world_size": 3, "local_rank": 0,
                                        "local_world_size": 3}
    assert "MASTER_ADDR" not in env  # torchrun exports its own


def test_the_port_rule_is_the_one_of_the_array_script() -> None:
    assert ranks.slurm_master_port(0) == 20000
    assert ranks.slurm_master_port(40001) == 20001
    assert all(20000 <= ranks.slurm_master_port(j) < 60000 for j in (1, 39999, 10**9))
