"""The rendezvous port of a local run: free before start, and who holds it when it is not.

Rank 0 listens on `cluster.master_port` (its TCPStore). A port another program or run
already listens on would have rank 0 fail to bind and the other ranks join the wrong
store. So a given port is checked before anything starts (exit 2 naming who holds it,
when /proc tells), and port 0 means a free one picked by the kernel per run, so two
concurrent runs never share one. A port taken in the moment between the check and rank
0's bind is reported as a collision (harness.launch.failure), not as a rank's failure.
"""

from __future__ import annotations

import errno
import os
import re
import socket
from pathlib import Path

from harness.config import ConfigError

IN_USE = re.compile(r"EADDRINUSE|[Aa]ddress already in use")


def free_port(addr: str = "127.0.0.1") -> int:
    """A port nobody listens on now (the kernel's pick)."""
    with socket.socket() as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def check_free(addr: str, port: int) -> None:
    """ConfigError unless rank 0 of a local run can listen on `addr` (cluster.master_addr)
    and `port` (cluster.master_port; 0: any free one): the address resolves, is this
    machine's, and nobody listens on the port (the message names who does)."""
    try:
        family = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0][0]
    except socket.gaierror as exc:
        raise ConfigError(f"cluster.master_addr={addr} does not resolve here ({exc.strerror}); "
                          "a local run's rank 0 listens on it: give this machine's address "
                          "or name, e.g. 127.0.0.1") from None
    with socket.socket(family) as s:
        try:
            s.bind((addr, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise ConfigError(f"cluster.master_port={port} is already in use on {addr}"
                                  f"{holder(port)}; choose another port, or "
                                  "cluster.master_port=0 (a free one per run)") from None
            raise ConfigError(f"cluster.master_addr={addr} cannot be listened on here "
                              f"({exc.strerror}): a local run's rank 0 listens on it; give "
                              "this machine's address, e.g. 127.0.0.1") from None


def holder(port: int) -> str:
    """' by pid N (command)' of the process listening on TCP `port`, or '' when /proc
    does not say (another user's process, or no /proc)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                inodes.add(f"socket:[{inode}]")
    for pid in filter(str.isdigit, os.listdir("/proc") if inodes else []):
        if any(link in inodes for link in _fd_links(pid)):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
            except OSError:
                return f" by pid {pid}"
            return f" by pid {pid} ({cmd.decode(errors='replace').strip()[:120]})"
    return ""


def _fd_links(pid: str):
    """What process `pid`'s open files point to (nothing where /proc will not say)."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return
    for fd in fds:
        try:
            yield os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
