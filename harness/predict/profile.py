"""Per-tensor compute times of one worker's training iteration: the simulator's compute input.

The steps of an iteration (harness/predict/trace.py traces them): each
parameter-owning module's forward, the moment each gradient is ready during backward,
and the optimizer step, timed by one of two clocks:

- `counted`: each step's work, counted on the meta device (no memory, no compute):
  its floating-point operations at the GPU's peak FLOP/s (at `simulate.precision`), plus
  the bytes moved by the operations that have none (element-wise, normalizations,
  softmax, embeddings, the optimizer step) at its memory's bytes/s, both from the GPU
  table (conf/gpu/, harness.config.gpus), the sum over an efficiency: that of a measured
  1-GPU throughput of the model on that GPU (a 1-GPU row of `simulate.calibrate`, else
  `simulate.gpus`: the study's for its 2080 Ti), else `simulate.efficiency`
  (`calibrated`: yes or no).
- measured: wall-clock time on this machine's device, the median of a few iterations,
  in one process; for a run of this machine's own (a local or emulated cluster on one
  of its networks) in as many processes at once as it has workers, so the slowdown of
  sharing its cores is in the profile, and so is how much longer the slowest of them
  takes (`straggle`): a run's iteration waits for its slowest worker, so every step is
  taken that much longer; on GPUs each process on a GPU of its own, as the
  launcher places workers (a profile needing more GPUs than there are is refused before
  it starts: harness.config). A CPU profile of a GPU cluster says so (`unlike_device`).

Counting BERT-Large takes seconds, so counted traces are kept in
`$XDG_CACHE_HOME/ddlbench/` (default ~/.cache/ddlbench/), keyed by the model's
family, build arguments, batch and optimizer (one count serves every GPU), the model and
counting code and the torch and transformers/torchvision versions. torch is imported
only to count a model the cache lacks, or to measure.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass
from typing import Any

from harness import config
from harness.config import gpus
from harness.config.cache import MODELS, cached
from harness.config.frozen import Config, thaw
from harness.config.gpus import GPU
from harness.config.ranks import num_servers, profile_processes, torch_threads
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
    calibrated: str = "no"    # yes: timed by a measurement of this model on this device
    straggle: float = 1.0     # the slowest of the workers profiled together over their mean

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
        """Every step `factor` times longer (processes sharing too few cores, the slowest
        of several workers)."""
        return dataclasses.replace(
            self, backward_s=[t * factor for t in self.backward_s],
            forward=[(needs, t * factor) for needs, t in self.forward],
            update_s=self.update_s * factor, byte_s=self.byte_s * factor)


def counted(model_cfg: Config, *, gpu: GPU, precision: str, efficiency: float,
            source: str = "", calibrated: str = "no") -> Compute:
    """Steps timed by their counted work on `gpu`: each step's FLOPs at its peak FLOP/s
    at `precision` plus its memory-bound bytes at its memory's bytes/s, the sum over
    `efficiency` (the share of its peaks a real iteration reaches)."""
    flops, moved = work(model_cfg)
    flop_s, byte_s = gpu.flop_s(precision) * efficiency, gpu.byte_s * efficiency
    return _combined(flops, moved, 1 / flop_s, 1 / byte_s,
                     source or f"counted:{gpu.name}:{precision}", calibrated)


def efficiency(model_cfg: Config, *, gpu: GPU, precision: str, throughput: float,
               measured_with: Config | None = None) -> float:
    """The efficiency at which `model_cfg`'s iteration stepping `measured_with` (the
    optimizer `throughput` was measured with; None: the model's own) takes `local_batch /
    throughput` seconds on `gpu`: its time at the GPU's peaks over that."""
    flops, moved = work(model_cfg, measured_with)
    peak = _combined(flops, moved, 1 / gpu.flop_s(precision), 1 / gpu.byte_s, "", "")
    return peak.total_s / (model_cfg.local_batch_size / throughput)


def _combined(flops: Compute, moved: Compute, per_flop: float, per_byte: float,
              source: str, calibrated: str) -> Compute:
    """Each step's FLOPs times `per_flop` plus its bytes times `per_byte` (seconds)."""
    return Compute(
        flops.sizes, [f * per_flop + b * per_byte for f, b in zip(flops.backward_s,
                                                                moved.backward_s)],
        flops.layer_of, [(needs, f * per_flop + b * per_byte)
                         for (needs, f), (_, b) in zip(flops.forward, moved.forward)],
        flops.update_s * per_flop + moved.update_s * per_byte, source, per_byte, calibrated)


def work(model_cfg: Config, optimizer: Config | None = None) -> tuple[Compute, Compute]:
    """The iteration's FLOPs and memory-bound bytes per step (from the cache when there:
    one count per model, batch and optimizer serves every GPU); stepping `optimizer`, by
    default the model's."""
    build = thaw(model_cfg.build)
    optimizer = thaw(model_cfg.optimizer if optimizer is None else optimizer)
    key = [model_cfg.family, build, model_cfg.local_batch_size, optimizer]
    text = json.dumps(key, sort_keys=True)
    if text not in _WORK:
        _WORK[text] = cached(
            "work2", key, lambda: trace.count_work(
                model_cfg.family, build, batch=model_cfg.local_batch_size, optimizer=optimizer),
            sources=(MODELS, ("harness/predict", "trace.py"), ("harness/measure", "bench.py")))
    data = _WORK[text]
    return Compute.of(data["flops"]), Compute.of(data["bytes"])


_WORK: dict[str, dict] = {}  # this process's counts, by key


class ComputeProfiles:
    """Each model's compute, profiled once per simulation. `measured`: per GPU of the
    table and model, a measured 1-GPU throughput and the model it ran (a row of
    `simulate.calibrate`), which calibrates that GPU's efficiency on that model before
    `simulate.gpus` does."""

    def __init__(self, measured: dict[tuple[str, str], tuple[Config, float]] | None = None
                 ) -> None:
        self.cache: dict[tuple, Compute] = {}
        self.measured = measured or {}

    def __call__(self, cfg: Config) -> Compute:
        sim, model = cfg.simulate, cfg.model
        if sim.compute != "measured":
            key = (config.to_json(model), sim.compute, sim.precision)
            if key not in self.cache:
                self.cache[key] = self._on_gpu(cfg)
            return self.cache[key]
        # a run of this machine's own has every worker here: profile as many processes at
        # once, so the profile has their sharing of its cores in it; any other cluster, one
        together = profile_processes(cfg)
        local = together + num_servers(cfg) if together > 1 else 1
        threads = torch_threads(cfg, local)  # as a run's worker gets
        key = (config.to_json(model), threads, together)
        if key not in self.cache:
            print(f"profiling {model.name} on this machine ({together} process(es) of "
                  f"{threads} thread(s))...", flush=True)
            measured = Compute.of(trace.measure(
                model, processes=together, threads=threads, iters=sim.profile_iters,
                device=config.resolve_device(cfg.cluster), seed=cfg.run.seed))
            if measured.straggle != 1.0:  # each iteration waits for the slowest worker
                print(f"  the slowest of the {together} took {measured.straggle:.3f}x their "
                      "mean iteration: every step is taken that much longer", flush=True)
            self.cache[key] = dataclasses.replace(
                measured.scaled(measured.straggle),
                calibrated="no" if unlike_device(cfg) else "yes")
        return self.cache[key]

    def _on_gpu(self, cfg: Config) -> Compute:
        """The model's counted work on the GPU of simulate.compute, at the efficiency of a
        measured 1-GPU throughput of it (a row of simulate.calibrate, else simulate.gpus),
        or else at simulate.efficiency; says which in one line."""
        sim, model = cfg.simulate, cfg.model
        gpu = gpus.table()[sim.compute]
        row = self.measured.get((gpu.name, model.name))
        given = sim.gpus.get(gpu.name, {}).get(model.name)
        if row is not None:
            eff = efficiency(row[0], gpu=gpu, precision=sim.precision, throughput=row[1])
            how = f"calibrated by a measured 1-GPU row ({row[1]:.1f} samples/s)"
        elif given is not None:
            eff = efficiency(model, gpu=gpu, precision=sim.precision, throughput=given,
                             measured_with=sim.gpus_optimizer.get(model.name))
            how = f"calibrated by simulate.gpus.{gpu.name}.{model.name}={given:g} samples/s"
        else:
            eff = sim.efficiency
            how = ("not calibrated: simulate.efficiency; calibrate it with simulate.calibrate="
                   "<a results folder with a 1-GPU harness.run row of it>")
        calibrated = "no" if row is None and given is None else "yes"
        if eff > 1:  # faster than the spec sheet allows: measured at another precision?
            how += (f"; above its {sim.precision} peaks: was it measured at another precision"
                    " (run.tf32_matmul, simulate.precision)?")
        if cfg.network.get("gpu") == gpu.name:
            how += f"; the GPU network={cfg.network.name} was measured between"
        print(f"compute: {model.name} on {gpu.name} ({sim.precision}: "
              f"{gpu.flop_s(sim.precision) / 1e12:g} TFLOP/s, {gpu.memory_gb_per_s:g} GB/s, "
              f"conf/gpu/{gpu.name}.yaml) at {eff:.0%} of its peaks, {how}", flush=True)
        return counted(model, gpu=gpu, precision=sim.precision, efficiency=eff,
                       calibrated=calibrated)


def unlike_device(cfg: Config) -> str | None:
    """Why measured compute comes from a device unlike the one predicted (a CPU profile of
    a GPU cluster: cluster=slurm, a real network, cluster.device=cuda), else None."""
    if cfg.simulate.compute != "measured":
        return None
    if config.resolve_device(cfg.cluster) != "cpu":
        return None
    if cfg.cluster.device == "cuda":
        why = "cluster.device=cuda"
    elif config.is_real_network(cfg.network):
        why = f"network={cfg.network.name} is a GPU cluster's"
    elif cfg.cluster.name == "slurm":
        why = "cluster=slurm"
    else:
        return None
    return (f"the compute of this prediction is measured on this machine's CPU, but {why}: "
            f"predict GPUs with simulate.compute=<gpu> ({', '.join(gpus.table())}: conf/gpu/)")
