"""Parameter servers that die bring the workers down in time, naming the server (the
run-level faults of servers are in tests/test_faults.py)."""

from __future__ import annotations

import datetime as dt
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

import methods
from harness import config
from harness.measure.verify import train
from tests.test_methods import BERT, _context, _free_port, _spawn

TIMEOUT_S = 20


def _dying_server_rank(rank: int, world: int, port: int, out: str) -> None:
    """Workers train bsp_ps; the server dies after its second aggregation round."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=dt.timedelta(seconds=TIMEOUT_S))
    ctx = _context(rank, world, workers=2, per_node=1)  # two nodes: one server
    if rank == 2:
        methods.serve(num_workers=2, on_round=lambda i: os._exit(3) if i == 1 else None)
        return
    cfg = config.load([*BERT, "method=bsp_ps", "cluster.nodes=2", "verify.steps=5",
                       f"run.timeout_s={TIMEOUT_S}"])
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
