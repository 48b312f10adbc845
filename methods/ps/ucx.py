"""The UCX wire: the PS family's messages (methods/ps/wire.py) over UCX tag matching,
on ucxx's synchronous core API (`ucxx._lib.libucxx`), beside Gloo's point-to-point.

One UCX context and worker per process, progressed by one thread of ours (`Progress`, on
the rank's device) in UCX's blocking mode: it sleeps in epoll on the worker's event file
until the network or a request has something for it, progresses the worker, and wakes the
threads waiting for a message that is now through. A waiter blocks on its own Event (no
polling, no CPU while it waits). Each rank publishes its worker address in the run's
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
reports an error (a peer that went away: "Connection reset ..."; the progress thread wakes
a receive's waiter as soon as UCX saw the peer's endpoint fail), so the callers'
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

from methods import base

CPU = torch.device("cpu")
TAG_BITS = 32  # the wire tag's bits; the sender's rank above them
# the progress thread's longest sleep in epoll: it wakes on the worker's events; this only
# bounds a wake-up UCX did not signal (and how long close() waits for the thread)
EPOLL_TIMEOUT_MS = 10
CLOSE_S = 1.0  # how long close() lets UCX close the endpoints
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


class Progress:
    """The worker's progress thread (module docstring) and the threads waiting on it."""

    def __init__(self, worker: Any, device: torch.device) -> None:
        self.worker, self.running = worker, True
        self.lock = threading.Lock()
        self.waiting: set[Handle] = set()  # the handles a thread is blocked on now
        worker.init_blocking_progress_mode()
        self.thread = base.start_thread(self.run, name="ucx-progress", device=device,
                                        stream=base.side_stream(device, "ucx progress"))

    def run(self) -> None:
        while self.running:
            self.worker.progress_worker_event(EPOLL_TIMEOUT_MS)  # progress, else epoll
            if self.waiting:
                self.wake()

    def wake(self) -> None:
        """Set the Event of every waiting handle whose message is through or lost."""
        with self.lock:
            ready = [handle for handle in self.waiting if handle.ready()]
            self.waiting.difference_update(ready)
        for handle in ready:
            handle.event.set()

    def block(self, handle: Handle, limit: float) -> None:
        """Return once `handle` is ready (`Handle.ready`) or `limit` seconds passed."""
        handle.event = threading.Event()
        with self.lock:
            self.waiting.add(handle)
        if not handle.ready():  # else it was ready before the thread could see it wait
            handle.event.wait(limit)
        with self.lock:
            self.waiting.discard(handle)

    def stop(self) -> None:
        self.running = False
        self.thread.join()


class Handle:
    """One message in flight, as a `dist.Work` to its callers: `wait`, `is_completed`."""

    __slots__ = ("request", "keep", "peer", "what", "timeout_s", "lost", "after",
                 "progress", "event")

    def __init__(self, request: Any, keep: Any, *, peer: int, what: str, timeout_s: float,
                 progress: Progress, lost: Callable[[], bool] | None = None) -> None:
        self.request, self.keep, self.peer, self.what = request, keep, peer, what
        self.timeout_s, self.lost = timeout_s, lost  # lost: whether the peer is gone
        self.progress, self.event = progress, None
        self.after: Callable[[], Any] | None = None  # run once through (a copy in)

    def is_completed(self) -> bool:
        return bool(self.request.completed)

    def ready(self) -> bool:
        """Whether a wait would return now: the message is through, or its peer lost."""
        return self.request.completed or (self.lost is not None and self.lost())

    def wait(self, timeout: float | dt.timedelta | None = None) -> bool:
        """Block until the message is through; RuntimeError naming the peer if it is not
        within `timeout` (module docstring) or if UCX failed it."""
        limit = seconds(timeout, self.timeout_s)
        if not self.request.completed:
            self.progress.block(self, limit)
        if not self.request.completed:
            if self.lost is not None and self.lost():
                raise RuntimeError(f"ucx wire: {self.what} rank {self.peer} failed: "
                                   "Connection closed (UCX reports its endpoint gone)")
            raise RuntimeError(f"ucx wire: {self.what} rank {self.peer} timed out: not "
                               f"through within {limit:g} s")
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
        self.progress = Progress(self.worker, device)
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
        return self._send(tensor, self._array(tensor), peer, tag)

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int) -> Handle:
        if tensor.is_cuda:
            return self._device_recv(tensor, peer, tag)
        return self._recv(tensor, self._array(tensor), peer, tag)

    def _device_send(self, tensor: torch.Tensor, peer: int, tag: int) -> Handle:
        """A device tensor's send: from the GPU where UCX can, else its host copy."""
        if not self.cuda:
            return self.isend(tensor.cpu(), peer, tag)  # copied before it returns
        torch.cuda.current_stream(tensor.device).synchronize()  # its bytes are written
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        return self._send(tensor, self.api_array(data), peer, tag)

    def _device_recv(self, tensor: torch.Tensor, peer: int, tag: int) -> Handle:
        """A device tensor's receive: into the GPU where UCX can, else copied in on wait."""
        if not self.cuda:
            host = torch.empty(tensor.shape, dtype=tensor.dtype)
            handle = self.irecv(host, peer, tag)
            handle.after = lambda: tensor.copy_(host)
            return handle
        if not tensor.is_contiguous():
            raise ValueError("ucx wire: only contiguous tensors can be received")
        return self._recv(tensor, self.api_array(tensor.detach().reshape(-1).view(torch.uint8)),
                          peer, tag)

    def _send(self, tensor: torch.Tensor, array: Any, peer: int, tag: int) -> Handle:
        """Post `array` (the bytes of `tensor`, kept alive with it) to `peer` on `tag`."""
        request = self.endpoint(peer).tag_send(array, self.api.UCXXTag(ucx_tag(self.rank, tag)))
        return self.handle(request, (tensor, array), peer, f"a send (tag {tag}) to")

    def _recv(self, tensor: torch.Tensor, array: Any, peer: int, tag: int) -> Handle:
        """Post a receive into `array` (the bytes of `tensor`) from `peer` on `tag`."""
        request = self.worker.tag_recv(array, self.api.UCXXTag(ucx_tag(peer, tag)))
        return self.handle(request, (tensor, array), peer, f"a receive (tag {tag}) from",
                           lost=lambda: self.lost(peer))

    def handle(self, request: Any, keep: Any, peer: int, what: str,
               lost: Callable[[], bool] | None = None) -> Handle:
        return Handle(request, keep, peer=peer, what=what, timeout_s=self.timeout_s,
                      progress=self.progress, lost=lost)

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
        """Close the endpoints, then stop the progress thread (every message is through)."""
        if self.closed:
            return
        self.closed = True
        closing = [self.handle(ep.close(), None, peer, "closing the endpoint to")
                   for peer, ep in self.endpoints.items()
                   if ep.alive]  # closing one that UCX already closed on an error crashes ucxx
        deadline = time.monotonic() + CLOSE_S
        for handle in closing:  # the progress thread closes them
            self.progress.block(handle, max(0.0, deadline - time.monotonic()))
        self.endpoints.clear()
        self.progress.stop()


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
