"""The what-if page of harness.report: a small what-if folder simulated here (two GPUs of
the table, two fabrics, three GPU counts, four methods), its heatmaps per model and GPU
(each cell in its best method's colour with the margin over the runner-up) and index.html."""

from __future__ import annotations

import base64

import numpy as np
import pandas as pd
import pytest
from matplotlib.colors import to_rgba

from harness import simulate
from harness.report import __main__ as command
from harness.report import whatif
from harness.report.style import method_color

SWEEP = ["experiment=whatif_gpus", "model=resnet50",
         "method=wfbp_a2a,bsp_ps,bytescheduler_ps,wfbp_ps", "simulate.compute=v100,h100_sxm",
         "network=ib_hdr,eth25_tcp", "cluster.nodes=1,2,8"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> tuple:
    """The simulated what-if folder and its report."""
    src, out = tmp_path_factory.mktemp("results"), tmp_path_factory.mktemp("plots")
    assert simulate.main([*SWEEP, f"results_dir={src}"]) == 0
    assert command.main([f"results_dir={src}", f"out_dir={out}"]) == 0
    return src, out, (out / "index.html").read_text(encoding="utf-8")


def test_a_what_if_folder_gets_a_heatmap_per_model_and_gpu_on_its_page(folder) -> None:
    _, out, text = folder
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert pngs == ["whatif_resnet50_h100_sxm_fp32.png", "whatif_resnet50_v100_fp32.png"]
    assert (out / "whatif_resnet50_v100_fp32.pdf").is_file()
    assert not list(out.glob("fig_*"))  # no bars averaging the GPUs together
    for png in out.glob("*.png"):
        data = base64.b64encode(png.read_bytes()).decode("ascii")
        assert text.count(data) == 1
    assert "What if: resnet50" in text and "a what-if sweep, 48 simulated rows" in text


def test_each_cell_is_its_best_methods_colour_with_its_margin(folder) -> None:
    src, _, text = folder
    best = whatif.read_best(src)
    assert best is not None and len(best) == 2 * 2 * 3  # GPUs x fabrics x GPU counts
    for _, cells in best.groupby("compute"):
        fabrics, counts = sorted(cells.network.unique()), sorted(cells.gpus.unique())
        grid, texts = whatif.marks(cells, fabrics, counts)
        for row in cells.itertuples():
            i, j = fabrics.index(row.network), counts.index(row.gpus)
            if row.tied.count("=") >= 2:  # on one GPU every method is the compute alone
                assert tuple(grid[i, j]) == whatif.TIED and texts[i, j] == ""
                continue
            assert tuple(grid[i, j]) == to_rgba(method_color(row.method))
            want = "=" if "=" in row.tied else ("<1" if row.margin_pct < 1
                                                 else f"{row.margin_pct:.0f}")
            assert texts[i, j] == want
    shares = whatif.shares(best)
    lone = best[best.tied.str.count("=") < 2]
    assert shares.cells.sum() == len(lone) and ">cells<" in text


@pytest.mark.parametrize("computes", [
    ["counted:v100:fp32", "counted:v100:tf32"],       # one GPU of the table
    ["measured:cpu", "measured:cpu x2 processes"]])  # measured here: no GPU of the table
def test_a_folder_of_fewer_than_two_gpus_is_no_what_if_folder(tmp_path, computes) -> None:
    def best(name: str, of: list[str]) -> None:
        pd.DataFrame({"model": "m", "compute": of, "network": "n", "gpus": 8, "method": "ddp",
                      "tied": "ddp", "margin_pct": np.nan}).to_csv(tmp_path / name, index=False)

    best("sim-x_best.csv", computes)
    assert whatif.read_best(tmp_path) is None
    gpus = ["counted:v100:fp32", "counted:h100_sxm:fp32"]
    best("sim-y_best.csv", gpus)  # two GPUs of the table: a what-if folder, a cell once
    assert len(whatif.read_best(tmp_path)) == len({*computes, *gpus})
