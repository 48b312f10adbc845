"""`python -m harness.report [results_dir=results] [out_dir=plots] [reference=<csv>]
[timeline=<trace>]`: the study's figures and tables, computed from result rows only.

    python -m harness.report                                   # results/ -> plots/
    python -m harness.report reference=published.csv           # beside the study's numbers
    python -m harness.report timeline=results/traces/<run>_r0_rank0.trace.json

* Input: every parquet shard under ``results_dir`` (``results.load_report``; unreadable
  shards are listed, never dropped silently) and optionally a published CSV (REF_COLUMNS).
* A *setting* is (model, local_batch_size, network, source): measured, simulated and
  published numbers are never mixed. Per (setting, method, world_size) *cell*: mean and
  std of throughput over the repeats with status "ok".
* Speedup = mean / the model's 1-worker baseline (mean ok throughput at world_size 1, any
  method, preferring the same network and source); published speedups divide by the
  reference's ``single_gpu_throughput``. No number is typed into the code.
* ``out_dir`` gets per setting ``fig_*`` (grouped bars with std error bars, ideal linear
  scaling, best speedup per group, a hatched published panel when the reference has the
  model), ``efficiency_*`` and ``breakdown_*`` (PNG + PDF), and ``summary.md``,
  ``summary.csv``, ``best.csv``, ``ratios.csv`` (with both inputs), and ``index.html``: one
  self-contained page of this call's figures, the tables, what is missing and the rows'
  provenance. With a reference and no results, the reference alone is drawn.
* A what-if folder (``python -m harness.simulate experiment=whatif``: its best.csv names
  several GPUs) gets the what-if page instead: per model and GPU a heatmap of the best
  method by fabric and GPU count with its margin over the runner-up
  (harness/report/whatif.py), in ``whatif_*`` PNG + PDF and ``index.html``.
* ``timeline=<trace>`` (a run.trace or simulate.trace file) also draws one iteration's
  timeline, measured beside predicted (harness/report/timeline.py); on the page too.
* Missing cells and failed runs get no bar; they are noted in the figure and listed in
  summary.md's "Missing" section.
* User errors (no data, bad reference, unknown argument, an out_dir that cannot be written):
  one line on stderr, exit code 2, nothing written.
* A disk that fills up (or fails) while the report is written: one line naming out_dir,
  exit code 1, and every file this call had created or changed there removed (out_dir too,
  if the call made it): no half-written figure or table is left.
"""

from __future__ import annotations

import contextlib
import shutil
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from harness.config import ConfigError, paths, usage
from harness.measure import results
from harness.report import page, whatif
from harness.report.data import (
    ReportError,
    _log,
    aggregate,
    failed_runs,
    load_rows,
    missing_cells,
    normalize,
    read_reference,
    reference_cells,
)
from harness.report.figures import write_figures
from harness.report.tables import gap_tables, missing_section, write_tables
from harness.report.timeline import draw_timeline

ARGS = {"results_dir": "results", "out_dir": "plots", "reference": None, "timeline": None}


def _no_data(results_dir: str | Path, bad: list[tuple[Path, str]], n: int) -> ReportError:
    hint = "run a benchmark first or pass reference=<csv> to draw the published numbers alone"
    if not Path(results_dir).exists():
        return ReportError(f"results_dir '{results_dir}' does not exist; {hint}")
    if bad and len(bad) == n:
        return ReportError(
            f"none of the {n} shards under '{results_dir}' could be read (first: "
            f"{bad[0][0]}: {bad[0][1]}); re-run them or move them away"
        )
    return ReportError(f"no result rows in shards (*.parquet) under '{results_dir}'; {hint}")


def report(results_dir: str, out_dir: str, reference: str | None = None,
           timeline: str | None = None) -> None:
    """Load, aggregate and write every figure and table (see the module docstring)."""
    paths.output_dir("out_dir", out_dir, example="plots")
    if results_dir is None or not str(results_dir).strip():
        raise ReportError("results_dir is empty; give the folder of the shards (e.g. "
                          "results_dir=results)")
    published = (reference_cells(read_reference(paths.named_file(reference)))
                 if reference else None)
    start = time.perf_counter()
    best = None if reference or timeline else whatif.read_best(results_dir)
    rows, bad, n = load_rows(results_dir)  # as written: the page shows their provenance
    if best is not None:  # a what-if folder: its rows mix GPUs, so the what-if page alone
        with all_or_nothing(Path(out_dir)):
            Path(out_dir).mkdir(parents=True, exist_ok=True)
            intro = (f"results_dir `{results_dir}`: a what-if sweep, {len(rows)} simulated "
                     f"rows in {n} shards, {len(best)} cells (model, GPU, fabric, GPU count).")
            page.write_page(Path(out_dir), whatif.render(intro, best,
                                                         whatif.draw(best, Path(out_dir)), rows))
        return
    frame = normalize(rows)
    with all_or_nothing(Path(out_dir)):  # a full disk leaves nothing half-written
        drawn = {}
        if timeline:  # after every input check: a user error writes nothing
            png = draw_timeline(timeline, results_dir, out_dir)
            _log(f"wrote {png} and .pdf")
            drawn = {"Timeline": [png]}
        if frame.empty and published is None:
            if drawn:  # the timeline alone
                return
            raise _no_data(results_dir, bad, n)
        _log(
            f"loaded {n} shards ({len(frame)} rows, {len(bad)} unreadable) from '{results_dir}' "
            f"in {time.perf_counter() - start:.1f}s"
        )
        results.warn(bad)
        if frame.empty:  # the reference alone: the study's own figures and numbers
            data, attempted, published = published, published, None
        else:
            data, attempted = aggregate(frame), frame
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        missing = missing_cells(frame, data)
        figures = write_figures(data, out, attempted=attempted, reference=published,
                                missing=missing)
        intro = (
            f"results_dir `{results_dir}`: {n} shards, {len(frame)} rows, "
            f"{len(bad)} unreadable; reference `{reference or 'none'}`."
        )
        gaps = gap_tables(missing, failed_runs(frame), bad, data)
        write_tables(data, out, header=f"# ddlbench report\n\n{intro}\n", published=published,
                     missing=missing_section(gaps))
        page.write_page(out, page.render(intro=intro, cells=data, figures={**figures, **drawn},
                                         published=published, gaps=gaps, rows=rows))


class WriteFailed(Exception):
    """The report could not be written (a full disk): `main` prints it, exit code 1."""


def _stamps(folder: Path) -> dict[Path, tuple[int, int]]:
    """Each file under `folder`: (size, mtime in ns)."""
    out = {}
    for path in folder.rglob("*") if folder.is_dir() else []:
        with contextlib.suppress(OSError):
            if path.is_file():
                out[path] = (path.stat().st_size, path.stat().st_mtime_ns)
    return out


@contextlib.contextmanager
def all_or_nothing(out: Path) -> Iterator[None]:
    """What the block writes under `out` stays only if all of it was written: on an
    OSError (ENOSPC from the image library, a table or the page) every file it created or
    changed is removed, and `out` itself if the block made it; then WriteFailed, naming
    `out`. Files it left alone (an earlier report's) stay."""
    made, before = not out.exists(), _stamps(out)
    try:
        yield
    except OSError as exc:
        for path, stamp in _stamps(out).items():
            if before.get(path) != stamp:
                path.unlink(missing_ok=True)
        if made:
            shutil.rmtree(out, ignore_errors=True)
        raise WriteFailed(
            f"could not write the report to out_dir '{out}': {exc.strerror or exc}; removed "
            "what it had written there; free space there or choose another out_dir") from exc


def parse_args(argv: Sequence[str]) -> dict[str, str | None]:
    """key=value arguments over ARGS' defaults; an unknown key is a ReportError."""
    args = dict(ARGS)
    for item in argv:
        key, sep, value = item.partition("=")
        if not sep or key not in ARGS:
            raise ReportError(
                f"unknown argument '{item}'; use key=value with keys "
                f"{', '.join(ARGS)}, e.g. results_dir=results out_dir=plots"
            )
        args[key] = value or None
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit code."""
    argv = sys.argv[1:] if argv is None else argv
    if usage.answer(argv, __doc__, groups=False):  # -h, --help: the help, and nothing else
        return 0
    try:
        report(**parse_args(argv))
    except (ReportError, ConfigError) as exc:
        print(f"ddlbench: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    except WriteFailed as exc:
        print(f"ddlbench: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
