"""Tests of the paper-style report: numbers, bars, labels, tables, missing data, errors."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from matplotlib.container import BarContainer

from harness.measure import results
from harness.report import __main__ as command
from harness.report import data, figures, style
from tests.conftest import STUDY as STUDY_CSV

REPO = Path(__file__).resolve().parents[1]

METHODS = ["bsp_a2a", "wfbp_a2a", "mgwfbp", "ddp"]
SIZES = [2, 4, 8]
# Per-method scaling efficiency of the synthetic data: distinct, so the best method is known.
EFF = {"bsp_a2a": 0.6, "wfbp_a2a": 0.8, "mgwfbp": 0.9, "ddp": 0.7}


def row(method: str, ws: int, repeat: int, throughput: float | None, **extra) -> dict:
    """One result row of the synthetic study (model 'toy'); `extra` overrides columns."""
    base = {
        "run_id": f"{extra.get('model', 'toy')}-{method}-{ws}-{extra.get('source', 'm')}",
        "model": "toy",
        "method": method,
        "network": "loopback",
        "world_size": ws,
        "repeat": repeat,
        "local_batch_size": 16,
        "source": "measured",
        "model_intensity": 123.0,
        "throughput": throughput,
        "status": "ok" if throughput is not None else "failed",
        "forward_s": 0.1,
        "backward_s": 0.2,
        "comm_s": 0.05 * ws,
        "update_s": 0.01,
    }
    return {**base, **extra}


def study_rows(base: float = 10.0, repeats: int = 3, skip=(), fail=()) -> list[dict]:
    """A 1-worker baseline plus every METHOD at every SIZE, jittered per repeat.

    `skip` cells (method, ws) are never run; `fail` cells have one failed repeat only.
    """
    rows = [row("single", 1, r, base + r - 1) for r in range(repeats)]
    for method in METHODS:
        for ws in SIZES:
            if (method, ws) in skip:
                continue
            if (method, ws) in fail:
                rows.append(row(method, ws, 0, None, error=f"RuntimeError: rank 1 died at {ws}"))
                continue
            rows += [
                row(method, ws, r, base * ws * EFF[method] * (1 + 0.01 * r)) for r in range(repeats)
            ]
    return rows


def write(directory: Path, rows: list[dict]) -> Path:
    """One shard per row, as the runner writes them."""
    for r in rows:
        assert results.write_shard(results.shard_path(directory, r["run_id"], r["repeat"]), [r])
    return directory


def expected(rows: list[dict], method: str, ws: int) -> tuple[float, float, float]:
    """(mean, std, speedup) of a cell computed straight from the rows."""
    values = [
        r["throughput"]
        for r in rows
        if (r["method"], r["world_size"]) == (method, ws) and r["status"] == "ok"
    ]
    base = np.mean([r["throughput"] for r in rows if r["world_size"] == 1])
    return float(np.mean(values)), float(np.std(values, ddof=1)), float(np.mean(values) / base)


def cells_of(rows: list[dict], tmp_path: Path) -> pd.DataFrame:
    frame, _, _ = data.load_results(write(tmp_path / "results", rows))
    return data.aggregate(frame)


def bars(fig) -> dict[str, list]:
    """Bar patches per method container of the first axes."""
    ax = fig.axes[0]
    return {c.get_label(): list(c.patches) for c in ax.containers if isinstance(c, BarContainer)}


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "harness.report", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_method_order_is_the_studys_then_ddp_then_alphabetical():
    names = ["zeta", "ddp", "mgwfbp", "alpha", "bsp_ps", "bytescheduler_a2a", "bsp_a2a"]
    assert style.method_order(names) == [
        "bsp_ps",
        "bsp_a2a",
        "mgwfbp",
        "bytescheduler_a2a",
        "ddp",
        "alpha",
        "zeta",
    ]
    assert style.method_color("bsp_ps") != style.method_color("bsp_a2a")
    # a method on another engine: right after it, in its color, hatched
    assert style.method_order(["mgwfbp@horovod", "zeta", "bsp_a2a@horovod", "mgwfbp"]) == [
        "bsp_a2a@horovod", "mgwfbp", "mgwfbp@horovod", "zeta"]
    assert style.method_color("mgwfbp@horovod") == style.method_color("mgwfbp")
    assert style.method_hatch("mgwfbp@horovod") and not style.method_hatch("mgwfbp")


def test_aggregate_mean_std_and_speedup_over_the_measured_baseline(tmp_path):
    rows = study_rows()
    cells = cells_of(rows, tmp_path).set_index(["method", "world_size"])
    for method in METHODS:
        for ws in SIZES:
            mean, std, speedup = expected(rows, method, ws)
            assert cells.loc[(method, ws), "mean"] == pytest.approx(mean)
            assert cells.loc[(method, ws), "std"] == pytest.approx(std)
            assert cells.loc[(method, ws), "speedup"] == pytest.approx(speedup)
            assert cells.loc[(method, ws), "efficiency"] == pytest.approx(speedup / ws)
            assert cells.loc[(method, ws), "repeats"] == 3


def test_a_method_on_another_engine_is_a_method_of_its_own(tmp_path):
    native = study_rows()
    horovod = [row("wfbp_a2a", 2, r, 5.0 + r, engine="horovod", run_id="toy-wfbp_a2a-2-hvd")
               for r in range(3)]
    cells = cells_of(native + horovod, tmp_path).set_index(["method", "world_size"])
    assert cells.loc[("wfbp_a2a@horovod", 2), "mean"] == pytest.approx(6.0)
    assert cells.loc[("wfbp_a2a", 2), "mean"] == pytest.approx(expected(native, "wfbp_a2a", 2)[0])


def test_runs_of_different_configurations_are_series_of_their_own(tmp_path, capsys):
    scatter = json.dumps({"method": {"name": "wfbp_a2a", "transport": {"node_reduce": "scatter"}},
                          "model": {"name": "toy"}, "network": {"name": "loopback"}})
    root = scatter.replace('"scatter"', '"root"')
    rows = [row("single", 1, 0, 10.0, config_json=scatter)]
    rows += [row("wfbp_a2a", 2, r, 15.0 + r, config_json=text, run_id=f"w{r}")
             for r, text in enumerate([scatter, scatter, root])]
    rows += [row("wfbp_a2a", 4, r, 25.0 + r, config_json=scatter, run_id=f"s{r}",
                 sync_each_step="device" if r == 1 else "false") for r in range(2)]
    rows += [row("mgwfbp", 2, r, 16.0, config_json=scatter, run_id=f"m{r}") for r in range(2)]
    cells = cells_of(rows, tmp_path).set_index(["method", "world_size"])["mean"].to_dict()
    # never averaged: each configuration of wfbp_a2a a series (a bar, a legend entry) of its
    # own, named by what tells it from the others; mgwfbp ran one and keeps its name
    assert cells == pytest.approx({
        ("single", 1): 10.0, ("mgwfbp", 2): 16.0,
        ("wfbp_a2a [transport.node_reduce=scatter, sync_each_step=false]", 2): 15.5,
        ("wfbp_a2a [transport.node_reduce=root, sync_each_step=false]", 2): 17.0,
        ("wfbp_a2a [transport.node_reduce=scatter, sync_each_step=false]", 4): 25.0,
        ("wfbp_a2a [transport.node_reduce=scatter, sync_each_step=device]", 4): 26.0})
    assert command.main([f"results_dir={tmp_path / 'results'}",
                         f"out_dir={tmp_path / 'plots'}"]) == 0
    assert "averages" not in capsys.readouterr().err
    summary = (tmp_path / "plots" / "summary.md").read_text()
    assert "wfbp_a2a [transport.node_reduce=root, sync_each_step=false]" in summary


def test_sources_and_networks_are_kept_apart_with_their_own_baseline(tmp_path):
    measured = study_rows(base=10.0)
    simulated = [
        {**r, "source": "simulated", "run_id": r["run_id"] + "-sim"} for r in study_rows(base=40.0)
    ]
    # A second network with no 1-worker run of its own falls back to the same source's.
    slow = [
        {**r, "network": "tbf1g", "run_id": r["run_id"] + "-1g"}
        for r in study_rows(base=5.0)
        if r["world_size"] > 1
    ]
    cells = cells_of(measured + simulated + slow, tmp_path)
    assert set(cells["source"]) == {"measured", "simulated"}
    assert len(cells) == 3 * len(METHODS) * len(SIZES) + 2
    base = cells.groupby(["source", "network"])["baseline"].unique()
    assert list(base[("measured", "loopback")]) == pytest.approx([10.0])
    assert list(base[("simulated", "loopback")]) == pytest.approx([40.0])
    assert list(base[("measured", "tbf1g")]) == pytest.approx([10.0])


def best_labels(rows: list[dict], absent: set) -> list[str]:
    """The "Nx" label each size should carry: the best speedup among cells with data."""
    return sorted(
        f"{max(expected(rows, m, ws)[2] for m in METHODS if (m, ws) not in absent):.1f}x"
        for ws in SIZES
    )


def test_bars_labels_and_missing_cells_in_the_figure(tmp_path):
    absent = {("wfbp_a2a", 4), ("ddp", 8)}
    rows = study_rows(skip={("wfbp_a2a", 4)}, fail={("ddp", 8)})
    frame, _, _ = data.load_results(write(tmp_path / "results", rows))
    cells = data.aggregate(frame)
    missing = data.missing_cells(frame, cells)
    fig = figures.plot_throughput(cells, sizes=SIZES, notes=figures._notes(missing, cells))
    got = bars(fig)
    assert {m: len(p) for m, p in got.items()} == {
        "bsp_a2a": 3,
        "wfbp_a2a": 2,
        "mgwfbp": 3,
        "ddp": 2,
    }
    assert all(p.get_height() > 0 for patches in got.values() for p in patches)
    assert sorted(t.get_text() for t in fig.axes[0].texts) == best_labels(rows, absent)
    note = fig.get_supxlabel()
    assert "wfbp_a2a @ 4 workers: not run" in note
    assert "ddp @ 8 workers: failed: RuntimeError: rank 1 died at 8" in note
    assert "toy: local batch size 16, model intensity 123" in fig.get_suptitle()


def test_bar_heights_errors_and_ideal_marks_follow_the_data(tmp_path):
    rows = study_rows()
    cells = cells_of(rows, tmp_path)
    fig = figures.plot_throughput(cells)
    for method, patches in bars(fig).items():
        heights = [p.get_height() for p in sorted(patches, key=lambda p: p.get_x())]
        assert heights == pytest.approx([expected(rows, method, ws)[0] for ws in SIZES])
    ideal = [seg[0][1] for seg in fig.axes[0].collections[-1].get_segments()]
    assert sorted(ideal) == pytest.approx([10.0 * ws for ws in SIZES])


def test_efficiency_and_breakdown_plots(tmp_path):
    rows = study_rows()
    cells = cells_of(rows, tmp_path)
    lines = {ln.get_label(): ln for ln in figures.plot_efficiency(cells).axes[0].get_lines()}
    mg = lines["mgwfbp"]  # on the common x of all sizes; NaN (a gap) where it did not run
    assert list(mg.get_xdata()) == [1, *SIZES] and np.isnan(mg.get_ydata()[0])
    assert list(mg.get_ydata()[1:]) == pytest.approx(
        [expected(rows, "mgwfbp", ws)[2] / ws for ws in SIZES]
    )
    fig = figures.plot_breakdown(cells)
    panels = {ax.get_title(): ax for ax in fig.axes if ax.get_visible()}
    assert list(panels) == style.method_order([*METHODS, "single"])
    patches = panels["mgwfbp"].patches  # 4 stacked phases per size it ran at, none at 1
    assert len(patches) == 4 * len(SIZES) and len(panels["single"].patches) == 4
    tops: dict[float, float] = {}
    for p in patches:
        tops[p.get_x()] = max(tops.get(p.get_x(), 0.0), p.get_y() + p.get_height())
    assert [tops[x] for x in sorted(tops)] == pytest.approx(
        [0.1 + 0.2 + 0.05 * ws + 0.01 for ws in SIZES]
    )
    assert figures.plot_breakdown(cells.assign(**{c: np.nan for c in data.PHASES})) is None


def parse_mean_std(text: str) -> tuple[float, float]:
    mean, std = text.split(" ± ")
    return float(mean), float(std)


def test_cli_report_tables_and_missing_section(tmp_path, capsys):
    absent = {("mgwfbp", 2), ("bsp_a2a", 8)}
    rows = study_rows(skip={("mgwfbp", 2)}, fail={("bsp_a2a", 8)})
    src = write(tmp_path / "results", rows)
    (src / "broken.parquet").write_bytes(b"not parquet")
    out = tmp_path / "plots"
    assert command.main([f"results_dir={src}", f"out_dir={out}"]) == 0
    for kind in ("fig", "efficiency", "breakdown"):
        assert (out / f"{kind}_toy.png").stat().st_size > 0 and (out / f"{kind}_toy.pdf").exists()
    summary = pd.read_csv(out / "summary.csv").set_index("method")
    mean, std = parse_mean_std(summary.loc["wfbp_a2a", "4 GPUs"])
    want = expected(rows, "wfbp_a2a", 4)
    assert mean == pytest.approx(want[0], abs=0.05) and std == pytest.approx(want[1], abs=0.05)
    assert pd.isna(summary.loc["mgwfbp", "2 GPUs"])
    best = pd.read_csv(out / "best.csv").set_index("gpus")
    for ws in SIZES:
        speedups = {m: expected(rows, m, ws)[2] for m in METHODS if (m, ws) not in absent}
        assert best.loc[ws, "best_method"] == max(speedups, key=speedups.get)
        assert best.loc[ws, "speedup"] == pytest.approx(max(speedups.values()))
    md = (out / "summary.md").read_text()
    missing = md.split("## Missing")[1]
    assert "broken.parquet" in missing and "| mgwfbp | 2 | not run |" in missing
    assert "RuntimeError: rank 1 died at 8" in missing
    assert all(label in md for label in best_labels(rows, absent))
    err = capsys.readouterr().err
    assert "wrote" in err and "fig_toy.png" in err and "broken.parquet" in err


def test_reference_panel_and_ratios(tmp_path):
    rows = study_rows()
    ref = pd.DataFrame(
        [
            {
                "model": "toy",
                "local_batch_size": 16,
                "network": "ib",
                "method": m,
                "gpus": ws,
                "throughput_mean": 100.0 * ws,
                "throughput_std": 1.0,
                "single_gpu_throughput": 50.0,
            }
            for m in METHODS[:2]
            for ws in (4, 8)
        ]
    )
    ref.to_csv(tmp_path / "ref.csv", index=False)
    src, out = write(tmp_path / "results", rows), tmp_path / "plots"
    assert (
        command.main([f"results_dir={src}", f"out_dir={out}", f"reference={tmp_path / 'ref.csv'}"])
        == 0
    )
    ratios = pd.read_csv(out / "ratios.csv").set_index(["method", "gpus"])
    assert len(ratios) == 4
    mean, speedup = expected(rows, "wfbp_a2a", 8)[::2]
    assert ratios.loc[("wfbp_a2a", 8), "throughput_ratio"] == pytest.approx(mean / 800.0)
    assert ratios.loc[("wfbp_a2a", 8), "speedup_ratio"] == pytest.approx(speedup / 16.0)
    frame, _, _ = data.load_results(src)
    published = data.reference_cells(data.read_reference(tmp_path / "ref.csv"))
    fig = figures.plot_throughput(data.aggregate(frame), reference=published)
    assert len(fig.axes) == 2
    published_bars = [c for c in fig.axes[1].containers if isinstance(c, BarContainer)]
    assert sorted(len(c) for c in published_bars) == [2, 2]
    assert sorted(t.get_text() for t in fig.axes[1].texts) == ["16.0x", "8.0x"]


@pytest.mark.parametrize(
    "content, problem",
    [
        ("model,method\nx,y\n", "lacks columns"),
        ("{header}\ntoy,16,ib,mgwfbp,4,fast,1.0,5.0\n", "non-numeric value 'fast'"),
        (None, "not found"),
        (b"\x89PNG\x00\xff\xfe garbage", "reference file"),
    ],
)
def test_malformed_reference_exits_2_with_one_line(tmp_path, content, problem):
    path = tmp_path / "ref.csv"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content.format(header=",".join(data.REF_COLUMNS)))
    proc = run_cli(f"results_dir={tmp_path}", f"out_dir={tmp_path / 'o'}", f"reference={path}")
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("ddlbench: error: reference file") and problem in proc.stderr


@pytest.mark.parametrize(
    "args, problem",
    [
        (["results_dir={tmp}/empty"], "no result rows"),
        (["results_dir={tmp}/absent"], "does not exist"),
        (["results_dir={tmp}/bad"], "could be read"),
        (["colour=red"], "unknown argument 'colour=red'"),
    ],
)
def test_no_data_or_bad_arguments_exit_2_with_one_line(tmp_path, args, problem):
    (tmp_path / "empty").mkdir()
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "x.parquet").write_text("junk")
    proc = run_cli(*(a.format(tmp=tmp_path) for a in args), f"out_dir={tmp_path / 'o'}")
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
    assert problem in proc.stderr
    assert not (tmp_path / "o").exists()


def test_reference_alone_reproduces_the_studys_headline_speedups(tmp_path):
    out = tmp_path / "plots"  # the study's numbers by their short name
    proc = run_cli(f"results_dir={tmp_path / 'none'}", f"out_dir={out}", "reference=study")
    assert proc.returncode == 0, proc.stderr
    md = (out / "summary.md").read_text()
    best = md.split("## Best method")[1].split("##")[0]
    table = [
        [c.strip() for c in line.strip().strip("|").split("|")]
        for line in best.splitlines()
        if line.startswith("| ")
    ]
    head = table[0]
    cells = {
        (r[head.index("model")], r[head.index("gpus")]): r[head.index("speedup")] for r in table[1:]
    }
    assert cells[("resnet50", "32")] == "31.6x"
    assert cells[("bert_base", "32")] == "23.2x"
    assert cells[("bert_large", "4")] == "1.2x"
    assert {p.name for p in out.glob("fig_*.png")} == {
        "fig_resnet50.png",
        "fig_bert_base.png",
        "fig_bert_large.png",
    }
    published = data.reference_cells(data.read_reference(STUDY_CSV))
    fig = figures.plot_throughput(published[published["model"] == "resnet50"])
    labels = [t.get_text() for t in fig.axes[0].texts]
    assert labels[-1] == "31.6x" and len(labels) == 4  # one per GPU count, 32 last
    assert {len(c) for c in fig.axes[0].containers if isinstance(c, BarContainer)} == {4}


def test_two_thousand_shards_report_quickly(tmp_path):
    methods = style.METHOD_ORDER[:8]  # 8 methods x 5 sizes x 50 repeats
    rows = [
        row(m, ws, r, 10.0 * ws * (1 - 0.01 * i) + r, run_id=f"{m}-{ws}-{r}")
        for i, m in enumerate(methods)
        for ws in (1, 2, 4, 8, 16)
        for r in range(50)
    ]
    assert len(rows) == 2000
    src = write(tmp_path / "results", rows)
    start = time.perf_counter()
    assert command.main([f"results_dir={src}", f"out_dir={tmp_path / 'plots'}"]) == 0
    assert time.perf_counter() - start < 60
    best = pd.read_csv(tmp_path / "plots" / "best.csv")
    assert list(best["best_method"]) == ["bsp_ps"] * 4


def test_a_parquet_of_other_columns_is_listed_as_unreadable(tmp_path, capsys):
    src = write(tmp_path / "results", study_rows(repeats=1))
    pd.DataFrame({"kind": ["p2p"], "seconds": [1.0]}).to_parquet(src / "other.parquet")
    frame, bad, n = data.load_results(src)
    assert [p.name for p, _ in bad] == ["other.parquet"] and frame["model"].notna().all()
    out = tmp_path / "plots"
    assert command.main([f"results_dir={src}", f"out_dir={out}"]) == 0
    assert "ddlbench: warning: skipped unreadable shard" in capsys.readouterr().err
    assert "other.parquet" in (out / "summary.md").read_text()


def test_an_out_dir_that_is_a_file_exits_2_before_reading(tmp_path, capsys):
    (tmp_path / "plots").write_text("a file")
    assert command.main([f"results_dir={tmp_path}", f"out_dir={tmp_path / 'plots'}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ddlbench: error: out_dir=") and len(err.strip().splitlines()) == 1
