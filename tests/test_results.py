"""Result shards: written once, never overwritten, merged by `load`."""

from __future__ import annotations

import pytest

from harness import results


def _row(run_id: str, repeat: int, throughput: float) -> dict:
    return {"run_id": run_id, "repeat": repeat, "model": "m", "method": "bsp_a2a",
            "world_size": 2, "throughput": throughput, "status": "ok",
            "iter_times_s": [0.1, 0.2], "rank_iter_times_s": [[0.1, 0.2], [0.1, 0.15]]}


def test_shards_are_never_overwritten(tmp_path) -> None:
    path = results.shard_path(tmp_path, "run", 0)
    assert results.write_shard(path, [_row("run", 0, 10.0)])
    assert not results.write_shard(path, [_row("run", 0, 99.0)])
    assert results.load(tmp_path).throughput.tolist() == [10.0]
    assert not list(tmp_path.glob(".*tmp")), "no temporary file may be left behind"


def test_load_merges_files_and_directories(tmp_path) -> None:
    for i in range(3):
        results.write_shard(results.shard_path(tmp_path / "a", "run", i), [_row("run", i, i)])
    results.write_shard(results.shard_path(tmp_path / "b", "x", 0), [_row("x", 0, 7.0)])
    frame = results.load([tmp_path / "a", results.shard_path(tmp_path / "b", "x", 0)])
    assert sorted(frame.throughput) == [0.0, 1.0, 2.0, 7.0]
    assert list(frame.columns) == results.COLUMNS
    assert list(frame.iter_times_s.iloc[0]) == [0.1, 0.2]


def test_unknown_columns_are_refused(tmp_path) -> None:
    with pytest.raises(KeyError, match="througput"):
        results.write_shard(tmp_path / "s.parquet", [{"througput": 1.0}])


def test_unreadable_shards_are_reported(tmp_path) -> None:
    results.write_shard(results.shard_path(tmp_path, "ok", 0), [_row("ok", 0, 1.0)])
    (tmp_path / "broken.parquet").write_text("not parquet")
    frame, bad = results.load_report(tmp_path)
    assert len(frame) == 1 and [p.name for p, _ in bad] == ["broken.parquet"]
    with pytest.raises(ValueError, match="broken.parquet"):
        results.load(tmp_path)
