"""`ddlbench <command>`: the installed console entry runs each command as `python -m`."""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from harness import cli
from tests.conftest import REPO, TINY, run_main

ENTRY = Path(sys.executable).with_name("ddlbench")


def _ddlbench(*args: str) -> subprocess.CompletedProcess:
    command = [str(ENTRY)] if ENTRY.exists() else [sys.executable, "-m", "harness.cli"]
    return subprocess.run([*command, *args], cwd=REPO, capture_output=True, text=True,
                          timeout=300)


def test_every_command_is_a_module_with_a_main() -> None:
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


# -- every command answers --help: its usage, an example, its keys; nothing else -----------

HELP_VARIANTS = ("-h", "-help", "--h", "help")  # --help: through the ddlbench entry below
KEY = {"run": "run.repeats", "verify": "verify.steps", "check": "--clean", "plan": "--json",
       "simulate": "simulate.compute", "report": "reference=", "submit": "dry_run=true",
       "microbench": "microbench.max_bytes", "methodbench": "--models",
       "install_horovod": "--force"}  # a key or option of each command's own
COMPOSES = ("run", "verify", "check", "plan", "simulate", "submit", "microbench")


def _is_help(name: str, out: subprocess.CompletedProcess) -> None:
    """`out` is `name`'s help: exit 0, nothing on stderr, a usage line, an example, its keys."""
    assert out.returncode == 0, out.stderr
    assert not out.stderr.strip(), out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith(f"usage: python -m harness.{name}"), lines[0]
    example = re.compile(rf"^\s+python -m harness\.{name} \S")
    assert any(example.match(line) for line in lines), out.stdout
    assert KEY[name] in out.stdout
    if name in COMPOSES:  # the names every config group takes
        assert re.search(r"^\s+model=\s+bert_base, ", out.stdout, re.MULTILINE), out.stdout


@pytest.mark.parametrize("name", list(cli.COMMANDS))
def test_every_command_answers_help_and_writes_nothing(name: str, tmp_path: Path) -> None:
    """`ddlbench <command> --help`, a real process in an empty folder with a cache folder of
    its own: the help, exit 0, the folder still empty (no results, no plots) and nothing in
    ddlbench's cache (matplotlib may build its font list there on first import)."""
    command = [str(ENTRY)] if ENTRY.exists() else [sys.executable, "-m", "harness.cli"]
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"),
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    work = tmp_path / "work"
    work.mkdir()
    out = subprocess.run([*command, name, "--help"], cwd=work, capture_output=True,
                         text=True, timeout=120, env=env)
    _is_help(name, out)
    assert not list(work.iterdir()) and not (tmp_path / "cache" / "ddlbench").exists()


@pytest.mark.parametrize("flag", HELP_VARIANTS)
def test_every_spelling_of_help_is_the_help(flag: str) -> None:
    """-h, -help, --h and a first `help`: each command's main returns its help, exit 0."""
    for name, (module, _) in cli.COMMANDS.items():
        importlib.import_module(module)  # the fork inherits it
        _is_help(name, run_main(module, flag))
    if flag != "help":  # a flag after overrides too; `help` only first
        _is_help("run", run_main("harness.run", "model=bert_tiny", flag))


def test_ddlbench_help_lists_the_commands_or_gives_one() -> None:
    for args in (["--help"], ["-help"], ["help"], ["-h"]):
        out = _ddlbench(*args)
        assert out.returncode == 0 and out.stdout.startswith("usage: ddlbench <command>")
        assert all(f"  {name} " in out.stdout for name in cli.COMMANDS), out.stdout
    _is_help("run", _ddlbench("help", "run"))
    out = _ddlbench("help", "rnu")
    assert out.returncode == 2 and "'rnu' is not a command; did you mean run?" in out.stderr


@pytest.mark.parametrize("module, args", [
    ("harness.plan", ["nope"]),                                    # plan adds run.force=true
    ("harness.submit", ["experiment=smoke", "dry_run=true", "nope"]),  # submit: cluster=slurm
    ("harness.plan", ["model=bert_tiny", "--help=1"]),
])
def test_a_parse_error_names_only_what_the_user_typed(module: str, args: list[str]) -> None:
    importlib.import_module(module)
    out = run_main(module, *args)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    bad = args[-1]
    assert f"'{bad}'" in out.stderr, out.stderr
    assert ("give key=value overrides" in out.stderr) == ("=" not in bad), out.stderr
    for unseen in ("run.force", "cluster=slurm", "quote the value"):
        assert unseen not in out.stderr, out.stderr


def test_install_horovods_bad_argument_is_one_line_and_exit_2() -> None:
    importlib.import_module("harness.install_horovod")
    out = run_main("harness.install_horovod", "--nope")
    assert out.returncode == 2 and not out.stdout
    assert out.stderr == ("ddlbench: error: unrecognized arguments: --nope; see python -m "
                          "harness.install_horovod --help\n")
