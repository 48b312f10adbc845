"""The node's shared host buffer (BytePS's shared memory), for the scatter path of node-local
aggregation (methods/ps/scatter.py): every worker of a node maps one file, each copies its
slice of a partition into it, the root pushes it from there and pulls the sum back into it.

The root creates the file in /dev/shm (`SHM_DIR`; the system's temporary folder where there
is none), named by a random token, the node's root rank and the dtype, sized like the
gradient buffer, and sends the token to the node's other workers (tag SHM_TAG); each maps
the file (torch.from_file, shared=True) and answers. The root removes the file as soon as
every worker has answered, or when that fails or times out: the mappings live on until the
tensors are freed, and no file outlives `share`, whatever happens after it (the plan's
close, a crash). A worker maps only a file that exists, so it never makes one itself.

On GPUs the copies between the device and this buffer run on the host staging's copy
streams (methods/ps/node.py `HostStaging`), and each worker registers its mapping with CUDA
(`pin`: cudaHostRegister, as BytePS pins its shared memory in shared_memory.cc) while the
plan is open: the copies are then asynchronous to the host and run at page-locked speed,
so a partition's reduce-scatter overlaps the copy of the one before. `unpin` ends it.
"""

from __future__ import annotations

import datetime as dt
import os
import secrets
import tempfile
from pathlib import Path

import torch

from methods.ps import wire
from methods.ps.order import Node
from methods.ps.wire import SHM_TAG, naming

SHM_DIR = "/dev/shm"


def shm_folder() -> Path:
    """Where the node's buffer lives: /dev/shm (memory), else the temporary folder."""
    return Path(SHM_DIR) if os.path.isdir(SHM_DIR) else Path(tempfile.gettempdir())


def shared_path(folder: Path, token: int, node: Node, dtype: torch.dtype) -> Path:
    return folder / f"ddlbench-ps-{token:016x}-node{node.root}-{str(dtype).split('.')[-1]}"


def share(numel: int, dtype: torch.dtype, *, node: Node, timeout_s: float,
          folder: Path | None = None) -> torch.Tensor:
    """The node's shared buffer of `numel` elements, mapped on every worker of `node` (every
    one calls this at the same point); the file is gone when it returns (module docstring)."""
    folder = shm_folder() if folder is None else folder
    if node.is_root:
        return _create(numel, dtype, node=node, timeout_s=timeout_s, folder=folder)
    return _map(numel, dtype, node=node, timeout_s=timeout_s, folder=folder)


def _create(numel: int, dtype: torch.dtype, *, node: Node, timeout_s: float,
            folder: Path) -> torch.Tensor:
    token = secrets.randbits(62)
    path = shared_path(folder, token, node, dtype)
    try:
        shared = torch.from_file(str(path), shared=True, size=numel, dtype=dtype)
        for peer in node.ranks[1:]:
            _exchange(torch.tensor([token]), peer, send=True, timeout_s=timeout_s)
        for peer in node.ranks[1:]:
            _exchange(torch.zeros(1, dtype=torch.int64), peer, send=False, timeout_s=timeout_s)
    finally:
        path.unlink(missing_ok=True)
    return shared


def _map(numel: int, dtype: torch.dtype, *, node: Node, timeout_s: float,
         folder: Path) -> torch.Tensor:
    token = torch.zeros(1, dtype=torch.int64)
    _exchange(token, node.root, send=False, timeout_s=timeout_s)
    path = shared_path(folder, int(token), node, dtype)
    if not path.exists():
        raise RuntimeError(f"{node.name}: the node's shared buffer {path} is missing; the "
                           "workers of a node must share one machine (and /dev/shm)")
    shared = torch.from_file(str(path), shared=True, size=numel, dtype=dtype)
    _exchange(torch.ones(1, dtype=torch.int64), node.root, send=True, timeout_s=timeout_s)
    return shared


def _exchange(msg: torch.Tensor, peer: int, *, send: bool, timeout_s: float) -> None:
    """Send `msg` to, or receive it from, worker rank `peer` (tag SHM_TAG), within `timeout_s`."""
    with naming(f"worker rank {peer} (the node's shared buffer)"):
        work = wire.isend(msg, peer, tag=SHM_TAG) if send else \
            wire.irecv(msg, peer, tag=SHM_TAG)
        work.wait(dt.timedelta(seconds=timeout_s))


def pin(host: torch.Tensor) -> None:
    """Register `host` (this worker's mapping of the node's shared buffer) with CUDA as
    page-locked memory (a GPU worker only)."""
    _cudart_call("cudaHostRegister", host.data_ptr(), host.numel() * host.element_size(), 0)


def unpin(host: torch.Tensor) -> None:
    """Undo `pin` (before the mapping goes)."""
    _cudart_call("cudaHostUnregister", host.data_ptr())


def _cudart_call(name: str, *args: int) -> None:
    """Call the CUDA runtime's `name`; a RuntimeError naming it and the error code if it
    failed."""
    code = int(getattr(torch.cuda.cudart(), name)(*args))
    if code != 0:
        raise RuntimeError(f"{name} of the node's shared buffer failed with CUDA error {code}; "
                           "set method.transport.node_reduce=root to stage without it")
