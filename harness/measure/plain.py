"""The plain training loop, timed as a run: the yardstick of `python -m harness.methodbench`
(forward, backward, optimizer step; no method, one process), kept as a result row of
method 'plain'."""

from __future__ import annotations

import json

from omegaconf import DictConfig

from harness.launch.rank import Context
from harness.measure import results
from harness.measure.bench import device_name, plain_training
from harness.measure.provenance import identity
from harness.measure.timing import Clock, timed_window


def worker(cfg: DictConfig, ctx: Context) -> None:
    """The plain loop's process: forward, backward, optimizer step, zero_grad; no method.

    The launcher starts it exactly as it starts a 1-worker harness run (a fresh
    process, the same thread count, the same rendezvous), and it is timed by the
    harness's own window (barrier, `timed_iters` iterations, device sync), so the
    ratio to it measures only what the harness and the method add.
    """
    model, optimizer, batch = plain_training(cfg.model, seed=cfg.run.seed, device=ctx.device,
                                             rank=ctx.rank)

    def step(_clock: Clock | None = None) -> None:
        model(batch).backward()
        optimizer.step()
        optimizer.zero_grad()

    for _ in range(cfg.run.warmup_iters):
        step()
    window = timed_window(step, iters=cfg.run.timed_iters, drain=lambda: None,
                          device=ctx.device)
    record_plain(cfg, window=window.seconds, iter_times=window.iter_times, ctx=ctx)


def _identity(cfg: DictConfig, run_id: str) -> dict:
    """A plain-loop row's identity: method 'plain', one worker, no servers."""
    return {**identity(cfg, run_id=run_id, repeat=0), "method": "plain",
            "servers": 0, "world_size": 1, "workers_per_node": 1}


def record_plain(cfg: DictConfig, *, window: float, iter_times: list[float],
                 ctx: Context) -> None:
    """Keep a plain-loop measurement as a result row (method 'plain', world size 1) under
    the launcher's run id (so a failure after it adds no row: `record_failure`)."""
    run_id = ctx.run_id
    row = {**_identity(cfg, run_id),
           "throughput": cfg.model.local_batch_size * cfg.run.timed_iters / window,
           "timed_s": window, "iter_times_s": iter_times, "rank_iter_times_s": [iter_times],
           "status": "ok", "backend": ctx.backend, "device": device_name(ctx.device),
           "plan_json": json.dumps({"method": "plain"})}
    results.write_shard(results.shard_path(cfg.results_dir, run_id, 0), [row])


def record_failure(cfg: DictConfig, *, run_id: str, repeat: int | None, error: str) -> None:
    """The plain loop's failed row, as a method run's (harness.launch.failure.record calls
    it when the loop's process fails or the launcher is stopped; `repeat` is always 0). A
    loop that wrote its row keeps it alone: a shard is never overwritten."""
    row = {**_identity(cfg, run_id), "status": "failed", "error": error}
    results.write_shard(results.shard_path(cfg.results_dir, run_id, 0), [row])
