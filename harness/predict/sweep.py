"""A sweep's predictions as result rows (source=simulated), one shard per simulation,
so the report draws simulated figures with the same code as measured ones."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pandas as pd
from omegaconf import DictConfig

from harness.config.ranks import num_workers
from harness.measure import results
from harness.predict import profile
from harness.predict.model import Prediction, predict
from harness.predict.network import Network, network

# -- the sweep ---------------------------------------------------------------------------

def row(cfg: DictConfig, pred: Prediction, compute: profile.Compute, *, run_id: str) -> dict:
    """The result row of a prediction, with its own columns for calibration (iteration_s,
    hidden_s, messages, samples and one) beside those of results.COLUMNS."""
    from harness.measure.bench import identity

    return {
        **identity(cfg, run_id=run_id, repeat=0), "source": "simulated",
        "model_params": sum(compute.sizes), "model_tensors": len(compute.sizes),
        "throughput": pred.throughput, "timed_s": pred.iteration_s * cfg.run.timed_iters,
        "forward_s": compute.forward_s, "backward_s": sum(compute.backward_s),
        "comm_s": pred.exposed_s, "update_s": compute.update_s, "status": "ok",
        "device": compute.source, "plan_json": json.dumps({**pred.plan,
                                                           "bottleneck": pred.bottleneck}),
        "speedup": pred.speedup, "bottleneck": pred.bottleneck, "iteration_s": pred.iteration_s,
        "hidden_s": pred.hidden_s, "messages": pred.messages, "one": 1.0,
        "samples": num_workers(cfg) * cfg.model.local_batch_size,
    }


def predict_sweep(cfgs: list[DictConfig]) -> pd.DataFrame:
    """Predict every configuration: one row each (`row`)."""
    networks: dict[str, Network] = {}
    for cfg in cfgs:  # first, so a missing microbenchmark stops it before any profiling
        if cfg.network.name not in networks:
            networks[cfg.network.name] = network(cfg)
    profiles, run_id, rows = profile.ComputeProfiles(), f"sim-{uuid.uuid4().hex[:8]}", []
    for cfg in cfgs:
        compute = profiles(cfg)
        rows.append(row(cfg, predict(cfg, compute, networks[cfg.network.name]), compute,
                        run_id=run_id))
    return pd.DataFrame(rows)


def write(frame: pd.DataFrame, uncalibrated: pd.DataFrame, costs: dict, results_dir: str) -> Path:
    """Print a line per configuration and write them as one shard, each row's plan with
    its method's fitted costs and its uncalibrated throughput."""
    rows = []
    for i, (r, raw) in enumerate(zip(frame.to_dict("records"),
                                     uncalibrated.throughput), 1):
        plan = json.loads(r["plan_json"])
        if costs:
            plan.update(calibration=costs.get(r["method"], {}), uncalibrated_throughput=raw)
        rows.append({**{k: v for k, v in r.items() if k in results.COLUMNS},
                     "plan_json": json.dumps(plan)})
        print(f"[{i}/{len(frame)}] {r['model']} {r['method']} {r['nodes']}x"
              f"{r['workers_per_node']} on {r['network']}: {r['throughput']:.1f} samples/s, "
              f"speedup {r['speedup']:.2f}x, exposed comm {r['comm_s'] * 1e3:.1f} ms/iter "
              f"({r['bottleneck']})", flush=True)
    path = results.shard_path(results_dir, frame.run_id.iloc[0], 0)
    results.write_shard(path, rows)
    print(f"simulated {len(rows)} configurations -> {path}", flush=True)
    return path
