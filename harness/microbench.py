"""`python -m harness.microbench [cluster=...] [network=...]`: the network as the methods see it.

    python -m harness.microbench cluster.workers_per_node=2          # this machine's loopback
    python -m harness.microbench cluster=emulated cluster.nodes=2 network=eth1g

Main keys: cluster=, network= (names below), cluster.nodes, cluster.workers_per_node,
microbench.min_bytes=1024, microbench.max_bytes=16777216, microbench.repeats=5, results_dir,
cluster.ps_wire (gloo | ucx: the wire the `wire` kind and PS round trips go over).

Times point-to-point transfers (half a round trip) and all-reduces over all workers
for message sizes from `microbench.min_bytes` to
`microbench.max_bytes` (powers of 4), on the configured cluster (local, emulated or
under torchrun/srun), fits t = alpha + beta * bytes to each with the same code
MG-WFBP uses at start-up (methods.costmodel), prints a table and writes one parquet
file to `<results_dir>/microbench/`, a folder the benchmark loader leaves alone.

The point-to-point kinds (column `ranks` says which pair): `p2p` is the network between
nodes, rank 0 and rank `cluster.workers_per_node` (the first worker of node 1); on a
single node, the link between its first two workers, the only one there is.
`p2p_intra`, measured apart where several nodes have several workers each, is the link
inside a node (ranks 0 and 1). With a PS `method=` (servers exist from 2 nodes on), `ps`
is a push/pull round trip per size through the real parameter server, every node's root
pushing, and `ps_flight` 16 partitions of one unit in flight, posted and landed as a PS
method's node does, a partition's share (harness/measure/psbench.py); where nodes have
several workers, `node_scatter` and `node_root` time the node's own part of a partition on
each node path (its collectives and copies, every node at once). `wire` is the `p2p`
link over the PS wire (`cluster.ps_wire`: gloo or ucx) with host tensors, as pushes and
pulls travel: run it once with each wire to compare their alpha and beta; the rows'
`ps_wire` and `ps_wire_transports` say which wire, and which transports UCX picked. Each
row names the cluster's `nodes` and `workers_per_node`: the simulator takes the all-reduce
and the PS round trip and flight of the shape (and wire) it predicts from there
(harness/predict/links.py).
"""

from __future__ import annotations

import sys

from omegaconf import DictConfig

from harness.config import ConfigError, usage
from harness.config.ranks import num_workers
from harness.launch.launcher import command
from harness.launch.process import exit_now

ENTRY = "harness.measure.microbench"  # what every rank runs


def two_workers(cfg: DictConfig) -> None:
    """Messages need two ranks: one worker would time an all-reduce that moves nothing and
    fit a link that costs nothing per byte."""
    if num_workers(cfg) < 2:
        raise ConfigError(f"harness.microbench times messages between workers, and "
                          f"cluster.nodes={cfg.cluster.nodes} x cluster.workers_per_node="
                          f"{cfg.cluster.workers_per_node} is one; use "
                          "cluster.workers_per_node=2 (this machine's loopback) or "
                          "cluster.nodes=2")


def main(argv: list[str]) -> int:
    if usage.answer(argv, __doc__):  # -h, --help: the help, and nothing else
        return 0
    return command(argv, name="harness.microbench", entry=ENTRY, check=two_workers)


if __name__ == "__main__":
    exit_now(main(sys.argv[1:]))
