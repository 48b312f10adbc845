"""A small soak in every `make test`: a short run of every method, none may fail
(`make soak` is the large one: tests/soak.py)."""

from __future__ import annotations

from pathlib import Path

from harness import config
from tests import soak


def test_a_round_of_short_runs_and_two_verify_runs_all_succeed(tmp_path: Path) -> None:
    runs, problems = soak.sweep(1, tmp_path)  # one whole round: every method once
    assert runs == len(config.choices("method")) and problems == []
    runs, problems = soak.verify(2)
    assert runs == 2 and problems == []
