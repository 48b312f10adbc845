"""Measured 1-GPU throughputs that calibrate a GPU of the table (conf/gpu/): one number
each, read from `simulate.calibrate` (a folder of measured results, or a CSV).

A results folder's 1-GPU rows (world_size 1, status ok, measured) calibrate the GPU their
`device` names (harness.config.gpus.matching: "NVIDIA H100 80GB HBM3" is h100_sxm), for
the model as that row ran it (its build, batch and optimizer, from its config_json): its
efficiency is the counted work at the GPU's peaks over the measured iteration
(harness/predict/profile.py). A CSV names no device: its 1-GPU rows (gpus = 1)
calibrate the GPU of simulate.compute, for each model as the sweep configures it.
"""

from __future__ import annotations

import json
from pathlib import Path

from harness.config import gpus, tables
from harness.config.frozen import Config, freeze
from harness.measure import results

Rows = dict[tuple[str, str], tuple[Config, float]]  # (GPU, model) -> (model config, samples/s)


def one_gpu_rows(where: str, source: str, cfgs: list[Config]) -> Rows:
    """The 1-GPU rows of `source` per GPU of the table and model of the sweep `cfgs`
    (`where` names the setting in errors; a model's mean where it has several rows)."""
    models = {c.model.name: c.model for c in cfgs}
    found: dict[tuple[str, str], tuple[Config, list[float]]] = {}
    if Path(source).is_dir():
        runs = results.load(Path(source))
        runs = runs[(runs.status == "ok") & (runs.source == "measured") & (runs.world_size == 1)]
        for r in runs.itertuples():
            gpu = gpus.matching(str(r.device))
            if gpu is None or r.model not in models:
                continue
            model = freeze(json.loads(r.config_json)["model"]) if r.config_json else models[
                r.model]
            found.setdefault((gpu, r.model), (model, []))[1].append(float(r.throughput))
    else:
        table = tables.read_csv(source) if Path(source).exists() else None
        if table is not None and {"gpus", "model", "throughput_mean"} <= set(table):
            compute = cfgs[0].simulate.compute
            for r in table[table.gpus == 1].itertuples():
                if r.model in models and compute in gpus.table():
                    found.setdefault((compute, r.model), (models[r.model], []))[1].append(
                        float(r.throughput_mean))
    return {k: (model, sum(t) / len(t)) for k, (model, t) in found.items()}


def describe(rows: Rows) -> str:
    """One line: what the measured 1-GPU rows calibrate."""
    return "1-GPU rows calibrate: " + ", ".join(
        f"{gpu} on {model} ({t:.1f} samples/s)" for (gpu, model), (_, t) in sorted(rows.items()))
