"""`python -m harness.verify [overrides]`: is a method lossless on this cluster?

    python -m harness.verify model=bert_tiny method=bsp_a2a cluster.workers_per_node=3
    python -m harness.verify method=bsp_ps cluster.workers_per_node=2 verify.steps=5

Main keys: model=, method=, cluster= (names below), verify.steps=3, verify.atol=1e-5,
verify.rtol=1.3e-6.

Runs `verify.steps` training steps of the configured method on every worker
and, on rank 0, of a single-process reference that processes the same N local
batches one after another, averages their gradients and steps the same
optimizer (dropout is reseeded identically per step and rank). Prints
`max_abs_diff=<value>` (method vs reference) and `max_rank_diff=<value>`
(spread of the parameters across ranks); exits 0 when the parameters match
within verify.atol/rtol and are identical on every rank, 1 otherwise. It injects no
fault: `run.fault` naming a rank is refused before start (exit 2); faults are tested
with `python -m harness.run`, whose failed row names the rank.
"""

from __future__ import annotations

import sys

from omegaconf import DictConfig

from harness.config import ConfigError, usage
from harness.launch.launcher import command
from harness.launch.process import exit_now

ENTRY = "harness.measure.verify"  # what every rank runs


def refuse_fault(cfg: DictConfig) -> None:
    """A verify run ends in a verdict, not in a result row that could name the rank a
    fault struck, so it injects none: ConfigError when run.fault names a rank."""
    if cfg.run.fault.rank != -1:
        raise ConfigError(
            f"run.fault.rank={cfg.run.fault.rank}: harness.verify does not inject faults; test "
            "one with python -m harness.run (the run ends in a failed row naming the rank), "
            "or drop run.fault")


def main(argv: list[str]) -> int:
    if usage.answer(argv, __doc__):  # -h, --help: the help, and nothing else
        return 0
    return command(argv, name="harness.verify", entry=ENTRY, check=refuse_fault)


if __name__ == "__main__":
    exit_now(main(sys.argv[1:]))
