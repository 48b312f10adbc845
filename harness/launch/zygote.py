"""A local CPU run's ranks, forked from one process that imported their libraries once.

Before it does anything a rank imports torch, its entry and its model's library: here
4-5 CPU s for torch and 10-12 for a `bert_tiny` rank, paid again by every rank of every
run. So the launcher of a CPU run keeps one zygote for the life of its own process
(`python -m harness.launch.zygote`): it imports what a run's ranks need (the first run of
a model pays once) and forks each rank, which then runs what `python -m
harness.launch.rank <entry> <config.json>` would, with the launcher's environment and
standard streams at that moment (sent along: SCM_RIGHTS), in a session of its own. A fork
dies with the zygote and the zygote with the launcher (PR_SET_PDEATHSIG both), as a
spawned rank dies with the launcher. The zygote reaps its forks and sends back each one's
exit code, negative for a signal as `subprocess` gives it: `Fork.poll` and `Fork.pid` are
all the launcher's watchdog and `_stop` use of a process.

On an emulated cluster a fork joins its node's network namespace as `ip netns exec` would
(`netem.enter`). GPU runs spawn as before: CUDA does not survive a fork of a process whose
driver was touched, and a GPU machine has the cores to import its ranks side by side.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import time
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from harness.launch import netem
from harness.launch.process import die_with_parent

POLL_S = 0.05
MAX_MESSAGE = 1 << 20
ROOM = 4096  # bytes the zygote's arguments and environment leave for a fork's (_show)


class ZygoteGone(RuntimeError):
    """The zygote could not fork (it died, or fork failed): spawn the rank instead."""


@dataclass
class Zygote:
    """The launcher's end: `fork` a module's `python -m` run, `exit_code` of a fork."""

    proc: subprocess.Popen
    sock: socket.socket
    exits: dict[int, int] = field(default_factory=dict)

    @classmethod
    def start(cls) -> Zygote:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = dict(os.environ, PYTORCH_NVML_BASED_CUDA_CHECK="1",  # no import touches CUDA
                   DDLBENCH_ZYGOTE_ROOM=" " * ROOM)
        with theirs:
            proc = subprocess.Popen(
                [sys.executable, "-m", "harness.launch.zygote", str(theirs.fileno()),
                 " " * ROOM],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, env=env,
                start_new_session=True, preexec_fn=die_with_parent)
        return cls(proc, mine)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def fork(self, module: str, args: list[str], *, env: dict[str, str],
             preload: list[str], timeout_s: float, namespace: str | None = None) -> Fork:
        """`python -m module *args` with `env` (in network `namespace`, as `ip netns exec`
        would run it), forked once `preload` is imported (within `timeout_s`, else
        ZygoteGone)."""
        request = json.dumps({"module": module, "args": args, "env": env, "preload": preload,
                              "namespace": namespace})
        deadline = time.monotonic() + timeout_s
        try:
            try:
                socket.send_fds(self.sock, [request.encode()], [0, 1, 2])
            except OSError as exc:  # a standard stream closed, or the zygote gone
                raise ZygoteGone(f"could not ask the zygote: {exc}") from exc
            while True:
                left = max(0.0, deadline - time.monotonic())
                if not select.select([self.sock], [], [], left)[0]:
                    raise ZygoteGone(f"the zygote did not fork within {timeout_s:g} s")
                message = self._receive(block=True)
                if "pid" in message:
                    return Fork(self, message["pid"])
                if "error" in message:
                    raise ZygoteGone(message["error"])
        except BaseException:  # a fork it may still make would be no one's: end them all
            self.close()
            raise

    def exit_code(self, pid: int) -> int | None:
        with contextlib.suppress(ZygoteGone):
            while pid not in self.exits and self._receive(block=False):
                pass
        if pid not in self.exits and not self.alive():
            self.exits[pid] = -signal.SIGKILL  # its PR_SET_PDEATHSIG, as the zygote died
        return self.exits.get(pid)

    def _receive(self, *, block: bool) -> dict:
        """One message ({} when none waits and not `block`); exits are kept as they come."""
        try:
            data = self.sock.recv(MAX_MESSAGE, 0 if block else socket.MSG_DONTWAIT)
        except BlockingIOError:
            return {}
        except OSError as exc:
            raise ZygoteGone(f"the zygote's socket failed: {exc}") from exc
        if not data:
            raise ZygoteGone(f"the zygote ended (exit code {self.proc.wait()})")
        message = json.loads(data)
        if "exit" in message:
            self.exits[message["exit"]] = message["code"]
        return message

    def close(self) -> None:
        """End the zygote (its forks die with it)."""
        self.sock.close()
        if self.alive():
            self.proc.kill()
        self.proc.wait()


@dataclass
class Fork:
    """A rank forked by the zygote: what the launcher uses of a `subprocess.Popen`."""

    zygote: Zygote
    pid: int

    def poll(self) -> int | None:
        return self.zygote.exit_code(self.pid)


_ZYGOTE: Zygote | None = None


def zygote() -> Zygote:
    """This process's zygote, started on first use (and again if it died)."""
    global _ZYGOTE
    if _ZYGOTE is None or not _ZYGOTE.alive():
        _ZYGOTE = Zygote.start()
    return _ZYGOTE


# -- the zygote's own process ---------------------------------------------------------------


def serve(sock: socket.socket) -> None:
    """Fork on each request, report each fork's end; return when the launcher is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # its launcher stops it, not a terminal
    while True:
        if select.select([sock], [], [], POLL_S)[0]:
            try:
                data, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, 3)
            except OSError:
                return
            if not data:
                return
            request = json.loads(data)
            for name in request["preload"]:  # a failing import fails again in the fork, told
                with contextlib.suppress(Exception):
                    importlib.import_module(name)
            try:
                reply = {"pid": _fork(sock, request, fds)}
            except OSError as exc:
                reply = {"error": f"fork failed: {exc}"}
            for fd in fds:
                os.close(fd)
            sock.send(json.dumps(reply).encode())
        _reap(sock)


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        sock.send(json.dumps({"exit": pid, "code": os.waitstatus_to_exitcode(status)}).encode())


def _fork(sock: socket.socket, request: dict, fds: list[int]) -> int:
    zygote_pid = os.getpid()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:  # the fork: from here on it is `python -m module *args`
        sock.close()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.setsid()
        die_with_parent()
        if os.getppid() != zygote_pid:  # the zygote died before PR_SET_PDEATHSIG was set
            os._exit(1)
        if request["namespace"]:
            netem.enter(request["namespace"])
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = [request["module"], *request["args"]]
        _show([sys.executable, "-m", *sys.argv], request["env"])
        with warnings.catch_warnings():  # preloaded, as an entry imports it: so does -m
            warnings.filterwarnings("ignore", "'.*' found in sys.modules", RuntimeWarning)
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - told, and the fork's exit code says so
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _show(argv: list[str], env: dict[str, str]) -> None:
    """Make this process's command line and environment as /proc shows them (`ps`, `pkill
    -f`, /proc/PID/environ, the tests' orphan checks) read `argv` and `env`, as a spawned
    rank's do: written over the areas this process was started with (the zygote's, with
    ROOM to spare in each), as setproctitle does."""
    stat = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    areas = (int(stat[45]), int(stat[46])), (int(stat[47]), int(stat[48]))  # fields 48-51
    texts = argv, [f"{k}={v}" for k, v in env.items()]
    with contextlib.suppress(OSError), open("/proc/self/mem", "r+b", buffering=0) as mem:
        for (start, end), text in zip(areas, texts, strict=True):
            mem.seek(start)
            mem.write(b"\0".join(t.encode() for t in text)[:end - start - 1]
                      .ljust(end - start, b"\0"))


if __name__ == "__main__":
    with socket.socket(fileno=int(sys.argv[1])) as conn:
        importlib.import_module("harness.launch.rank")  # torch: every rank's, while asked
        serve(conn)
