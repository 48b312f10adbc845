"""The seven methods (and ddp) are lossless, on all-reduce and on parameter servers.

The lossless matrix starts real processes once per cluster shape (Gloo on CPU,
workers plus parameter servers; 1 and 2 nodes of 2 and 3 workers) and runs every
method of conf/method/ in them (a new YAML file is covered for free; on two nodes
the PS methods) and every combination of the PS switches (node-local aggregation,
hash or balanced servers, server scheduling) on a ResNet flavor (SGD + momentum)
and a BERT flavor (AdamW), with small partitions and credits so that tensors
really are split, and random per-rank delays in the gradient hooks so that ranks
see gradients at different times. After 3 steps (one exception below) the
parameters must equal the single-process reference of harness.verify and be
identical on every rank.
Every job runs with the garbage collector off, and nothing the method, model and
optimizer were made of may outlive `method.close()` (no reference cycles).

Two workers sum exactly (a + b is the reference's g0 + g1), so there a ResNet
at lr 0.1, whose ReLU and max-pool kinks turn any wrong bit into a visible
difference, must match. With more workers an all-reduce sums in another order
than the reference; the ResNet flavor there uses lr 1e-4 so that the rounding
stays within float tolerance (at lr 0.1 no all-reduce method, bsp_a2a included,
meets it), and one step: a parameter server sums three pushes in the order they
arrive, so its rounding differs from run to run, and a rounding-sized difference
after one step can flip a kink in the next step's forward pass, moving a few
hundred parameters by lr x their gradient (seen once: 521 of 11.2 M by 2.1e-5).
One step compares the summation itself; the BERT flavor (no kinks) takes 3 steps.
"""

from __future__ import annotations

import datetime as dt
import gc
import json
import socket
import time
import traceback
import weakref
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import yaml

import methods
from harness import config
from harness.launch.rank import Context, node_groups
from harness.measure import verify
from harness.measure.bench import build, model_of
from harness.measure.verify import flat_params, reference, train
from methods.costmodel import Cost, least_squares, relative_least_squares
from methods.layout import assign, cut
from methods.plan import Bucket, Partition, PerTensor, mgwfbp_groups
from methods.ps import wire as ps_wire
from tests.conftest import REPO, SMALL_BERT, run_module

METHOD_FILES = sorted((REPO / "conf" / "method").glob("*.yaml"))
METHODS = [p.stem for p in METHOD_FILES]

RESNET = ["model=resnet50_small", "model.build.arch=resnet18", "model.build.image_size=32",
          "model.build.num_classes=10", "model.local_batch_size=4"]
BERT = SMALL_BERT
FLAVORS = {
    "resnet": RESNET, "bert": BERT,  # more than two workers: another order of summation
    "resnet_many": [*RESNET, "model.optimizer.lr=1e-4", "verify.steps=1"], "bert_many": BERT,
}
PARTITION = {"resnet": 50_000, "bert": 8_192}  # elements: both models get split tensors
HOOK_DELAY_S = 0.002
PS_METHODS = [m for m in METHODS if m.endswith("_ps")]
SWITCHES = [(local, rule, sched) for local in (True, False) for rule in ("hash", "balanced")
            for sched in (False, True)]
# (nodes, workers per node, server processes, methods, flavors): one node runs every
# method, two nodes (where node-local aggregation and servers meet) the PS methods
SHAPES = [(1, 2, 1, METHODS, ("resnet", "bert")), (1, 3, 1, METHODS, ("resnet", "bert")),
          (2, 2, 2, PS_METHODS, ("resnet", "bert")), (2, 3, 2, PS_METHODS, ("bert",))]
# ... and the PS methods on the UCX wire (cluster.ps_wire=ucx, methods/ps/ucx.py), the
# smallest flavor: one node with every worker pushing to the server, two nodes on the
# scatter path and (wfbp_ps) through the root
WIRE_SHAPES = [(1, 2, 1, PS_METHODS, ("bert",), "ucx"), (2, 2, 2, PS_METHODS, ("bert",), "ucx")]
MATRIX_TIMEOUT_S = 600


# -- planners, cost model, server assignment (no processes) ----------------------------


def test_mgwfbp_keeps_large_tensors_apart_when_communication_is_free() -> None:
    sizes = [100_000] * 4
    groups = mgwfbp_groups(sizes, [1.0] * 4, Cost(alpha=0.0, beta=1e-12))
    assert groups == [[0], [1], [2], [3]]


def test_mgwfbp_merges_everything_when_startup_dominates() -> None:
    sizes = [100_000] * 4
    groups = mgwfbp_groups(sizes, [1e-3] * 4, Cost(alpha=1.0, beta=1e-12))
    assert groups == [[0, 1, 2, 3]]


def test_mgwfbp_always_merges_small_tensors() -> None:
    sizes = [100_000, 10, 20, 100_000, 30]
    groups = mgwfbp_groups(sizes, [1.0] * 5, Cost(alpha=0.0, beta=1e-12))
    assert groups == [[0], [1, 2, 3], [4]]


def test_mgwfbp_merges_when_the_previous_allreduce_still_runs() -> None:
    # tensor 0 (output side) is ready at 1 s and takes 10 s to all-reduce, so tensor 1's
    # all-reduce could not start before 11 s anyway: merge 1 into 2. Tensor 2's gradient
    # is ready at 3 s, long before that; the group (1, 2) waits until tensor 0 is done.
    # Tensor 3 is ready at 103 s, when the link has long been idle: it stays alone.
    sizes = [1_000_000, 100_000, 100_000, 100_000]
    beta = 10.0 / (4 * 1_000_000)
    groups = mgwfbp_groups(sizes, [1.0, 1.0, 1.0, 100.0], Cost(alpha=0.0, beta=beta))
    assert groups == [[0], [1, 2], [3]]


def test_mgwfbp_merges_when_waiting_costs_less_than_alpha() -> None:
    # the link is idle when tensor 1 is ready; tensor 2 follows 0.1 s later, less than
    # the alpha = 0.5 s a separate all-reduce would cost: merge. Tensor 3 follows 5 s later.
    sizes = [100_000] * 4
    groups = mgwfbp_groups(sizes, [1.0, 10.0, 0.1, 5.0], Cost(alpha=0.5, beta=1e-12))
    assert groups == [[0], [1, 2], [3]]


def test_least_squares_recovers_the_line() -> None:
    xs = [1e3, 1e4, 1e5, 1e6]
    cost = least_squares(xs, [2e-5 + 3e-9 * x for x in xs])
    assert cost.alpha == pytest.approx(2e-5) and cost.beta == pytest.approx(3e-9)
    with pytest.raises(ValueError, match="two message sizes"):
        least_squares([1.0, 1.0], [1.0, 2.0])


def test_relative_least_squares_takes_alpha_from_the_small_sizes() -> None:
    xs = [float(1 << k) for k in range(10, 25, 2)]  # 1 KiB to 16 MiB
    line = [2e-3 + 1e-8 * x for x in xs]
    exact = relative_least_squares(xs, line)
    assert (exact.alpha, exact.beta) == pytest.approx((2e-3, 1e-8))
    noisy = [y * (0.6 if x == 1 << 22 else 1.0) for x, y in zip(xs, line)]  # 4 MiB 40% low
    assert relative_least_squares(xs, noisy).alpha == pytest.approx(2e-3, rel=0.1)
    assert abs(least_squares(xs, noisy).alpha - 2e-3) > 1e-3  # the plain fit's: 0.09 ms
    falling = relative_least_squares([1.0, 2.0], [2.0, 1.0])  # beta clamped at 0
    assert (falling.alpha, falling.beta) == (pytest.approx(1.2), 0.0)  # the weighted mean
    # a size that read no CPU (a clock's tick) weighs as the least one that did
    assert relative_least_squares([1.0, 2.0, 3.0], [0.0, 2.0, 3.0]).beta > 0.5  # 0.89


def test_planners_cover_the_buffer_contiguously() -> None:
    sizes = [10, 25, 7]
    for planner, expected in ((Bucket(), 1), (PerTensor(), 3),
                              (Partition(partition_elements=8), 2 + 4 + 1),
                              (Partition(partition_bytes=40), 1 + 3 + 1)):
        units = planner.plan(sizes, element_size=4)
        assert len(units) == expected, planner
        assert units[0].start == 0 and units[-1].end == sum(sizes)
        assert all(a.end == b.start for a, b in zip(units, units[1:]))
    assert all(u.numel <= 8 for u in Partition(partition_elements=8).plan(sizes))


def test_balanced_server_partitions_are_balanced_and_deterministic() -> None:
    units = Bucket().plan([1_000_000, 3_000_000, 500])
    parts = [e - s for s, e in cut(units, 1_024_000)[0]]
    assert sum(parts) == 4_000_500 and max(parts) <= 1_024_000
    owners = assign(list(range(len(parts))), parts, 2, "balanced")
    assert owners == assign(list(range(len(parts))), parts, 2, "balanced")
    loads = [sum(n for n, o in zip(parts, owners) if o == s) for s in (0, 1)]
    assert abs(loads[0] - loads[1]) <= max(parts)


# -- bad input: one line, before anything starts ----------------------------------------


@pytest.mark.parametrize("overrides, words", [
    (["method=bsp_ps", "cluster.nodes=2", "cluster.servers=0"],
     ["uses parameter servers", "cluster.servers=0"]),
    (["method=wfbp_ps", "method.transport.partition_bytes=0"], ["partition_bytes=0", "> 0"]),
    (["method=bytescheduler_a2a", "method.planner.partition_elements=-5"],
     ["partition_elements=-5", "> 0"]),
    (["method=bytescheduler_a2a", "method.scheduler.credit_elements=0"],
     ["credit_elements=0", "> 0"]),
    (["method=bytescheduler_a2a", "method.scheduler.cycle_s=-1"], ["cycle_s=-1", ">= 0"]),
    (["method=bytescheduler_a2a", "method.scheduler.fusion_bytes=0"], ["fusion_bytes=0", "> 0"]),
    (["method=wfbp_ps", "method.transport.assignment=random"],
     ["assignment='random' is unknown", "hash, balanced"]),
    (["method=bsp_ps", "method.transport.node_reduce=ring"],
     ["node_reduce='ring' is unknown", "scatter, root"]),
    (["method=wfbp_ps", "cluster.servers=2"],
     ["runs without parameter servers", "method.transport.local_reduce=false"]),
    (["method=mgwfbp", "+method.planner.bucket=3"],
     ["method.planner.bucket is not an argument", "profile_iters"]),
])
def test_bad_method_settings_are_one_line_config_errors(overrides, words) -> None:
    with pytest.raises(config.ConfigError) as err:
        config.load(overrides)
    message = str(err.value)
    assert "\n" not in message
    for word in words:
        assert word in message, message


def test_run_rejects_a_ps_method_without_servers_before_launch() -> None:
    out = run_module("harness.run", "method=bytescheduler_ps", "cluster.nodes=2",
                     "cluster.servers=0", "results_dir=/nonexistent/never")
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and "cluster.servers=0" in out.stderr


# -- the lossless matrix: real processes, every method, two cluster shapes --------------


def _method_overrides(name: str, flavor: str) -> list[str]:
    """Shrink partitions and credits so tensors split; profile briefly; shake hook timing."""
    conf = yaml.safe_load((REPO / "conf" / "method" / f"{name}.yaml").read_text())
    part = PARTITION[flavor]
    out = [f"method={name}"]
    if conf["transport"]["name"] == "ddp":
        return out
    if "partition_bytes" in conf["transport"]:
        out.append(f"method.transport.partition_bytes={4 * part}")
    for key, value in (("partition_elements", part), ("partition_bytes", 4 * part)):
        if key in conf["planner"]:
            out.append(f"method.planner.{key}={value}")
    for key, value in (("credit_elements", 2 * part), ("credit_bytes", 8 * part)):
        if key in conf["scheduler"]:
            out.append(f"method.scheduler.{key}={value}")
    if conf["planner"]["name"] == "mgwfbp":
        out += ["method.planner.profile_iters=1", "+method.planner.fit_sizes=[256,4096,32768]",
                "+method.planner.fit_repeats=2"]
    out.append(f"+method.scheduler.hook_delay_s={HOOK_DELAY_S}")
    return out


def _variants(nodes: int) -> list[tuple[str, list[str]]]:
    """wfbp_ps under every combination of the PS switches its defaults and
    bytescheduler_ps do not already run (on one node with node-local aggregation the
    others have no server to act on: that is one combination), and with servers the
    node's aggregation through the root instead of BytePS's scatter path, and priority_ps
    with every worker pushing (no node collectives to order: its ranks follow rank 0's
    announcements all the same)."""
    out = [] if nodes == 1 else [("wfbp_ps[node_reduce=root]",
                                  ["method.transport.node_reduce=root"]),
                                 ("priority_ps[local_reduce=false]",
                                  ["method.transport.local_reduce=false"])]
    for local, rule, sched in SWITCHES:
        if local and (nodes == 1 or rule == "hash"):
            continue
        label = f"wfbp_ps[local_reduce={local},{rule},server_schedule={sched}]"
        out.append((label, [f"method.transport.local_reduce={str(local).lower()}",
                            f"method.transport.assignment={rule}",
                            f"method.transport.server_schedule={str(sched).lower()}"]))
    return out


def _wire_runs(nodes: int) -> list[tuple[str, list[str]]]:
    """The PS methods where their messages cross the wire: on one node every worker
    pushes (with node-local aggregation one node has no server), on two the scatter path,
    and the path through the root."""
    if nodes == 1:
        return [(f"{n}[local_reduce=False]", ["method.transport.local_reduce=false"])
                for n in PS_METHODS]
    return [(n, []) for n in PS_METHODS] + [("wfbp_ps[node_reduce=root]",
                                             ["method.transport.node_reduce=root"])]


def _jobs(nodes: int, per_node: int, names: list[str], flavors,
          wire: str = "gloo") -> list[tuple[str, str, list[str]]]:
    shape = [f"cluster.nodes={nodes}", f"cluster.workers_per_node={per_node}", "run.force=true",
             "run.timeout_s=120", f"cluster.ps_wire={wire}"]
    runs = [(n, []) for n in names] + _variants(nodes) if wire == "gloo" else _wire_runs(nodes)
    jobs = []
    for flavor in flavors:
        overrides = FLAVORS[flavor if nodes * per_node == 2 else f"{flavor}_many"]
        for label, extra in runs:
            name = label.split("[")[0]
            jobs.append((label, flavor, [*overrides, *_method_overrides(name, flavor), *extra,
                                         *shape]))
    return jobs


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _context(rank: int, world: int, workers: int, per_node: int) -> Context:
    timeout = dt.timedelta(seconds=120)
    group = dist.new_group(list(range(workers)), timeout=timeout)
    return Context(rank=rank, world_size=world, local_rank=rank, local_world_size=world,
                   num_workers=workers, num_servers=world - workers, run_id="test",
                   run_dir=None, device=torch.device("cpu"), backend="gloo",
                   worker_group=group, node_groups=node_groups(workers, per_node,
                                                               timeout=timeout))


def _compare(cfg, mine: torch.Tensor, refs: dict, flavor: str, workers: int) -> dict:
    if flavor not in refs:
        refs[flavor] = flat_params(reference(cfg, workers=workers, device=torch.device("cpu")))
    ref = refs[flavor]
    try:
        torch.testing.assert_close(mine, ref, atol=cfg.verify.atol, rtol=cfg.verify.rtol)
        mismatch = None
    except AssertionError as exc:
        mismatch = str(exc)
    return {"max_abs_diff": (mine - ref).abs().max().item(), "mismatch": mismatch}


def _summary(plan: dict) -> dict:
    return {"units": len(plan.get("units", [])), "partitions": plan.get("partitions"),
            "groups": plan.get("groups"), "alpha_s": plan.get("alpha_s")}


def _weak_parts(model: torch.nn.Module, method: methods.Method,
                optimizer: torch.optim.Optimizer) -> dict[str, weakref.ref]:
    """Weak references to a built job's objects, and to the method's own parts."""
    parts = {"model": model, "module": model_of(model), "method": method,
             "optimizer": optimizer}
    for attr in ("buffer", "scheduler", "transport", "active", "profiler"):
        if getattr(method, attr, None) is not None:
            parts[f"method.{attr}"] = getattr(method, attr)
    return {name: weakref.ref(obj) for name, obj in parts.items()}


def _train_collector_off(cfg, ctx: Context) -> tuple[torch.Tensor, float, dict, list[str]]:
    """harness.measure.verify.train with the garbage collector off; also the names of what it built
    that is still alive once it returned (after method.close(): nothing may be)."""
    refs: dict[str, weakref.ref] = {}

    def watched(*args, **kwargs):
        built = build(*args, **kwargs)
        refs.update(_weak_parts(*built))
        return built

    gc.collect()
    gc.disable()
    try:
        with mock.patch.object(verify, "build", watched):
            mine, spread, plan = train(cfg, ctx)
        alive = sorted(name for name, ref in refs.items() if ref() is not None)
    finally:
        gc.enable()
    return mine, spread, plan, alive if refs else ["(harness.measure.verify.train built nothing)"]


def _first_uses() -> None:
    """Import torchvision and step each optimizer once: the first time, torch keeps the
    calling frames (and the model or optimizer in them) alive, which is no method's fault."""
    import torchvision  # noqa: F401

    warm = torch.nn.Linear(1, 1)
    warm(torch.ones(1)).sum().backward()
    for opt in (torch.optim.SGD(warm.parameters(), lr=0.1, momentum=0.9),
                torch.optim.AdamW(warm.parameters())):
        opt.step()


def _matrix_rank(rank: int, world: int, shape: tuple, port: int, out: str) -> None:
    """One process of the matrix: a server serves; a worker runs every job in turn."""
    nodes, per_node, _, names, flavors, *wire = shape
    workers = nodes * per_node
    _first_uses()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=dt.timedelta(seconds=120))
    ps_wire.start(*wire or ["gloo"], store=dist.distributed_c10d._get_default_store(),
                  rank=rank, timeout_s=120)
    ctx = _context(rank, world, workers, per_node)
    if rank >= workers:
        methods.serve(num_workers=workers)
        dist.barrier()
        ps_wire.close()
        dist.destroy_process_group()
        return
    results, refs = {}, {}
    for name, flavor, overrides in _jobs(nodes, per_node, names, flavors, *wire):
        started = time.perf_counter()
        cfg = config.load(overrides)
        try:
            mine, spread, plan, alive = _train_collector_off(cfg, ctx)
            everyone = [None] * workers
            dist.all_gather_object(everyone, (alive, plan.get("order")), group=ctx.worker_group)
        except Exception:  # noqa: BLE001 - recorded; the next job would hang, so stop
            results[f"{name}/{flavor}"] = {"error": traceback.format_exc()}
            break
        if rank == 0:
            results[f"{name}/{flavor}"] = {
                **_compare(cfg, mine, refs, flavor, workers), "max_rank_diff": spread,
                "seconds": time.perf_counter() - started, "alive": [a for a, _ in everyone],
                "orders": [o for _, o in everyone],
                **_summary(plan)}
    if ctx.num_servers:
        methods.stop_servers(num_workers=workers)
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.barrier()  # every server has had its STOP before the wire closes
    ps_wire.close()
    dist.destroy_process_group()


# What every process of _spawn imports, once: the fork server imports them (5-10 s of CPU
# here) and each process is a fork of it, where spawning each would import them again.
PRELOAD = ["torch", "torch.distributed", "torchvision", "transformers.models.bert.modeling_bert",
           "methods", "models", "harness.measure.bench"]


def _spawn(fn, world: int, *args, timeout_s: float) -> list[int]:
    """Run fn(rank, world, *args) in `world` fresh processes (forks of multiprocessing's
    fork server, a process that has done nothing but import PRELOAD); their exit codes.

    Raises if they are not all done within `timeout_s` (and kills what is left).
    """
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    procs = [ctx.Process(target=fn, args=(rank, world, *args), daemon=True)
             for rank in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    try:
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        if any(p.is_alive() for p in procs):
            raise TimeoutError(f"processes still running after {timeout_s:g} s")
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    return [p.exitcode for p in procs]


def _shape_id(shape: tuple) -> str:
    nodes, per_node, servers, names, _, *wire = shape
    return f"n{nodes}x{per_node}s{servers}" + ("" if names is METHODS else "-ps") + \
        "".join(f"-{w}" for w in wire)


@pytest.fixture(scope="module", params=SHAPES + WIRE_SHAPES,
                ids=[_shape_id(s) for s in SHAPES + WIRE_SHAPES])
def matrix(request, tmp_path_factory) -> tuple[int, dict]:
    nodes, per_node, servers, names, flavors, *wire = shape = request.param
    world = nodes * per_node + servers
    out = tmp_path_factory.mktemp("matrix") / "results.json"
    started = time.monotonic()
    codes = _spawn(_matrix_rank, world, shape, _free_port(), str(out),
                   timeout_s=MATRIX_TIMEOUT_S)
    assert codes == [0] * world, f"exit codes {codes}"
    results = json.loads(out.read_text())
    expected = {f"{n}/{f}" for n, f, _ in _jobs(nodes, per_node, names, flavors, *wire)}
    missing = expected - set(results)
    assert not missing, f"did not run (an earlier job failed): {sorted(missing)}"
    results["_seconds"] = time.monotonic() - started
    return nodes * per_node, results


def _jobs_of(results: dict) -> dict[str, dict]:
    return {k: v for k, v in results.items() if not k.startswith("_")}


def test_lossless(matrix) -> None:
    workers, results = matrix
    bad = {}
    for key, got in _jobs_of(results).items():
        if "error" in got:
            bad[key] = got["error"]
        elif got["mismatch"] is not None:
            bad[key] = got["mismatch"]
        elif got["max_rank_diff"] != 0.0:
            bad[key] = f"ranks disagree by {got['max_rank_diff']}"
        elif workers == 2 and got["max_abs_diff"] != 0.0:  # two-term sums are exact
            bad[key] = f"two workers differ from the reference by {got['max_abs_diff']}"
    assert not bad, f"x{workers}: " + "\n".join(f"{k}: {v}" for k, v in bad.items())


def test_nothing_outlives_close(matrix) -> None:
    workers, results = matrix
    alive = {key: {rank: names for rank, names in enumerate(got["alive"]) if names}
             for key, got in _jobs_of(results).items() if "alive" in got}
    alive = {k: v for k, v in alive.items() if v}
    assert not alive, f"x{workers}: alive after close() and del without a garbage " \
                      f"collection, per job and rank: {alive}"


def test_partitions_really_split_tensors_and_plans_are_recorded(matrix) -> None:
    workers, results = matrix
    for key, got in _jobs_of(results).items():
        if "error" in got:
            continue
        name, flavor = key.split("/")
        if name in ("bytescheduler_a2a", "priority_ps"):
            tensors = 62 if flavor == "resnet" else 41  # resnet18; the BERT flavor
            assert got["units"] > tensors, (key, got)
            # rank 0 decides the issue order and every other rank follows it, on PS too
            # (pushing at will, they would bypass rank 0's credit)
            assert got["orders"] == ["leader"] + ["follower"] * (workers - 1), (key, got)
        if name.endswith("_ps") or name.startswith("wfbp_ps["):
            assert got["partitions"] > 1, (key, got)
        if name == "mgwfbp":
            assert got["groups"] and got["alpha_s"] is not None, (key, got)


# -- one process: the schedulers' own machinery leaves no cycle ---------------------------

ONE_PROCESS = [n for n in METHODS if not methods.uses_servers(
    yaml.safe_load((REPO / "conf" / "method" / f"{n}.yaml").read_text()), nodes=1)]


class _Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x))).square().mean()


def _one_process_release(rank: int, world: int, port: int, out: str) -> None:
    """Every method without servers on a one-rank group, the engine made to run its scheduler
    (one worker's all-reduce is no move, so it would step aside); what outlives close()."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    _first_uses()
    alive = {}
    for name in ONE_PROCESS:
        conf = yaml.safe_load((REPO / "conf" / "method" / f"{name}.yaml").read_text())
        conf["planner"] |= {"profile_iters": 1, "fit_sizes": [64, 256], "fit_repeats": 1} \
            if conf["planner"]["name"] == "mgwfbp" else {}
        gc.collect()
        gc.disable()
        model = _Tiny()
        method = methods.build(conf, group=None, device=torch.device("cpu"), timeout_s=30)
        if hasattr(method, "transport"):
            method.transport.identity = False
        wrapped = method.wrap(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        refs = _weak_parts(wrapped, method, optimizer)
        for _ in range(3):
            wrapped(torch.ones(4, 8)).backward()
            method.synchronize()
            method.step(optimizer)
            method.zero_grad()
        method.drain()
        method.close()
        del model, method, wrapped, optimizer
        alive[name] = sorted(n for n, ref in refs.items() if ref() is not None)
        gc.enable()
    Path(out).write_text(json.dumps(alive))
    dist.destroy_process_group()


def test_nothing_outlives_close_in_one_process(tmp_path: Path) -> None:
    out = tmp_path / "alive.json"
    assert _spawn(_one_process_release, 1, _free_port(), str(out), timeout_s=120) == [0]
    alive = json.loads(out.read_text())
    assert sorted(alive) == sorted(ONE_PROCESS)
    assert not {k: v for k, v in alive.items() if v}, alive


# -- harness.verify end to end, every method --------------------------------------------


@pytest.mark.parametrize("method", METHODS)
def test_harness_verify_passes(method: str) -> None:
    extra = [o for o in _method_overrides(method, "bert") if not o.startswith("+method.sched")]
    out = run_module("harness.verify", *BERT, *extra, "cluster.workers_per_node=2",
                     "run.timeout_s=120", timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    line = out.stdout.strip().splitlines()[-1]
    assert line == "max_abs_diff=0.000e+00 max_rank_diff=0.000e+00", line
