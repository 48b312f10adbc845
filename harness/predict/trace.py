"""One worker's training iteration traced step by step, with torch: the measurements
behind harness/predict/profile.py's compute, made only where no cached one will do.

One trace gives the steps of an iteration: each parameter-owning module's forward (in
execution order, with the layers its forward needs), the moment each gradient is ready
during backward (backward order, as the methods lay gradients out) and the optimizer
step, stamped by a clock: work counted on the meta device (`count_work`, a cache
miss: FLOPs, and apart from them the bytes that operations without FLOPs move), or
wall-clock time on this machine's device (`measure`: on a GPU CUDA events, read once
the last iteration is queued, so nothing waits inside or between iterations; each of
several processes on a GPU of its own, as the launcher places workers). Each returns
the fields of profile.Compute as a dict (what the cache keeps). torch, the
models and the methods' torch side are imported inside the functions, so the predictor
imports this module without them.
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn


def _trace(model: nn.Module, batch: dict, clock: Callable[[], float],
           optimizer: torch.optim.Optimizer | None = None, *, layers: bool = True
           ) -> tuple[list, list[float], list[float]]:
    """One iteration stamped by `clock`: ([(layers needed, end) per parameter-owning
    module's forward, execution order], gradient ready times, [start, forward end,
    backward end, step end]); without `layers`, only the last list (no hooks)."""
    from methods.base import backward_order
    from methods.layerwise import module_layers

    ends: list[tuple[tuple[int, ...], float]] = []
    ready: list[float] = []
    hooks = []
    if layers:
        params = backward_order(model)
        _, _, needs = module_layers(model, params)
        index = {p: i for i, p in enumerate(params)}
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


def _steps(model: nn.Module, ends: list, ready: list[float], marks: list[float],
           *, scale: float, source: str, plain: list[float] | None = None) -> dict[str, Any]:
    """The fields of profile.Compute from one trace's stamps, each step times `scale`;
    `plain`, the marks of an iteration without hooks, sets the lengths of forward, backward
    and the step, the layers' stamps only their shares."""
    from methods.base import backward_order
    from methods.layerwise import module_layers

    params = backward_order(model)
    _, layer_of, _ = module_layers(model, params)
    start, forward_end, backward_end, step_end = marks
    order, times = zip(*ends)
    # a step is everything since the previous one ended; the loss joins the last step
    steps = [b - a for a, b in zip([start, *times], times)]
    steps[-1] += forward_end - times[-1]
    # a gradient is ready after forward, and no earlier than the ones before it
    ready = list(itertools.accumulate((max(r, forward_end) for r in ready), max))
    backward = [b - a for a, b in zip([forward_end, *ready], ready)]
    backward[-1] += backward_end - ready[-1]
    update = step_end - backward_end
    to_fwd = to_bwd = 1.0
    if plain is not None:
        to_fwd = (plain[1] - plain[0]) / max(forward_end - start, 1e-12)
        to_bwd = (plain[2] - plain[1]) / max(backward_end - forward_end, 1e-12)
        update = plain[3] - plain[2]
    return {"sizes": [p.numel() for p in params],
            "backward_s": [t * to_bwd * scale for t in backward], "layer_of": layer_of,
            "forward": [(n, t * to_fwd * scale) for n, t in zip(order, steps)],
            "update_s": update * scale, "source": source}


# operations that move no data: views, fresh allocations, aliases
_FREE = ("aten.empty", "aten.new_empty", "aten._unsafe_view", "aten.detach", "aten.alias",
         "aten.lift")


def count_work(family: str, build: Mapping[str, Any], *, batch: int,
               optimizer: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """A steady-state iteration of a `batch` (the optimizer's state made by one before it)
    counted on the meta device, twice over: `flops`, each step's floating-point
    operations, and `bytes`, the bytes read and written by the operations that count no
    FLOPs (element-wise ones, normalizations, softmax, dropout, embeddings, the
    optimizer's step). A GPU runs the first at its arithmetic's speed, the second at its
    memory's; both clocks advance with the same events, so a step's time on any GPU is
    its FLOPs over the GPU's FLOP/s plus its bytes over its bytes/s."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves
    from torch.utils.flop_counter import FlopCounterMode

    import models
    from harness.config.frozen import freeze
    from harness.measure.bench import make_optimizer

    class MemoryBytes(TorchDispatchMode):
        """Bytes of each distinct tensor in and out of the operations that add no FLOPs."""

        def __init__(self, flops: FlopCounterMode) -> None:
            super().__init__()
            self.flops, self.total = flops, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            before = self.flops.get_total_flops()
            out = func(*args, **(kwargs or {}))
            if (self.flops.get_total_flops() == before and not func.is_view
                    and not str(func).startswith(_FREE)):
                ins = {id(t): t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
                outs = {id(t): t for t in tree_leaves(out) if isinstance(t, torch.Tensor)}
                self.total += sum(t.nbytes for t in [*ins.values(), *outs.values()])
            return out

    with torch.device("meta"):
        model = models.family_class(family)(**build)
        data = model.make_batch(batch, None)
        opt = make_optimizer(model, freeze(optimizer))
        model(data).backward()  # the optimizer's state, made once
        opt.step()
        opt.zero_grad(set_to_none=False)
    counter = FlopCounterMode(display=False)
    with counter, MemoryBytes(counter) as moved:
        ends, ready, marks = _trace(
            model, data, lambda: (counter.get_total_flops(), moved.total), opt)
    def part(i: int, stamp) -> float:  # a gradient no hook stamped is ready at 0.0
        return stamp[i] if isinstance(stamp, tuple) else stamp

    return {kind: _steps(model, [(n, part(i, t)) for n, t in ends],
                         [part(i, r) for r in ready], [part(i, m) for m in marks],
                         scale=1.0, source="counted")
            for i, kind in enumerate(("flops", "bytes"))}


def measure(model_cfg: Mapping[str, Any], *, processes: int, threads: int, iters: int,
            device: str, seed: int = 0) -> dict[str, Any]:
    """Steps timed on `device` in `processes` processes of `threads` threads at once (the
    workers of a run sharing this machine; on GPUs process k on GPU k: `devices`); one
    process: in this one."""
    import torch

    torch.set_num_threads(threads)
    if processes > 1:
        return _measured_together(model_cfg, processes=processes, threads=threads, iters=iters,
                                  device=device, seed=seed)
    return _measured(model_cfg, iters=iters, device=device, seed=seed)


def devices(device: str, processes: int) -> list[str]:
    """The device of each of `processes` profiling processes: GPU k for process k, as the
    launcher gives worker k (harness.config's checks refuse more than there are)."""
    return [f"cuda:{k}" for k in range(processes)] if device == "cuda" else [device] * processes


def _stamp() -> torch.cuda.Event:
    """A GPU's clock: an event at the end of the work queued so far on the current stream."""
    import torch

    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def _in_seconds(trace: tuple[list, list, list]) -> tuple[list, list, list]:
    """One iteration's stamps in seconds: a CPU's clock readings as they are; a GPU's events
    once the last has happened, as seconds after the iteration's start (a gradient never
    stamped, 0.0, stays at the start)."""
    ends, ready, marks = trace
    start = marks[0]
    if isinstance(start, float):
        return trace
    marks[-1].synchronize()  # every event of the iteration was recorded before it

    def sec(stamp) -> float:
        return stamp if isinstance(stamp, float) else start.elapsed_time(stamp) / 1e3

    return [(n, sec(t)) for n, t in ends], [sec(t) for t in ready], [sec(t) for t in marks]


def _measured(model_cfg: Mapping[str, Any], *, iters: int, device: str, seed: int = 0,
              start: Callable[[], object] = lambda: None,
              keep_busy: Callable[[], bool] = lambda: False,
              iterations: list[float] | None = None) -> dict[str, Any]:
    """Steps timed on `device`, median of `iters` iterations: on a CPU by the clock, on a
    GPU by events read once the last iteration is queued (`_in_seconds`), never
    synchronizing inside or between them.

    `start` is called once the model is built, before the first iteration; after
    the timed ones, iterations go on while `keep_busy()` (load for other profiles).
    `iterations`, when given, gets each timed iteration's seconds (with and without hooks,
    alternately).
    """
    import torch

    from harness.measure.bench import plain_training

    where = torch.device(device)
    if where.type == "cuda":
        if where.index is None:  # "cuda": the current GPU (torch 2.11 refuses no index)
            where = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(where)  # the events' stream is the current device's
    model, optimizer, batch = plain_training(model_cfg, seed=seed, device=where)
    clock = _stamp if where.type == "cuda" else time.perf_counter
    start()
    # a GPU's events are read only after the last iteration: reading each before the next
    # starts would leave the GPU idle while the host queues the next forward (resnet50 on an
    # H100: 42.7 ms an iteration against 38.8 ms read at the end and the plain loop's 38.4).
    # The hooks' stamps cost the host time, which sets the pace where the GPU is faster than
    # the host (resnet50 on an H200: 33.3-37.4 ms stamped, 32.8 plain; from the stamps
    # alone the simulator predicted 1540 samples/s against 1971 measured): an iteration without
    # hooks after each hooked one gives forward, backward and the step their lengths, the
    # hooked one only how forward and backward split among the layers
    traces = [_trace(model, batch, clock, optimizer, layers=layers)
              for _ in range(2 + iters) for layers in (True, False)]
    traces = [_in_seconds(t) for t in traces][4:]
    while keep_busy():
        _in_seconds(_trace(model, batch, clock, optimizer))
    order = [n for n, _ in traces[0][0]]
    # every stamp relative to its iteration's start, then the median per stamp
    rel = [([t - marks[0] for _, t in ends], [t - marks[0] for t in ready],
            [t - marks[0] for t in marks]) for ends, ready, marks in traces]
    ends, ready, marks = ([statistics.median(v) for v in zip(*(r[k] for r in rel[::2]))]
                          for k in range(3))
    plain = [statistics.median(v) for v in zip(*(r[2] for r in rel[1::2]))]
    if iterations is not None:
        iterations += [marks[-1] for _, _, marks in rel]
    return _steps(model, list(zip(order, ends)), ready, marks, scale=1.0,
                  source=f"measured:{where.type}", plain=plain)


def _profile_process(model_cfg: dict, iters: int, device: str, seed: int, threads: int,
                     barrier, finished, out) -> None:
    """One of `_measured_together`'s processes: all start their iterations together, and
    each goes on iterating until every one has finished its timed ones. Puts its steps
    and its timed iterations' seconds."""
    import torch

    from harness.config.frozen import freeze

    torch.set_num_threads(threads)
    counted = False

    def keep_busy() -> bool:
        nonlocal counted
        if not counted:
            counted = True
            with finished.get_lock():
                finished.value += 1
        return finished.value < barrier.parties

    iterations: list[float] = []
    steps = _measured(freeze(model_cfg), iters=iters, device=device, seed=seed,
                      start=barrier.wait, keep_busy=keep_busy, iterations=iterations)
    out.put((steps, iterations))


def _measured_together(model_cfg: Mapping[str, Any], *, processes: int, threads: int,
                       iters: int, device: str, seed: int = 0) -> dict[str, Any]:
    """`_measured` in `processes` processes at once; each step's mean over them, and
    `straggle` (`slowest`)."""
    import multiprocessing as mp

    from harness.config.frozen import thaw

    ctx = mp.get_context("spawn")
    barrier, finished, out = ctx.Barrier(processes), ctx.Value("i", 0), ctx.Queue()
    procs = [ctx.Process(target=_profile_process, daemon=True,
                         args=(thaw(model_cfg), iters, where, seed, threads, barrier,
                               finished, out))
             for where in devices(device, processes)]
    for proc in procs:
        proc.start()
    ended = False
    try:
        runs, iterations = zip(*_collect(out, procs))
        ended = True
    finally:
        for proc in procs:  # after a failure the others iterate on: ended at once
            proc.join(timeout=60 if ended else 0)
            if proc.is_alive():
                proc.kill()
    first = runs[0]
    return {**first,
            "backward_s": [statistics.fmean(v) for v in zip(*(r["backward_s"] for r in runs))],
            "forward": [(needs, statistics.fmean(v)) for (needs, _), *v in
                        zip(first["forward"], *([t for _, t in r["forward"]] for r in runs))],
            "update_s": statistics.fmean(r["update_s"] for r in runs),
            "source": f"{first['source']} x{processes} processes",
            "straggle": slowest(iterations)}


def _collect(out, procs: list, *, timeout_s: float = 600) -> list:
    """Every process's result from `out`. RuntimeError once a process has ended without
    putting its own (it crashed: the others would wait for it forever), or after
    `timeout_s`."""
    import queue

    got, deadline = [], time.monotonic() + timeout_s
    while len(got) < len(procs):
        try:
            got.append(out.get(timeout=1.0))
            continue
        except queue.Empty:
            pass
        dead = [p for p in procs if not p.is_alive()]
        if len(dead) > len(got):  # what an ended process put is in the queue by now
            try:
                got.append(out.get(timeout=1.0))
                continue
            except queue.Empty:
                codes = [getattr(p, "exitcode", None) for p in dead]
                raise RuntimeError(f"a profiling process ended without its profile (exit "
                                   f"codes {codes}): its error is above") from None
        if time.monotonic() > deadline:
            raise RuntimeError(f"the profiling processes gave no profile in {timeout_s:g} s")
    return got


def slowest(iterations: Sequence[Sequence[float]]) -> float:
    """How much longer the slowest of several processes takes than their mean: over
    their k-th iterations, the mean of the longest one's share of their mean (1.0 for
    one). The processes ran at once, so their k-th iterations overlap in time. A collective
    waits for its slowest member: where workers share a machine, each iteration of a
    run is as long as the slowest worker's compute (2 emulated eth1g nodes, bert_tiny:
    the two ranks' compute differed by 41 ms an iteration, median, of about 620 ms,
    harness/predict/README.md)."""
    rounds = list(zip(*iterations))
    if len(iterations) < 2 or not rounds:
        return 1.0
    return statistics.fmean(max(r) / statistics.fmean(r) for r in rounds)
