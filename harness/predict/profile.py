"""Per-tensor compute times of one worker's training iteration: the simulator's compute input.

The steps of an iteration (harness/predict/trace.py traces them): each
parameter-owning module's forward, the moment each gradient is ready during backward,
and the optimizer step, timed by one of two clocks:

- `counted`: each step's work, counted on the meta device (no memory, no compute):
  its floating-point operations, plus the bytes moved by the operations that have none
  (element-wise, normalizations, softmax, embeddings, the optimizer step) times the
  named GPU's `simulate.flop_per_byte` (its peak FLOP/s per byte/s of memory), the
  iteration scaled so that it takes `local_batch / throughput` seconds: the GPU
  calibrated by nothing but its 1-GPU throughput on that model and its spec sheet.
- measured: wall-clock time on this machine's device, the median of a few iterations,
  in as many processes at once as a local run has workers, so the slowdown of sharing
  this machine's cores is in the profile; on GPUs each process on a GPU of its own, as
  the launcher places workers (a profile needing more GPUs than there are is refused
  before it starts: harness.config).

Counting BERT-Large takes seconds, so counted traces are kept in
`$XDG_CACHE_HOME/ddlbench/` (default ~/.cache/ddlbench/), keyed by the model's
family, build arguments, batch and optimizer, the GPU's FLOP/s per byte/s, the model and
counting code and the torch and transformers/torchvision versions. torch is imported
only to count a model the cache lacks, or to measure.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

from harness import config
from harness.config.cache import MODELS, cached
from harness.config.frozen import Config, thaw
from harness.config.ranks import num_servers, num_workers, profile_processes, torch_threads
from harness.predict import trace


@dataclass(frozen=True)
class Compute:
    """One worker's iteration, step by step (seconds)."""

    sizes: list[int]          # elements of each gradient tensor, backward order
    backward_s: list[float]   # per tensor: from the previous gradient ready until this one
    layer_of: list[int]       # per tensor: its layer (methods.layerwise.module_layers)
    forward: list[tuple[tuple[int, ...], float]]  # execution order: (layers needed, seconds)
    update_s: float           # the optimizer step of the whole model
    source: str
    byte_s: float = 0.0       # seconds per byte a memory-bound operation moves (0: not known)

    @classmethod
    def of(cls, data: dict[str, Any]) -> Compute:
        """From its fields as data (a trace, or the cache's JSON)."""
        return cls(**{**data, "forward": [(tuple(n), t) for n, t in data["forward"]]})

    @functools.cached_property
    def forward_s(self) -> float:
        return sum(s for _, s in self.forward)

    @functools.cached_property
    def total_s(self) -> float:
        return self.forward_s + sum(self.backward_s) + self.update_s

    def scaled(self, factor: float) -> Compute:
        """Every step `factor` times longer (processes sharing too few cores)."""
        return Compute(self.sizes, [t * factor for t in self.backward_s], self.layer_of,
                       [(needs, t * factor) for needs, t in self.forward],
                       self.update_s * factor, self.source, self.byte_s * factor)


def counted(model_cfg: Config, *, throughput: float, gpu: str, flop_per_byte: float,
            measured_with: Config | None = None) -> Compute:
    """Steps timed by their counted work at the GPU's speed: the speed at which the
    model's iteration stepping `measured_with` (the optimizer `throughput` was measured
    with; None: the model's own) takes `local_batch / throughput` seconds. So a run of
    another optimizer has its own step's work at the same speed; a byte a memory-bound
    operation moves costs `flop_per_byte` FLOPs at that speed (`byte_s`)."""
    work = _work(model_cfg, flop_per_byte)
    base = work if measured_with is None else _work(model_cfg, flop_per_byte, measured_with)
    factor = model_cfg.local_batch_size / throughput / base.total_s  # seconds per FLOP
    scaled = work.scaled(factor)
    return dataclasses.replace(scaled, source=f"counted:{gpu}", byte_s=factor * flop_per_byte)


def _work(model_cfg: Config, flop_per_byte: float, optimizer: Config | None = None
          ) -> Compute:
    """The iteration's work per step in FLOPs, its memory-bound bytes counted as
    `flop_per_byte` FLOPs each (from the cache when there); stepping `optimizer`, by
    default the model's."""
    build = thaw(model_cfg.build)
    optimizer = thaw(model_cfg.optimizer if optimizer is None else optimizer)
    key = [model_cfg.family, build, model_cfg.local_batch_size, optimizer, flop_per_byte]
    return Compute.of(cached(
        "work", key, lambda: trace.count_work(
            model_cfg.family, build, batch=model_cfg.local_batch_size, optimizer=optimizer,
            flop_per_byte=flop_per_byte),
        sources=(MODELS, ("harness/predict", "trace.py"), ("harness/measure", "bench.py"))))


class ComputeProfiles:
    """Each model's compute, profiled once per simulation."""

    def __init__(self) -> None:
        self.cache: dict[tuple, Compute] = {}

    def __call__(self, cfg: Config) -> Compute:
        sim, model = cfg.simulate, cfg.model
        if sim.compute != "measured":
            key = (config.to_json(model), sim.compute, sim.flop_per_byte[sim.compute])
            if key not in self.cache:
                self.cache[key] = counted(
                    model, throughput=sim.gpus[sim.compute][model.name], gpu=sim.compute,
                    flop_per_byte=sim.flop_per_byte[sim.compute],
                    measured_with=sim.gpus_optimizer.get(model.name))
            return self.cache[key]
        threads = torch_threads(cfg, num_workers(cfg) + num_servers(cfg))  # as a run gets
        # every worker of a local or emulated cluster runs on this machine: profile as many
        # processes at once, so the profile has their sharing of its cores in it
        together = profile_processes(cfg)
        key = (config.to_json(model), threads, together)
        if key not in self.cache:
            print(f"profiling {model.name} on this machine ({together} process(es) of "
                  f"{threads} thread(s))...", flush=True)
            self.cache[key] = Compute.of(trace.measure(
                model, processes=together, threads=threads, iters=sim.profile_iters,
                device=config.resolve_device(cfg.cluster), seed=cfg.run.seed))
        return self.cache[key]
