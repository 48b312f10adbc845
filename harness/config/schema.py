"""The typed schema of a configuration, and what it resolves to on this machine.

`BenchConf` is conf/bench.yaml as dataclasses: Hydra composes into it, so a value of
the wrong type is an error before anything starts. Free-form parts (a model's
`build`, a method's parts, a network profile) are typed by harness.checks.
"""

from __future__ import annotations

import ctypes
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

REPO = Path(__file__).resolve().parents[2]  # the checkout: conf/, slurm/, models/
CONF_DIR = REPO / "conf"
GROUPS = ("model", "method", "cluster", "network", "experiment")
OPTIMIZERS = ("sgd", "adam", "adamw")
# run.sync_each_step, how each step ends: false (ours: nothing waits), device (the study's
# Horovod-family scripts: torch.cuda.synchronize()), drain (every piece and update done,
# then the device synchronized); true is drain, as it was before device existed
CLOCKS = ("false", "device", "drain")
RATES = ("window", "study")  # run.rate: the row's throughput statistic


def step_ending(run: Any) -> str:
    """How each step of `run` (the run section) ends: one of CLOCKS, or the value as given
    when it is none of them (checked by config.validate)."""
    return ending(run.sync_each_step)


def ending(value: Any) -> str:
    """A run.sync_each_step value as one of CLOCKS: true (as shards and configurations
    before `device` said it) is drain, nothing (None, NaN) is false."""
    text = "false" if value is None or value != value else str(value).lower()
    return "drain" if text == "true" else text


PS_WIRES = ("gloo", "ucx")  # methods/ps/wire.py WIRES: Gloo's point-to-point, or UCX
ENGINES = ("native", "horovod")  # what runs an all-reduce method's collectives
# run.fault.kind: raise an error, exit (os._exit(3)), hang (the training thread sleeps; the
# process's other threads run on), stop (SIGSTOP: every thread of the process frozen, as a
# stalled node or a debugger leaves it), abort (SIGABRT, as a C++ crash or NCCL's watchdog)
FAULT_KINDS = ("raise", "exit", "hang", "stop", "abort")


def first_line(exc: BaseException, default: str = "") -> str:
    """The first line of an error's message (`default` when it has none), for one-line
    reports of it."""
    return (str(exc).strip().splitlines() or [default])[0]


class ConfigError(ValueError):
    """Bad user input, reported as one line before anything starts."""


@dataclass
class OptimizerConf:
    name: str = "sgd"
    lr: float = 0.1
    momentum: float = 0.0
    weight_decay: float = 0.0


@dataclass
class ModelConf:
    name: str = "???"
    family: str = "???"
    local_batch_size: int = 1
    build: dict[str, Any] = field(default_factory=dict)
    optimizer: OptimizerConf = field(default_factory=OptimizerConf)


@dataclass
class HorovodConf:
    """Horovod's settings for a method on engine=horovod (HOROVOD_FUSION_THRESHOLD,
    HOROVOD_CYCLE_TIME and HOROVOD_CACHE_CAPACITY at hvd.init). The defaults are Horovod's at
    the study's time (64 MiB, 5 ms, 1024 cached responses); each all-reduce method's YAML
    sets the study's own values."""

    fusion_threshold_bytes: int = 64 * 1024 * 1024  # 0: no fusion, each tensor alone
    cycle_time_s: float = 0.005  # how often Horovod's thread negotiates; 0: without a wait
    cache_capacity: int = 1024  # Horovod's response cache; 0: off


@dataclass
class MethodConf:
    name: str = "???"
    transport: dict[str, Any] = field(default_factory=dict)
    planner: dict[str, Any] = field(default_factory=dict)
    scheduler: dict[str, Any] = field(default_factory=dict)
    horovod: HorovodConf = field(default_factory=HorovodConf)  # used on engine=horovod only


@dataclass
class SlurmConf:
    """cluster.slurm of conf/cluster/slurm.yaml (its comments say what each key does)."""

    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    reservation: str | None = None
    time: str | None = "01:00:00"
    gpus_per_node: int | None = None  # None: one per worker when the device is cuda or auto
    cpus_per_task: int | None = None
    mem: str | None = None  # --mem (per node), e.g. "64G"; None: Slurm's default
    colocate_servers: bool = True
    servers_per_node: int = 1
    max_parallel: int = 0
    extra: list[str] = field(default_factory=list)
    setup: str = ""
    template: str = "slurm/array.sbatch"
    jobs_dir: str = "slurm/jobs"


@dataclass
class ClusterConf:
    name: str = "local"
    nodes: int = 1
    workers_per_node: int = 1
    servers: int | None = None
    device: str = "auto"
    backend: str = "auto"
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    gloo_ifname: str | None = None  # GLOO_SOCKET_IFNAME: the interface of Gloo's (PS) traffic
    ps_wire: str = "gloo"  # what carries PS messages: PS_WIRES (methods/ps/wire.py)
    slurm: SlurmConf | None = None  # submission settings (harness.submit, cluster=slurm)


@dataclass
class FaultConf:
    """Fault injection, to test failure handling: rank `rank` fails at iteration `at_iter`."""

    rank: int = -1        # -1: no fault
    at_iter: int = 0      # counted over warm-up and timed iterations of all repeats
    kind: str = "raise"   # one of FAULT_KINDS


@dataclass
class RunConf:
    warmup_iters: int = 10
    timed_iters: int = 100
    repeats: int = 5
    seed: int = 0
    timeout_s: float = 300.0
    threads: int = 0
    force: bool = False   # true: lift the machine-fit limits (harness.checks)
    tf32_matmul: bool = False    # torch's defaults: matmul in full fp32,
    tf32_cudnn: bool = True      # cuDNN convolutions in TF32,
    cudnn_benchmark: bool = False  # no cuDNN autotuning
    sync_each_step: str = "false"  # false | device | drain (CLOCKS; true = drain)
    rate: str = "window"  # window: samples over the slowest rank's window | study (RATES)
    method_host: bool = True  # time the method's host work and waits (methods/hostmeter.py)
    trace: bool = False  # after each repeat's window, trace an iteration (measure/timeline.py)
    fault: FaultConf = field(default_factory=FaultConf)


@dataclass
class VerifyConf:
    steps: int = 3
    atol: float = 1e-5
    rtol: float = 1.3e-6


@dataclass
class MicrobenchConf:
    min_bytes: int = 1024
    max_bytes: int = 16 * 1024 * 1024
    repeats: int = 5


@dataclass
class SimulateConf:
    # auto: the GPU the network profile was measured on (its `gpu`: the study's networks),
    # else measured | measured (profile this machine) | a GPU of conf/gpu/
    compute: str = "auto"
    precision: str = "fp32"     # the GPU's peak FLOP/s used: fp32 | tf32 | bf16
    efficiency: float = 0.8     # share of its peaks a GPU reaches where no 1-GPU row says
    gpus: dict[str, Any] = field(default_factory=dict)  # GPU -> {model: 1-GPU samples/s}
    # model -> the optimizer its `gpus` throughputs were measured with (others: the model's)
    gpus_optimizer: dict[str, Any] = field(default_factory=dict)
    engines: dict[str, Any] = field(default_factory=dict)  # the study's engines' host facts
    mgwfbp_cost: str | None = None  # MG-WFBP's cost when simulated; null: method.planner.cost
    profile_iters: int = 5
    iterations: int = 6
    reference: str | None = None
    calibrate: str | None = None
    calibrate_gpus: list[int] | None = None
    advise: bool = False
    trace: bool = False  # write each configuration's predicted timeline (predict/timeline.py)


@dataclass
class BenchConf:
    engine: str = "native"  # native (torch.distributed) | horovod (harness/horovod.py)
    model: ModelConf = field(default_factory=ModelConf)
    method: MethodConf = field(default_factory=MethodConf)
    cluster: ClusterConf = field(default_factory=ClusterConf)
    network: dict[str, Any] = field(default_factory=lambda: {"name": "loopback"})
    run: RunConf = field(default_factory=RunConf)
    verify: VerifyConf = field(default_factory=VerifyConf)
    microbench: MicrobenchConf = field(default_factory=MicrobenchConf)
    simulate: SimulateConf = field(default_factory=SimulateConf)
    results_dir: str = "results"


def is_real_network(network: DictConfig) -> bool:
    """Whether a network profile describes a real cluster's links (simulator input)."""
    return "inter_node" in network


def cuda_gpus() -> int:
    """torch.cuda.device_count(). A process that has not imported torch (it takes seconds)
    does not import it where no CUDA driver is installed: torch's CUDA runs on the driver's
    libcuda, so without it there is no GPU, and a command's own process stays torch-free."""
    torch = sys.modules.get("torch")
    if torch is None:
        try:
            ctypes.CDLL("libcuda.so.1")
        except OSError:
            return 0
        import torch
    return torch.cuda.device_count()


def resolve_device(cluster: DictConfig) -> str:
    """'cuda' or 'cpu' for cluster.device=auto|cuda|cpu on this machine."""
    if cluster.device == "auto":
        return "cuda" if cuda_gpus() else "cpu"
    return cluster.device


def resolve_backend(cluster: DictConfig) -> str:
    if cluster.backend == "auto":
        return "nccl" if resolve_device(cluster) == "cuda" else "gloo"
    return cluster.backend
