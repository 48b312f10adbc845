"""The paper-style report (``python -m harness.report``), one concept per module.

* ``data``: result shards and a published CSV -> cells (per setting, method and world
  size: mean, std, baseline, speedup, efficiency), failed runs and missing cells.
* ``style``: the study's method order and each method's color and hatching.
* ``figures``: throughput, efficiency and breakdown figures per setting (PNG + PDF).
* ``tables``: summary.md, summary.csv, best.csv and ratios.csv.
* ``page``: index.html, one self-contained page of the figures, tables, gaps and provenance.
* ``__main__``: the command (arguments, user errors, exit codes); its docstring is the usage.

Imports go one way: data, style <- figures, tables <- page <- __main__. Nothing is imported here,
so importing one submodule stays cheap.
"""
