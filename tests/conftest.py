"""Shared helpers: compose the real config, run the real commands."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
REFERENCE = REPO.parent / "shared" / "reference"

# A run small enough for a 2-core test machine: few iterations, one repeat.
TINY = ["run.warmup_iters=1", "run.timed_iters=2", "run.repeats=1", "run.timeout_s=60"]


def run_module(module: str, *args: str, timeout: float = 300, env: dict | None = None
               ) -> subprocess.CompletedProcess:
    """Run `python -m module args` from the repository root and capture its output."""
    return subprocess.run(
        [sys.executable, "-m", module, *args], cwd=REPO, capture_output=True, text=True,
        timeout=timeout, env={**os.environ, **(env or {})},
    )


def live_processes(marker: str) -> list[str]:
    """Command lines of live processes that mention `marker` (for orphan checks)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = (proc / "stat").read_text().split()[2]
        except OSError:
            continue
        if marker in cmd and state != "Z":
            found.append(cmd)
    return found


@pytest.fixture
def results_dir(tmp_path: Path) -> Path:
    return tmp_path / "results"
