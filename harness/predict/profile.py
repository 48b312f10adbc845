"""Per-tensor compute times of one worker's training iteration: the simulator's compute input.

One trace gives the steps of an iteration: each parameter-owning module's forward
(in execution order, with the layers its forward needs), the moment each gradient is
ready during backward (backward order, as the methods lay gradients out) and the
optimizer step. Two clocks drive the same trace:

- `counted`: floating-point operations, counted on the meta device (no memory, no
  compute), scaled so the whole iteration takes `local_batch / throughput` seconds: a
  named GPU calibrated by nothing but its 1-GPU throughput on that model. The
  optimizer step is inside that time, spread over the steps by their FLOPs.
- `measured`: wall-clock time on this machine's device, the median of a few iterations;
  `measured_together` times it in as many processes at once as a local run has
  workers, so the slowdown of sharing this machine's cores is in the profile.

Counting BERT-Large takes seconds, so counted traces are kept in
`$XDG_CACHE_HOME/ddlbench/` (default ~/.cache/ddlbench/), keyed by the model's
family, build arguments and the torch and transformers/torchvision versions.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from omegaconf import DictConfig
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import models
from harness import config
from harness.config.cache import cached
from harness.config.ranks import num_servers, num_workers, torch_threads
from harness.measure.bench import plain_training
from harness.measure.timing import device_sync
from methods.base import backward_order
from methods.layerwise import module_layers


@dataclass(frozen=True)
class Compute:
    """One worker's iteration, step by step (seconds)."""

    sizes: list[int]          # elements of each gradient tensor, backward order
    backward_s: list[float]   # per tensor: from the previous gradient ready until this one
    layer_of: list[int]       # per tensor: its layer (methods.layerwise.module_layers)
    forward: list[tuple[tuple[int, ...], float]]  # execution order: (layers needed, seconds)
    update_s: float           # the optimizer step of the whole model
    source: str

    @property
    def forward_s(self) -> float:
        return sum(s for _, s in self.forward)

    @property
    def total_s(self) -> float:
        return self.forward_s + sum(self.backward_s) + self.update_s

    def scaled(self, factor: float) -> Compute:
        """Every step `factor` times longer (processes sharing too few cores)."""
        return Compute(self.sizes, [t * factor for t in self.backward_s], self.layer_of,
                       [(needs, t * factor) for needs, t in self.forward],
                       self.update_s * factor, self.source)


def _trace(model: nn.Module, batch: models.Batch, clock: Callable[[], float],
           optimizer: torch.optim.Optimizer | None = None) -> tuple[list, list[float], list[float]]:
    """One iteration stamped by `clock`: ([(layers needed, end) per parameter-owning
    module's forward, execution order], gradient ready times, [start, forward end,
    backward end, step end])."""
    params = backward_order(model)
    _, _, needs = module_layers(model, params)
    index = {p: i for i, p in enumerate(params)}
    ends: list[tuple[tuple[int, ...], float]] = []
    ready = [0.0] * len(params)
    hooks = [m.register_forward_hook(lambda m, *_: ends.append((tuple(needs[m]), clock())))
             for m in needs]
    hooks += [p.register_post_accumulate_grad_hook(
        lambda p: ready.__setitem__(index[p], clock())) for p in params]  # last one wins
    try:
        start = clock()
        loss = model(batch)
        forward_end = clock()
        loss.backward()
        backward_end = clock()
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)
        return ends, ready, [start, forward_end, backward_end, clock()]
    finally:
        for h in hooks:
            h.remove()


def _compute(model: nn.Module, ends: list, ready: list[float], marks: list[float],
             *, scale: float, source: str) -> Compute:
    params = backward_order(model)
    _, layer_of, _ = module_layers(model, params)
    start, forward_end, backward_end, step_end = marks
    order, times = zip(*ends)
    # a step is everything since the previous one ended; the loss joins the last step
    steps = [b - a for a, b in zip([start, *times], times)]
    steps[-1] += forward_end - times[-1]
    ready = list(torch.cummax(torch.tensor(ready, dtype=torch.float64).clamp(min=forward_end),
                              dim=0).values)
    backward = [float(b - a) for a, b in zip([forward_end, *ready], ready)]
    backward[-1] += backward_end - float(ready[-1])
    return Compute(sizes=[p.numel() for p in params],
                   backward_s=[t * scale for t in backward], layer_of=layer_of,
                   forward=[(n, t * scale) for n, t in zip(order, steps)],
                   update_s=(step_end - backward_end) * scale, source=source)


def counted(model_cfg: DictConfig, *, throughput: float, gpu: str) -> Compute:
    """Steps timed by their FLOPs, the iteration scaled to `local_batch / throughput` s."""
    flops = _flops(model_cfg)
    scaled = flops.scaled(model_cfg.local_batch_size / throughput / flops.total_s)
    return dataclasses.replace(scaled, source=f"counted:{gpu}")


def _flops(model_cfg: DictConfig) -> Compute:
    """The iteration of one sample in FLOPs per step (from the cache when there)."""
    def count() -> dict:
        with torch.device("meta"):
            model = models.family_class(model_cfg.family)(**model_cfg.build)
            batch = model.make_batch(1, None)  # FLOPs grow linearly with the batch
        counter = FlopCounterMode(display=False)
        with counter:
            trace = _trace(model, batch, lambda: float(counter.get_total_flops()))
        return dataclasses.asdict(_compute(model, *trace, scale=1.0, source="flops"))

    data = cached("flops", [model_cfg.family, dict(model_cfg.build)], count)
    return Compute(**{**data, "forward": [(tuple(n), t) for n, t in data["forward"]]})


def measured(model_cfg: DictConfig, *, iters: int, device: torch.device, seed: int = 0,
             start: Callable[[], object] = lambda: None,
             keep_busy: Callable[[], bool] = lambda: False) -> Compute:
    """Steps timed on `device` (synchronized at each stamp), median of `iters` iterations.

    `start` is called once the model is built, before the first iteration; after
    the timed ones, iterations go on while `keep_busy()` (load for other profiles).
    """
    model, optimizer, batch = plain_training(model_cfg, seed=seed, device=device)

    def clock() -> float:
        device_sync(device)
        return time.perf_counter()

    start()
    traces = [_trace(model, batch, clock, optimizer) for _ in range(2 + iters)][2:]
    while keep_busy():
        _trace(model, batch, clock, optimizer)
    order = [n for n, _ in traces[0][0]]
    # every stamp relative to its iteration's start, then the median per stamp
    rel = [([t - marks[0] for _, t in ends], [t - marks[0] for t in ready],
            [t - marks[0] for t in marks]) for ends, ready, marks in traces]
    ends, ready, marks = ([statistics.median(v) for v in zip(*(r[k] for r in rel))]
                          for k in range(3))
    return _compute(model, list(zip(order, ends)), ready, marks, scale=1.0,
                    source=f"measured:{device.type}")


def _profile_process(model_cfg: dict, iters: int, device: str, seed: int, threads: int,
                     barrier, finished, out) -> None:
    """One of `measured_together`'s processes: all start their iterations together, and
    each goes on iterating until every one has finished its timed ones."""
    from omegaconf import OmegaConf

    torch.set_num_threads(threads)
    counted = False

    def keep_busy() -> bool:
        nonlocal counted
        if not counted:
            counted = True
            with finished.get_lock():
                finished.value += 1
        return finished.value < barrier.parties

    out.put(measured(OmegaConf.create(model_cfg), iters=iters, device=torch.device(device),
                     seed=seed, start=barrier.wait, keep_busy=keep_busy))


def measured_together(model_cfg: DictConfig, *, processes: int, threads: int, iters: int,
                      device: torch.device, seed: int = 0) -> Compute:
    """`measured` in `processes` processes of `threads` threads running at once (the
    workers of a run sharing this machine); each step's mean over the processes."""
    import multiprocessing as mp

    from omegaconf import OmegaConf

    ctx = mp.get_context("spawn")
    barrier, finished, out = ctx.Barrier(processes), ctx.Value("i", 0), ctx.Queue()
    args = (OmegaConf.to_container(model_cfg, resolve=True), iters, str(device), seed, threads,
            barrier, finished, out)
    procs = [ctx.Process(target=_profile_process, args=args, daemon=True)
             for _ in range(processes)]
    for proc in procs:
        proc.start()
    try:
        runs = [out.get(timeout=600) for _ in procs]
    finally:
        for proc in procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()
    first = runs[0]
    return Compute(first.sizes, [statistics.fmean(v) for v in zip(*(r.backward_s for r in runs))],
                   first.layer_of,
                   [(needs, statistics.fmean(v)) for (needs, _), *v in
                    zip(first.forward, *([t for _, t in r.forward] for r in runs))],
                   statistics.fmean(r.update_s for r in runs),
                   f"{first.source} x{processes} processes")


class ComputeProfiles:
    """Each model's compute, profiled once per simulation."""

    def __init__(self) -> None:
        self.cache: dict[tuple, Compute] = {}

    def __call__(self, cfg: DictConfig) -> Compute:
        sim, model = cfg.simulate, cfg.model
        if sim.compute != "measured":
            key = (config.to_json(model), sim.compute)
            if key not in self.cache:
                self.cache[key] = counted(
                    model, throughput=sim.gpus[sim.compute][model.name], gpu=sim.compute)
            return self.cache[key]
        threads = torch_threads(cfg, num_workers(cfg) + num_servers(cfg))  # as a run gets
        # every worker of a local or emulated cluster runs on this machine: profile as many
        # processes at once, so the profile has their sharing of its cores in it
        together = num_workers(cfg) if cfg.cluster.name in ("local", "emulated") else 1
        key = (config.to_json(model), threads, together)
        if key not in self.cache:
            import torch

            print(f"profiling {model.name} on this machine ({together} process(es) of "
                  f"{threads} thread(s))...", flush=True)
            torch.set_num_threads(threads)
            device = torch.device(config.resolve_device(cfg.cluster))
            self.cache[key] = (
                measured_together(model, processes=together, threads=threads,
                                          iters=sim.profile_iters, device=device,
                                          seed=cfg.run.seed) if together > 1 else
                measured(model, iters=sim.profile_iters, device=device,
                                 seed=cfg.run.seed))
        return self.cache[key]
