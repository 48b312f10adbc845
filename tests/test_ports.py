"""The rendezvous port: a taken one is refused before start naming its holder, and one
taken as the ranks start is reported as a collision (real processes, real sockets)."""

from __future__ import annotations

import os
import socket
import sys
import time
from subprocess import PIPE, Popen

from harness import run as harness_run  # noqa: F401 - run_main's fork inherits it
from harness.launch.ports import free_port
from harness.measure import results
from tests.conftest import REPO, TINY, live_processes, run_main


def test_a_taken_master_port_is_refused_before_start_naming_its_holder(tmp_path) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        out = run_main("harness.run", *TINY, f"results_dir={tmp_path}",
                       f"cluster.master_port={port}")
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 2 and len(lines) == 1, out.stderr
    assert (f"cluster.master_port={port} is already in use on 127.0.0.1 by pid "
            in lines[0]), lines[0]
    assert "cluster.master_port=0" in lines[0]
    assert not any(tmp_path.iterdir()), "nothing may start or be written"


def test_a_port_taken_as_the_ranks_start_is_a_collision_not_a_ranks_failure(tmp_path) -> None:
    port, scratch, out = free_port(), tmp_path / "tmp", tmp_path / "results"
    scratch.mkdir()  # the run's folder, in its ranks' command lines: this run's ranks
    launcher = Popen([sys.executable, "-m", "harness.run", *TINY, f"results_dir={out}",
                      "cluster.workers_per_node=2", "run.timeout_s=20",
                      f"cluster.master_port={port}"], cwd=REPO, stdout=PIPE, stderr=PIPE,
                     text=True, env={**os.environ, "TMPDIR": str(scratch)})
    deadline = time.monotonic() + 60
    while not live_processes(str(scratch)) and time.monotonic() < deadline:
        time.sleep(0.02)  # the port was checked free; rank 0 now imports torch, then binds
    with socket.socket() as thief:
        thief.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        thief.bind(("127.0.0.1", port))
        thief.listen()
        _, err = launcher.communicate(timeout=180)
    assert launcher.returncode == 1, err
    assert "port collision: the rendezvous port was taken" in err, err
    row = results.load(out).iloc[0]
    assert row.status == "failed" and row.error.startswith("port collision"), row.error
