"""A harness entry for tests: the benchmark's repeats, proving that nothing a repeat
built is alive once it is over (so repeat k+1 never holds repeat k's model).

It runs two repeats of each method named in RELEASE_METHODS (comma-separated; all
of them with or all without parameter servers, as the launched configuration).
"""

from __future__ import annotations

import gc
import os

import torch
from omegaconf import DictConfig
from torch import nn

import methods
import models
from harness import config
from harness.launch.rank import Context
from harness.measure import bench
from methods.base import GradBuffer

BUILT = (nn.Module, methods.Method, torch.optim.Optimizer, GradBuffer)


def worker(cfg: DictConfig, ctx: Context) -> None:
    if not ctx.is_worker:
        bench.serve_until_done(cfg, ctx)
        return
    models.describe(cfg.model.family, cfg.model.build)  # as bench.worker does
    gc.collect()
    gc.disable()  # an object kept only by a reference cycle now stays in gc.get_objects()
    done = 0
    for name in os.environ["RELEASE_METHODS"].split(","):
        cfg.method = config.load([f"method={name}"]).method
        for repeat in range(2):
            ctx.repeat = repeat
            before = {id(o) for o in gc.get_objects() if isinstance(o, BUILT)}
            _, _, done = bench.run_repeat(cfg, ctx, done=done)
            alive = sorted({type(o).__name__ for o in gc.get_objects()
                            if isinstance(o, BUILT) and id(o) not in before})
            if alive:
                raise RuntimeError(f"{name}: after repeat {repeat} these are still alive: "
                                   f"{alive}")
    gc.enable()
    if ctx.num_servers:
        methods.stop_servers(num_workers=ctx.num_workers)
