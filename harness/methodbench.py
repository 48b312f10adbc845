"""`python -m harness.methodbench`: every method at 1 and 2 workers, plus the plain loop.

    python -m harness.methodbench                      # resnet50_small and bert_tiny
    python -m harness.methodbench --rounds 1 --models bert_tiny --timed-iters 10
    python -m harness.methodbench --engines native     # without the Horovod twins
    python -m harness.methodbench --simulate           # the simulator's wall time instead
    python -m harness.methodbench --nodes 2 --workers 2 --methods bsp_ps,wfbp_ps \\
        --node-reduce scatter,root                     # PS with servers, both node paths
    python -m harness.methodbench --nodes 2 --workers 1 --methods bsp_ps,wfbp_ps \\
        --wires gloo,ucx --network eth10g              # both PS wires, emulated 10 Gb/s

Runs every method of conf/method/ on each model at each worker count through
the normal `harness.run` path (one parquet shard per run), each all-reduce method
also on engine=horovod at every count above 1 (its Horovod twin, `<method>@horovod`
below; `--engines native` leaves them out), and measures a
plain training loop (forward, backward, optimizer step, zero_grad: no method,
no phase stamps) on the same model, batch and optimizer as the 1.0x baseline,
in a process started and timed exactly as a 1-worker run is (`worker` below);
its rows have method "plain". Everything is repeated in `--rounds` rounds with
the configurations interleaved and rotated (the plain loop among the 1-worker
runs), so the drift of a shared machine hits every method alike. The ratios it
prints:

- at the largest worker count: the better of wfbp_a2a and mgwfbp over ddp, each PS
  method over bsp_ps, bytescheduler_a2a over wfbp_a2a, and each all-reduce method
  natively over its Horovod twin (native/horovod);
- with `--nodes` above 1 (emulated nodes on this machine, so parameter servers exist)
  and `--node-reduce scatter,root`: each PS method also on the node path through the
  root (its `@root` twin, method.transport.node_reduce=root), each twin over bsp_ps@root,
  and each PS method over its twin (BytePS's scatter path over the root path);
- with `--wires gloo,ucx` (and `--nodes` above 1): each PS method also with its messages
  over UCX (its `@ucx` twin, cluster.ps_wire=ucx), and each twin over the method on Gloo;
- at 1 worker: every all-reduce method over the plain loop (the harness's overhead);
- with `--unmetered`: each method without its host meter over itself with it (what
  timing `method_host_s` costs; run.method_host=false, its `@unmetered` twin).

Beside each configuration's throughput it prints the medians of `method_host_s` and
`method_wait_s` (ms per iteration): the method's own cost on the training thread.

Each ratio is taken within a round (runs minutes apart, so the slow drift of a
shared machine cancels) and the median over the rounds is the figure; every
round's value is printed and saved too.

Results land in `<results-dir>/<timestamp>/round<k>/`, the ratios also in `ratios.json`.

`--simulate` times the simulator instead, as a user meets it (a whole `python -m
harness.simulate` process, warm cache: one untimed run of each first): the study's
sweep calibrated on its published numbers (`--reference`, if found), and the what-if
sweeps (whatif: 110,160 on the fast path; whatif_study), interleaved over `--rounds`;
each one's median and range against its target, saved as `simulate.json`. `--selfcheck
[key=value ...]` measures and predicts experiment=selfcheck (harness/predict/selfcheck.py).
"""

from __future__ import annotations

import argparse
import datetime as dt
import difflib
import json
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from harness import config
from harness import run as harness_run
from harness.config import checks, paths, usage
from harness.config.schema import ENGINES, PS_WIRES
from harness.launch import failure
from harness.launch.launcher import Terminated, launch, signals_raise
from harness.launch.process import new_run_id
from harness.measure import progress, results
from harness.measure.benchratios import ROOT, TWIN, TWINS, UCX, UNMETERED, report
from harness.predict import selfcheck
from methods.layout import NODE_REDUCES

# the simulator's sweeps timed by --simulate, with their targets in seconds (issue 25)
SIMULATIONS = {"paper": (["experiment=paper", "network=ib100_rdma"], 2.0),
               **{w: ([f"experiment={w}"], 30.0) for w in ("whatif", "whatif_study")}}
class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line and exit 2, as every command
        raise config.ConfigError(f"{message}; see python -m harness.methodbench --help")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = _Parser(prog="python -m harness.methodbench", description=usage.description(__doc__),
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="resnet50_small,bert_tiny")
    parser.add_argument("--methods", default=",".join(config.choices("method")))
    parser.add_argument("--workers", default="1,2", help="worker counts (per node)")
    parser.add_argument("--nodes", type=int, default=1,
                        help="emulated nodes of every method run (servers exist from 2 on)")
    parser.add_argument("--node-reduce", default="scatter",
                        help="the PS node paths measured with --nodes above 1: scatter "
                             "(BytePS's, the default) and/or root (each PS method's @root twin)")
    parser.add_argument("--wires", default="gloo",
                        help="the PS wires measured with --nodes above 1: gloo and/or ucx "
                             "(each PS method's @ucx twin, cluster.ps_wire=ucx)")
    parser.add_argument("--network", default="loopback",
                        help="the network of every run: loopback, or a rate-limited one of "
                             "conf/network/ (eth1g, eth10g, ...: emulated nodes, cluster=emulated)")
    parser.add_argument("--unmetered", action="store_true",
                        help="also run each method natively without its host meter "
                             "(<method>@unmetered): what timing method_host_s costs")
    parser.add_argument("--engines", default="native,horovod",
                        help="native runs every method; horovod adds each all-reduce method's "
                             "Horovod twin at every worker count above 1")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup-iters", type=int, default=10)
    parser.add_argument("--timed-iters", type=int, default=20)
    parser.add_argument("--results-dir", default="results/methodbench")
    parser.add_argument("--force", action="store_true",
                        help="lift the machine-fit limits (run.force=true of every run)")
    parser.add_argument("--simulate", action="store_true",
                        help="time the simulator's paper and what-if sweeps instead")
    parser.add_argument("--reference", default="study",
                        help="published throughputs to calibrate and validate the paper sweep "
                             "on (--simulate): a CSV, or study (conf/reference/shi2020_ib100.csv)")
    return parser.parse_args(argv)


def _names(flag: str, text: str, known: list[str]) -> list[str]:
    names = text.split(",")
    for name in names:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
            hint = f"did you mean {close[0]}? " if close else ""
            raise config.ConfigError(f"{flag} {name!r} is unknown; {hint}choose among: "
                                     f"{', '.join(known)}")
    return names


def check_args(args: argparse.Namespace) -> tuple[list[str], dict[int, list[str]]]:
    """(models, {worker count: the names run at it}) of valid arguments; a name is a
    method, or `<method>@horovod` for its Horovod twin. Every run they make is validated
    (machine fit included) before the first starts. ConfigError otherwise."""
    model_names = _names("--models", args.models, config.choices("model"))
    method_names = _names("--methods", args.methods, config.choices("method"))
    engines = _names("--engines", args.engines, list(ENGINES))
    node_reduces = _names("--node-reduce", args.node_reduce, list(NODE_REDUCES))
    wires = _names("--wires", args.wires, list(PS_WIRES))
    _names("--network", args.network, config.choices("network"))
    counts = args.workers.split(",")
    if not all(c.isdigit() and int(c) > 0 for c in counts):
        raise config.ConfigError(f"--workers {args.workers} is invalid; give worker counts > 0, "
                                 "e.g. --workers 1,2")
    for flag, value, low in (("--rounds", args.rounds, 1), ("--warmup-iters", args.warmup_iters, 0),
                             ("--timed-iters", args.timed_iters, 1), ("--nodes", args.nodes, 1)):
        if value < low:
            raise config.ConfigError(f"{flag} {value} is invalid; it must be >= {low}")
    paths.output_dir("--results-dir", args.results_dir)
    runs = run_list(method_names, engines=engines, counts=[int(c) for c in counts],
                    roots="root" in node_reduces and args.nodes > 1, unmetered=args.unmetered,
                    ucx="ucx" in wires and args.nodes > 1)
    if not any(runs.values()):
        raise config.ConfigError(
            f"--methods {args.methods} with --engines {args.engines} selects no run: engine "
            "horovod runs the all-reduce methods only "
            f"({', '.join(checks.methods_on('allreduce'))}); add --engines native or choose "
            "an all-reduce method")
    try:
        config.load_all([[f"model={m}", *_method_overrides(x), f"cluster.workers_per_node={w}",
                          f"cluster.nodes={args.nodes}", *_network(args),
                          *_run_overrides(args, Path(args.results_dir))]
                         for m in model_names for w, names in runs.items() for x in names])
    except config.ConfigError as exc:
        raise config.ConfigError(str(exc).replace(checks.FORCE, "add --force to run it anyway")
                                 .replace("or use engine=native", "or add --engines native")
                                 ) from None
    return model_names, runs


def run_list(method_names: list[str], *, engines: list[str], counts: list[int],
             roots: bool = False, unmetered: bool = False,
             ucx: bool = False) -> dict[int, list[str]]:
    """The names run at each worker count: every method natively, the Horovod twin of
    each all-reduce method above 1 worker (where an all-reduce has something to move),
    with `roots` the root-path twin of each PS method, with `ucx` its UCX-wire twin, and
    with `unmetered` each method natively without its host meter."""
    allreduce = checks.methods_on("allreduce")  # reads conf/method/: once
    twins = [m + TWIN for m in method_names if m in allreduce]
    ps = checks.methods_on("ps") if roots or ucx else []
    roots_of = [m + ROOT for m in method_names if m in ps] if roots else []
    roots_of += [m + UCX for m in method_names if m in ps] if ucx else []
    native = [m for m in method_names if "native" in engines]
    bare = [m + UNMETERED for m in native] if unmetered else []
    return {n: native + (twins if "horovod" in engines and n > 1 else []) + roots_of + bare
            for n in counts}


def _method_overrides(name: str) -> list[str]:
    """The overrides of a run-list name: the method, and its twin's."""
    method, at, twin = name.partition("@")
    return [f"method={method}", *(TWINS[at + twin] if at else [])]


def _network(args: argparse.Namespace) -> list[str]:
    """A method run's network: loopback, or emulated nodes behind a rate-limited link."""
    return [] if args.network == "loopback" else ["cluster=emulated", f"network={args.network}"]


def _run_overrides(args: argparse.Namespace, out: Path) -> list[str]:
    """What every run of the benchmark (a method or the plain loop) is given."""
    return ["run.repeats=1", f"run.warmup_iters={args.warmup_iters}",
            f"run.timed_iters={args.timed_iters}", f"results_dir={out}",
            *(["run.force=true"] if args.force else [])]


def overrides(model_name: str, name: str, workers: int, *, out: Path,
              args: argparse.Namespace) -> list[str]:
    """The overrides of one configuration: a run-list name at `workers` per node, or
    "plain" (the plain loop: the model and the run's settings)."""
    shape = [f"cluster.workers_per_node={workers}", f"cluster.nodes={args.nodes}",
             *_network(args)]
    return [f"model={model_name}", *([] if name == "plain" else _method_overrides(name) + shape),
            *_run_overrides(args, out)]


def run_one(model_name: str, name: str, workers: int, *, out: Path,
            args: argparse.Namespace) -> int:
    """One configuration, one repeat, its exit code: a method as one harness.run, the plain
    loop in a process of its own. Ctrl-C or SIGTERM stop it (130, 143) with its failed row:
    its launcher records it, and so does this before the launcher starts or after it ends."""
    argv = overrides(model_name, name, workers, out=out, args=args)
    entry = "harness.measure.plain" if name == "plain" else "harness.measure.bench"
    try:  # the plain loop in a process started as a 1-worker run's
        return launch(config.load(argv), entry=entry)[0] if name == "plain" else \
            harness_run.main(argv)
    except KeyboardInterrupt as exc:  # SIGINT, or SIGTERM by signals_raise
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # stopping: record once, then exit
        code = 143 if isinstance(exc, Terminated) else 130
        cfg = config.load(argv)
        failure.record(cfg, entry=entry, run_id=new_run_id(cfg), repeat=None,
                       error=f"methodbench was stopped by {harness_run.STOPPED[code]} as "
                             "this run started or ended")
        return code


def simulations(args: argparse.Namespace, out: Path) -> dict[str, tuple[list[str], float]]:
    """The simulator's command lines timed by --simulate, with their targets in seconds."""
    sims = {name: ([*overrides, f"results_dir={out / name}"], target)
            for name, (overrides, target) in SIMULATIONS.items()}
    if Path(paths.named_file(args.reference)).is_file():
        sims["paper"][0].extend([f"simulate.reference={args.reference}",
                                 f"simulate.calibrate={args.reference}"])
    return sims


def time_simulations(args: argparse.Namespace, out: Path) -> int:
    """Wall time of each simulation as a whole process, warm cache, interleaved rounds."""
    sims = simulations(args, out)
    out.mkdir(parents=True, exist_ok=True)
    times: dict[str, list[float]] = {name: [] for name in sims}
    for rnd in range(args.rounds + 1):  # round 0 warms the caches and is not counted
        for name, (overrides, _) in sims.items():
            start = time.perf_counter()
            done = subprocess.run([sys.executable, "-m", "harness.simulate", *overrides],
                                  capture_output=True, text=True)
            if done.returncode:
                print(f"{name}: python -m harness.simulate {' '.join(overrides)} failed:\n"
                      f"{done.stderr.strip()}", file=sys.stderr)
                return 1
            if rnd:
                times[name].append(time.perf_counter() - start)
                print(f"== round {rnd}/{args.rounds} {name}: {times[name][-1]:.2f} s", flush=True)
    table = {name: {"median": statistics.median(v), "min": min(v), "max": max(v), "rounds": v,
                    "target": sims[name][1], "command": sims[name][0]}
             for name, v in times.items()}
    for name, row in table.items():
        verdict = "meets" if row["median"] < row["target"] else "MISSES"
        print(f"{name:8s} median {row['median']:.2f} s ({row['min']:.2f}-{row['max']:.2f}) "
              f"{verdict} its target of {row['target']:g} s")
    (out / "simulate.json").write_text(json.dumps(table, indent=2))
    return 0 if all(r["median"] < r["target"] for r in table.values()) else 1


def round_runs(runs: dict[int, list[str]], rnd: int) -> list[tuple[int, str]]:
    """(workers, method or "plain") of one model in round `rnd`, in the order they run:
    each worker count's methods rotated by the round; the plain loop takes its turn among
    the smallest runs, rotated like them."""
    order = []
    for workers, names in runs.items():
        names = ["plain", *names] if workers == min(runs) else names
        if names:  # none: e.g. --engines horovod with no all-reduce method
            order += [(workers, n) for n in names[rnd % len(names):] + names[:rnd % len(names)]]
    return order


def main(argv: list[str]) -> int:
    if argv[:1] == ["--selfcheck"]:  # its own overrides and help: harness/predict/selfcheck.py
        return selfcheck.command(argv[1:])
    argv = ["--help"] if usage.asked(argv) else argv  # -help, help: argparse's help
    try:
        args = parse_args(argv)
        if args.simulate:
            paths.output_dir("--results-dir", args.results_dir)
        else:
            model_names, runs = check_args(args)
    except config.ConfigError as exc:
        print(f"ddlbench: error: {exc}", file=sys.stderr)
        return 2
    stamp = f"{dt.datetime.now():%Y%m%d-%H%M%S}"
    if args.simulate:
        return time_simulations(args, Path(args.results_dir) / f"simulate-{stamp}")
    out = Path(args.results_dir) / stamp
    failed, started, done = 0, time.perf_counter(), 0
    total = args.rounds * len(model_names) * len(round_runs(runs, 0))
    for rnd in range(args.rounds):
        folder = out / f"round{rnd + 1}"
        for model_name in model_names:
            for workers, name in round_runs(runs, rnd):
                what = "plain loop" if name == "plain" else f"{name} x{workers}"
                eta = progress.line("bench", done, total, time.perf_counter() - started,
                                    "runs done")
                print(f"== round {rnd + 1}/{args.rounds} {model_name} {what}  ({eta})",
                      flush=True)
                done += 1
                with signals_raise():  # a SIGTERM between runs stops this one too
                    code = run_one(model_name, name, workers, out=folder, args=args)
                if code in harness_run.STOPPED:  # Ctrl-C or SIGTERM: stop the benchmark
                    return code
                failed += code != 0
    table = report([results.load(out / f"round{r + 1}") for r in range(args.rounds)],
                   workers=[w * args.nodes for w in runs])
    (out / "ratios.json").write_text(json.dumps(table, indent=2))
    print(f"{failed} failed runs; shards and ratios.json in {out}/")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

