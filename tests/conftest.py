"""Shared helpers: compose the real config, run the real commands."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# the study's published numbers, the project's own copy (conf/reference/README.md)
STUDY = REPO / "conf" / "reference" / "shi2020_ib100.csv"

# A run small enough for a 2-core test machine: few iterations, one repeat.
TINY = ["run.warmup_iters=1", "run.timed_iters=2", "run.repeats=1", "run.timeout_s=60"]
# bert_tiny's layers, smaller still: a test of the machinery, not of the model's numbers
SMALL_BERT = ["model=bert_tiny", "model.build.hidden_size=64", "model.build.intermediate_size=128",
              "model.build.seq_len=16", "+model.build.vocab_size=1000", "model.local_batch_size=2"]


def run_module(module: str, *args: str, timeout: float = 300, env: dict | None = None
               ) -> subprocess.CompletedProcess:
    """Run `python -m module args` from the repository root and capture its output."""
    return subprocess.run(
        [sys.executable, "-m", module, *args], cwd=REPO, capture_output=True, text=True,
        timeout=timeout, env={**os.environ, **(env or {})},
    )


def run_main(module: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """`module`'s `main(args)` in a fork of this process, its output captured: the command
    as `run_module` runs it, less a fresh interpreter's imports (3-4 s each here). Meant for
    commands that end before starting anything (bad input); import the module first so the
    fork inherits it."""
    with tempfile.TemporaryDirectory() as tmp:
        paths = [Path(tmp, "stdout"), Path(tmp, "stderr")]
        pid = os.fork()
        if pid == 0:  # the child: never returns into pytest
            code = 70
            try:
                for fd, path in zip((1, 2), paths):
                    os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT), fd)
                sys.stdout, sys.stderr = open(1, "w", closefd=False), open(2, "w", closefd=False)
                os.chdir(REPO)
                sys.argv = [module, *args]
                code = importlib.import_module(module).main(list(args))
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else 1
            except BaseException:  # noqa: BLE001 - reported as a traceback, as python -m would
                traceback.print_exc()
                code = 1
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        deadline = time.monotonic() + timeout
        while (status := os.waitpid(pid, os.WNOHANG))[0] == 0:
            if time.monotonic() > deadline:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                raise subprocess.TimeoutExpired([module, *args], timeout)
            time.sleep(0.01)
        out, err = (path.read_text() for path in paths)
        return subprocess.CompletedProcess([module, *args], os.waitstatus_to_exitcode(status[1]),
                                           out, err)


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
