"""`ddlbench <command>`: the installed console entry runs each command as `python -m`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from harness import cli
from tests.conftest import REPO, TINY

ENTRY = Path(sys.executable).with_name("ddlbench")


def _ddlbench(*args: str) -> subprocess.CompletedProcess:
    command = [str(ENTRY)] if ENTRY.exists() else [sys.executable, "-m", "harness.cli"]
    return subprocess.run([*command, *args], cwd=REPO, capture_output=True, text=True,
                          timeout=300)


def test_every_command_is_a_module_with_a_main() -> None:
    import importlib

    for module, _ in cli.COMMANDS.values():
        assert callable(importlib.import_module(module).main), module


def test_the_entry_point_is_installed() -> None:
    assert ENTRY.exists(), "pip install -e . (make) installs the ddlbench console script"


def test_ddlbench_run_is_python_m_harness_run(tmp_path) -> None:
    out = _ddlbench("run", *TINY, "model=bert_tiny", f"results_dir={tmp_path}")
    assert out.returncode == 0, out.stderr
    assert "samples/s over 1 repeats" in out.stdout and list(tmp_path.glob("*.parquet"))
    bad = _ddlbench("run", "run.timeout_s=nan")  # the command's own exit code and line
    assert bad.returncode == 2 and "run.timeout_s=nan is invalid" in bad.stderr


def test_an_unknown_command_is_one_line_and_exit_2() -> None:
    out = _ddlbench("rnu")
    assert out.returncode == 2
    assert out.stderr.strip() == ("ddlbench: error: 'rnu' is not a command; did you mean run? "
                                  f"choose one of: {', '.join(cli.COMMANDS)}")
    assert _ddlbench().returncode == 2 and "usage: ddlbench <command>" in _ddlbench().stdout
    assert _ddlbench("--help").returncode == 0
