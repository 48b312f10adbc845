"""The UCX wire itself (methods/ps/ucx.py), between real processes: messages matched by
(peer, tag) whatever order they are posted and sent in, every dtype the PS family sends,
empty messages, a wait past its timeout naming the peer as a peer's timeout, a dead peer
named as a closed connection, the transports UCX picked, and `close` (its progress thread
gone); a waiter sleeps until its message arrives and wakes at once."""

from __future__ import annotations

import datetime as dt
import importlib.util
import json
import os
import threading
import time
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torch.distributed import TCPStore

from harness import config
from harness.config import ConfigError
from harness.launch import failure
from harness.measure import provenance, results
from methods.ps import ucx, wire
from tests.conftest import run_module
from tests.test_methods import _free_port, _spawn

TIMEOUT_S = 60


def _rank(rank: int, _world: int, port: int, out: str) -> None:
    """Ranks 0 and 2 send to rank 1 on the same tags; rank 1 receives them from 2 first,
    in the other order of tags; then rank 1 waits for a message nobody sends, and for one
    from rank 2 after rank 2 died."""
    store = TCPStore("127.0.0.1", port, 3, rank == 0, timeout=dt.timedelta(seconds=TIMEOUT_S))
    wire.start("ucx", store=store, rank=rank, timeout_s=TIMEOUT_S)
    said: dict = {}
    if rank in (0, 2):
        sends = [wire.isend(torch.full((5,), float(rank + 1)), 1, tag=7),
                 wire.isend(torch.arange(3, dtype=torch.bfloat16) + rank, 1, tag=9),
                 wire.isend(torch.empty(0, dtype=torch.int64), 1, tag=11),
                 wire.isend(torch.tensor(rank + 0.5, dtype=torch.float64), 1, tag=12)]
        for work in sends:
            work.wait()
        said["transports"] = wire.describe()
        store.set(f"sent{rank}", "1")
        if rank == 2:  # gone without a word once rank 1 has an endpoint to it
            wire.recv(torch.empty(1), 1, tag=15)
            Path(out + ".2").write_text(json.dumps(said))
            os._exit(0)
    else:
        said.update(_receive(store))
    store.set(f"done{rank}", "1")
    if rank == 0:
        store.wait(["done1"])
    wire.close()
    said["after_close"] = wire.current().name
    said["threads_after_close"] = [t.name for t in threading.enumerate()
                                   if t.name == "ucx-progress"]
    Path(f"{out}.{rank}").write_text(json.dumps(said))


def _receive(store: TCPStore) -> dict:
    """Rank 1's part of `_rank`."""
    got = {(peer, tag): torch.empty(shape, dtype=dtype) for peer in (2, 0)
           for tag, shape, dtype in ((12, (), torch.float64), (9, (3,), torch.bfloat16),
                                     (7, (5,), torch.float32), (11, (0,), torch.int64))}
    works = [wire.irecv(t, peer, tag=tag) for (peer, tag), t in got.items()]
    for work in works:
        work.wait()
    said = {f"{peer}/{tag}": t.float().tolist() for (peer, tag), t in got.items()}
    started = time.monotonic()
    try:
        wire.irecv(torch.empty(1), 0, tag=13).wait(dt.timedelta(seconds=1))  # never sent
    except RuntimeError as exc:
        said["timeout"] = {"error": str(exc), "symptom": failure.symptom(exc),
                           "seconds": time.monotonic() - started}
    wire.send(torch.ones(1), 2, tag=15)  # rank 2 leaves once it has this
    started = time.monotonic()
    try:
        wire.irecv(torch.empty(1), 2, tag=17).wait(TIMEOUT_S)
    except RuntimeError as exc:
        said["dead"] = {"error": str(exc), "symptom": failure.symptom(exc),
                        "seconds": time.monotonic() - started}
    return said


@pytest.fixture(scope="module")
def ucx_ranks(tmp_path_factory) -> dict[int, dict]:
    assert ucx.available(), "ucxx is not installed: pip install -e '.[ucx]'"
    out = str(tmp_path_factory.mktemp("ucx") / "said")
    assert _spawn(_rank, 3, _free_port(), out, timeout_s=2 * TIMEOUT_S) == [0, 0, 0]
    return {r: json.loads(Path(f"{out}.{r}").read_text()) for r in range(3)}


def test_messages_match_by_peer_and_tag_in_any_order(ucx_ranks) -> None:
    got = ucx_ranks[1]
    for peer in (0, 2):
        assert got[f"{peer}/7"] == [peer + 1.0] * 5
        assert got[f"{peer}/9"] == [peer + 0.0, peer + 1.0, peer + 2.0]
        assert got[f"{peer}/11"] == []
        assert got[f"{peer}/12"] == peer + 0.5  # a 0-dim tensor


def test_a_wait_past_its_timeout_names_the_peer_as_a_timeout(ucx_ranks) -> None:
    said = ucx_ranks[1]["timeout"]
    assert "rank 0" in said["error"] and "timed out" in said["error"], said
    assert said["symptom"] == "timeout"


def test_a_dead_peer_is_named_before_the_timeout(ucx_ranks) -> None:
    said = ucx_ranks[1]["dead"]
    assert "rank 2" in said["error"], said
    assert said["symptom"] in ("closed", "timeout"), said
    assert said["seconds"] < TIMEOUT_S, said


def test_transports_are_recorded_and_close_returns_to_gloo(ucx_ranks) -> None:
    columns = ucx_ranks[0]["transports"]
    assert columns["ps_wire"] == "ucx"
    assert columns["ps_wire_transports"], columns  # e.g. "tcp/lo" or "posix/memory,..."
    assert ucx_ranks[0]["after_close"] == ucx_ranks[1]["after_close"] == "gloo"
    assert ucx_ranks[0]["threads_after_close"] == ucx_ranks[1]["threads_after_close"] == []


LATE_S = 0.3  # how late the message of the waking test is sent


def test_a_waiter_sleeps_until_its_message_arrives_and_wakes_at_once() -> None:
    """A receive whose message is sent LATE_S after the wait began returns within a small
    margin of it, and the waiting thread spent (almost) no CPU meanwhile: it blocked until
    the progress thread woke it, instead of looking at its request again and again (two
    UCX workers of one process, over the loopback)."""
    store = TCPStore("127.0.0.1", _free_port(), 1, True, timeout=dt.timedelta(seconds=30))
    ends = [ucx.Ucx(store, rank=rank, timeout_s=TIMEOUT_S) for rank in (0, 1)]
    try:
        for end in ends:
            end.publish()
        ends[0].isend(torch.zeros(1), 1, 5).wait()  # the endpoint is up before timing
        ends[1].irecv(torch.empty(1), 0, 5).wait()
        got = torch.empty(1 << 16)

        def late() -> None:
            time.sleep(LATE_S)
            ends[0].isend(torch.full((1 << 16,), 3.0), 1, 6).wait()

        sender = threading.Thread(target=late)
        handle = ends[1].irecv(got, 0, 6)
        sender.start()
        started, cpu = time.monotonic(), time.thread_time()
        handle.wait(10)
        waited, cpu = time.monotonic() - started, time.thread_time() - cpu
        sender.join()
    finally:
        for end in ends:
            end.close()
    assert bool((got == 3.0).all())
    assert LATE_S - 0.02 <= waited < LATE_S + 0.1, waited
    assert cpu < 1e-3, f"the waiting thread used {cpu * 1e3:.2f} ms of CPU in {waited:.2f} s"


def test_tags_must_fit() -> None:
    assert ucx.ucx_tag(3, 17) == (3 << 32) | 17
    with pytest.raises(ValueError, match="does not fit"):
        ucx.ucx_tag(0, 1 << 32)


def test_ucx_without_ucxx_is_refused_naming_the_extra(monkeypatch) -> None:
    """cluster.ps_wire=ucx where ucxx is not installed: one line naming the fix, before
    any rank starts (this environment has it: its absence is made for this check alone)."""
    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "ucxx" else found(name, *a))
    with pytest.raises(ConfigError, match=r"pip install -e '\.\[ucx\]'"):
        config.load(["method=bsp_ps", "cluster.ps_wire=ucx"])  # load validates
    assert config.load(["method=bsp_ps"]).cluster.ps_wire == "gloo"  # gloo needs nothing


def test_microbench_times_the_ucx_wire(tmp_path: Path) -> None:
    """harness.microbench's `wire` kind goes over cluster.ps_wire, its rows name the wire and
    the transports UCX picked, and its fit costs something per message and per byte."""
    out = run_module("harness.microbench", "cluster.workers_per_node=2", "cluster.ps_wire=ucx",
                     "microbench.min_bytes=4096", "microbench.max_bytes=1048576",
                     "microbench.repeats=3", f"results_dir={tmp_path}")
    assert out.returncode == 0, out.stdout + out.stderr
    frame = pd.read_parquet(next((tmp_path / "microbench").glob("*.parquet")))
    wire_rows = frame[frame.kind == "wire"]
    assert len(wire_rows) == 5 and set(wire_rows.ranks) == {"0-1"}
    assert set(frame.ps_wire) == {"ucx"} and frame.ps_wire_transports.iloc[0]
    assert wire_rows.alpha_s.iloc[0] > 0 and wire_rows.seconds.min() > 0
    assert "wire: alpha=" in out.stdout


def test_rows_say_their_wire_and_older_shards_load_as_gloo(tmp_path: Path) -> None:
    cfg = config.load(["model=bert_tiny", "method=bsp_ps", "cluster.ps_wire=ucx"])
    row = {**provenance.identity(cfg, run_id="new", repeat=0), "status": "ok", "throughput": 1.0}
    assert row["ps_wire"] == "ucx"
    assert results.write_shard(results.shard_path(tmp_path, "new", 0), [row])
    old = {k: v for k, v in row.items() if k not in results.WIRE} | {"run_id": "old"}
    before = pa.schema([f for f in results.SCHEMA if f.name not in results.WIRE])
    pq.write_table(pa.Table.from_pylist([old], schema=before),
                   results.shard_path(tmp_path, "old", 0))
    frame = results.load(tmp_path).set_index("run_id")
    assert frame.ps_wire.to_dict() == {"new": "ucx", "old": "gloo"}
