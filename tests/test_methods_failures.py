"""Parameter servers that die or hang bring the workers down in time, naming the server."""

from __future__ import annotations

import datetime as dt
import json
import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import methods
from harness import config, results
from harness.verify import train
from tests.conftest import TINY, live_processes, run_module
from tests.test_methods import BERT, _context, _free_port, _spawn

TIMEOUT_S = 20


def _dying_server_rank(rank: int, world: int, port: int, out: str) -> None:
    """Workers train bsp_ps; the server dies after its second aggregation round."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=dt.timedelta(seconds=TIMEOUT_S))
    ctx = _context(rank, world, workers=2)
    if rank == 2:
        methods.serve(num_workers=2, on_round=lambda i: os._exit(3) if i == 1 else None)
        return
    cfg = config.load([*BERT, "method=bsp_ps", "verify.steps=5", f"run.timeout_s={TIMEOUT_S}"])
    started = time.monotonic()
    try:
        train(cfg, ctx)
        error = None
    except RuntimeError as exc:
        error = str(exc)
    Path(f"{out}.{rank}").write_text(json.dumps({"error": error,
                                                 "seconds": time.monotonic() - started}))
    os._exit(0)  # the process group is broken: skip its clean-up


def test_workers_fail_in_time_naming_the_dead_server(tmp_path: Path) -> None:
    out = tmp_path / "worker"
    codes = _spawn(_dying_server_rank, 3, _free_port(), str(out), timeout_s=180)
    assert codes == [0, 0, 3], codes
    for rank in (0, 1):
        got = json.loads(Path(f"{out}.{rank}").read_text())
        assert got["error"] is not None, f"worker {rank} did not notice the dead server"
        assert "parameter server rank 2" in got["error"], got["error"]
        assert got["seconds"] < TIMEOUT_S + 30


@pytest.mark.parametrize("kind", ["hang"])
def test_run_fails_within_the_timeout_when_a_server_fails(kind: str, results_dir) -> None:
    started = time.monotonic()
    out = run_module("harness.run", *TINY, *BERT, "method=wfbp_ps",
                     "cluster.workers_per_node=2", f"results_dir={results_dir}",
                     "run.timeout_s=10", "run.fault.rank=2", "run.fault.at_iter=1",
                     f"run.fault.kind={kind}", timeout=240)
    elapsed = time.monotonic() - started
    assert out.returncode != 0
    assert elapsed < 10 + 60, f"took {elapsed:.0f}s"  # the timeout plus start-up on 2 cores
    frame = results.load(results_dir)
    assert frame.status.tolist() == ["failed"], frame
    error = frame.error.iloc[0]
    assert "rank 2" in error, error
    if kind == "hang":  # a worker timed out waiting for the server, and says which one
        assert "parameter server rank 2" in error, error
    for run_id in frame.run_id.unique():
        assert live_processes(run_id) == [], f"processes of run {run_id} were left behind"
