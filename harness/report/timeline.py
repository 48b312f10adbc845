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
"""

from __future__ import annotations

import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib import colormaps  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from harness.measure import traces  # noqa: E402
from harness.report.data import ReportError  # noqa: E402

PHASE_COLORS = {"forward": "#4c72b0", "backward": "#dd8452", "synchronize": "#b0b0b0",
                "update": "#55a868"}
WAIT_COLOR = "#c44e52"
MAX_ROWS = 4  # sub-rows of a lane where units overlap


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


def _panel(ax: Axes, tl: traces.Timeline, title: str) -> None:
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
            room = 0.04 * tl.length_s  # a label where it fits beside the last one
            if lane == "comm" and b.end_s - b.start_s > room and b.start_s > labelled[row] + room:
                ax.text(b.start_s * ms, y0 + height * 0.45, f" {unit}", ha="left",
                        va="center", fontsize=6, clip_on=True)
                labelled[row] = b.start_s
    for x in (0, tl.length_s * ms):
        ax.axvline(x, color="black", linestyle="--", linewidth=0.8)
    ax.set_yticks(range(len(lanes)), lanes, fontsize=8)
    ax.set_ylim(len(lanes) - 0.5, -0.5)
    ax.set_xlim(-0.1 * tl.length_s * ms, 1.05 * tl.length_s * ms)
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


def draw_timeline(path: str | Path, results_dir: str | Path, out_dir: str | Path) -> Path:
    """The timeline figure of the trace at `path` and its counterpart; returns the PNG."""
    first = _read(path)
    other = counterpart(first, results_dir)
    shown = [first] + ([other] if other is not None else [])
    shown.sort(key=lambda tl: tl.about["source"] != "measured")
    heights = [len(tl.lanes) for tl in shown]
    fig, axes = plt.subplots(len(shown), 1, figsize=(11, 1.2 + 0.55 * sum(heights)),
                             height_ratios=heights, squeeze=False)
    for ax, tl in zip(axes[:, 0], shown):
        _panel(ax, tl, _title(tl))
    a = first.about
    about = (f"{a['model']} {a['method']} x{a['workers']} on {a['network']}, local batch "
             f"{a['local_batch_size']}")
    fig.suptitle(about + ("" if other is not None else " (no trace of the other source found)"),
                 x=0.01, ha="left", fontsize=11)
    keys = [Patch(color=c, label=name) for name, c in PHASE_COLORS.items()]
    keys.append(Patch(facecolor="none", edgecolor=WAIT_COLOR, hatch="////", label="wait"))
    fig.legend(handles=keys, loc="lower center", ncol=len(keys), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.05, 1, 0.96))
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    name = f"timeline_{a['model']}_{a['method']}_w{a['workers']}_{a['network']}"
    stem = Path(out_dir) / re.sub(r"[^\w.-]", "_", name)  # a name from the file: no '/'
    fig.savefig(f"{stem}.png", dpi=130)
    fig.savefig(f"{stem}.pdf")
    plt.close(fig)
    return Path(f"{stem}.png")
