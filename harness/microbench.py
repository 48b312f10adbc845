"""`python -m harness.microbench [cluster=...] [network=...]`: the network as the methods see it.

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
inside a node (ranks 0 and 1).
"""

from __future__ import annotations

import sys

from harness.launch.launcher import command
from harness.launch.rank import exit_now

ENTRY = "harness.measure.microbench"  # what every rank runs


def main(argv: list[str]) -> int:
    return command(argv, entry=ENTRY)


if __name__ == "__main__":
    exit_now(main(sys.argv[1:]))
