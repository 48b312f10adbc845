"""The what-if fast path (harness/predict/fastpath.py) against the discrete-event model
(harness/predict/model.py) on cells sampled from experiment=whatif, and the fast path's
sweep as harness.simulate runs it (one shard, best.csv, no torch)."""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

from harness import config
from harness.measure import results
from harness.predict import fastsweep
from harness.predict.model import predict
from harness.predict.network import key as network_key
from harness.predict.sweep import inputs
from tests.conftest import REPO

CELLS = 32  # sampled cells (a model on a GPU, fabric and shape), every method in each
# the tolerances README.md states: the exact families, and ByteScheduler's bounds
EXACT = 0.01
PRIORITY_MEDIAN, PRIORITY_P90 = 0.15, 0.40
BEST_AGREES = 0.8
KEY = ["model", "method", "compute", "network", "nodes", "workers_per_node"]


def _cells(n: int) -> list[list[str]]:
    """Every method of `n` cells of experiment=whatif, drawn with a fixed seed."""
    jobs = config.sweep(["experiment=whatif"])
    by: dict[tuple, list[list[str]]] = {}
    for job in jobs:
        by.setdefault(tuple(o for o in job if not o.startswith("method=")), []).append(job)
    chosen = random.Random(41).sample(sorted(by), n)
    return [job for cell in chosen for job in by[cell]]


@pytest.fixture(scope="module")
def both() -> pd.DataFrame:
    """Each sampled configuration's throughput by the full model and by the fast path."""
    cfgs = config.load_all(_cells(CELLS), simulate=True)
    given = inputs(cfgs)
    full = pd.DataFrame([{
        "model": c.model.name, "method": c.method.name, "compute": comp.source,
        "network": c.network.name, "nodes": c.cluster.nodes,
        "workers_per_node": c.cluster.workers_per_node,
        "full": predict(c, comp, given.networks[network_key(c)]).throughput}
        for c, comp in zip(cfgs, given.computes)])
    groups = [fastsweep.Group(c, np.array([c.cluster.nodes]),
                              np.array([c.cluster.workers_per_node])) for c in cfgs]
    fast = fastsweep.predict_groups(groups)[[*KEY, "throughput"]].rename(
        columns={"throughput": "fast"})
    out = full.merge(fast, on=KEY)
    assert len(out) == len(cfgs) == CELLS * len(config.choices("method"))
    out["error"] = out.fast / out.full - 1
    return out


def test_the_fast_path_is_the_full_model_but_for_bytescheduler(both) -> None:
    exact = both[~both.method.isin(["bytescheduler_a2a", "priority_ps"])]
    worst = exact.loc[exact.error.abs().idxmax()]
    assert abs(worst.error) <= EXACT, worst.to_dict()


def test_bytescheduler_is_bounded_within_the_stated_tolerance(both) -> None:
    for method in ("bytescheduler_a2a", "priority_ps"):
        errors = both[both.method == method].error.abs()
        assert errors.median() <= PRIORITY_MEDIAN, (method, errors.describe())
        assert errors.quantile(0.9) <= PRIORITY_P90, (method, errors.describe())


def test_the_fast_path_picks_the_full_models_best_method_in_most_cells(both) -> None:
    """A cell agrees where the fast path's pick is, by the full model, within 1% of the
    full model's best (ties: on one GPU every method is the compute alone)."""
    cell = [k for k in KEY if k != "method"]
    agree = []
    for _, rows in both.groupby(cell):
        pick = rows.loc[rows.fast.idxmax()]
        agree.append(pick.full >= 0.99 * rows.full.max())
    assert np.mean(agree) >= BEST_AGREES, f"{np.mean(agree):.2f} of {len(agree)} cells"


def test_a_big_sweep_takes_the_fast_path_without_torch(tmp_path) -> None:
    """More than FAST_FROM configurations: the fast path, one shard with a row each, the
    best method per cell beside it, and no torch imported once the models' counted work
    is in the cache (a run with an empty cache counts it with torch, once)."""
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    args = ["experiment=whatif", "model=resnet50,bert_base"]
    first = subprocess.run([sys.executable, "-m", "harness.simulate", *args,
                            f"results_dir={tmp_path / 'first'}"], cwd=REPO, env=env,
                           capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-2000:]
    out = subprocess.run([sys.executable, "-X", "importtime", "-m", "harness.simulate",
                          *args, f"results_dir={tmp_path / 'run'}"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert not [line for line in out.stderr.splitlines()
                if re.search(r"\b(torch|torchvision|transformers)\b", line)]
    frame = results.load(tmp_path / "run")
    n = 2 * 9 * 10 * 6 * 68
    assert n > fastsweep.FAST_FROM and len(frame) == n
    assert f"simulated {n} configurations (fast path)" in out.stdout
    assert set(frame.source) == {"simulated"} and frame.world_size.max() == 1024
    best = pd.read_csv(next((tmp_path / "run").glob("sim-*_best.csv")))
    assert len(best) == len(frame.groupby(["model", "device", "network", "world_size"]))
    assert {"runner_up", "margin_pct", "calibrated"} <= set(best.columns)


def test_a_bad_shape_in_a_big_sweep_is_refused_naming_it() -> None:
    jobs = [[*job, "cluster.nodes=0"] if i == 5 else job
            for i, job in enumerate(config.sweep(["experiment=whatif", "model=resnet50"]))]
    with pytest.raises(config.ConfigError, match="cluster.nodes=0 is not a count"):
        fastsweep.load(jobs)
