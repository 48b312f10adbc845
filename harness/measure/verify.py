"""The rank side of `python -m harness.verify` (harness/verify.py says what it checks):
`train` runs the method's steps on every worker, `reference` the single process that
processes the same local batches one after another, and `worker` compares the two on
rank 0 (exit 1 when they differ or the ranks disagree)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from omegaconf import DictConfig
from torch import nn

import methods
import models
from harness.launch.rank import Context
from harness.measure.bench import batch_generator, build, make_optimizer, model_of, serve_until_done


def dropout_seed(seed: int, step: int, rank: int) -> int:
    return seed * 7_919 + step * 104_729 + rank


def local_batch(model: nn.Module, cfg: DictConfig, rank: int, step: int) -> models.Batch:
    return model_of(model).make_batch(cfg.model.local_batch_size,
                                      batch_generator(cfg.run.seed, rank, step))


def reference(cfg: DictConfig, *, workers: int, device: torch.device,
              beat: Callable[[str], None] = lambda where: None) -> nn.Module:
    """The single-process run the method must equal: N local batches, averaged gradients."""
    model = models.build(cfg.model.family, cfg.model.build, seed=cfg.run.seed).to(device)
    optimizer = make_optimizer(model, cfg.model.optimizer)
    for step in range(cfg.verify.steps):
        beat(f"reference step {step}")
        optimizer.zero_grad(set_to_none=False)
        for rank in range(workers):
            torch.manual_seed(dropout_seed(cfg.run.seed, step, rank))
            model(models.move_batch(local_batch(model, cfg, rank, step), device)).backward()
        for p in model.parameters():
            if p.grad is not None:
                p.grad.div_(workers)
        optimizer.step()
    return model


def flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model_of(model).parameters()])


def train(cfg: DictConfig, ctx: Context) -> tuple[torch.Tensor, float, dict]:
    """`verify.steps` steps of the method on this worker.

    Returns this rank's parameters (on the CPU: the trained model is gone from the
    device when this returns), their largest difference from rank 0's (the same on
    every worker) and the method's plan. A collective of the workers.
    """
    model, method, optimizer = build(cfg, ctx, seed=cfg.run.seed)
    for step in range(cfg.verify.steps):
        ctx.beat(f"step {step}")
        batch = models.move_batch(local_batch(model, cfg, ctx.rank, step), ctx.device)
        torch.manual_seed(dropout_seed(cfg.run.seed, step, ctx.rank))
        model(batch).backward()
        method.synchronize()
        method.step(optimizer)
        method.zero_grad()
    method.drain()
    mine = flat_params(model)
    theirs = mine.clone()
    dist.broadcast(theirs, src=0, group=ctx.worker_group)
    spread = (mine - theirs).abs().max()
    dist.all_reduce(spread, op=dist.ReduceOp.MAX, group=ctx.worker_group)
    plan = method.plan()
    method.close()
    return mine.cpu(), spread.item(), plan


def worker(cfg: DictConfig, ctx: Context) -> None:
    """Entry of every rank for `python -m harness.verify`."""
    if not ctx.is_worker:
        serve_until_done(cfg, ctx)
        return
    models.describe(cfg.model.family, cfg.model.build)  # first imports: see bench.worker
    mine, rank_diff, _ = train(cfg, ctx)
    if ctx.num_servers:
        methods.stop_servers(num_workers=ctx.num_workers)
    if ctx.rank != 0:
        return
    ref = flat_params(reference(cfg, workers=ctx.num_workers, device=ctx.device,
                                beat=ctx.beat)).cpu()
    diff = (mine - ref).abs().max().item()
    close = torch.allclose(mine, ref, atol=cfg.verify.atol, rtol=cfg.verify.rtol)
    print(f"max_abs_diff={diff:.3e} max_rank_diff={rank_diff:.3e}", flush=True)
    if not close or rank_diff != 0:
        raise SystemExit(1)
