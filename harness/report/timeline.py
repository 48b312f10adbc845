"""The timeline figure: one iteration's compute and communication, measured beside predicted.

`python -m harness.report timeline=<trace>` draws the trace (run.trace or simulate.trace,
harness/measure/traces.py) and the newest trace of the same configuration from the other
source found under `<results_dir>/traces/`, one panel each, as
`timeline_<model>_<method>_w<workers>_<network>.png` (and .pdf). Per lane a row: compute
(forward, backward, synchronize, update; the method's waits hatched over them), comm
(each unit from its issue to its end, stacked where they overlap, labelled with its unit
index) and, predicted, each collective stream, link or server busy with a unit. A unit
has one color in every lane. The traced iteration lies between the dashed lines; what
came before it (communication of the previous iteration still in flight) shows left of 0.

The two panels share one time axis (the same ms scale, each iteration from 0) when they
describe the same hardware (`one_axis`): the measured trace's `device` and the predicted
one's `compute` both a CPU (a self-check: a run here and its prediction from the compute
measured here) or both a GPU. A CPU run against a GPU prediction differs by orders: each
panel keeps its own axis and the title says so and why. Where a trace records neither,
the iteration lengths decide: less than `ORDERS` times apart, one axis. Under the title,
the units' issue and completion gaps (harness.measure.traces.unit_gap).
"""

from __future__ import annotations

import re
from pathlib import Path

from matplotlib import colormaps
from matplotlib.axes import Axes
from matplotlib.figure import Figure  # Figure objects render with Agg; no pyplot state
from matplotlib.patches import Patch

from harness.measure import traces
from harness.report.data import ReportError

PHASE_COLORS = {"forward": "#4c72b0", "backward": "#dd8452", "synchronize": "#b0b0b0",
                "update": "#55a868"}
WAIT_COLOR = "#c44e52"
MAX_ROWS = 4  # sub-rows of a lane where units overlap
ORDERS = 10.0  # iterations this many times apart are not of one cluster (no device recorded)
GPU_NAME = re.compile(r"nvidia|tesla|geforce|quadro|titan|radeon|instinct", re.IGNORECASE)


def _read(path: str | Path) -> traces.Timeline:
    try:
        return traces.read(path)
    except (OSError, ValueError, KeyError) as exc:
        raise ReportError(f"timeline={path} cannot be read as a trace: {exc}") from exc


def counterpart(timeline: traces.Timeline, results_dir: str | Path) -> traces.Timeline | None:
    """The newest trace of the same configuration from the other source, if any."""
    other = {"measured": "simulated"}.get(timeline.about["source"], "measured")
    found = []
    for path in Path(results_dir, traces.FOLDER).glob("*.trace.json"):
        try:
            candidate = traces.read(path)
        except (OSError, ValueError, KeyError):
            continue
        about = candidate.about
        if about["source"] == other and all(about.get(k) == timeline.about.get(k)
                                            for k in traces.KEY):
            found.append((path.stat().st_mtime, candidate))
    return max(found, key=lambda found: found[0], default=(0, None))[1]


def hardware(tl: traces.Timeline) -> str | None:
    """"cpu" or "gpu": what a measured trace ran on (its `device`: a CUDA device's name,
    else the CPU's), what a predicted one is for (its `compute`: "measured:cpu ..." this
    machine's CPU, "measured:cuda", "counted:<gpu>:..." a GPU); None where not recorded."""
    a = tl.about
    name = a.get("device") if a["source"] == "measured" else a.get("compute")
    if not isinstance(name, str) or not name:
        return None
    if a["source"] == "measured":
        return "gpu" if GPU_NAME.search(name) else "cpu"
    return "cpu" if name.startswith("measured:cpu") else "gpu"


def one_axis(a: traces.Timeline, b: traces.Timeline) -> bool:
    """Whether two traces are drawn on one time axis: both on the same hardware (CPU or
    GPU); where either does not record it, iterations less than ORDERS times apart."""
    mine, theirs = hardware(a), hardware(b)
    if mine and theirs:
        return mine == theirs
    return max(a.length_s, b.length_s) < ORDERS * min(a.length_s, b.length_s)


def _axes_line(shown: list[traces.Timeline], shared: bool) -> str:
    """The title's word on the time axis: one, or why each panel has its own."""
    kinds = [hardware(tl) for tl in shown]
    if shared:
        return (f"measured and predicted on one time axis (both {kinds[0].upper()})"
                if kinds[0] and kinds[1] else "measured and predicted on one time axis")
    if kinds[0] and kinds[1]:
        what = [f"measured on a {k.upper()} ({tl.about['device']})"
                if tl.about["source"] == "measured"
                else f"predicted for a {k.upper()} ({tl.about['compute']})"
                for tl, k in zip(shown, kinds)]
        return "each on its own time axis: " + ", ".join(what)
    lengths = " and ".join(f"{tl.length_s * 1e3:.3g} ms" for tl in shown)
    return f"each on its own time axis: iterations of {lengths}, orders apart"


def _rows(bars: list[traces.Bar]) -> list[int]:
    """A sub-row per bar, the first where it overlaps nothing (greedy, in start order)."""
    ends: list[float] = []
    rows = [0] * len(bars)
    for i in sorted(range(len(bars)), key=lambda i: bars[i].start_s):
        row = next((r for r, end in enumerate(ends) if end <= bars[i].start_s), len(ends))
        if row == len(ends):
            ends.append(0.0)
        ends[row] = bars[i].end_s
        rows[i] = row
    return [r % MAX_ROWS for r in rows]


def _panel(ax: Axes, tl: traces.Timeline, title: str, *, span_s: float) -> None:
    """One trace's lanes; `span_s`: the longest iteration on this axis (the x range)."""
    ms = 1e3
    lanes = tl.lanes
    colors = colormaps["tab20"]
    for y, lane in enumerate(lanes):
        bars = [b for b in tl.bars if b.lane == lane and "iteration" not in b.name]
        if lane == "compute":  # the phases, then the waits over them
            for b in sorted(bars, key=lambda b: b.name.startswith("wait")):
                wait = b.name.startswith("wait")
                ax.broken_barh([(b.start_s * ms, (b.end_s - b.start_s) * ms)],
                               (y - 0.15, 0.3) if wait else (y - 0.3, 0.6),
                               facecolors="none" if wait else PHASE_COLORS.get(b.name, "#888"),
                               edgecolors=WAIT_COLOR if wait else "none",
                               hatch="////" if wait else None, linewidth=0.6)
            continue
        rows = _rows(bars)
        height = 0.8 / max(1, min(MAX_ROWS, len(set(rows))))
        labelled = [-float("inf")] * MAX_ROWS  # per sub-row, where its last label is
        for b, row in zip(bars, rows):
            unit = b.args.get("unit", 0)
            color = PHASE_COLORS["update"] if lane == "updates" else colors(unit % 20)
            y0 = y - 0.4 + row * height
            ax.broken_barh([(b.start_s * ms, max((b.end_s - b.start_s) * ms, 1e-3))],
                           (y0, height * 0.9), facecolors=color, edgecolors="black",
                           linewidth=0.3)
            room = 0.04 * span_s  # a label where it fits beside the last one
            if lane == "comm" and b.end_s - b.start_s > room and b.start_s > labelled[row] + room:
                ax.text(b.start_s * ms, y0 + height * 0.45, f" {unit}", ha="left",
                        va="center", fontsize=6, clip_on=True)
                labelled[row] = b.start_s
    for x in (0, tl.length_s * ms):
        ax.axvline(x, color="black", linestyle="--", linewidth=0.8)
    ax.set_yticks(range(len(lanes)), lanes, fontsize=8)
    ax.set_ylim(len(lanes) - 0.5, -0.5)
    ax.set_xlim(-0.1 * span_s * ms, 1.05 * span_s * ms)
    ax.set_xlabel("ms from the traced iteration's start")
    ax.set_title(title, fontsize=9, loc="left")


def _title(tl: traces.Timeline) -> str:
    a = tl.about
    if a["source"] == "measured":
        who = (f"measured on rank {a['rank']}"
               f"{' (the slowest)' if a['rank'] == a.get('slowest_rank') else ''}, "
               f"{a.get('device', '')}")
    else:
        who = f"predicted ({a.get('compute', 'simulated')})"
    units = len({b.args.get("unit") for b in tl.bars
                 if b.lane == "comm" and 0 <= b.end_s and b.start_s <= tl.length_s})
    return f"{who}: iteration {tl.length_s * 1e3:.1f} ms, {units} units in it"


def _heading(shown: list[traces.Timeline], shared: bool) -> str:
    """The figure's title: the configuration; for a pair (measured first), its time axis
    and the units' issue and completion gaps."""
    a = shown[0].about
    first = (f"{a['model']} {a['method']} x{a['workers']} on {a['network']}, local batch "
             f"{a['local_batch_size']}")
    if len(shown) == 1:
        other = "predicted" if a["source"] == "measured" else "measured"
        return f"{first} (no {other} trace found)"
    return "\n".join([first, _axes_line(shown, shared), traces.gap_text(*shown)])


def figure(shown: list[traces.Timeline]) -> Figure:
    """The panels of one or two traces of one configuration, measured above predicted, on
    one time axis where `one_axis` says so; the title names the configuration, the axes
    and, for a pair, the units' issue and completion gaps."""
    shown = sorted(shown, key=lambda tl: tl.about["source"] != "measured")
    shared = len(shown) == 2 and one_axis(*shown)
    heights = [len(tl.lanes) for tl in shown]
    fig = Figure(figsize=(11, 1.6 + 0.55 * sum(heights)), layout="constrained")
    axes = fig.subplots(len(shown), 1, sharex=shared, height_ratios=heights,
                        squeeze=False)[:, 0]
    span_s = max(tl.length_s for tl in shown)
    for ax, tl in zip(axes, shown):
        _panel(ax, tl, _title(tl), span_s=span_s if shared else tl.length_s)
    for ax in axes[:-1] if shared else []:
        ax.set_xlabel("")  # the axis is the bottom panel's
    fig.suptitle(_heading(shown, shared), x=0.01, ha="left", fontsize=10)
    keys = [Patch(color=c, label=name) for name, c in PHASE_COLORS.items()]
    keys.append(Patch(facecolor="none", edgecolor=WAIT_COLOR, hatch="////", label="wait"))
    fig.legend(handles=keys, loc="outside lower center", ncol=len(keys), fontsize=8,
               frameon=False)
    return fig


def draw_timeline(path: str | Path, results_dir: str | Path, out_dir: str | Path) -> Path:
    """The timeline figure of the trace at `path` and its counterpart; returns the PNG."""
    first = _read(path)
    other = counterpart(first, results_dir)
    fig = figure([first] + ([other] if other is not None else []))
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    a = first.about
    name = f"timeline_{a['model']}_{a['method']}_w{a['workers']}_{a['network']}"
    stem = Path(out_dir) / re.sub(r"[^\w.-]", "_", name)  # a name from the file: no '/'
    fig.savefig(f"{stem}.png", dpi=130)
    fig.savefig(f"{stem}.pdf")
    return Path(f"{stem}.png")
