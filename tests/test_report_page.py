"""Tests of the report's page, index.html: figures embedded once each, tables, the
published comparison, failed runs and provenance, all from the rows."""

from __future__ import annotations

import base64
import re
from pathlib import Path

import pandas as pd
import pytest

from harness.report import __main__ as command
from tests.test_report import STUDY_CSV, row, write

METHODS = ["bsp_a2a", "ddp"]  # the study's reference has bsp_a2a (at 4 GPUs and up), not ddp
SIZES = (1, 2, 4)
ERROR = "RuntimeError: rank 1 lost its peer <gloo>"


def page_rows() -> list[dict]:
    """Two methods at world sizes 1, 2 and 4 (model resnet50 at batch 64, as in the study's
    reference), two repeats each, one failed repeat, a torch version and hosts."""
    prov = {"model": "resnet50", "local_batch_size": 64, "torch_version": "9.8.7+page",
            "hostnames": ["nodeA", "nodeB"], "git_commit": "c0ffee"}
    rows = []
    for method in METHODS:
        for ws in SIZES:
            rows += [row(method, ws, r, 40.0 * ws * (1 + 0.1 * r) + len(method), **prov)
                     for r in range(2)]
    rows.append(row("bsp_a2a", 2, 2, None, error=ERROR, **prov))
    return rows


def make_page(tmp_path: Path, *extra: str) -> tuple[Path, str]:
    src, out = write(tmp_path / "results", page_rows()), tmp_path / "plots"
    assert command.main([f"results_dir={src}", f"out_dir={out}", *extra]) == 0
    return out, (out / "index.html").read_text(encoding="utf-8")


def section(text: str, anchor: str) -> str:
    """The HTML of one section: from its heading to the next one."""
    return text.split(f'<h2 id="{anchor}">')[1].split("<h2 ")[0]


def test_page_embeds_every_png_once_and_lists_tables_failures_provenance(tmp_path, capsys):
    if not STUDY_CSV.exists():
        pytest.skip(f"the study's reference {STUDY_CSV} is absent")
    out, text = make_page(tmp_path, f"reference={STUDY_CSV}")
    pngs = sorted(out.glob("*.png"))
    assert len(pngs) >= 3  # throughput, efficiency and breakdown of resnet50
    assert text.count("data:image/png;base64,") == len(pngs)
    for png in pngs:
        data = base64.b64encode(png.read_bytes()).decode("ascii")
        assert text.count(data) == 1 and png.name in text
    first = re.search(r"data:image/png;base64,([A-Za-z0-9+/=]+)", text).group(1)
    assert base64.b64decode(first)[:8] == b"\x89PNG\r\n\x1a\n"
    summary = section(text, "throughput")
    mean = (40.0 * 2 * 1.0 + 40.0 * 2 * 1.1) / 2 + len("ddp")  # ddp's 2-worker mean
    assert ">ddp<" in summary and f"{mean:.1f} ± " in summary
    assert ">bsp_a2a<" in section(text, "best")
    assert html_escaped(ERROR) in section(text, "missing")
    comparison = section(text, "published")
    assert "<table>" in comparison and "throughput_ratio" in comparison
    ref = pd.read_csv(STUDY_CSV).query("model == 'resnet50' and method == 'bsp_a2a' and gpus == 4")
    ratio = (40.0 * 4 * 1.05 + len("bsp_a2a")) / ref["throughput_mean"].iloc[0]
    assert f">{ratio:.3g}<" in comparison
    prov = section(text, "provenance")
    assert all(f"<code>{v}</code>" in prov for v in ("9.8.7+page", "nodeA", "nodeB", "c0ffee"))
    assert "src=\"http" not in text and "<script" not in text
    assert f"wrote {out / 'index.html'}" in capsys.readouterr().err


def html_escaped(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def test_page_without_reference_says_none_and_keeps_only_this_calls_figures(tmp_path):
    out = tmp_path / "plots"
    out.mkdir()
    (out / "fig_old.png").write_bytes(b"\x89PNG\r\n\x1a\nstale")  # an earlier call's figure
    out, text = make_page(tmp_path)
    assert "none: no reference=" in section(text, "published")
    assert "<table>" not in section(text, "published")
    assert "fig_old.png" not in text
    assert text.count("data:image/png;base64,") == len(list(out.glob("*.png"))) - 1
    assert "resnet50" in section(text, "figures")
