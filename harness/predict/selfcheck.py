"""`python -m harness.methodbench --selfcheck [key=value ...]`: the simulator against our runs.

    python -m harness.methodbench --selfcheck                          # experiment=selfcheck
    python -m harness.methodbench --selfcheck model=bert_tiny network=eth1g run.repeats=1

Takes Hydra overrides of `experiment=selfcheck` (conf/experiment/selfcheck.yaml: every
method on bert_tiny and resnet50_small, emulated clusters of 2 and 3 nodes x 1 and 2
workers over eth1g and eth100m) and, into one results folder `<results_dir>/<timestamp>/`:

1. measures each network of the sweep with `harness.microbench` on each cluster shape
   of the sweep, with parameter servers (the point-to-point link, the link inside a node,
   the all-reduce as Gloo runs it on that shape and a push/pull round trip through the
   real server: harness/predict/links.py);
2. runs the sweep (`harness.run`, source=measured rows);
3. predicts the same sweep from what a user has: that microbenchmark and the compute
   profile measured here (`harness.simulate simulate.reference=<the folder>`, which prints
   `validation, uncalibrated: ...`, source=simulated rows). Nothing is fitted on the runs
   it predicts;
4. prints, per model, network and cluster (nodes x workers), the median and max absolute
   error of the predicted throughput and the Kendall tau of the methods' order, against
   the targets (median <= 10%, tau >= 0.6, max <= 25%); writes them as `selfcheck.csv`
   (per configuration `selfcheck_cells.csv`, with the machine's CPU seconds an iteration
   measured and predicted: the inputs of the shared cores' floor, cpushare.py) and draws
   `selfcheck_<model>.png`: measured beside predicted, bar by bar.

With `run.trace=true simulate.trace=true` it also compares each configuration's traced
iteration, measured (rank 0) against predicted: the median absolute difference of the
units' issue and completion times, as a share of the measured iteration (`harness.report
timeline=<folder>/traces/<file>` draws both, on one time axis).

`--selfcheck --predict <folder> [key=value ...]` predicts an earlier self-check's measured
rows again (after a change of the model; its microbenchmarks, no run) and compares.

Exit 0 when every step ran (missed targets are a finding, not a failure), 1 when a step
failed, 2 on bad input (nothing started).
"""

from __future__ import annotations

import datetime as dt
import math
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from harness import config
from harness.config import checks, paths, usage
from harness.measure import results, traces
from harness.predict.calibrate import kendall_tau

EXPERIMENT = "experiment=selfcheck"
CLUSTER = ["model", "network", "nodes", "workers_per_node"]  # one cluster of one model
CELL = [*CLUSTER, "method"]
TARGETS = {"median": 10.0, "max": 25.0, "tau": 0.6}  # issue 43
# the machine's CPU seconds an iteration, measured (rank 0's clock over the window) and
# predicted (cpushare.py: the compute's busy cores and the messages' measured CPU)
CPU = ["cpu_measured_s", "cpu_predicted_s"]


@dataclass(frozen=True)
class Plan:
    """What one self-check runs: the sweep's overrides, its links and its folder."""
    overrides: list[str]
    links: list[tuple[str, str, int, int]]  # (cluster, network, nodes, workers per node)
    out: Path
    measure: bool = True  # False: predict the measured rows of `out` again


def plan(argv: list[str], *, again: Path | None = None) -> Plan:
    """The self-check of `argv` (Hydra overrides of experiment=selfcheck), every job
    validated before anything starts: ConfigError names what is wrong. `again`: the
    folder of an earlier self-check to predict again (nothing measured)."""
    bad = [a for a in argv if "=" not in a]
    if bad:
        raise config.ConfigError(f"--selfcheck takes key=value overrides, not {bad[0]!r}; "
                                 "e.g. --selfcheck model=bert_tiny network=eth1g")
    overrides = [EXPERIMENT, *argv]
    cfgs = config.load_all(config.sweep(overrides), simulate=again is not None)  # run rules too
    if again is not None and not (again / results.OTHER_DATA).is_dir():
        raise config.ConfigError(f"--predict {again} holds no microbenchmark; give the folder "
                                 "of an earlier --selfcheck")
    paths.output_dir("results_dir", cfgs[0].results_dir)
    out = again or Path(cfgs[0].results_dir) / f"{dt.datetime.now():%Y%m%d-%H%M%S}"
    links = [] if again else sorted({(c.cluster.name, c.network.name, c.cluster.nodes,
                                      c.cluster.workers_per_node) for c in cfgs})
    return Plan([o for o in overrides if not o.startswith("results_dir=")], links, out,
                measure=again is None)


def commands(p: Plan) -> list[list[str]]:
    """The commands of a self-check, in order: a microbenchmark per link and cluster
    shape (its all-reduce as Gloo runs it there, links.py), the measured sweep, the
    predicted one."""
    where = f"results_dir={p.out}"
    own = [o for o in p.overrides if o.startswith("microbench.")]
    bench = [["harness.microbench", f"cluster={c}", f"network={n}", f"cluster.nodes={nodes}",
              f"cluster.workers_per_node={w}", "method=bsp_ps", *own, where]  # with servers
             for c, n, nodes, w in p.links]
    return [*bench, *[["harness.run", *_read_by("harness.run", p.overrides), where]] * p.measure,
            ["harness.simulate", *_read_by("harness.simulate", p.overrides), where,
             f"simulate.reference={p.out}"]]


def _read_by(command: str, overrides: list[str]) -> list[str]:
    """The overrides `command` reads (run.* to harness.run, simulate.* to harness.simulate)."""
    return [o for o in overrides
            if o.split("=", 1)[0].lstrip("+~").split(".")[0] not in checks.NOT_READ[command]]


def run(command: list[str]) -> tuple[int, str]:
    """Run `python -m <command>` with its output shown; its exit code and stdout."""
    print("== python -m " + " ".join(command), flush=True)
    proc = subprocess.Popen([sys.executable, "-m", *command], stdout=subprocess.PIPE,
                            text=True)
    lines = []
    assert proc.stdout is not None
    for line in proc.stdout:
        print(line, end="", flush=True)
        lines.append(line)
    return proc.wait(), "".join(lines)


# -- the comparison ------------------------------------------------------------------------

def cells(folder: Path) -> pd.DataFrame:
    """Per configuration: measured (mean over ok repeats) and predicted throughput, the
    predicted one's error in % of the measured, and the machine's CPU seconds an iteration
    each way (`CPU`; NaN where not read)."""
    rows = results.load(folder)
    newest = max(folder.glob("sim-*_r0.parquet"), key=lambda f: f.stat().st_mtime, default=None)
    rows = rows[(rows.status == "ok") & ((rows.source == "measured") | (
        rows.run_id == (newest.name.removesuffix("_r0.parquet") if newest else None)))]
    mean = rows.groupby([*CELL, "source"]).throughput.mean().unstack("source")
    both = mean.dropna(subset=[c for c in ("measured", "simulated") if c in mean])
    if not {"measured", "simulated"} <= set(both.columns):
        return pd.DataFrame(columns=[*CELL, "measured", "simulated", "pct_error", *CPU])
    both = both[["measured", "simulated"]].dropna()
    both["pct_error"] = 100 * (both.simulated - both.measured) / both.measured
    cpu = rows.groupby([*CELL, "source"]).machine_cpu_s.mean().unstack("source")
    for source, column in zip(("measured", "simulated"), CPU):
        both[column] = cpu[source] if source in cpu else math.nan
    return both.reset_index()


def scores(both: pd.DataFrame) -> pd.DataFrame:
    """Per model, network and cluster: cells, median and max absolute error (%), Kendall
    tau of the methods' order (NaN with fewer than 2 methods)."""
    out = []
    for key, g in both.groupby(CLUSTER):
        err = g.pct_error.abs()
        tau = (kendall_tau(list(g.simulated), list(g.measured)) if len(g) > 1
               else float("nan"))
        out.append((*key, len(g), err.median(), err.max(), tau))
    return pd.DataFrame(out, columns=[*CLUSTER, "cells", "median_abs_pct_error",
                                      "max_abs_pct_error", "kendall_tau"])


def verdict(table: pd.DataFrame) -> str:
    """The table as text, each row's targets met or not, and the overall line."""
    lines = [f"{'model':<15} {'network':<8} {'cluster':<7} {'cells':>5} {'median%':>8} "
             f"{'max%':>7} {'tau':>6}  targets"]
    for r in table.itertuples():
        met = (r.median_abs_pct_error <= TARGETS["median"] and r.max_abs_pct_error
               <= TARGETS["max"] and not r.kendall_tau < TARGETS["tau"])
        lines.append(f"{r.model:<15} {r.network:<8} {r.nodes}x{r.workers_per_node:<5} "
                     f"{r.cells:>5} {r.median_abs_pct_error:>8.1f} {r.max_abs_pct_error:>7.1f} "
                     f"{r.kendall_tau:>6.2f}  {'met' if met else 'missed'}")
    taus = [t for t in table.kendall_tau if t == t]
    lines.append(
        f"selfcheck: clusters={len(table)} worst median_abs_pct_error="
        f"{table.median_abs_pct_error.max():.1f} (target <= {TARGETS['median']:g}) "
        f"max_abs_pct_error={table.max_abs_pct_error.max():.1f} (<= {TARGETS['max']:g}) "
        f"mean_kendall_tau={statistics.fmean(taus) if taus else float('nan'):.2f} "
        f"(>= {TARGETS['tau']:g} per cluster)")
    return "\n".join(lines)


def draw(both: pd.DataFrame, out: Path) -> list[Path]:
    """`selfcheck_<model>.png` per model: a panel per network, a group per cluster, per
    method a measured bar and a hatched predicted one beside it."""
    from matplotlib.figure import Figure  # only when drawing

    written = []
    for model, rows in both.groupby("model"):
        networks = sorted(rows.network.unique())
        fig = Figure(figsize=(13, 3.6 * len(networks)), layout="constrained")
        axes = fig.subplots(len(networks), 1, squeeze=False)[:, 0]
        for ax, network in zip(axes, networks):
            _panel(ax, rows[rows.network == network])
            ax.set_title(f"{model} on emulated {network}: measured (solid) beside predicted "
                         "(hatched), error above", fontsize=10)
        path = out / f"selfcheck_{model}.png"
        fig.savefig(path, dpi=110)
        written.append(path)
    return written


def _panel(ax, rows: pd.DataFrame) -> None:
    """One network's bars: x = cluster, within it a pair of bars per method."""
    import matplotlib as mpl

    methods = sorted(rows.method.unique())
    clusters = sorted({(r.nodes, r.workers_per_node) for r in rows.itertuples()})
    width = 0.8 / len(methods)
    colors = mpl.colormaps["tab10"]
    for i, method in enumerate(methods):
        mine = rows[rows.method == method].set_index(["nodes", "workers_per_node"])
        for j, cluster in enumerate(clusters):
            if cluster not in mine.index:
                continue
            r = mine.loc[cluster]
            x = j + (i - len(methods) / 2 + 0.5) * width
            ax.bar(x - width / 4, r.measured, width / 2, color=colors(i),
                   label=method if j == 0 else None)
            ax.bar(x + width / 4, r.simulated, width / 2, color="white", edgecolor=colors(i),
                   hatch="///")
            ax.text(x, max(r.measured, r.simulated), f"{r.pct_error:+.0f}%", ha="center",
                    va="bottom", fontsize=6, rotation=90)
    ax.set_xticks(range(len(clusters)), [f"{n} nodes x {w}" for n, w in clusters])
    ax.set_ylabel("samples/s")
    ax.margins(y=0.15)
    ax.legend(fontsize=7, ncols=min(len(methods), 9), loc="upper center",
              bbox_to_anchor=(0.5, -0.12))  # below the cluster names, clear of the errors


def _traces(folder: Path) -> dict[tuple, dict[str, traces.Timeline]]:
    """The newest trace of each configuration (traces.KEY) by source: rank 0's measured."""
    found: dict[tuple, dict[str, traces.Timeline]] = {}
    for path in sorted((folder / traces.FOLDER).glob("*.trace.json"),
                       key=lambda f: f.stat().st_mtime):
        tl = traces.read(path)
        if tl.about.get("rank", 0) == 0:
            found.setdefault(tuple(tl.about.get(k) for k in traces.KEY), {})[
                tl.about["source"]] = tl
    return found


def trace_lines(folder: Path) -> list[str]:
    """Per configuration traced both ways: its iterations and the units' issue and
    completion gaps (traces.unit_gap), the completion's also counted from the end of backward."""
    lines = []
    for key, pair in sorted(_traces(folder).items(), key=str):
        if {"measured", "simulated"} <= pair.keys():
            m, p = pair["measured"], pair["simulated"]
            late, n = traces.unit_gap(m, p, after_backward=True)
            lines.append(f"trace {' '.join(map(str, key))}: iteration measured "
                         f"{m.length_s * 1e3:.0f} ms, predicted {p.length_s * 1e3:.0f} ms; "
                         f"{traces.gap_text(m, p)}" + (f"; completion {100 * late:.1f}% counted "
                                                "from the end of backward" if n else ""))
    return lines


def compare(out: Path) -> int:
    """Print and write the comparison of the measured and predicted rows in `out`."""
    both = cells(out)
    if both.empty:
        print(f"ddlbench: error: {out} holds no configuration both measured and predicted",
              file=sys.stderr)
        return 1
    table = scores(both)
    both.to_csv(out / "selfcheck_cells.csv", index=False)
    table.to_csv(out / "selfcheck.csv", index=False)
    print(verdict(table))
    for line in trace_lines(out):  # with run.trace=true simulate.trace=true
        print(line)
    for path in draw(both, out):
        print(f"drew {path}")
    return 0


def main(argv: list[str]) -> int:
    """The self-check: measure, predict, compare (module docstring); `--predict <folder>
    [key=value ...]`: predict an earlier one's measured rows again and compare."""
    try:
        if argv[:1] == ["--predict"] and len(argv) < 2:
            raise config.ConfigError("--predict needs the folder of an earlier --selfcheck")
        again = Path(argv[1]) if argv[:1] == ["--predict"] else None
        p = plan(argv[2:] if again else argv, again=again)
    except config.ConfigError as exc:
        print(f"ddlbench: error: {exc}", file=sys.stderr)
        return 2
    failed, validation = 0, ""
    for command in commands(p):
        code, text = run(command)
        if code in (130, 143):  # Ctrl-C or SIGTERM: stop here
            return code
        failed += code != 0
        validation = "\n".join(x for x in text.splitlines() if x.startswith("validation"))
    code = compare(p.out)
    print(validation or "validation: none (no configuration both measured and predicted)")
    print(f"results, microbenchmarks and selfcheck.csv in {p.out}/")
    return 1 if failed or code else 0


def command(argv: list[str]) -> int:
    """`--selfcheck [key=value ...]`: its help, or the self-check."""
    return 0 if usage.answer(argv, __doc__) else main(argv)
