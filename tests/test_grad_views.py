"""Gradients live in the method's flat buffer (issue 42): views, no copy, one gradient copy.

Each parameter's `.grad` is a view of its slice of the method's flat buffer from `wrap`
on, so autograd adds every gradient into the buffer in place. Checked here in real
processes (Gloo on CPU), for every method of the engine that runs without servers (the
PS transport's own paths are the lossless matrix's, tests/test_methods.py; `ddp` is
torch's reducer with its own buckets):

- the views are attached before the first backward, are what autograd wrote into,
  survive `zero_grad` (which zeroes the buffer), the plan switch of MG-WFBP, several
  iterations and a second build (the benchmark's repeats), and are dropped on `close`;
- backward and `synchronize` dispatch exactly the plain loop's operations (the same
  model with its gradients zeroed, not dropped) besides the collectives: no copy, slice
  or scaled copy into the buffer is left, and nothing but marking and issuing runs in a
  gradient hook;
- the result equals the plain loop's, step for step;
- a `.grad` set to None behind the method's back is refused with a one-line error;
- `peak_memory_bytes` (harness.measure.bench.peak_memory) of `bsp_a2a` on two workers,
  on a model whose gradients dominate, grows by far less than one model's gradients
  during training (before: every fresh gradient and the buffer beside it);
- the all-reduce leaves the sum on Gloo, which the scheduler divides by the workers, and
  the average on NCCL (ReduceOp.AVG, no pass of ours; its backend faked here).
"""

from __future__ import annotations

import collections
import copy
import json
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist
import yaml
from torch.utils._python_dispatch import TorchDispatchMode

import methods
from harness.measure.bench import peak_memory
from methods.allreduce import AllreduceTransport
from tests.conftest import REPO
from tests.test_methods import ONE_PROCESS, _first_uses, _free_port, _spawn, _Tiny

ITERS = 4  # MG-WFBP profiles one, then switches to its merged groups
ENGINE = [n for n in ONE_PROCESS if n != "ddp"]  # ddp: torch's reducer, its own buckets


class _Ops(TorchDispatchMode):
    """Counts the aten operations dispatched on this thread while active."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def _attached(method: methods.Method) -> bool:
    buffer = method.buffer
    return all(p.grad is view and view.untyped_storage().data_ptr() ==
               buffer.flat.untyped_storage().data_ptr()
               for p, view in zip(buffer.params, buffer.views))


def _one_method(name: str) -> dict:
    """Train `name` and the plain loop side by side for ITERS iterations; what held."""
    conf = yaml.safe_load((REPO / "conf" / "method" / f"{name}.yaml").read_text())
    conf["planner"] |= {"profile_iters": 1, "fit_sizes": [64, 256], "fit_repeats": 1} \
        if conf["planner"]["name"] == "mgwfbp" else {}
    model = _Tiny()
    plain = copy.deepcopy(model)
    method = methods.build(conf, group=None, device=torch.device("cpu"), timeout_s=30)
    method.transport.identity = False  # one worker would step aside: run the scheduler
    method.wrap(model)
    seen = {"attached_at_wrap": _attached(method), "in_place": [], "zeroed": [], "ops": []}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    reference = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    for p in plain.parameters():  # the plain loop's gradients exist, zeroed, not dropped
        p.grad = torch.zeros_like(p)
    for it in range(ITERS):
        x = torch.full((4, 8), float(it + 1))
        loss, plain_loss = model(x), plain(x)
        with _Ops() as mine:
            loss.backward()
            method.synchronize()
        with _Ops() as theirs:
            plain_loss.backward()
        seen["in_place"].append(_attached(method))
        added = (mine.ops - theirs.ops) + (theirs.ops - mine.ops)
        seen["ops"].append(sorted(op for op in added if not op.startswith("c10d.")))
        method.step(optimizer)
        method.zero_grad()
        method.drain()
        seen["zeroed"].append(_attached(method) and not method.buffer.flat.count_nonzero())
        reference.step()
        reference.zero_grad(set_to_none=False)
    seen["equal"] = all(torch.equal(a, b) for a, b in zip(model.parameters(),
                                                         plain.parameters()))
    seen["refused"] = _refused(model, method, optimizer)
    method.close()
    seen["detached"] = all(p.grad is None for p in model.parameters())
    return seen


def _refused(model: torch.nn.Module, method: methods.Method,
             optimizer: torch.optim.Optimizer) -> str:
    """The error of a backward (and synchronize) after optimizer.zero_grad() dropped the views."""
    optimizer.zero_grad()  # set_to_none=True: autograd writes fresh tensors, not the buffer
    try:
        model(torch.ones(4, 8)).backward()
        method.synchronize()
    except RuntimeError as exc:
        return str(exc)
    finally:
        method.buffer.attach()  # let drain and close run as usual
        method.drain()
    return ""


def _views_rank(rank: int, world: int, port: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    _first_uses()
    seen = {f"{name}#{repeat}": _one_method(name) for name in ENGINE for repeat in (0, 1)}
    Path(out).write_text(json.dumps(seen))
    dist.destroy_process_group()


def test_gradients_are_views_of_the_buffer_written_in_place_by_every_method(
        tmp_path: Path) -> None:
    out = tmp_path / "views.json"
    assert _spawn(_views_rank, 1, _free_port(), str(out), timeout_s=240) == [0]
    seen = json.loads(out.read_text())
    assert sorted(seen) == sorted(f"{n}#{r}" for n in ENGINE for r in (0, 1))
    for job, got in seen.items():
        assert got["attached_at_wrap"], job
        assert got["in_place"] == [True] * ITERS, job  # autograd wrote into the buffer
        assert got["zeroed"] == [True] * ITERS, job  # zero_grad zeroed it, views kept
        assert got["ops"] == [[]] * ITERS, (job, got["ops"])  # not one operation added
        assert got["equal"], job
        assert "no longer its view" in got["refused"], (job, got["refused"])
        assert "\n" not in got["refused"], job
        assert got["detached"], job


# -- peak memory: one copy of the gradients, not two ----------------------------------------

LAYERS, WIDTH = 32, 1024  # 33.6 M parameters: 134 MB of gradients, far above the rest


def _memory_rank(rank: int, world: int, port: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(WIDTH, WIDTH, bias=False)
                                  for _ in range(LAYERS)))
    conf = yaml.safe_load((REPO / "conf" / "method" / "bsp_a2a.yaml").read_text())
    method = methods.build(conf, group=None, device=torch.device("cpu"), timeout_s=60)
    method.wrap(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)  # no state of its own
    before = peak_memory(torch.device("cpu"))  # the model and its buffer, both touched
    model(torch.ones(2, WIDTH)).square().mean().backward()
    method.synchronize()
    method.step(optimizer)
    method.zero_grad()
    grown = peak_memory(torch.device("cpu")) - before
    method.close()
    grads = sum(p.numel() * p.element_size() for p in model.parameters())
    gloo = AllreduceTransport()
    with mock.patch.object(dist, "get_backend", return_value="nccl"):  # the GPU-only line
        nccl = AllreduceTransport()
    ops = [[t.scale, t.options.reduceOp == dist.ReduceOp.AVG] for t in (gloo, nccl)]
    Path(f"{out}.{rank}").write_text(json.dumps({"grown": grown, "grads": grads, "ops": ops}))
    dist.destroy_process_group()


def test_peak_memory_holds_one_copy_of_the_gradients(tmp_path: Path) -> None:
    """bsp_a2a used to hold every fresh gradient until synchronize copied it into the
    buffer: an iteration grew the peak by one model's gradients (measured: 141 MB for 134
    MB of them). Now autograd adds each into the buffer and frees it at once: the peak
    grows by a few layers' gradients (34 MB). (On a CPU the peak is the process's
    resident memory, which creeps up in later iterations under every method, old or new,
    as Gloo's threads allocate: the first iteration is the clean reading.)"""
    out = tmp_path / "memory"
    assert _spawn(_memory_rank, 2, _free_port(), str(out), timeout_s=240) == [0, 0]
    for rank in (0, 1):
        got = json.loads(Path(f"{out}.{rank}").read_text())
        assert got["grown"] < got["grads"] / 2, (rank, got)
        # Gloo sums and the scheduler divides; NCCL averages in the reduction itself
        assert got["ops"] == [[0.5, False], [1.0, True]], got["ops"]
