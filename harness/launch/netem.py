"""One machine as a small cluster: network namespaces on a bridge, links rate-limited by tbf.

Each emulated host is a network namespace whose `eth0` is one end of a veth pair;
the other end sits on a bridge made for the run. A token bucket filter (tc tbf)
on both ends of every pair limits the host's link in each direction (netem is not
available on these machines, so there is no added latency). Everything is named
after a per-run token, made on entry and removed on exit, also on errors.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import uuid
from collections.abc import Sequence

IFNAME = "eth0"  # the host's interface inside its namespace
SUBNET = "10.231.0"  # private addresses that exist only on the run's own bridge
PREFIX = "dlb"
MIN_BURST_KB = 96  # a token bucket's least size in KiB: more than one GSO packet (__init__)
CLONE_NEWNS, CLONE_NEWNET, MS_REC, MS_SLAVE, MNT_DETACH = 0x20000, 0x40000000, 0x4000, 0x80000, 2


def enter(namespace: str) -> None:
    """Move this process into `namespace` as `ip netns exec` would (a rank forked by
    harness.launch.zygote): its network, and a mount namespace of its own whose /sys shows
    that network's devices."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)

    def check(result: int, what: str) -> None:
        if result != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"{what} for network namespace {namespace}: {os.strerror(err)}")

    fd = os.open(f"/run/netns/{namespace}", os.O_RDONLY)
    try:
        check(libc.setns(fd, CLONE_NEWNET), "setns")
    finally:
        os.close(fd)
    check(libc.unshare(CLONE_NEWNS), "unshare")
    check(libc.mount(b"none", b"/", None, MS_REC | MS_SLAVE, None), "mount --make-rslave /")
    check(libc.umount2(b"/sys", MNT_DETACH), "umount /sys")
    check(libc.mount(namespace.encode(), b"/sys", b"sysfs", 0, None), "mount sysfs")


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def _tc(*args: str) -> None:
    subprocess.run(["tc", *args], check=True, capture_output=True, text=True)


class EmulatedNetwork:
    """`hosts` namespaces joined by a bridge; each link limited to `rate_mbit` (None: no limit)."""

    def __init__(self, *, hosts: int, rate_mbit: float | None) -> None:
        if hosts > 250:
            raise ValueError(f"{hosts} emulated hosts do not fit one /24 subnet; use at most 250")
        self.hosts, self.rate_mbit = hosts, rate_mbit
        # the bucket holds 0.5 ms of tokens (a fixed 64 kB burst caps a veth at ~3 Gbit/s
        # here, whatever the rate), and at least one whole GSO packet: 64 KiB of payload
        # with each segment's headers is about 68.5 KiB, and tbf cuts a packet larger than
        # its bucket into MTU-sized ones in software (tbf_segment), which kept a core busy
        # in softirq per link sending at 1 Gbit/s here (1.06 cores with 64 KiB and 66 KiB,
        # 0.16-0.18 with 72-96 KiB; harness/predict/README.md)
        self.burst_kb = max(MIN_BURST_KB, round((rate_mbit or 0) * 1e6 / 8 * 5e-4 / 1024))
        self.token = uuid.uuid4().hex[:6]
        self.bridge = f"{PREFIX}{self.token}br"
        self._made: list[tuple[str, ...]] = []  # undo commands, newest last

    def namespace(self, host: int) -> str:
        return f"{PREFIX}{self.token}n{host}"

    def address(self, host: int) -> str:
        return f"{SUBNET}.{host + 1}"

    def environment(self, host: int) -> dict[str, str]:
        """The variables of every rank on `host`: Gloo and NCCL bound to the host's veth
        (`=`: that name exactly), and to NCCL a host of its own. NCCL takes two ranks for
        one host when their host name and boot id agree (or their NCCL_HOSTID), and `ip
        netns exec` changes neither: every emulated node would be one host to NCCL, whose
        traffic between them would go over NVLink, PCIe or shared memory around the
        rate-limited links while the PS traffic over Gloo took them. InfiniBand, which no
        veth limits, is off: NCCL's sockets on the veth are its only network."""
        return {"GLOO_SOCKET_IFNAME": IFNAME, "NCCL_SOCKET_IFNAME": f"={IFNAME}",
                "NCCL_HOSTID": self.namespace(host), "NCCL_IB_DISABLE": "1",
                "NCCL_NET": "Socket"}

    def command(self, host: int, argv: Sequence[str]) -> list[str]:
        """`argv` run inside `host`'s namespace."""
        return ["ip", "netns", "exec", self.namespace(host), *argv]

    def __enter__(self) -> EmulatedNetwork:
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            self._made.append(("link", "del", self.bridge))
            _ip("link", "set", self.bridge, "up")
            for host in range(self.hosts):
                self._add_host(host)
        except BaseException:
            self.close()
            raise
        return self

    def _add_host(self, host: int) -> None:
        ns, outer = self.namespace(host), f"{PREFIX}{self.token}v{host}"
        inner = f"{PREFIX}{self.token}i{host}"  # renamed to IFNAME once inside the namespace
        _ip("netns", "add", ns)
        self._made.append(("netns", "del", ns))  # deleting it also deletes the veth pair
        _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
        self._made.append(("link", "del", outer))
        _ip("link", "set", inner, "netns", ns)
        _ip("-n", ns, "link", "set", inner, "name", IFNAME)
        _ip("-n", ns, "addr", "add", f"{self.address(host)}/24", "dev", IFNAME)
        _ip("-n", ns, "link", "set", IFNAME, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        _ip("link", "set", outer, "master", self.bridge, "up")
        if self.rate_mbit is not None:
            limit = ["root", "tbf", "rate", f"{self.rate_mbit}mbit", "burst",
                     f"{self.burst_kb}kb", "latency", "100ms"]
            _tc("-n", ns, "qdisc", "add", "dev", IFNAME, *limit)  # host -> bridge
            _tc("qdisc", "add", "dev", outer, *limit)  # bridge -> host

    def close(self) -> None:
        """Remove everything this network made; safe to call more than once."""
        while self._made:
            undo = self._made.pop()
            subprocess.run(["ip", *undo], capture_output=True)

    def __exit__(self, *exc: object) -> None:
        self.close()


def _names(argv: list[str], marker: str) -> list[str]:
    try:
        text = subprocess.run(argv, capture_output=True, text=True).stdout
    except OSError:  # no iproute2: no network was made here
        return []
    return sorted({w.split("@")[0].rstrip(":") for w in text.split() if w.startswith(marker)})


def leftovers(token: str = "") -> list[str]:
    """Names of namespaces and links of ddlbench networks (of one run, given its token)."""
    marker = PREFIX + token
    return sorted({*_names(["ip", "-o", "link"], marker), *_names(["ip", "netns", "list"], marker)})


def remove(token: str) -> list[str]:
    """Remove the network of `token` (its owner died without closing it): its namespaces
    (which takes their veth pairs with them), then the links left. What was removed."""
    if not token.isalnum():
        return []  # not a token this module made
    marker, gone = PREFIX + token, []
    for ns in _names(["ip", "netns", "list"], marker):
        if subprocess.run(["ip", "netns", "del", ns], capture_output=True).returncode == 0:
            gone.append(f"namespace {ns}")
    for link in _names(["ip", "-o", "link"], marker):
        if subprocess.run(["ip", "link", "del", link], capture_output=True).returncode == 0:
            gone.append(f"link {link}")
    return gone
