"""The UCX wire: the PS family's messages (methods/ps/wire.py) over UCX tag matching,
on ucxx's synchronous core API (`ucxx._lib.libucxx`), beside Gloo's point-to-point.

One UCX context and worker per process, progressed by ucxx's progress thread (started
with the rank's device current). Each rank publishes its worker address in the run's
store (`publish`); an endpoint to a peer is made from the peer's address on the first
send to it. A receive is posted on the worker, so it needs no endpoint.

Matching is by (peer, tag), as on Gloo: a UCX tag is `sender rank << 32 | wire tag`,
received with the full mask, so a message only matches a receive that names its sender
and its tag; messages of one sender and tag match in the order they were sent.

Host tensors go as they are (their bytes); device tensors go straight from the GPU where
UCX reports CUDA support (`cuda`), else through a host copy (the GPU-only lines are
`_device_send` and `_device_recv`, beside their host twins). Which transports UCX picked
for each endpoint (`transports`) is read from `ucp_ep_print_info`: its lanes.

A handle's `wait(timeout)` (seconds or a timedelta; None: the wire's `timeout_s`) raises a
RuntimeError naming the peer rank when the message is not through in time, or when UCX
reports an error (a peer that went away: "Connection reset ..."), so the callers'
`naming`/`naming_server` and the harness's failure handling blame the right rank.
"""

from __future__ import annotations

import ctypes
import datetime as dt
import os
import re
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

CPU = torch.device("cpu")
TAG_BITS = 32  # the wire tag's bits; the sender's rank above them
# a waiting thread's longest sleep between looks at its request: short sleeps cost the
# CPU the run's other threads need (bert_tiny wfbp_ps, 2 emulated eth10g nodes, ucx over
# gloo: 20 us 0.65x, 200 us 0.83x, 1 ms 0.92x; methods/README.md, "The wire")
POLL_MAX_S = 1e-3
ADDRESS_KEY = "ddlbench/ps_wire/ucx/address{rank}"
LANE = re.compile(r"lane\[\d+\]:\s+\d+:(\S+)")


def available() -> bool:
    """Whether ucxx can be imported here (the `.[ucx]` extra is installed)."""
    try:
        import ucxx._lib.libucxx  # noqa: F401
    except ImportError:
        return False
    return True


def ucx_tag(sender: int, tag: int) -> int:
    """The 64-bit UCX tag of wire tag `tag` sent by rank `sender`."""
    if not 0 <= tag < 1 << TAG_BITS or sender < 0:
        raise ValueError(f"ucx wire: tag {tag} from rank {sender} does not fit a UCX tag")
    return sender << TAG_BITS | tag


def seconds(timeout: float | dt.timedelta | None, default: float) -> float:
    if timeout is None:
        return default
    return timeout.total_seconds() if isinstance(timeout, dt.timedelta) else float(timeout)


class Handle:
    """One message in flight, as a `dist.Work` to its callers: `wait`, `is_completed`."""

    __slots__ = ("request", "keep", "peer", "what", "timeout_s", "lost", "after")

    def __init__(self, request: Any, keep: Any, *, peer: int, what: str, timeout_s: float,
                 lost: Callable[[], bool] | None = None) -> None:
        self.request, self.keep, self.peer, self.what = request, keep, peer, what
        self.timeout_s, self.lost = timeout_s, lost  # lost: whether the peer is gone
        self.after: Callable[[], Any] | None = None  # run once through (a copy in)

    def is_completed(self) -> bool:
        return bool(self.request.completed)

    def wait(self, timeout: float | dt.timedelta | None = None) -> bool:
        """Block until the message is through; RuntimeError naming the peer if it is not
        within `timeout` (module docstring) or if UCX failed it."""
        limit = seconds(timeout, self.timeout_s)
        deadline, pause = time.monotonic() + limit, 1e-6
        while not self.request.completed:
            if self.lost is not None and self.lost():
                raise RuntimeError(f"ucx wire: {self.what} rank {self.peer} failed: "
                                   "Connection closed (UCX reports its endpoint gone)")
            if time.monotonic() > deadline:
                raise RuntimeError(f"ucx wire: {self.what} rank {self.peer} timed out: not "
                                   f"through within {limit:g} s")
            time.sleep(pause)
            pause = min(2 * pause, POLL_MAX_S)
        try:
            self.request.check_error()
        except Exception as exc:  # noqa: BLE001 - every UCX error names its peer
            raise RuntimeError(f"ucx wire: {self.what} rank {self.peer} failed: "
                               f"{type(exc).__name__}: {exc}") from exc
        if self.after is not None:
            after, self.after = self.after, None
            after()
        return True


class Ucx:
    """The UCX wire of one rank (module docstring): `isend`/`irecv` as `wire.Gloo`'s."""

    name = "ucx"

    def __init__(self, store: Any, *, rank: int, timeout_s: float,
                 device: torch.device = CPU) -> None:
        import ucxx._lib.libucxx as ucx_api

        self.api, self.store, self.rank = ucx_api, store, rank
        self.timeout_s, self.device = timeout_s, device
        self.context = ucx_api.UCXContext(feature_flags=(ucx_api.Feature.TAG,
                                                         ucx_api.Feature.WAKEUP))
        self.cuda = bool(self.context.cuda_support)
        self.worker = ucx_api.UCXWorker(self.context)
        if device.type == "cuda":  # the progress thread runs on the rank's device
            self.worker.set_progress_thread_start_callback(torch.cuda.set_device,
                                                           cb_args=(device,))
        self.worker.start_progress_thread(polling_mode=False, epoll_timeout=1)
        self.endpoints: dict[int, Any] = {}
        self.lock = threading.Lock()
        self.closed = False

    def publish(self) -> None:
        """Put this rank's worker address in the store for its peers."""
        self.store.set(ADDRESS_KEY.format(rank=self.rank), self.worker.address.tobytes())

    def endpoint(self, peer: int) -> Any:
        """The endpoint to `peer`, made from its published address on first use."""
        with self.lock:
            if peer not in self.endpoints:
                found = self.store.get(ADDRESS_KEY.format(rank=peer))
                address = self.api.UCXAddress.create_from_buffer(found)
                try:
                    self.endpoints[peer] = self.api.UCXEndpoint.create_from_worker_address(
                        self.worker, address, True)
                except Exception as exc:  # noqa: BLE001 - a peer that is gone, named
                    raise RuntimeError(f"ucx wire: cannot reach rank {peer}: Connection "
                                       f"refused ({type(exc).__name__}: {exc})") from exc
            return self.endpoints[peer]

    def isend(self, tensor: torch.Tensor, peer: int, tag: int) -> Handle:
        if tensor.is_cuda:
            return self._device_send(tensor, peer, tag)
        array = self._array(tensor)
        request = self.endpoint(peer).tag_send(array, self.api.UCXXTag(ucx_tag(self.rank, tag)))
        return Handle(request, (tensor, array), peer=peer, what=f"a send (tag {tag}) to",
                      timeout_s=self.timeout_s)

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int) -> Handle:
        if tensor.is_cuda:
            return self._device_recv(tensor, peer, tag)
        array = self._array(tensor)
        request = self.worker.tag_recv(array, self.api.UCXXTag(ucx_tag(peer, tag)))
        return Handle(request, (tensor, array), peer=peer, what=f"a receive (tag {tag}) from",
                      timeout_s=self.timeout_s, lost=lambda: self.lost(peer))

    def _device_send(self, tensor: torch.Tensor, peer: int, tag: int) -> Handle:
        """A device tensor's send: from the GPU where UCX can, else its host copy."""
        if not self.cuda:
            return self.isend(tensor.cpu(), peer, tag)  # copied before it returns
        torch.cuda.current_stream(tensor.device).synchronize()  # its bytes are written
        array = self.api_array(tensor.detach().contiguous().reshape(-1).view(torch.uint8))
        request = self.endpoint(peer).tag_send(array, self.api.UCXXTag(ucx_tag(self.rank, tag)))
        return Handle(request, (tensor, array), peer=peer, what=f"a send (tag {tag}) to",
                      timeout_s=self.timeout_s)

    def _device_recv(self, tensor: torch.Tensor, peer: int, tag: int) -> Handle:
        """A device tensor's receive: into the GPU where UCX can, else copied in on wait."""
        if not self.cuda:
            host = torch.empty(tensor.shape, dtype=tensor.dtype)
            handle = self.irecv(host, peer, tag)
            handle.after = lambda: tensor.copy_(host)
            return handle
        if not tensor.is_contiguous():
            raise ValueError("ucx wire: only contiguous tensors can be received")
        array = self.api_array(tensor.detach().reshape(-1).view(torch.uint8))
        request = self.worker.tag_recv(array, self.api.UCXXTag(ucx_tag(peer, tag)))
        return Handle(request, (tensor, array), peer=peer, what=f"a receive (tag {tag}) from",
                      timeout_s=self.timeout_s, lost=lambda: self.lost(peer))

    def lost(self, peer: int) -> bool:
        """Whether UCX saw the endpoint to `peer` fail (a receive has no endpoint of its
        own: without this it would only time out on a peer that died)."""
        ep = self.endpoints.get(peer)
        return ep is not None and not ep.alive

    @staticmethod
    def api_array(data: Any) -> Any:
        from ucxx._lib.arr import Array

        return Array(data)

    def _array(self, tensor: torch.Tensor) -> Any:
        """A host tensor's bytes as a ucxx Array (no copy; contiguous tensors only)."""
        if not tensor.is_contiguous():
            raise ValueError("ucx wire: only contiguous tensors can be sent or received")
        return self.api_array(tensor.detach().reshape(-1).view(torch.uint8).numpy())

    def transports(self) -> list[str]:
        """The transports UCX picked for this rank's endpoints ("tcp/lo", "rc_mlx5/mlx5_0:1",
        "posix/memory", ...), sorted; empty before the first send."""
        with self.lock:
            endpoints = list(self.endpoints.values())
        found = set()
        for ep in endpoints:
            found.update(name.rsplit(".", 1)[0] if name.startswith("tcp/") else name
                         for name in LANE.findall(endpoint_info(ep)))
        return sorted(found)

    def close(self) -> None:
        """Stop the progress thread and close the endpoints (every message is through)."""
        if self.closed:
            return
        self.closed = True
        for ep in self.endpoints.values():  # while the progress thread runs: it closes them
            if ep.alive:  # closing one that UCX already closed on an error crashes ucxx
                ep.close()
        self.endpoints.clear()
        self.worker.stop_progress_thread()


def endpoint_info(ep: Any) -> str:
    """UCX's own description of endpoint `ep` (`ucp_ep_print_info`), or '' where the
    loaded UCX cannot tell."""
    try:
        ucp = ctypes.CDLL("libucp.so.0", mode=os.RTLD_NOLOAD)
        libc = ctypes.CDLL(None)
    except OSError:
        return ""
    libc.tmpfile.restype = ctypes.c_void_p
    for fn in (libc.fflush, libc.fileno, libc.fclose):
        fn.argtypes = [ctypes.c_void_p]
    ucp.ucp_ep_print_info.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    stream = libc.tmpfile()
    if not stream:
        return ""
    try:
        ucp.ucp_ep_print_info(ctypes.c_void_p(ep.handle), ctypes.c_void_p(stream))
        libc.fflush(ctypes.c_void_p(stream))
        fd = libc.fileno(ctypes.c_void_p(stream))
        os.lseek(fd, 0, os.SEEK_SET)
        chunks = []
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
        return b"".join(chunks).decode(errors="replace")
    finally:
        libc.fclose(ctypes.c_void_p(stream))
