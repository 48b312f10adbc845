"""`python -m harness.plan [overrides] [--json FILE]`: the communication plan of a method.

    python -m harness.plan model=resnet50 method=wfbp_ps cluster.nodes=4
    python -m harness.plan model=bert_base method=mgwfbp network=ib100_rdma \\
        cluster.nodes=2 cluster.workers_per_node=4 simulate.compute=rtx2080ti --json plan.json

Prints what a method will communicate, without training: its units in the order
they are issued (tensor names, elements, bytes, priority), MG-WFBP's merged groups
(from the compute of `simulate.compute` and the all-reduce cost of a real `network`
profile or of this network's microbenchmark; otherwise the one bucket it profiles
with, saying so), and for parameter servers each partition's key and server with
the bytes per server and busiest / mean, and the worker's pipeline: a thread per stage
and what it runs per partition (methods/ps/stages.py). The model is built on the meta device (no
memory, no weights); only MG-WFBP's groups with `simulate.compute=measured` (the
default) time the real model here, as the simulator does, for a few iterations, in one
process (in one per worker only for a run of this machine's own: local or emulated on
loopback or a rate-limited network); `simulate.compute=<gpu>` (conf/gpu/) counts it. The
simulator plans through the same functions (`plan_of`), and the PS transport places
partitions with the same rules (methods/layout.py).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from harness import config
from harness.config import checks, paths, usage
from harness.predict.plans import describe, mgwfbp_inputs, plan_of, render, tensors
from harness.predict.profile import unlike_device
from methods.ps.stage_table import stage_lines


def main(argv: list[str]) -> int:
    if usage.answer(argv, __doc__):  # -h, --help: the help, and nothing else
        return 0
    out = None
    if "--json" in argv:
        i = argv.index("--json")
        if i + 1 >= len(argv):
            print("ddlbench: error: --json needs a file name, e.g. --json plan.json",
                  file=sys.stderr)
            return 2
        out, argv = Path(argv[i + 1]), argv[:i] + argv[i + 2:]
    try:
        checks.used_by("harness.plan", argv)
        if out is not None:
            paths.output_file("--json", out)
        # only MG-WFBP's measured profile starts processes here: the machine-fit limits are
        # its alone (one process, unless the plan is of this machine's own run)
        cfg = config.load(["run.force=true", *argv], simulate=True)
        profiles = cfg.method.planner.name == "mgwfbp" and cfg.simulate.compute == "measured"
        if profiles:
            cfg = config.load(argv, simulate=True)
            if unlike_device(cfg):
                print(f"ddlbench: note: {unlike_device(cfg)}", file=sys.stderr, flush=True)
        model = tensors(cfg.model)
        backward_s, cost = (mgwfbp_inputs(cfg) if cfg.method.planner.name == "mgwfbp"
                            else (None, None))
        data = describe(cfg, model, plan_of(cfg, model, backward_s=backward_s, cost=cost))
    except config.ConfigError as exc:
        print(f"ddlbench: error: {exc}", file=sys.stderr)
        return 2
    try:
        print("\n".join([render(data), *_ps_stages(data)]), flush=True)
    except BrokenPipeError:  # `| head`: the reader has what it wanted
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - Python flushes it at exit
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(data, indent=1))
        print(f"plan -> {out}")
    return 0


def _ps_stages(data: dict) -> list[str]:
    """A PS method's pipeline with servers: which thread runs what, per partition."""
    t, c = data["transport"], data["cluster"]
    if t.get("name") != "ps" or not c["servers"]:
        return []
    per_node = c["workers_per_node"] if t.get("local_reduce", True) else 1
    return ["", *stage_lines(t.get("node_reduce", "scatter"), per_node)]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
