"""`python -m harness.run [overrides]`: benchmark one configuration, or a sweep.

    python -m harness.run model=bert_tiny method=ddp cluster.workers_per_node=2
    python -m harness.run -m method=bsp_a2a,ddp cluster.workers_per_node=1,2   # a sweep
    python -m harness.run experiment=smoke                                      # a recipe

Main keys (defaults in conf/bench.yaml):
  model= method= cluster= network=   what runs where (their names are listed below)
  engine=native|horovod              what runs an all-reduce method's collectives
  cluster.workers_per_node           workers per node (x cluster.nodes)
  run.timed_iters, run.repeats       the timing protocol (after run.warmup_iters)
  run.force=true                     lift the limits of what fits this machine
  results_dir=results                where the result shards (parquet) go

Every job of a sweep is composed and validated before the first one starts; a
bad value stops everything with a one-line error and exit code 2. A failed job
leaves a failed row and the sweep goes on; Ctrl-C or SIGTERM stops the sweep
(exit code 130 / 143). `python -m harness.report` draws the results.
"""

from __future__ import annotations

import sys
import time

from harness import config
from harness.config import checks, usage
from harness.launch.launcher import check_launcher, launch
from harness.launch.process import exit_now
from harness.measure import progress
from harness.measure.results import summarize

STOPPED = {130: "SIGINT (Ctrl-C)", 143: "SIGTERM"}  # exit codes of a stopped launcher


def main(argv: list[str]) -> int:
    if usage.answer(argv, __doc__):  # -h, --help: the help, and nothing else
        return 0
    try:
        checks.used_by("harness.run", argv)
        jobs = config.expand(argv)
        cfgs = config.load_all(jobs)
        for cfg in cfgs:
            check_launcher(cfg)
    except config.ConfigError as exc:
        print(f"ddlbench: error: {exc}", file=sys.stderr)
        return 2
    failed, started = 0, time.perf_counter()
    for i, (job, cfg) in enumerate(zip(jobs, cfgs), start=1):
        if len(jobs) > 1:
            done = progress.line("sweep", i - 1, len(jobs), time.perf_counter() - started,
                                 "jobs done")
            print(f"== job {i}/{len(jobs)}: {' '.join(job)}  ({done})", flush=True)
        code, run_id = launch(cfg, entry="harness.measure.bench")
        if run_id is not None:
            print(summarize(cfg, run_id), flush=True)
        if code in STOPPED:  # Ctrl-C or SIGTERM stops the sweep, not just this job
            print(f"ddlbench: stopped by {STOPPED[code]} at job {i} of {len(jobs)}",
                  file=sys.stderr)
            return code
        failed += code != 0
    if len(jobs) > 1:
        print(f"{len(jobs) - failed} of {len(jobs)} jobs succeeded; results in "
              f"{cfgs[0].results_dir}/")  # `make run` draws them next; --help says how
    return 1 if failed else 0


if __name__ == "__main__":
    try:
        exit_now(main(sys.argv[1:]))
    except KeyboardInterrupt:  # between jobs; a running job is stopped by its launcher
        print(f"ddlbench: stopped by {STOPPED[130]}", file=sys.stderr)
        exit_now(130)
