"""`python -m harness.simulate experiment=<name> network=<profile>`: predict a sweep.

    python -m harness.simulate experiment=paper network=ib100_rdma simulate.advise=true
    python -m harness.simulate experiment=whatif      # 110,160 configurations (fast path)
    python -m harness.simulate model=resnet50 method=wfbp_ps cluster.nodes=4 \\
        cluster.workers_per_node=4 network=eth10_tcp simulate.compute=rtx2080ti

    python -m harness.simulate advise model=bert_large gpu=h100_sxm network=ib_ndr nodes=16

Main keys: experiment=, model=, method=, network= (names below), cluster.nodes,
cluster.workers_per_node, simulate.compute (measured: profile the model here; or a GPU of
conf/gpu/, e.g. h100_sxm or the study's rtx2080ti), simulate.precision (fp32, tf32, bf16),
simulate.reference / simulate.calibrate (a CSV or results
folder to validate against / fit on), simulate.advise=true, simulate.trace=true,
results_dir.

Every configuration of the sweep becomes one result row with source=simulated (one
shard per simulation), so `harness.report` draws simulated figures with the same code;
the best method per model, network and GPU count is printed and written beside the
shard (<run_id>_best.csv). A sweep of more than a few hundred configurations (e.g.
experiment=whatif_study, 10,044 of them) prints its progress instead of a line each, and
shares the work among this machine's cores; one of more than 20,000 (experiment=whatif:
110,160) is predicted on the fast path (harness/predict/fastpath.py: every model and
method at once over its GPUs, fabrics and shapes, checked against this model) unless it
asks for calibration, validation, advice, traces or a measured profile.
`simulate.calibrate=<csv>` fits each method's costs that no fact gives on one node's
measurements (harness.predict.calibrate), `simulate.reference=<csv>` validates against
measured throughputs, `simulate.advise=true` ranks the methods per model and cluster.

A discrete-event model of training iterations, per configuration:

- compute: per-tensor forward and backward times (harness.predict.profile): FLOPs and
  the bytes of memory-bound operations at a GPU's spec-sheet peaks (conf/gpu/) over an
  efficiency, calibrated by a measured 1-GPU throughput where there is one (counted once
  per model and batch and cached, so a warm run imports no torch), or measured here (one
  process; one per worker only for a run of this machine's own);
- the method's own plan (harness.predict.plans.plan_of: the planners of methods.plan, the
  MG-WFBP merge from the backward times and a fitted alpha/beta or the study's table
  (`simulate.mgwfbp_cost`, experiment=paper), ByteScheduler's
  slices, and the PS partitions, keys and servers of methods.layout) and its
  scheduler's semantics: after backward, on ready, or a priority queue under a credit
  (issuing while any is left) with per-layer updates that the next forward pass waits
  for, its pieces of one cycle fused as Horovod did when the method sets `cycle_s`;
- the network: intra- and inter-node links (alpha + beta * bytes) from a real profile's
  facts or from the microbenchmark; ring, tree or hierarchical all-reduce (on the study's
  networks each starting on Horovod's negotiation cycle); S parameter servers each behind
  its own link, fed once per node with node-local aggregation (none on one node: the
  partitions are all-reduced there). Server-side scheduling only reorders a server's
  summations, which this model does not time: it predicts bytescheduler_ps as wfbp_ps.
"""

from __future__ import annotations

import sys

from harness import config
from harness.config import checks, paths, usage
from harness.config.ranks import num_workers
from harness.predict import calibrate, fastsweep, onegpu
from harness.predict.profile import unlike_device
from harness.predict.sweep import Inputs, inputs, predict_sweep, write

MAX_TRACES = 64  # simulate.trace: a file per configuration


def main(argv: list[str]) -> int:
    if usage.answer(argv, __doc__):  # -h, --help: the help, and nothing else
        return 0
    argv = short_form(argv)
    try:
        checks.used_by("harness.simulate", argv)
        jobs = config.sweep(argv)
        if fastsweep.wanted(jobs) and fastsweep.simulate(jobs):
            return 0  # a big what-if sweep: the fast path (harness/predict/fastpath.py)
        cfgs = config.load_all(jobs, simulate=True)
        sim = cfgs[0].simulate
        if sim.trace and len(cfgs) > MAX_TRACES:
            raise config.ConfigError(
                f"simulate.trace=true writes a timeline per configuration, and this sweep has "
                f"{len(cfgs)} (at most {MAX_TRACES}); choose fewer, e.g. with model=, method= "
                "and cluster.nodes= overrides")
        ref = (calibrate.read_cells(f"simulate.reference={sim.reference}",
                                    paths.named_file(sim.reference), cfgs)
               if sim.reference else None)
        where = f"simulate.calibrate={sim.calibrate}"
        one_gpu = (onegpu.one_gpu_rows(where, paths.named_file(sim.calibrate), cfgs)
                   if sim.calibrate else {})
        measured = (calibrate.read_cells(where, paths.named_file(sim.calibrate), cfgs,
                                         empty_ok=bool(one_gpu))
                    if sim.calibrate else None)
        fitted_on = (calibrate.fit_cells(measured, sim.calibrate_gpus)
                     if measured is not None else measured)
        for note in dict.fromkeys(unlike_device(c) for c in cfgs):
            if note:
                print(f"ddlbench: note: {note}", file=sys.stderr, flush=True)
        if one_gpu:
            print(onegpu.describe(one_gpu), flush=True)
        given = inputs(cfgs, measured=one_gpu)
        raw = predict_sweep(cfgs, given)
        costs, frame = _calibrated(cfgs, given, raw, fitted_on)
        write(frame, raw, costs, cfgs[0].results_dir)
        if costs:
            print(calibrate.describe(costs, fitted_on, list(raw.method)))
        errors = {}
        check = ref if ref is not None else measured
        if check is not None:  # the cells fitted on are no test of the fit
            if fitted_on is not None:
                check = check.merge(fitted_on[calibrate.CELL], how="left", indicator=True)
                check = check[check._merge == "left_only"].drop(columns="_merge")
            for name, predicted in [("uncalibrated", raw)] + [("calibrated", frame)] * bool(costs):
                both, line = calibrate.validate(predicted, check)
                errors = both.pct_error.abs().groupby([both.model, both.network]).median().to_dict()
                print(f"validation, {name}: {line}")
        if sim.advise:
            print(calibrate.advice(frame, errors))
    except config.ConfigError as exc:
        print(f"ddlbench: error: {exc}", file=sys.stderr)
        return 2
    return 0


SHORT = {"gpu": "simulate.compute", "nodes": "cluster.nodes",
         "gpus_per_node": "cluster.workers_per_node"}


def short_form(argv: list[str]) -> list[str]:
    """`advise key=value ...`: simulate.advise=true for every method (unless
    `method=` names some), with `gpu=`, `nodes=` and
    `gpus_per_node=` for simulate.compute, cluster.nodes and cluster.workers_per_node."""
    if not argv or argv[0] != "advise":
        return argv
    keys = [a.partition("=") for a in argv[1:]]
    every = [] if any(k == "method" for k, _, _ in keys) else [
        f"method={','.join(config.choices('method'))}"]  # ranked: every method
    return [*(f"{SHORT.get(k, k)}{eq}{v}" for k, eq, v in keys), *every,
            "simulate.advise=true"]


def _calibrated(cfgs: list, given: Inputs, raw, fitted_on) -> tuple[dict, object]:
    """The fitted costs and the calibrated predictions (none and `raw` without cells to
    fit on): the fit cells simulated at the slowdowns the fit tries (at 0: `raw`'s), then
    the configurations of each slowed method again at its fitted one, with the linear
    costs added."""
    if fitted_on is None:
        return {}, raw
    cells = set(zip(fitted_on.model, fitted_on.method, fitted_on.network, fitted_on.world_size))
    chosen = [i for i, c in enumerate(cfgs)
              if (c.model.name, c.method.name, c.network.name, num_workers(c)) in cells]

    def simulate_at(slowdown: float, methods: set[str]):
        mine = [i for i in chosen if cfgs[i].method.name in methods]
        if not slowdown:
            return raw.iloc[mine]
        return _again(cfgs, given, mine, dict.fromkeys(methods, slowdown))

    costs = calibrate.fit(simulate_at, fitted_on)
    slowdown = {m: c["slowdown"] for m, c in costs.items() if c["slowdown"]}
    slowed = raw.copy()
    redo = [i for i, c in enumerate(cfgs) if c.method.name in slowdown]
    if redo:  # the same rows (one shard, one run id), simulated slowed
        again = _again(cfgs, given, redo, slowdown).set_axis(raw.index[redo])
        again["run_id"] = raw.run_id.iloc[0]
        slowed.loc[again.index] = again[raw.columns]
    return costs, calibrate.apply(slowed, costs)


def _again(cfgs: list, given: Inputs, which: list[int], slowdown: dict[str, float]):
    """The configurations `which` (indices into `cfgs`) predicted at `slowdown`."""
    return predict_sweep([cfgs[i] for i in which],
                         Inputs(given.networks, [given.computes[i] for i in which]),
                         slowdown=slowdown)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
