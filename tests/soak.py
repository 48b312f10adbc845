"""Many short runs in a row, every one of which must succeed.

    python -m tests.soak --local 200 --emulated 50 --verify 50   # `make soak`

Local and emulated runs are sweeps of 2-worker bert_tiny runs over every method
(the seed varies, so each run is a fresh configuration); verify runs cycle
through the methods. Prints one line per kind and exits 1 on any failure: a
non-zero exit, a failed or missing row, or an abort at exit in the output.
tests/test_run.py runs one round in `make test` (every method once, on the small BERT).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from harness import config
from harness.measure import results
from tests.conftest import run_module

# 5 warm-up iterations: MG-WFBP profiles 5, which must stay out of the timed window
SHORT = ["model=bert_tiny", "cluster.workers_per_node=2", "run.warmup_iters=5",
         "run.timed_iters=2", "run.repeats=1"]
ABORTS = ("terminate called", "Traceback", "core dumped")


def sweep(count: int, results_dir: Path, *extra: str) -> tuple[int, list[str], str]:
    """At least `count` runs (whole rounds of every method) as one sweep; how many ran,
    the problems seen, and what the sweep printed."""
    methods = config.choices("method")
    rounds = -(-count // len(methods))
    out = run_module("harness.run", "-m", *SHORT, *extra, f"method={','.join(methods)}",
                     f"run.seed={','.join(map(str, range(rounds)))}",
                     f"results_dir={results_dir}", timeout=24 * 3600)
    frame = results.load(results_dir)
    expected = len(methods) * rounds
    problems = [f"{e}" for e in frame[frame.status != "ok"].error]
    if out.returncode != 0 or len(frame) != expected or problems:
        problems.append(f"exit {out.returncode}, {len(frame)} rows of {expected}: "
                        f"{out.stderr[-2000:]}")
    aborts = [f"{a!r} in the output" for a in ABORTS if a in out.stderr]
    return expected, problems + aborts, out.stdout


def verify(count: int) -> tuple[int, list[str]]:
    methods = config.choices("method")
    problems = []
    for i in range(count):
        method = methods[i % len(methods)]
        out = run_module("harness.verify", "model=bert_tiny", "cluster.workers_per_node=2",
                         f"method={method}", timeout=600)
        if out.returncode != 0 or "max_abs_diff=" not in out.stdout:
            problems.append(f"verify {method}: exit {out.returncode}: {out.stderr[-2000:]}")
        problems += [f"verify {method}: {a!r}" for a in ABORTS if a in out.stderr]
    return count, problems


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.soak", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--local", type=int, default=200)
    parser.add_argument("--emulated", type=int, default=50)
    parser.add_argument("--verify", type=int, default=50)
    args = parser.parse_args(argv)
    failed = 0
    with tempfile.TemporaryDirectory(prefix="ddlbench-soak-") as tmp:
        kinds = [("local", args.local, lambda n: sweep(n, Path(tmp) / "local")[:2]),
                 ("emulated", args.emulated,
                  lambda n: sweep(n, Path(tmp) / "emulated", "cluster=emulated",
                                  "network=eth1g")[:2]),
                 ("verify", args.verify, verify)]
        for name, count, soak in kinds:
            if count <= 0:
                continue
            started = time.monotonic()
            runs, problems = soak(count)
            failed += len(problems)
            print(f"{name}: {runs} runs, {len(problems)} failed, "
                  f"{time.monotonic() - started:.0f} s", flush=True)
            for p in problems:
                print(f"  {p}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
