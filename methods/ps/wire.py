"""The parameter-server wire protocol, shared by workers (methods/ps/transport.py, node.py)
and servers (methods/ps/server.py): tags, message kinds, the control header, dtypes, and how
a failed exchange names its peer.

Messages are matched by (peer, tag), never by arrival order:

- control stream, tag CTRL_TAG, worker -> server, fixed-size int64 headers:
  OPEN (a plan starts: its keys and sizes follow on LAYOUT_TAG), PUSH (these
  keys' data follow, each on tag KEY_TAG + key), CLOSE (the plan ends), STOP
  (the worker is done). Every worker sends OPEN, CLOSE and STOP; only roots push. A
  server keeps CTRL_AHEAD receives of each worker's stream posted, so a header never
  waits for the server to have read the one before (on Gloo a message goes only to a
  posted receive); a worker ends with CTRL_AHEAD STOPs, one for each.
- data, tag KEY_TAG + key: the root's partition; the server answers on the same tag
  with the sum over the nodes.
- inside a node (scatter path, methods/ps/scatter.py), tag KEY_TAG + key between a worker
  and its root: "my slice of the partition is in the shared buffer" (worker -> root) and
  "the pulled sum is there" (root -> worker), one int64 each; tag SHM_TAG: the name of the
  node's shared buffer (root -> worker) and "mapped" (worker -> root),
  methods/ps/shared.py; tag LANDED_TAG: the key of each partition as its pull lands at the
  root (root -> worker, in the root's landing order, one int64 each).

A header is HEADER int64 words: [op, count, dtype, values...], `dtype` an index into
DTYPES. OPEN's values are [keys, node size, server_schedule, engine_threads]; PUSH's are
the keys
whose data follow (at most HEADER - 3 per header).

Every message of the family goes through `isend`/`irecv`/`send`/`recv` here, never through
torch.distributed directly, so the wire under them is one choice per process (`use`):
Gloo's point-to-point (the default) or UCX's tag matching (methods/ps/ucx.py), with the
same calls and handles (a handle has `wait(timeout=None)` and `is_completed()`, as a
`dist.Work`). The harness picks it per run (`cluster.ps_wire`): `start` after
torch.distributed is up, `close` when the rank is done.
"""

from __future__ import annotations

import datetime as dt
import functools
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

CTRL_TAG, LAYOUT_TAG, SHM_TAG, LANDED_TAG, KEY_TAG = 1, 2, 3, 4, 16
OPEN, PUSH, CLOSE, STOP = 1, 2, 3, 4
HEADER = 64  # int64 words: [op, count, dtype, values...]
CTRL_AHEAD = 16  # a server's receives of a worker's control stream posted at once
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


def header(op: int, values: list[int] = (), dtype: int = 0) -> torch.Tensor:
    values = list(values)
    return torch.tensor([op, len(values), dtype, *values] + [0] * (HEADER - 3 - len(values)),
                        dtype=torch.int64)


@functools.lru_cache(maxsize=1 << 16)
def push_header(keys: tuple[int, ...]) -> torch.Tensor:
    """PUSH's header for `keys`, made once: a unit's pushes repeat every iteration, and on a
    GPU the Python a push costs holds back the autograd thread, which needs the GIL too
    (methods/ps/node.py). Shared, so never written (a send only reads it)."""
    return header(PUSH, keys)


def server_name(server: int, key: int | None = None) -> str:
    return f"parameter server rank {server}" + (f" (key {key})" if key is not None else "")


@contextmanager
def naming(peer: str) -> Iterator[None]:
    """Re-raise a communication error with the peer it involves."""
    try:
        yield
    except RuntimeError as exc:
        first = (str(exc).strip().splitlines() or [repr(exc)])[0]
        raise RuntimeError(f"{peer} failed or did not answer: {first}") from exc


def naming_server(server: int, key: int | None = None):
    return naming(server_name(server, key))


WIRES = ("gloo", "ucx")
CPU = torch.device("cpu")


class Gloo:
    """torch.distributed's point-to-point calls over Gloo (TCP between hosts).

    Started (`timeout_s` given, collectively on every rank), each direction between two
    ranks has a TCP connection of its own: messages to a higher rank go on one Gloo group,
    to a lower rank on another. Gloo sends a message only once its receiver has posted
    the receive and said so (NOTIFY_RECV_READY), and that word queues on the pair's one
    connection behind every byte already queued the other way (gloo/transport/tcp/pair.cc:
    one FIFO of writes a pair). On one connection a server's "ready for your next push"
    waited behind its pulls to that worker, and a worker's "ready for the pull" behind its
    pushes, so pushes and pulls took turns on a full-duplex link (harness/predict/README.md,
    "Gloo's words behind the data"). On two, a connection carries data one way only and its
    other way only those words. Not started: the default group, both ways."""

    name = "gloo"

    def __init__(self, timeout_s: float | None = None) -> None:
        self.rank, self.up, self.down = None, None, None
        if timeout_s is not None:
            timeout = dt.timedelta(seconds=timeout_s)
            self.rank = dist.get_rank()
            self.up = dist.new_group(backend="gloo", timeout=timeout)    # to a higher rank
            self.down = dist.new_group(backend="gloo", timeout=timeout)  # to a lower rank

    @staticmethod
    def transports() -> list[str]:
        return ["tcp"]  # torch's Gloo speaks TCP only

    @staticmethod
    def close() -> None:
        pass

    def isend(self, tensor: torch.Tensor, peer: int, tag: int) -> dist.Work:
        return dist.isend(tensor, dst=peer, tag=tag, group=self._group(self.rank, peer))

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int) -> dist.Work:
        return dist.irecv(tensor, src=peer, tag=tag, group=self._group(peer, self.rank))

    def _group(self, src: int | None, dst: int | None):
        """The group of a message from `src` to `dst`: `up` to a higher rank, else `down`
        (None, the default group, when not started)."""
        return None if self.rank is None else self.up if dst > src else self.down


_wire = Gloo()


def use(wire) -> None:
    """Send every message of this process's PS family over `wire` (from now on)."""
    global _wire
    _wire = wire


def current():
    return _wire


def start(name: str, *, store, rank: int, timeout_s: float,
          device: torch.device = CPU) -> None:
    """Use wire `name` (WIRES) in this process from now on, every rank at once. "gloo": its
    two groups, one a direction (`Gloo`); "ucx": a UCX worker whose address goes to `store`
    (the run's) for the peers. A wait past `timeout_s` fails."""
    if name not in WIRES:
        raise ValueError(f"ps wire {name!r} is unknown; choose one of: {', '.join(WIRES)}")
    if name == "gloo":
        use(Gloo(timeout_s))
        return
    from methods.ps.ucx import Ucx

    ucx = Ucx(store, rank=rank, timeout_s=timeout_s, device=device)
    ucx.publish()
    use(ucx)


def close() -> None:
    """End this process's wire (every message through) and go back to Gloo."""
    ending = _wire
    use(Gloo())
    ending.close()


def describe() -> dict[str, str]:
    """The row's columns of the wire in use: its name and the transports it picked."""
    return {"ps_wire": _wire.name, "ps_wire_transports": ",".join(_wire.transports())}


def isend(tensor: torch.Tensor, peer: int, *, tag: int):
    return _wire.isend(tensor, peer, tag)


def irecv(tensor: torch.Tensor, peer: int, *, tag: int):
    return _wire.irecv(tensor, peer, tag)


def send(tensor: torch.Tensor, peer: int, *, tag: int) -> None:
    _wire.isend(tensor, peer, tag).wait()


def recv(tensor: torch.Tensor, peer: int, *, tag: int) -> None:
    _wire.irecv(tensor, peer, tag).wait()
