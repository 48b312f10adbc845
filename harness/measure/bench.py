"""The timed benchmark of one configuration, run on every rank.

The study's protocol: per repeat, a fresh model and method, `warmup_iters`
untimed iterations, then `timed_iters` iterations in a window that starts at a
barrier and ends when all communication is done and the device is synchronized.
Throughput is global samples over the slowest rank's window.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import platform
import resource
import signal
import socket
import sys
import time

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from torch import nn

import methods
import models
from harness.config.ranks import on_one_machine
from harness.config.schema import step_ending
from harness.launch.rank import Context
from harness.measure import cpumeter, timeline, traces
from harness.measure.progress import Progress
from harness.measure.provenance import identity
from harness.measure.timing import PHASES, Clock, study_rate, timed_window
from methods.base import device_sync
from methods.hostmeter import HostMeter


def make_optimizer(model: nn.Module, conf: DictConfig) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    if conf.name == "sgd":
        return torch.optim.SGD(params, lr=conf.lr, momentum=conf.momentum,
                               weight_decay=conf.weight_decay)
    adam = torch.optim.Adam if conf.name == "adam" else torch.optim.AdamW
    return adam(params, lr=conf.lr, weight_decay=conf.weight_decay)


def batch_generator(seed: int, rank: int, step: int = 0) -> torch.Generator:
    """The generator of rank `rank`'s synthetic batch at `step` (same on every machine)."""
    return torch.Generator().manual_seed(seed * 1_000_003 + rank * 10_007 + step)


def plain_training(model_cfg: DictConfig, *, seed: int, device: torch.device, rank: int = 0
                   ) -> tuple[nn.Module, torch.optim.Optimizer, models.Batch]:
    """A fresh model of `model_cfg` (weights from `seed`) on `device`, its optimizer, and
    rank `rank`'s synthetic batch there: a training loop with no method."""
    model = models.build(model_cfg.family, model_cfg.build, seed=seed).to(device)
    batch = model.make_batch(model_cfg.local_batch_size, batch_generator(seed, rank))
    return model, make_optimizer(model, model_cfg.optimizer), models.move_batch(batch, device)


def build(cfg: DictConfig, ctx: Context, *, seed: int) -> tuple[nn.Module, methods.Method,
                                                                 torch.optim.Optimizer]:
    """A fresh model (weights from `seed`) wrapped by the configured method, and its optimizer."""
    model = models.build(cfg.model.family, cfg.model.build, seed=seed).to(ctx.device)
    method = methods.build(methods.on_engine(OmegaConf.to_container(cfg.method, resolve=True),
                                             cfg.engine),
                           group=ctx.worker_group, device=ctx.device, timeout_s=cfg.run.timeout_s,
                           workers_per_node=cfg.cluster.workers_per_node,
                           node_groups=ctx.node_groups, network=cfg.network.name)
    method.meter = HostMeter(on=cfg.run.method_host)
    wrapped = method.wrap(model)
    return wrapped, method, make_optimizer(model, cfg.model.optimizer)


def train_iteration(model: nn.Module, method: methods.Method, optimizer: torch.optim.Optimizer,
                    batch: models.Batch, clock: Clock, *, ending: str = "false",
                    device: torch.device | None = None) -> None:
    """One training iteration, marking `clock` after forward, backward and synchronize.

    `ending` (run.sync_each_step) is how the step ends: `false`, nothing waits (ours: the
    window's end waits once); `device`, the study's Horovod-family clock, its
    benchmark_step's torch.cuda.synchronize() on `device`, which waits for the GPU work
    already queued and for nothing held back (ByteScheduler's pieces waiting for credit,
    updates not yet launched), a no-op on CPUs; `drain`, the method drained (every piece
    and update done), then the device synchronized, on CPUs too.

    The method's meter times its calls here (the user's optimizer.step is update_s, not
    the method's); its hooks and waits inside forward and backward time themselves."""
    meter = method.meter
    loss = model(batch)
    clock.mark()
    loss.backward()
    clock.mark()
    meter.call(method.synchronize)
    clock.mark()
    method.step(optimizer)
    meter.call(method.zero_grad)
    if ending == "drain":
        meter.wait(method.drain)
    if ending != "false":
        device_sync(device)


def inject_fault(fault: DictConfig, *, rank: int, iteration: int) -> None:
    """Fail on purpose where run.fault says so (tests of the failure paths; the kinds are
    schema.FAULT_KINDS). `stop` freezes every thread of the process (Horovod's background
    thread, Gloo's and NCCL's included) until someone sends SIGCONT or SIGKILL; continued,
    the rank carries on. `abort` dies of SIGABRT without a word, leaving no core file."""
    if fault.rank != rank or fault.at_iter != iteration:
        return
    if fault.kind == "exit":
        os._exit(3)
    if fault.kind == "hang":
        time.sleep(10**6)
    if fault.kind == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
        return
    if fault.kind == "abort":
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file, nor a piped one:
        ctypes.CDLL(None).prctl(4, 0)  # PR_SET_DUMPABLE 0
        os.abort()
    raise RuntimeError(f"injected fault at iteration {iteration}")


def worker(cfg: DictConfig, ctx: Context) -> None:
    """Entry of every rank for `python -m harness.run`."""
    if not ctx.is_worker:
        serve_until_done(cfg, ctx)
        return
    # On every rank, before any repeat: describing the model (on the meta device) also
    # does the model libraries' first imports, whose frames can be kept in reference
    # cycles (torch.fx); made inside a repeat, they would keep its model alive.
    info = models.describe(cfg.model.family, cfg.model.build)
    hosts = _gather((socket.gethostname(), device_name(ctx.device)), ctx)
    done = 0  # iterations over all repeats (run.fault.at_iter counts these)
    for repeat in range(cfg.run.repeats):
        ctx.repeat = repeat
        per_rank, plan, done = run_repeat(cfg, ctx, done=done)
        if ctx.rank == 0:
            from harness.measure import results  # pandas and pyarrow: only where written

            ctx.beat("writing the shard")
            row = _row(cfg, ctx, repeat=repeat, per_rank=per_rank, hosts=hosts, plan=plan,
                       info=info)
            path = results.shard_path(cfg.results_dir, ctx.run_id, repeat)
            results.write_shard(path, [row])
            print(f"[{ctx.run_id}] repeat {repeat + 1}/{cfg.run.repeats}: "
                  f"{row['throughput']:.1f} samples/s -> {path}", flush=True)
    if ctx.num_servers:
        methods.stop_servers(num_workers=ctx.num_workers)


def run_repeat(cfg: DictConfig, ctx: Context, *, done: int) -> tuple[list, dict, int]:
    """One repeat on this worker: a fresh model and method, warm-up, the timed window.

    Returns every worker's (window, iteration times, phases, peak memory), the plan
    and the iterations done over all repeats. Everything the repeat built is
    released when this returns (nothing of it is in a reference cycle), so the
    next repeat's model never sits beside this one's.
    """
    first = done
    ctx.beat("building the model and method")
    reset_peak_memory(ctx.device)
    model, method, optimizer = build(cfg, ctx, seed=cfg.run.seed + ctx.repeat)
    batch = models.move_batch(
        model_of(model).make_batch(cfg.model.local_batch_size,
                                   batch_generator(cfg.run.seed, ctx.rank)), ctx.device)

    ending = step_ending(cfg.run)
    # rank 0 shows the repeat's progress once it takes 5 s: an update costs < 1 us a step
    shown = Progress(cfg.run.warmup_iters + cfg.run.timed_iters, unit="iterations",
                     desc=f"[{ctx.run_id}] repeat {ctx.repeat + 1}/{cfg.run.repeats}",
                     delay_s=5) if ctx.rank == 0 else None

    def step(clock: Clock) -> None:
        nonlocal done
        ctx.beat(f"iteration {done - first}")
        inject_fault(cfg.run.fault, rank=ctx.rank, iteration=done)
        done += 1
        train_iteration(model, method, optimizer, batch, clock, ending=ending,
                        device=ctx.device)
        if shown is not None:
            shown.update()

    for _ in range(cfg.run.warmup_iters):
        step(Clock(ctx.device))
    method.drain()
    method.meter.reset()
    # the machine's clock is the run's where every rank runs here (rank 0 reads it)
    cpu = cpumeter.busy_seconds if ctx.rank == 0 and on_one_machine(cfg) else cpumeter.no_clock
    before = cpu()
    window = timed_window(step, iters=cfg.run.timed_iters, drain=method.drain,
                          device=ctx.device, group=ctx.worker_group)
    machine_cpu = (cpu() - before) / cfg.run.timed_iters
    if shown is not None:
        shown.close()
    ctx.beat("gathering the timings")
    iters, meter = cfg.run.timed_iters, method.meter
    host = (meter.host_s / iters, meter.wait_s / iters) if meter.on else (None, None)
    study = study_rate(window.host_starts, samples_per_step=ctx.num_workers
                       * cfg.model.local_batch_size)
    per_rank = _gather((window.seconds, window.iter_times, window.phases,
                        peak_memory(ctx.device), host, study, machine_cpu), ctx)
    if cfg.run.trace:
        trace_repeat(cfg, ctx, per_rank, method, lambda marks: train_iteration(
            model, method, optimizer, batch, marks, ending=ending, device=ctx.device))
    plan = method.plan()
    if meter.on and method.units:  # this rank's; every rank runs the same plan
        plan["hook_s_per_unit"] = meter.per_unit([u.params for u in method.units], iters)
    method.close()
    return per_rank, plan, done


def trace_repeat(cfg: DictConfig, ctx: Context, per_rank: list, method: methods.Method,
                 iteration) -> None:
    """run.trace, after the window: every worker runs two more iterations, and rank 0 and
    the repeat's slowest rank write their trace (harness/measure/timeline.py)."""
    ctx.beat("tracing an iteration")
    slowest = max(range(len(per_rank)), key=lambda r: sum(per_rank[r][1]))
    trace = timeline.record(iteration, method=method, device=ctx.device,
                            profile=ctx.rank in (0, slowest), timeout_s=cfg.run.timeout_s)
    if trace is None:
        return
    about = {**traces.about(cfg, source="measured"), "run_id": ctx.run_id,
             "repeat": ctx.repeat, "rank": ctx.rank, "slowest_rank": slowest,
             "device": device_name(ctx.device)}
    name = f"{ctx.run_id}_r{ctx.repeat}_rank{ctx.rank}"
    path = traces.write(trace, traces.trace_path(cfg.results_dir, name), about)
    print(f"[{ctx.run_id}] repeat {ctx.repeat + 1}/{cfg.run.repeats}: trace of rank "
          f"{ctx.rank}{' (the slowest)' if ctx.rank == slowest else ''} -> {path}", flush=True)


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: torch.device) -> int:
    """Bytes: the repeat's peak of allocated GPU memory on GPUs; on CPUs the process's
    peak resident memory so far (it never goes down)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def serve_until_done(cfg: DictConfig, ctx: Context) -> None:
    """A parameter-server rank: serve until every worker is done.

    run.fault on a server rank counts the aggregation rounds of its first key.
    """
    def on_round(i: int) -> None:
        ctx.beat(f"serving round {i}")
        inject_fault(cfg.run.fault, rank=ctx.rank, iteration=i)

    methods.serve(num_workers=ctx.num_workers, on_round=on_round)


def model_of(model: nn.Module) -> nn.Module:
    """The user's model inside a wrapper (DDP keeps it as `.module`)."""
    return getattr(model, "module", model)


def _gather(obj, ctx: Context) -> list:
    out = [None] * ctx.num_workers
    dist.all_gather_object(out, obj, group=ctx.worker_group)
    return out


def _row(cfg: DictConfig, ctx: Context, *, repeat: int, per_rank: list, hosts: list,
         plan: dict, info: dict) -> dict:
    windows, rank_iters, phases, memory, host, study, cpu = zip(*per_rank)
    phase_means = torch.tensor(phases, dtype=torch.float64).mean(dim=(0, 1))
    samples = ctx.num_workers * cfg.model.local_batch_size * cfg.run.timed_iters
    rates = {"window": samples / max(windows), "study": study[0]}  # the study's: rank 0's
    return {
        **identity(cfg, run_id=ctx.run_id, repeat=repeat), **info,
        "throughput": rates[cfg.run.rate], "throughput_window": rates["window"],
        "throughput_study": rates["study"], "timed_s": max(windows),
        "iter_times_s": [max(ts) for ts in zip(*rank_iters)],
        "rank_iter_times_s": list(rank_iters),
        **dict(zip(PHASES, phase_means.tolist())),
        "peak_memory_bytes": max(memory),
        **dict(zip(("method_host_s", "method_wait_s"), _mean_over_ranks(host))),
        "machine_cpu_s": None if math.isnan(cpu[0]) else cpu[0],  # rank 0's reading
        "status": "ok", "backend": ctx.backend, "device": device_name(ctx.device),
        "hostnames": [h for h, _ in hosts], "devices": [d for _, d in hosts],
        "plan_json": json.dumps(plan),
    }


def _mean_over_ranks(values: tuple) -> tuple:
    """Per column, the mean over the workers (None when not measured)."""
    return tuple(None if None in col else sum(col) / len(col) for col in zip(*values))


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine() or "cpu"


def record_failure(cfg: DictConfig, *, run_id: str, repeat: int | None, error: str) -> None:
    """Write a failed row for `repeat` (None: the first without a shard), unless that
    repeat has its shard, all repeats have, or the run already has a failed row (the
    launcher's harness.launch.failure.record calls this on any failure)."""
    from harness.measure import results  # pandas and pyarrow: only where written

    shards = {r: results.shard_path(cfg.results_dir, run_id, r)
              for r in range(cfg.run.repeats)}
    written = [r for r, p in shards.items() if p.exists()]
    if repeat is None:
        repeat = next((r for r in shards if r not in written), None)
    if repeat is None or repeat in written or results.has_failed_row(
            [shards[r] for r in written]):
        return
    row = {**identity(cfg, run_id=run_id, repeat=repeat), "status": "failed", "error": error}
    results.write_shard(shards[repeat], [row])


if __name__ == "__main__":
    sys.exit("run benchmarks with: python -m harness.run")
