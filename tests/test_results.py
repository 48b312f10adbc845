"""Result shards: written once, never overwritten, merged by `load`."""

from __future__ import annotations

import pandas as pd
import pytest

from harness.measure import results


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


def test_a_copied_shard_is_counted_once_with_a_warning(tmp_path, capsys) -> None:
    import shutil

    path = results.shard_path(tmp_path / "a", "run", 0)
    results.write_shard(path, [_row("run", 0, 10.0)])
    results.write_shard(results.shard_path(tmp_path / "a", "run", 1), [_row("run", 1, 12.0)])
    (tmp_path / "backup").mkdir()
    shutil.copy(path, tmp_path / "backup" / path.name)
    frame = results.load(tmp_path)
    assert sorted(frame.throughput) == [10.0, 12.0]
    assert "1 rows were read twice" in capsys.readouterr().err
    # rows of one simulated sweep share a run and repeat, but not their configuration
    rows = [{**_row("sim", 0, t), "config_json": f'{{"n": {t}}}'} for t in (1.0, 2.0)]
    results.write_shard(results.shard_path(tmp_path / "s", "sim", 0), rows)
    assert sorted(results.load(tmp_path / "s").throughput) == [1.0, 2.0]


def test_unknown_columns_are_refused(tmp_path) -> None:
    with pytest.raises(KeyError, match="througput"):
        results.write_shard(tmp_path / "s.parquet", [{"througput": 1.0}])


def test_unreadable_shards_are_reported_and_skipped(tmp_path, capsys) -> None:
    results.write_shard(results.shard_path(tmp_path, "ok", 0), [_row("ok", 0, 1.0)])
    (tmp_path / "broken.parquet").write_text("not parquet")
    pd.DataFrame({"kind": ["p2p"], "seconds": [1.0]}).to_parquet(tmp_path / "other.parquet")
    frame, bad = results.load_report(tmp_path)
    assert len(frame) == 1 and [p.name for p, _ in bad] == ["broken.parquet", "other.parquet"]
    assert "lacks columns run_id" in bad[1][1]
    assert all("\n" not in error for _, error in bad)
    capsys.readouterr()
    assert results.load(tmp_path).run_id.tolist() == ["ok"]
    warnings = capsys.readouterr().err.splitlines()
    assert len(warnings) == 2 and all(w.startswith("ddlbench: warning: ") for w in warnings)
    assert "broken.parquet" in warnings[0] and "other.parquet" in warnings[1]


def test_a_shard_with_other_column_types_is_reported(tmp_path) -> None:
    results.write_shard(results.shard_path(tmp_path, "ok", 0), [_row("ok", 0, 1.0)])
    row = {c: [None] for c in results.COLUMNS} | {"world_size": ["two"], "run_id": ["x"]}
    pd.DataFrame(row).to_parquet(tmp_path / "typed.parquet")
    frame, bad = results.load_report(tmp_path)
    assert frame.run_id.tolist() == ["ok"] and [p.name for p, _ in bad] == ["typed.parquet"]


def test_microbenchmarks_skip_unreadable_tables(tmp_path, capsys) -> None:
    pd.DataFrame({"network": ["loopback"], "kind": ["p2p"], "alpha_s": [1e-5],
                  "beta_s_per_byte": [1e-9]}).to_parquet(tmp_path / "a.parquet")
    (tmp_path / "b.parquet").write_text("junk")
    assert len(results.load_microbench(tmp_path)) == 1
    assert "b.parquet" in capsys.readouterr().err
