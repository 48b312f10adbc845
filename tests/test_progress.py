"""Progress with the time left: tqdm's bar on a terminal, plain lines elsewhere, and a cost
per step that the timed window does not notice."""

from __future__ import annotations

import contextlib
import fcntl
import io
import os
import re
import statistics
import struct
import termios
import threading
import time
from collections.abc import Iterator
from typing import IO

import torch

import models
from harness.measure.progress import Progress, line


def test_a_line_says_how_far_and_how_long_is_left() -> None:
    assert line("sweep", 3, 8, 72.0, "jobs") == "sweep: 3/8 jobs [01:12 elapsed, ~02:00 left]"
    assert line("sweep", 0, 8, 0.0, "jobs").endswith("~? left]")  # no rate yet


def test_off_a_terminal_it_prints_plain_lines_at_most_every_so_often() -> None:
    out = io.StringIO()
    with Progress(400, "repeat 1/1", unit="iterations", file=out, every_s=0.05) as shown:
        start = time.perf_counter()
        for _ in range(400):
            shown.update()
            time.sleep(0.001)
        took = time.perf_counter() - start
    lines = out.getvalue().splitlines()
    assert lines and not set("\r\x1b") & set(out.getvalue())
    assert len(lines) <= took / 0.05 + 1
    assert all(re.fullmatch(r"repeat 1/1: \d+/400 iterations \[\d\d:\d\d elapsed, ~.+ left\]",
                            x) for x in lines)
    quiet = io.StringIO()  # work shorter than its delay says nothing
    with Progress(10, "short", file=quiet, delay_s=60, every_s=0.0) as shown:
        for _ in range(10):
            shown.update()
    assert quiet.getvalue() == ""


@contextlib.contextmanager
def terminal() -> Iterator[tuple[IO[str], list[bytes]]]:
    """A pseudo-terminal to write to, and what reached its other end (read as it comes:
    a full pty would block the writer)."""
    leader, follower = os.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    drawn: list[bytes] = []

    def drain() -> None:
        with contextlib.suppress(OSError):  # EIO once the follower is closed
            while chunk := os.read(leader, 65536):
                drawn.append(chunk)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    with open(follower, "w") as tty:
        yield tty, drawn
        tty.flush()
        time.sleep(0.5)  # for the reader: a pty's unread output goes with its follower
    reader.join(timeout=5)
    os.close(leader)


def test_on_a_terminal_it_is_tqdms_bar() -> None:
    with terminal() as (tty, drawn):
        with Progress(5, "sweep", unit="jobs", file=tty) as shown:
            for _ in range(5):
                shown.update()
    text = b"".join(drawn).decode()
    assert "\r" in text and "sweep:   0%|" in text and "0/5 [00:00<?" in text


def test_a_step_costs_under_a_thousandth_of_the_smallest_timed_iteration() -> None:
    """An update per step against one training iteration of the smallest model (bert_tiny,
    on this CPU), both measured here: the bar, or the plain line, must cost < 0.1%."""
    build = {"hidden_size": 128, "num_layers": 2, "num_heads": 2, "intermediate_size": 512,
             "seq_len": 64}  # conf/model/bert_tiny.yaml
    model = models.build("bert", build, seed=0)
    batch = model.make_batch(8, torch.Generator().manual_seed(0))

    def iteration() -> float:
        start = time.perf_counter()
        model(batch).backward()
        return time.perf_counter() - start

    smallest = min(iteration() for _ in range(5))
    with terminal() as (tty, _):
        for file in (io.StringIO(), tty):
            with Progress(10**6, "cost", file=file, every_s=0.01) as shown:
                per = []
                for _ in range(20):
                    start = time.perf_counter()
                    for _ in range(1000):
                        shown.update()
                    per.append((time.perf_counter() - start) / 1000)
            assert statistics.median(per) < 1e-3 * smallest, (per, smallest)
