"""Timelines: run.trace's measured trace, simulate.trace's predicted one, the report's figure."""

from __future__ import annotations

import json
import re
import shutil

import pytest

from harness.measure import results, traces
from harness.report.timeline import counterpart, draw_timeline, figure, one_axis
from tests.conftest import TINY, run_module


def _trace_files(results_dir):
    return sorted((results_dir / traces.FOLDER).glob("*.trace.json"))


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """A traced 2-worker run, and the prediction of the same configuration beside it."""
    results_dir = tmp_path_factory.mktemp("timeline")
    common = ["model=bert_tiny", "method=wfbp_a2a", "cluster.workers_per_node=2",
              f"results_dir={results_dir}"]
    out = run_module("harness.run", *TINY, *common, "run.trace=true")
    assert out.returncode == 0, out.stderr
    # the link's fit and the profile only feed the prediction's shape: small ones will do
    assert run_module("harness.microbench", *common, "microbench.max_bytes=262144").returncode == 0
    assert run_module("harness.simulate", *common, "simulate.trace=true",
                      "simulate.profile_iters=2").returncode == 0
    return results_dir, out


def _in_traced(tl: traces.Timeline, lane: str) -> list[traces.Bar]:
    return [b for b in tl.bars if b.lane == lane and 0 <= b.start_s <= tl.length_s]


def test_a_traced_run_writes_rank_0s_trace_with_the_plans_units(measured) -> None:
    results_dir, out = measured
    frame = results.load(results_dir)
    row = frame[frame.source == "measured"].iloc[0]
    assert row.status == "ok" and row.throughput > 0  # the window is untouched by tracing
    files = [p for p in _trace_files(results_dir) if p.name.startswith(row.run_id)]
    assert files[0].name == f"{row.run_id}_r0_rank0.trace.json" and len(files) <= 2
    assert "trace of rank 0" in out.stdout
    raw = json.loads(files[0].read_text())  # a Chrome trace: the profiler's events and ours
    assert any(e.get("cat") == "cpu_op" for e in raw["traceEvents"])
    tl = traces.read(files[0])
    assert tl.lanes == ["compute", "comm"]
    assert (tl.about["source"], tl.about["method"], tl.about["workers"]) == (
        "measured", "wfbp_a2a", 2)
    phases = [b.name for b in _in_traced(tl, "compute") if not b.name.startswith("wait")]
    assert phases[:5] == ["traced iteration", "forward", "backward", "synchronize", "update"]
    # every unit of the plan once in the traced iteration, with its bytes, in issue order
    plan = json.loads(row.plan_json)["units"]
    units = _in_traced(tl, "comm")
    assert sorted(b.args["unit"] for b in units) == list(range(len(plan)))
    for b in units:
        start, end = plan[b.args["unit"]]
        assert b.args["bytes"] == (end - start) * 4 and b.args["tensors"] >= 1
        assert b.end_s >= b.start_s and not b.args.get("unfinished")
    # WFBP: the output side's first unit goes during backward, before it ends
    backward = next(b for b in _in_traced(tl, "compute") if b.name == "backward")
    first = next(b for b in units if b.args["unit"] == 0)
    assert first.start_s < backward.end_s


def test_the_report_draws_measured_beside_predicted(measured, tmp_path) -> None:
    results_dir, _ = measured
    measured = next(p for p in _trace_files(results_dir) if "_rank0." in p.name)
    plots = tmp_path / "plots"
    out = run_module("harness.report", f"results_dir={results_dir}", f"out_dir={plots}",
                     f"timeline={measured}")
    assert out.returncode == 0, out.stderr
    png = plots / "timeline_bert_tiny_wfbp_a2a_w2_loopback.png"
    assert png.stat().st_size > 10_000 and png.with_suffix(".pdf").exists()
    assert f"wrote {png}" in out.stderr
    other = counterpart(traces.read(measured), results_dir)  # drawn beside it
    assert other is not None and other.about["source"] == "simulated"
    page = (plots / "index.html").read_text()
    assert "Timeline" in page and page.count("data:image/png;base64") >= 2


def _shared_x(fig) -> bool:
    """Whether the figure's two panels share their x axis, at the same limits."""
    top, bottom = fig.axes[:2]
    return top.get_shared_x_axes().joined(top, bottom) and top.get_xlim() == bottom.get_xlim()


def test_a_run_and_its_prediction_from_this_machines_compute_share_a_time_axis(measured,
                                                                              tmp_path) -> None:
    """A self-check's pair (both CPU) on one axis; the same run against a prediction for
    a GPU (simulate.compute=rtx2080ti) on two, the title saying which is which."""
    results_dir, _ = measured
    path = next(p for p in _trace_files(results_dir) if "_rank0." in p.name)
    run, cpu = traces.read(path), counterpart(traces.read(path), results_dir)
    assert cpu.about["compute"].startswith("measured:cpu") and one_axis(run, cpu)
    fig = figure([cpu, run])
    assert _shared_x(fig) and "one time axis (both CPU)" in fig.get_suptitle()
    assert fig.axes[0].get_title(loc="left").startswith("measured")  # measured above predicted
    gpu_dir = tmp_path / "gpu"  # the same configuration predicted for a GPU
    shutil.copytree(results_dir / results.OTHER_DATA, gpu_dir / results.OTHER_DATA)
    out = run_module("harness.simulate", "model=bert_tiny", "method=wfbp_a2a",
                     "cluster.workers_per_node=2", "simulate.compute=rtx2080ti",
                     "simulate.trace=true", f"results_dir={gpu_dir}")
    assert out.returncode == 0, out.stderr
    gpu = counterpart(run, gpu_dir)
    assert gpu.about["compute"].startswith("counted:rtx2080ti") and not one_axis(run, gpu)
    fig = figure([run, gpu])
    assert not _shared_x(fig)
    assert ("each on its own time axis: measured on a CPU (" in fig.get_suptitle()
            and "predicted for a GPU (counted:rtx2080ti" in fig.get_suptitle())
    png = draw_timeline(path, gpu_dir, tmp_path / "plots")
    assert png.stat().st_size > 10_000


def _made(source: str, length_s: float, hardware: str | None) -> traces.Timeline:
    """A hand-made trace: one forward, one unit; `hardware`: its device or compute."""
    about = {"source": source, "model": "m", "method": "wfbp_a2a", "workers": 2,
             "network": "eth1g", "local_batch_size": 8, "rank": 0}
    if hardware:
        about["device" if source == "measured" else "compute"] = hardware
    bars = [traces.Bar("compute", "forward", 0.0, length_s / 2, {}),
            traces.Bar("comm", "unit 0", length_s / 2, length_s, {"unit": 0})]
    return traces.Timeline(about, length_s, ["compute", "comm"], bars)


@pytest.mark.parametrize(("measured_on", "predicted_for", "lengths", "shared"), [
    ("x86_64", "measured:cpu x2 processes", (1.0, 3.0), True),  # a self-check, under load
    ("x86_64", "counted:rtx2080ti:fp32", (1.0, 0.9), False),  # CPU against GPU, however close
    ("NVIDIA H100 80GB HBM3", "counted:a100:fp32", (0.1, 0.2), True),  # two GPUs
    ("NVIDIA H100 80GB HBM3", "measured:cpu x2 processes", (0.1, 0.2), False),
    (None, "counted:rtx2080ti:fp32", (1.0, 9.0), True),  # not recorded: the lengths decide
    (None, None, (1.0, 0.05), False),  # 20x apart
])
def test_the_time_axis_is_shared_by_traces_of_one_kind_of_hardware(
        measured_on, predicted_for, lengths, shared) -> None:
    run = _made("measured", lengths[0], measured_on)
    prediction = _made("simulated", lengths[1], predicted_for)
    assert one_axis(run, prediction) == one_axis(prediction, run) == shared
    fig = figure([prediction, run])
    assert _shared_x(fig) == shared
    if shared:  # one ms scale: the longer iteration fits both panels
        assert fig.axes[0].get_xlim()[1] >= 1e3 * max(lengths)
    else:  # each its own: the shorter one is not squeezed into the longer one's range
        assert fig.axes[1].get_xlim()[1] < 1.1e3 * lengths[1]
    title = fig.get_suptitle()
    assert ("one time axis" in title) == shared and ("own time axis" in title) != shared
    issue, done = abs(lengths[0] - lengths[1]) / 2, abs(lengths[0] - lengths[1])  # from 0
    assert title.split("\n")[-1].endswith(
        f"issue {100 * issue / lengths[0]:.1f}%, completion {100 * done / lengths[0]:.1f}% "
        "(1 units)")  # the measured iteration's share


def test_bytescheduler_traces_its_pieces_from_its_own_thread(results_dir) -> None:
    out = run_module("harness.run", *TINY, "model=bert_tiny", "method=bytescheduler_a2a",
                     "cluster.workers_per_node=2", "run.trace=true",
                     f"results_dir={results_dir}")
    assert out.returncode == 0, out.stderr
    tl = traces.read(_trace_files(results_dir)[0])
    units = [b for b in tl.bars if b.lane == "comm"]
    assert units and all(b.end_s >= b.start_s for b in units)
    assert {"unit", "bytes", "tensors", "first", "last"} <= set(units[0].args)


@pytest.mark.parametrize(("method", "lanes"), [
    ("wfbp_a2a", ["compute", "comm", "collective"]),
    ("wfbp_ps", ["compute", "comm", "node_up", "node_down", "bus_up", "bus_down",
                 *[f"server{s}_{lane}" for s in (0, 1) for lane in
                   ("in", "out", *[f"engine{t}" for t in range(8)])]]),
    ("bytescheduler_a2a", ["compute", "comm", "updates", "collective"]),
])
def test_a_predicted_trace_has_a_lane_per_link_and_server(method, lanes, tmp_path) -> None:
    out = run_module("harness.simulate", "model=bert_base", f"method={method}",
                     "network=eth10_tcp", "cluster.nodes=2", "cluster.workers_per_node=4",
                     "simulate.compute=rtx2080ti", "simulate.trace=true",
                     f"results_dir={tmp_path}")
    assert out.returncode == 0, out.stderr
    [path] = _trace_files(tmp_path)
    assert f"predicted timeline -> {path}" in out.stdout
    tl = traces.read(path)
    assert tl.lanes == lanes
    assert tl.about["source"] == "simulated" and tl.about["workers"] == 8
    # the traced iteration is the steady-state one the prediction reports
    assert tl.length_s == pytest.approx(tl.about["iteration_s"], rel=0.01)
    units = {b.args["unit"] for b in _in_traced(tl, "comm")}
    assert units and all(b.args["unit"] in units or b.start_s < 0
                         for b in tl.bars if b.lane not in ("compute", "updates")
                         and 0 <= b.start_s <= tl.length_s)


def test_too_many_configurations_to_trace_is_refused(tmp_path) -> None:
    out = run_module("harness.simulate", "experiment=paper", "simulate.compute=rtx2080ti",
                     "simulate.trace=true", f"results_dir={tmp_path}")
    assert out.returncode == 2
    assert "simulate.trace=true writes a timeline per configuration" in out.stderr
    assert not (tmp_path / traces.FOLDER).exists()


def test_the_report_names_a_file_that_is_not_a_trace(tmp_path) -> None:
    bogus = tmp_path / "x.json"
    bogus.write_text("{}")
    out = run_module("harness.report", f"results_dir={tmp_path}", f"timeline={bogus}",
                     f"out_dir={tmp_path / 'plots'}")
    assert out.returncode == 2
    assert f"timeline={bogus} cannot be read as a trace" in out.stderr
    assert "run.trace=true" in out.stderr
    assert not (tmp_path / "plots").exists()  # a user error writes nothing


@pytest.fixture(scope="module")
def predicted(tmp_path_factory):
    """A predicted trace (simulate.trace=true) as parsed JSON."""
    results_dir = tmp_path_factory.mktemp("predicted")
    out = run_module("harness.simulate", "model=bert_base", "method=wfbp_a2a",
                     "network=eth10_tcp", "cluster.workers_per_node=4",
                     "simulate.compute=rtx2080ti", "simulate.trace=true",
                     f"results_dir={results_dir}")
    assert out.returncode == 0, out.stderr
    [path] = _trace_files(results_dir)
    return json.loads(path.read_text())


def _part(trace: dict, where: str) -> dict:
    """The object of `trace` that `where` names: "top", "ddlbench", the first event of the
    harness's of a kind ("X", "b"), or its args ("b.args")."""
    if where in ("top", "ddlbench"):
        return trace if where == "top" else trace["ddlbench"]
    ph, _, args = where.partition(".")
    event = next(e for e in trace["traceEvents"] if e.get("pid") == traces.PID and e["ph"] == ph)
    return event[args] if args else event


GONE = object()
BROKEN = [  # (where, key, value or GONE, what the refusal names)
    ("ddlbench", "traced_us", "x", 'ddlbench.traced_us is "x"'),
    ("ddlbench", "workers", "8", 'ddlbench.workers is "8"; it must be a whole number'),
    ("ddlbench", "model", GONE, "ddlbench.model is missing (a string is needed)"),
    ("top", "traceEvents", {}, "traceEvents is a JSON object, not a list"),
    ("X", "ts", "12:00", '.ts is "12:00"; it must be a number'),
    ("X", "dur", True, ".dur is true; it must be a number"),
    ("b", "id", None, ".id is null; it must be a whole number"),
    ("X", "tid", 99, "is on thread (tid) 99, which no thread_name"),
    ("b.args", "unit", "x", "its unit a whole number"),
]


@pytest.mark.parametrize("where, key, value, named", BROKEN,
                         ids=[f"{w}.{k}" for w, k, *_ in BROKEN])
def test_a_broken_trace_is_refused_naming_the_field(predicted, where, key, value, named,
                                                    tmp_path) -> None:
    """Each field the report reads, of the wrong type or missing: a ValueError naming it
    (the report's one line), before any of it is drawn."""
    path = tmp_path / "t.trace.json"
    path.write_text(json.dumps(predicted))
    assert traces.read(path).bars  # the real one reads
    trace = json.loads(json.dumps(predicted))
    part = _part(trace, where)
    if value is GONE:
        del part[key]
    else:
        part[key] = value
    path.write_text(json.dumps(trace))
    with pytest.raises(ValueError, match=re.escape(named)):
        traces.read(path)


def test_a_trace_without_its_counterpart_is_drawn_alone() -> None:
    fig = figure([_made("simulated", 0.5, "counted:rtx2080ti:fp32")])
    assert len(fig.axes) == 1 and fig.axes[0].get_xlim()[1] == pytest.approx(525)
    assert fig.get_suptitle().endswith("(no measured trace found)")
