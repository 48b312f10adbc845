"""`python -m harness.methodbench`: every method at 1 and 2 workers, plus the plain loop.

    python -m harness.methodbench                      # resnet50_small and bert_tiny
    python -m harness.methodbench --rounds 1 --models bert_tiny --timed-iters 10

Runs every method of conf/method/ on each model at each worker count through
the normal `harness.run` path (one parquet shard per run), and measures a
plain single-process training loop (forward, backward, optimizer step, no
method, no harness) on the same model, batch, optimizer and thread count as
the 1.0x baseline; its rows have method "plain". Everything is repeated in
`--rounds` rounds with the configurations interleaved, so the drift of a shared
machine hits every method alike. The ratios it prints:

- at the largest worker count: the better of wfbp_a2a and mgwfbp over ddp;
- at 1 worker: every all-reduce method over the plain loop (the harness's overhead).

Other processes on a shared machine only ever slow a run down, so the ratios
use each configuration's best round; the medians are printed (and saved) too.

Results land in `<results-dir>/<timestamp>/`; the ratios are printed and saved
next to the shards as ratios.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import time
import uuid
from pathlib import Path

import torch

import models
from harness import config, results
from harness import run as harness_run
from harness.bench import batch_generator, identity, make_optimizer

ALLREDUCE = ("bsp_a2a", "wfbp_a2a", "mgwfbp", "bytescheduler_a2a", "ddp")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m harness.methodbench",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="resnet50_small,bert_tiny")
    parser.add_argument("--methods", default=",".join(config.choices("method")))
    parser.add_argument("--workers", default="1,2")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup-iters", type=int, default=10)
    parser.add_argument("--timed-iters", type=int, default=20)
    parser.add_argument("--results-dir", default="results/methodbench")
    return parser.parse_args(argv)


def plain_loop(model_name: str, *, warmup: int, iters: int, seed: int = 0) -> list[float]:
    """Per-iteration seconds of forward, backward, step, zero_grad: no method, no harness."""
    cfg = config.load([f"model={model_name}"])
    torch.set_num_threads(len(os.sched_getaffinity(0)))  # as a 1-worker run gets
    model = models.build(cfg.model.family, cfg.model.build, seed=seed)
    optimizer = make_optimizer(model, cfg.model.optimizer)
    batch = model.make_batch(cfg.model.local_batch_size, batch_generator(seed, 0))
    times = []
    for i in range(warmup + iters):
        start = time.perf_counter()
        model(batch).backward()
        optimizer.step()
        optimizer.zero_grad()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times


def record_plain(model_name: str, times: list[float], *, out: Path, repeat: int,
                 warmup: int) -> None:
    """Keep a plain-loop measurement as a result row (method 'plain', world size 1)."""
    cfg = config.load([f"model={model_name}", f"run.warmup_iters={warmup}",
                       f"run.timed_iters={len(times)}", f"results_dir={out}"])
    run_id = f"{dt.datetime.now():%Y%m%d-%H%M%S}-{model_name}-plain-{uuid.uuid4().hex[:6]}"
    row = {**identity(cfg, run_id=run_id, repeat=repeat), "method": "plain", "servers": 0,
           "world_size": 1, "workers_per_node": 1,
           "throughput": cfg.model.local_batch_size * len(times) / sum(times),
           "timed_s": sum(times), "iter_times_s": times, "rank_iter_times_s": [times],
           "status": "ok", "plan_json": json.dumps({"method": "plain"})}
    results.write_shard(results.shard_path(out, run_id, 0), [row])


def run_method(model_name: str, method: str, workers: int, *, out: Path,
               args: argparse.Namespace) -> int:
    """One harness.run of one configuration, one repeat; its exit code."""
    return harness_run.main([
        f"model={model_name}", f"method={method}", f"cluster.workers_per_node={workers}",
        "run.repeats=1", f"run.warmup_iters={args.warmup_iters}",
        f"run.timed_iters={args.timed_iters}", f"results_dir={out}",
    ])


def ratios(frame, *, workers: list[int], stat: str = "max") -> dict[str, dict[str, float]]:
    """The targets' ratios per model, from each configuration's `stat` over the rounds.

    "max" (the default) is the least disturbed round: other processes on a shared
    machine only ever slow a run down. "median" is reported next to it.
    """
    ok = frame[frame.status == "ok"]
    best = ok.groupby(["model", "method", "world_size"]).throughput.agg(stat).to_dict()
    top = max(workers)
    out = {}
    for model_name in sorted(ok.model.unique()):
        def tput(method: str, n: int, model_name: str = model_name) -> float | None:
            return best.get((model_name, method, n))

        r = {}
        fast = max((t for t in (tput("wfbp_a2a", top), tput("mgwfbp", top)) if t), default=None)
        if fast and tput("ddp", top):
            r[f"best(wfbp_a2a,mgwfbp)/ddp@{top}w"] = fast / tput("ddp", top)
        for method in ALLREDUCE:
            if tput("plain", 1) and tput(method, 1):
                r[f"{method}/plain@1w"] = tput(method, 1) / tput("plain", 1)
        out[model_name] = r
    return out


def report(frame, *, workers: list[int]) -> dict[str, dict[str, dict[str, float]]]:
    """Print throughput per configuration and the ratios by both statistics; return them."""
    ok = frame[frame.status == "ok"].groupby(["model", "world_size", "method"]).throughput
    print(ok.agg(["max", "median", "min", "count"]).round(2).to_string())
    table = {stat: ratios(frame, workers=workers, stat=stat) for stat in ("max", "median")}
    for model_name in table["max"]:
        for name, value in table["max"][model_name].items():
            median = table["median"][model_name].get(name, float("nan"))
            print(f"{model_name:16s} {name:34s} best {value:.3f}   median {median:.3f}")
    return table


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    model_names, method_names = args.models.split(","), args.methods.split(",")
    worker_counts = [int(w) for w in args.workers.split(",")]
    out = Path(args.results_dir) / f"{dt.datetime.now():%Y%m%d-%H%M%S}"
    failed = 0
    for rnd in range(args.rounds):
        order = method_names[rnd % len(method_names):] + method_names[:rnd % len(method_names)]
        for model_name in model_names:
            print(f"== round {rnd + 1}/{args.rounds} {model_name}: plain loop", flush=True)
            times = plain_loop(model_name, warmup=args.warmup_iters, iters=args.timed_iters)
            record_plain(model_name, times, out=out, repeat=rnd, warmup=args.warmup_iters)
            for workers in worker_counts:
                for method in order:
                    print(f"== round {rnd + 1}/{args.rounds} {model_name} {method} "
                          f"x{workers}", flush=True)
                    failed += run_method(model_name, method, workers, out=out, args=args) != 0
    table = report(results.load(out), workers=worker_counts)
    (out / "ratios.json").write_text(json.dumps(table, indent=2))
    print(f"{failed} failed runs; shards and ratios.json in {out}/")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

