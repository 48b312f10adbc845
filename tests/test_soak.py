"""A small soak in every `make test`: short runs of every method, none may fail
(`make soak` is the large one: tests/soak.py)."""

from __future__ import annotations

from pathlib import Path

from tests import soak


def test_two_rounds_of_short_runs_and_four_verify_runs_all_succeed(tmp_path: Path) -> None:
    runs, problems = soak.sweep(16, tmp_path)  # whole rounds of every method: 2 of 9
    assert runs >= 16 and problems == []
    runs, problems = soak.verify(4)
    assert runs == 4 and problems == []
