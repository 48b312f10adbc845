"""Every bad input of every command: one line, exit code 2, nothing started, nothing written.

A row is (command, arguments, fragments of the message). `{tmp}` is the test's scratch
folder, holding `file.txt` (a file where a folder is expected) and the reference CSVs
below; `{ro}` is a folder this user cannot write. Every row runs the real command's `main` in a
fork of the test process (the commands are imported once, not once per row), with its
output folders inside `{tmp}` (harness.run also gets TINY: a missed check costs seconds).
Add a row, get a test.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest

import harness.check
import harness.methodbench
import harness.microbench
import harness.plan
import harness.report.__main__
import harness.run
import harness.simulate
import harness.submit
import harness.verify  # noqa: F401 - imported once here, inherited by each row's fork
from harness.config import checks
from harness.measure import results
from tests.conftest import TINY, run_main, run_module

RO = "/proc/sys/ddlbench-test"  # a read-only file system: not writable, even for root
RO_WRITABLE = os.access(Path(RO).parent, os.W_OK)
PUBLISHED = ("model,local_batch_size,network,method,gpus,throughput_mean,throughput_std,"
             "single_gpu_throughput")
FILES = {
    "file.txt": "not a folder\n",
    "cols.csv": "model,method\nx,y\n",
    "text.csv": "model,method,network,gpus,throughput_mean\nresnet50,bsp_a2a,ib100_rdma,4,fast\n",
    "other.csv": "model,method,network,gpus,throughput_mean\nbert_base,ddp,eth10_tcp,4,100\n",
    "bin.csv": "\x89PNG\x00\xff\xfe garbage",
    "neg.csv": "model,method,network,gpus,throughput_mean\nresnet50,bsp_a2a,ib100_rdma,4,-5\n",
    "zero.csv": "model,method,network,gpus,throughput_mean\nresnet50,bsp_a2a,ib100_rdma,4,0\n",
    "inf.csv": "model,method,network,gpus,throughput_mean\nresnet50,bsp_a2a,ib100_rdma,4,inf\n",
    "twice.csv": "model,method,network,gpus,throughput_mean\nresnet50,bsp_a2a,ib100_rdma,4,90\n"
                 "resnet50,bsp_a2a,ib100_rdma,4,95\n",
    "pubneg.csv": f"{PUBLISHED}\nresnet50,64,ib100_rdma,bsp_a2a,4,-300,1,200\n",
    "pubgpus.csv": f"{PUBLISHED}\nresnet50,64,ib100_rdma,bsp_a2a,2.5,300,1,200\n",
    "pubstd.csv": f"{PUBLISHED}\nresnet50,64,ib100_rdma,bsp_a2a,4,300,-1,200\n",
}
# One study configuration the simulator predicts from the study's GPU (no profiling).
STUDY = ["model=resnet50", "network=ib100_rdma", "simulate.compute=rtx2080ti",
         "cluster.workers_per_node=4"]
# The study's sweep, up to 32 workers and 8 servers: more than a machine of < 10 cores takes.
PAPER = ["experiment=paper", "cluster=local"]
SMOKE = ["experiment=smoke", "dry_run=true", "cluster.slurm.jobs_dir={tmp}/jobs"]
FIT = ["max(8, 4 x", "run.force=true"]

ROWS = [
    # an override a command does not read is refused, naming the command that reads it
    ("harness.run", ["simulate.iterations=3"], ["harness.run does not read simulate.iterations",
                                               "harness.simulate", "drop it"]),
    ("harness.run", ["verify.steps=2"], ["does not read verify.steps", "harness.verify"]),
    ("harness.simulate", ["microbench.repeats=2"], ["does not read microbench.repeats"]),
    ("harness.submit", ["simulate.compute=rtx2080ti"], ["harness.submit does not read"]),
    ("harness.verify", ["simulate.advise=true"], ["harness.verify does not read simulate"]),
    ("harness.microbench", ["verify.atol=1"], ["harness.microbench does not read verify.atol"]),
    ("harness.plan", ["microbench.max_bytes=9"], ["harness.plan does not read"]),
    ("harness.check", ["simulate.iterations=2"], ["harness.check does not read"]),
    # a value with a space the shell split; an interface this machine lacks
    ("harness.run", ["results_dir={tmp}/my", "results"],
     ["Error parsing override 'results'", "quote the value with its spaces",
      "/my results'"]),
    ("harness.run", ["cluster.gloo_ifname=nope0"],
     ["cluster.gloo_ifname='nope0' is not an interface of this machine", "lo"]),
    # Hydra's launchers are not a route (harness.submit is)
    ("harness.run", ["-m", "hydra/launcher=slurm"], ["hydra/launcher=slurm", "harness.submit"]),
    ("harness.submit", ["hydra.launcher.partition=gpu"], ["hydra.launcher", "harness.submit"]),
    # machine fit of local runs, lifted by run.force=true
    ("harness.run", ["cluster.workers_per_node=10000"],
     ["10000 local processes", "cluster.workers_per_node=10000", *FIT]),
    ("harness.run", ["run.threads=100000"], ["run.threads=100000", "cores", "run.force=true"]),
    ("harness.run", ["run.timed_iters=1000000000"],
     ["run.timed_iters=1000000000", "limit of 100000", "run.force=true"]),
    ("harness.run", ["run.repeats=5000"], ["run.repeats=5000", "limit of 1000"]),
    ("harness.run", PAPER, ["cluster.nodes=2", *FIT]),
    ("harness.verify", ["cluster.workers_per_node=10000"], ["10000 local processes", *FIT]),
    ("harness.microbench", ["microbench.max_bytes=4294967296"],
     ["microbench.max_bytes=4294967296", "run.force=true"]),
    ("harness.simulate", ["cluster.workers_per_node=1000"], ["1000 local processes", *FIT]),
    # rules no override lifts
    ("harness.run", ["cluster.master_port=99999"], ["cluster.master_port=99999", "0..65535"]),
    ("harness.run", ["run.force=true", "cluster.master_port=99999"], ["0..65535"]),
    ("harness.verify", ["cluster.master_port=-1"], ["cluster.master_port=-1"]),
    ("harness.run", ["cluster=emulated", "cluster.nodes=300"],
     ["cluster.nodes=300", "300 emulated hosts", "250"]),
    ("harness.run", ["run.fault.rank=99"], ["run.fault.rank=99", "0..0", "-1"]),
    ("harness.run", ["method=bsp_ps", "cluster.nodes=2", "run.fault.rank=4"],
     ["run.fault.rank=4", "0..3"]),
    ("harness.run", ["run.fault.at_iter=-1"], ["run.fault.at_iter=-1", ">= 0"]),
    # values that pass composition but could never run
    ("harness.run", ["run.timeout_s=nan"], ["run.timeout_s=nan is invalid", "finite number > 0"]),
    ("harness.run", ["run.timeout_s=inf"], ["run.timeout_s=inf is invalid"]),
    ("harness.verify", ["verify.atol=nan"], ["verify.atol=nan is invalid", ">= 0"]),
    ("harness.run", ["method=bytescheduler_a2a", "method.scheduler.cycle_s=inf"],
     ["method.scheduler.cycle_s=inf is invalid"]),
    ("harness.run", ["method=ddp", "method.planner.bucket_cap_mb=nan"],
     ["method.planner.bucket_cap_mb=nan is invalid"]),
    ("harness.run", ["cluster.master_addr=no.such.host.invalid"],
     ["cluster.master_addr=no.such.host.invalid does not resolve here", "127.0.0.1"]),
    ("harness.run", ["cluster.master_addr=192.0.2.1"],
     ["cluster.master_addr=192.0.2.1 cannot be listened on here"]),
    # a required group deleted
    ("harness.run", ["~model"], ["model.family has no value", "~model", "model=<bert_base"]),
    ("harness.simulate", ["~method"], ["method.name has no value", "method=<bsp_a2a"]),
    # numbers that cannot be, in files read as input
    ("harness.simulate", [*STUDY, "simulate.reference={tmp}/neg.csv"],
     ["column throughput_mean has value -5 (row 1)", "positive, finite"]),
    ("harness.simulate", [*STUDY, "simulate.reference={tmp}/zero.csv"],
     ["throughput_mean has value 0 (row 1)"]),
    ("harness.simulate", [*STUDY, "simulate.calibrate={tmp}/inf.csv"],
     ["throughput_mean has value inf (row 1)"]),
    ("harness.simulate", [*STUDY, "simulate.reference={tmp}/twice.csv"],
     ["{tmp}/twice.csv has 2 rows for one cell (model resnet50, method bsp_a2a, network "
      "ib100_rdma, gpus 4): rows 1 and 2; keep one"]),
    ("harness.report.__main__", ["results_dir={tmp}/results", "out_dir={tmp}/o",
                                 "reference={tmp}/pubneg.csv"],
     ["throughput_mean has value -300 (line 2)", "positive, finite"]),
    ("harness.report.__main__", ["results_dir={tmp}/results", "out_dir={tmp}/o",
                                 "reference={tmp}/pubgpus.csv"],
     ["gpus has value 2.5 (line 2)", "positive whole number"]),
    ("harness.report.__main__", ["results_dir={tmp}/results", "out_dir={tmp}/o",
                                 "reference={tmp}/pubstd.csv"],
     ["throughput_std has value -1 (line 2)", ">= 0"]),
    ("harness.microbench", ["cluster.workers_per_node=1"],
     ["times messages between workers", "cluster.workers_per_node=1", "is one",
      "cluster.workers_per_node=2"]),
    # output folders: checked, never made; an empty one is not the current folder
    ("harness.run", ["results_dir="], ["results_dir is empty", "results_dir=results"]),
    ("harness.microbench", ["results_dir="], ["results_dir is empty"]),
    ("harness.simulate", [*STUDY, "results_dir="], ["results_dir is empty"]),
    ("harness.report.__main__", ["results_dir="], ["results_dir is empty"]),
    ("harness.simulate", [*STUDY, "results_dir={tmp}/loop/results"],
     ["results_dir={tmp}/loop/results: {tmp}/loop is a symbolic link to nothing (or to itself)"]),
    ("harness.report.__main__", ["results_dir={tmp}/results", "out_dir={tmp}/loop"],
     ["symbolic link to nothing"]),
    ("harness.plan", ["--json", "{tmp}"], ["--json {tmp} is a folder", "{tmp}/plan.json"]),
    ("harness.plan", ["--json", "{tmp}/file.txt/plan.json"],
     ["cannot be written: {tmp}/file.txt is a file"]),
    ("harness.plan", ["--json", "{tmp}/loop"], ["{tmp}/loop is a symbolic link to nothing"]),
    ("harness.report.__main__", ["results_dir={tmp}/results", "out_dir= "],
     ["out_dir is empty", "(e.g. out_dir=plots)"]),
    ("harness.methodbench", ["--results-dir", ""], ["--results-dir is empty"]),
    ("harness.run", ["results_dir={tmp}/file.txt"], ["results_dir=", "file.txt is a file"]),
    ("harness.run", ["results_dir={tmp}/file.txt/results"], ["cannot be made", "is a file"]),
    ("harness.run", ["results_dir={ro}/results"], ["results_dir=", "not writable"]),
    ("harness.microbench", ["results_dir={tmp}/file.txt"], ["results_dir=", "is a file"]),
    ("harness.simulate", [*STUDY, "results_dir={tmp}/file.txt"], ["is a file"]),
    ("harness.report.__main__", ["results_dir={tmp}/results", "out_dir={tmp}/file.txt"],
     ["out_dir=", "file.txt is a file"]),
    ("harness.report.__main__", ["results_dir={tmp}/results", "out_dir={ro}/plots"],
     ["out_dir=", "not writable"]),
    # typed values, free-form keys included
    ("harness.run", ["network=eth1g", "network.rate_mbit=abc"],
     ["network.rate_mbit='abc'", "a number"]),
    ("harness.run", ["network.rate_mbit=abc"],
     ["network.rate_mbit is not a configuration key", "+network.rate_mbit="]),
    ("harness.run", ["+network.rate_mbt=3"], ["network.rate_mbt", "did you mean rate_mbit?"]),
    ("harness.run", ["method=bytescheduler_ps", "method.transport.partition_bytes=abc"],
     ["method.transport.partition_bytes='abc'", "an integer"]),
    ("harness.run", ["method=ddp", "method.planner.bucket_cap_mb=abc"],
     ["method.planner.bucket_cap_mb='abc'", "a number"]),
    ("harness.run", ["model.build.image_size=abc"], ["model.build.image_size='abc'", "integer"]),
    # values a model cannot be built or fed with, or an optimizer cannot take (failed in a rank)
    ("harness.run", ["run.timeout_s=1e-9"], ["run.timeout_s=1e-09 is too short", "at least 1"]),
    ("harness.run", ["model=bert_tiny", "model.build.seq_len=0"],
     ["model.build.seq_len=0 is invalid", ">= 1"]),
    ("harness.run", ["model=bert_tiny", "model.build.hidden_size=130", "model.build.num_heads=4"],
     ["model.build.hidden_size=130 is invalid with num_heads=4", "e.g. 132"]),
    ("harness.run", ["model=bert_tiny", "+model.build.dropout=1.5"],
     ["model.build.dropout=1.5 is invalid", "[0, 1)"]),
    ("harness.run", ["model=resnet50_small", "model.build.num_classes=0"],
     ["model.build.num_classes=0 is invalid"]),
    ("harness.verify", ["model=bert_tiny", "model.optimizer.lr=nan"],
     ["model.optimizer.lr=nan is invalid", ">= 0"]),
    ("harness.run", ["model=resnet50_small", "model.optimizer.momentum=-0.5"],
     ["model.optimizer.momentum=-0.5 is invalid"]),
    ("harness.run", ["method=mgwfbp", "method.planner.profile_iters=0"],
     ["method.planner.profile_iters=0 is invalid"]),
    ("harness.run", ["cluster.workers_per_node=abc"], ["cluster.workers_per_node", "'abc'"]),
    ("harness.simulate", [*STUDY, "network.ps_host_copy=abc"],
     ["network.ps_host_copy='abc'", "true or false"]),
    ("harness.simulate", [*STUDY, "simulate.gpus.rtx2080ti.resnet50=abc"],
     ["simulate.gpus.rtx2080ti.resnet50='abc'", "samples/s"]),
    ("harness.simulate", [*STUDY, "simulate.compute=h100", "+simulate.gpus.h100={{resnet50: 900}}"],
     ["simulate.compute='h100' is unknown", "h100_sxm"]),
    ("harness.simulate", ["experiment=paper", "network=ib100_rdma", "cluster.workers_per_node=3"],
     ["simulate.mgwfbp_cost=study: MG-WFBP's cost=study has", "not 3",
      "set simulate.mgwfbp_cost=fitted"]),
    ("harness.simulate", [*STUDY, "method=mgwfbp", "simulate.mgwfbp_cost=table"],
     ["simulate.mgwfbp_cost='table' is invalid", "fitted, study"]),
    # misspelled keys and choices
    ("harness.run", ["run.timed_iter=5"], ["run.timed_iter", "did you mean run.timed_iters?"]),
    ("harness.run", ["+run.timed_iter=5"], ["did you mean run.timed_iters?"]),
    ("harness.run", ["modle=bert_tiny"], ["modle", "did you mean model?"]),
    ("harness.run", ["model=bert_tin"], ["model 'bert_tin' is unknown", "did you mean bert_tiny?"]),
    ("harness.verify", ["cluster.worker_per_node=2"], ["did you mean cluster.workers_per_node?"]),
    # the simulator's reference, read and checked before anything is simulated
    ("harness.simulate", [*STUDY, "simulate.reference={tmp}/none.csv"], ["does not exist"]),
    ("harness.simulate", [*STUDY, "simulate.reference={tmp}/cols.csv"], ["lacks columns"]),
    ("harness.simulate", [*STUDY, "simulate.reference={tmp}/text.csv"],
     ["column throughput_mean", "non-numeric value 'fast'"]),
    ("harness.simulate", [*STUDY, "simulate.reference={tmp}/bin.csv"], ["is unreadable"]),
    ("harness.simulate", [*STUDY, "simulate.reference={tmp}/other.csv"],
     ["has no cell of this sweep"]),
    # the report's own arguments
    ("harness.report.__main__", ["results_dir={tmp}/results", "out_dir={tmp}/o", "colour=red"],
     ["unknown argument 'colour=red'"]),
    ("harness.report.__main__", ["results_dir={tmp}/results", "out_dir={tmp}/o",
                        "reference={tmp}/none.csv"], ["reference file", "not found"]),
    # submit's own options, Slurm settings and folders
    ("harness.submit", [*SMOKE, "dryrun=true"], ["did you mean dry_run=true?"]),
    ("harness.submit", [*SMOKE, "dry_run=maybe"], ["dry_run='maybe'", "true or false"]),
    ("harness.submit", [*SMOKE, "cluster.slurm.jobs_dir={tmp}/file.txt/jobs"],
     ["cluster.slurm.jobs_dir=", "cannot be made"]),
    ("harness.submit", [*SMOKE, "results_dir={tmp}/file.txt"], ["results_dir=", "is a file"]),
    ("harness.submit", [*SMOKE, "cluster.slurm.gpus_per_node=abc"],
     ["cluster.slurm.gpus_per_node", "'abc'"]),
    ("harness.submit", [*SMOKE, "cluster.slurm.gpu_per_node=1"],
     ["did you mean cluster.slurm.gpus_per_node"]),
    ("harness.submit", [*SMOKE, "cluster.slurm.partition='gpu\ntouch /tmp/x'"],
     ["cluster.slurm.partition='gpu\\ntouch /tmp/x' is invalid", "a partition name"]),
    ("harness.submit", [*SMOKE, "cluster.slurm.time=forever"],
     ["cluster.slurm.time='forever' is invalid", "01:30:00"]),
    ("harness.submit", [*SMOKE, "cluster.slurm.max_parallel=-1"],
     ["cluster.slurm.max_parallel=-1 is invalid"]),
    ("harness.submit", [*SMOKE, "cluster.slurm.extra=['--output=/tmp/x']"],
     ["sets --output", "set cluster.slurm.jobs_dir instead"]),
    # methodbench's arguments; every run it would make is validated first
    ("harness.methodbench", ["--models", "bert_tin"], ["--models 'bert_tin' is unknown",
                                                       "did you mean bert_tiny?"]),
    ("harness.methodbench", ["--methods", "wfbp"], ["--methods 'wfbp' is unknown"]),
    ("harness.methodbench", ["--workers", "0"], ["--workers 0 is invalid"]),
    ("harness.methodbench", ["--workers", "1,x"], ["--workers 1,x is invalid"]),
    ("harness.methodbench", ["--rounds", "0"], ["--rounds 0", ">= 1"]),
    ("harness.methodbench", ["--timed-iters", "0"], ["--timed-iters 0", ">= 1"]),
    ("harness.methodbench", ["--warmup-iters", "abc"], ["--warmup-iters", "invalid int"]),
    ("harness.methodbench", ["--nope"], ["unrecognized arguments: --nope"]),
    ("harness.methodbench", ["--nodes", "0"], ["--nodes 0 is invalid", ">= 1"]),
    ("harness.methodbench", ["--node-reduce", "ring"], ["--node-reduce 'ring' is unknown",
                                                        "scatter, root"]),
    ("harness.methodbench", ["--results-dir", "{tmp}/file.txt"], ["--results-dir", "is a file"]),
    ("harness.methodbench", ["--methods", "bsp_ps", "--engines", "horovod"],
     ["--methods bsp_ps with --engines horovod selects no run", "--engines native"]),
    ("harness.methodbench", ["--workers", "1000"], ["1000 local processes", "--force"]),
    # a measured GPU profile: a GPU per profiling process (none here, or fewer than 512)
    ("harness.simulate", ["simulate.compute=measured", "cluster.device=cuda",
                          "cluster.workers_per_node=512", "run.force=true"],
     ["simulate.compute=measured", "GPU", "cluster.device=cpu"]),
    # -- issue 37: deleted keys, parse errors, reference files, traces ----------------------
    ("harness.run", ["~run.seed"], ["~run.seed: run.seed is required", "silently put back",
                                    "drop ~run.seed, or set it: run.seed=<value>"]),
    ("harness.simulate", [*STUDY, "~run"], ["~run: run is required", "run.<key>=<value>"]),
    ("harness.verify", ["~cluster.workers_per_node"], ["cluster.workers_per_node is required"]),
    ("harness.microbench", ["~results_dir"], ["results_dir is required"]),
    ("harness.check", ["~model.local_batch_size"], ["model.local_batch_size is required"]),
    ("harness.run", ["~cluster"], ["~cluster: every configuration needs a cluster",
                                   "cluster=<emulated | local | slurm>"]),
    ("harness.plan", ["~network"], ["every configuration needs a network", "network=<"]),
    ("harness.run", ["model=bert_tiny", "nope"], ["Error parsing override 'nope'",
                                                  "give key=value overrides"]),
    ("harness.plan", ["--json"], ["--json needs a file name"]),
    ("harness.simulate", [*STUDY, "simulate.reference={tmp}/empty.csv"],
     ["{tmp}/empty.csv: column throughput_mean has an empty value (row 1)"]),
    ("harness.simulate", [*STUDY, "simulate.calibrate={tmp}/nomodel.csv"],
     ["column model has an empty value (row 1)"]),
    ("harness.simulate", [*STUDY, "simulate.reference={tmp}/frac.csv"],
     ["column gpus has value 2.5 (row 1)", "positive whole number"]),
    ("harness.simulate", [*STUDY, "simulate.reference={tmp}/extra.csv"],
     ["a row has more fields than the header has columns"]),
    ("harness.report.__main__", ["results_dir={tmp}/results", "out_dir={tmp}/o",
                                 "reference={tmp}/pubdup.csv"],
     ["reference file '{tmp}/pubdup.csv' has 2 rows for one cell (model resnet50, "
      "local_batch_size 64, network ib100_rdma, method bsp_a2a, gpus 4): lines 2 and 3"]),
    ("harness.report.__main__", ["results_dir={tmp}/results", "out_dir={tmp}/o",
                                 "reference={tmp}/pubempty.csv"],
     ["column throughput_mean has an empty value (line 2)"]),
    ("harness.report.__main__", ["results_dir={tmp}/results", "out_dir={tmp}/o",
                                 "reference={tmp}/pubbig.csv"],
     ["column gpus has value 1e+23 (line 2)", "whole number"]),
    ("harness.report.__main__", ["results_dir={tmp}/results", "out_dir={tmp}/o",
                                 "reference={tmp}/pubbatch.csv"],
     ["column local_batch_size has value -64 (line 2)"]),
    ("harness.report.__main__", ["results_dir={tmp}/results", "out_dir={tmp}/o",
                                 "reference={tmp}/pubmodel.csv"],
     ["column model has an empty value (line 2)"]),
    ("harness.report.__main__", ["results_dir={tmp}/results", "out_dir={tmp}/o",
                                 "timeline={tmp}/list.json"],
     ["timeline={tmp}/list.json cannot be read as a trace: it holds a JSON list",
      "run.trace=true"]),
    ("harness.report.__main__", ["results_dir={tmp}/results", "out_dir={tmp}/o",
                                 "timeline={tmp}/ts.json"],
     ["traceEvents[1].ts is \"abc\"; it must be a number"]),
    ("harness.report.__main__", ["results_dir={tmp}/results", "out_dir={tmp}/o",
                                 "timeline={tmp}/about.json"],
     ["ddlbench.workers is missing (a whole number is needed)"]),
    ("harness.report.__main__", ["results_dir={tmp}/results", "out_dir={tmp}/o",
                                 "timeline={tmp}/deep.json"], ["nested too deeply"]),
    # faults: verify injects none (it would pass silently), an unknown kind is named
    ("harness.verify", ["run.fault.rank=1", "cluster.workers_per_node=2"],
     ["run.fault.rank=1", "harness.verify does not inject faults", "python -m harness.run",
      "drop run.fault"]),
    ("harness.run", ["run.fault.rank=0", "run.fault.kind=freeze"],
     ["run.fault.kind='freeze' is invalid", "raise, exit, hang, stop, abort"]),
    # BytePS's server engine threads (issue 39, item 4)
    ("harness.run", ["method=wfbp_ps", "method.transport.engine_threads=0"],
     ["method.transport.engine_threads=0 is invalid", "> 0"]),
    ("harness.run", ["method=bsp_ps", "method.transport.engine_threads=2.5"],
     ["method.transport.engine_threads=2.5", "an integer"]),
    # any cluster from any machine: the GPU table (issue 41)
    ("harness.simulate", [*STUDY, "simulate.compute=v100", "simulate.precision=bf16"],
     ["simulate.precision=bf16 is not a unit of GPU v100", "choose one of: fp32"]),
    ("harness.simulate", [*STUDY, "simulate.precision=fp16"],
     ["simulate.precision='fp16' is invalid", "fp32, tf32, bf16"]),
    ("harness.simulate", [*STUDY, "simulate.compute=h100_sxm", "simulate.efficiency=1.5"],
     ["simulate.efficiency=1.5 is invalid", "(0, 1]"]),
    ("harness.plan", ["network=ib_ndr", "cluster.device=cuda", "method=mgwfbp"],
     ["shows none", "simulate.compute=<gpu>"]),
    # the what-if fast path checks each job's shape (issue 41, item 4)
    ("harness.simulate", ["experiment=whatif", "cluster.nodes=1,2,4,8,16,32,64,x"],
     ["cluster.nodes=x is not a count of at least 1", "cluster.nodes=2"]),
    # the simulator against our own runs: methodbench --selfcheck (issue 43)
    ("harness.methodbench", ["--selfcheck", "bert_tiny"],
     ["--selfcheck takes key=value overrides, not 'bert_tiny'"]),
    ("harness.methodbench", ["--selfcheck", "model=bert_tin"], ["model 'bert_tin' is unknown"]),
    ("harness.methodbench", ["--selfcheck", "results_dir={tmp}/file.txt"],
     ["results_dir={tmp}/file.txt is a file"]),
    ("harness.methodbench", ["--selfcheck", "--predict"], ["--predict needs the folder"]),
    ("harness.methodbench", ["--selfcheck", "run.warmup_iters=3"], ["run.warmup_iters>=5"]),
    ("harness.methodbench", ["--selfcheck", "--predict", "{tmp}"],
     ["--predict {tmp} holds no microbenchmark"]),
    # the PS wire (issue 40): cluster.ps_wire
    ("harness.run", ["method=bsp_ps", "cluster.ps_wire=rdma"],
     ["cluster.ps_wire='rdma' is invalid", "gloo, ucx"]),
    ("harness.check", ["cluster.ps_wire=tcp"], ["cluster.ps_wire='tcp' is invalid"]),
    ("harness.submit", ["method=bsp_ps", "cluster.ps_wire=UCX", "dry_run=true"],
     ["cluster.ps_wire='UCX' is invalid"]),
    # a real network's PS wire (issue 40 item 6)
    ("harness.simulate", [*STUDY, "network.ps_wire=gloo"],
     ["network.ps_wire='gloo' is invalid", "rdma, tcp"]),
    ("harness.simulate", ["network=eth1g", "+network.ps_wire=tcp"],
     ["network.ps_wire='tcp' is invalid", "cluster.ps_wire"]),
]
ABOUT = {"traced_us": [0, 10], "source": "simulated", "model": "m", "method": "x",
         "network": "n", "local_batch_size": 1}  # a trace's "ddlbench" key, less "workers"
EVENTS = [{"ph": "M", "pid": 1_000_000, "tid": 1, "name": "thread_name", "args": {"name": "c"}},
          {"ph": "X", "pid": 1_000_000, "tid": 1, "name": "forward", "ts": "abc", "dur": 1}]
FILES.update({  # issue 37's
    "empty.csv": "model,method,network,gpus,throughput_mean\nresnet50,bsp_a2a,ib100_rdma,4,\n",
    "nomodel.csv": "model,method,network,gpus,throughput_mean\n,bsp_a2a,ib100_rdma,4,9\n",
    "frac.csv": "model,method,network,gpus,throughput_mean\nresnet50,bsp_a2a,ib100_rdma,2.5,9\n",
    "extra.csv": "model,method,network,gpus,throughput_mean\nresnet50,bsp_a2a,ib100_rdma,4,9,1\n",
    "pubdup.csv": f"{PUBLISHED}\nresnet50,64,ib100_rdma,bsp_a2a,4,300,1,200\n"
                  "resnet50,64,ib100_rdma,bsp_a2a,4.0,310,1,200\n",
    "pubempty.csv": f"{PUBLISHED}\nresnet50,64,ib100_rdma,bsp_a2a,4,,1,200\n",
    "pubbig.csv": f"{PUBLISHED}\nresnet50,64,ib100_rdma,bsp_a2a,99999999999999999999999,3,1,2\n",
    "pubbatch.csv": f"{PUBLISHED}\nresnet50,-64,ib100_rdma,bsp_a2a,4,300,1,200\n",
    "pubmodel.csv": f"{PUBLISHED}\n,64,ib100_rdma,bsp_a2a,4,300,1,200\n",
    "list.json": "[1, 2]",
    "ts.json": json.dumps({"ddlbench": {**ABOUT, "workers": 1}, "traceEvents": EVENTS}),
    "about.json": json.dumps({"ddlbench": ABOUT, "traceEvents": []}),
    "deep.json": "[" * 100_000 + "]" * 100_000,
})
NUMPY_REPR = re.compile(r"\b(np|numpy)\.\w+\(")  # np.float64(nan), np.int64(64)
DEFAULTS = {  # where each command would write, inside the scratch folder
    "harness.run": ["results_dir={tmp}/results", *TINY],
    "harness.verify": ["results_dir={tmp}/results", *TINY],
    "harness.microbench": ["results_dir={tmp}/results"],
    "harness.simulate": ["results_dir={tmp}/results"],
    "harness.submit": ["results_dir={tmp}/results"],
    "harness.report.__main__": [],
    "harness.plan": [],
    "harness.check": [],
    "harness.methodbench": ["--results-dir", "{tmp}/results", "--rounds", "1"],
}


def _argv(module: str, args: list[str]) -> list[str]:
    """The row's arguments after the command's defaults that it does not set itself."""
    if module == "harness.methodbench" and args[:1] == ["--selfcheck"]:
        return args  # Hydra overrides of its own (harness/predict/selfcheck.py)
    if module == "harness.methodbench":
        flags = {a for a in args if a.startswith("--")}
        pairs = list(zip(DEFAULTS[module][::2], DEFAULTS[module][1::2]))
        return [x for flag, value in pairs if flag not in flags for x in (flag, value)] + args
    keys = {a.split("=", 1)[0].lstrip("+~") for a in args}
    return [a for a in DEFAULTS[module] if a.split("=", 1)[0] not in keys] + args


def _files(root: Path) -> set[Path]:
    return set(root.rglob("*"))


@pytest.mark.parametrize("module, args, fragments", ROWS,
                         ids=[f"{m.split('.')[1]}:{' '.join(a)}" for m, a, _ in ROWS])
def test_bad_input_is_one_line_exit_2_and_nothing_written(module: str, args: list[str],
                                                          fragments: list[str],
                                                          tmp_path: Path) -> None:
    if any("{ro}" in a for a in args) and RO_WRITABLE:
        pytest.skip(f"{Path(RO).parent} is writable here: no read-only folder to test with")
    if args == PAPER and checks.max_processes() >= 40:
        pytest.skip("this machine takes the study's 40 local processes")
    for name, text in FILES.items():
        (tmp_path / name).write_bytes(text.encode("latin-1"))
    (tmp_path / "loop").symlink_to(tmp_path / "loop")  # a path that resolves to itself
    before = _files(tmp_path)
    argv = [a.format(tmp=tmp_path, ro=RO) for a in _argv(module, args)]
    start = time.monotonic()
    out = run_main(module, *argv, timeout=120)
    elapsed = time.monotonic() - start
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    assert len(lines) == 1 and lines[0].startswith("ddlbench: error: "), out.stderr
    assert not NUMPY_REPR.search(lines[0]), f"a library's repr in a message: {lines[0]}"
    for fragment in fragments:
        assert fragment.format(tmp=tmp_path) in lines[0], lines[0]
    assert _files(tmp_path) == before, "bad input may write nothing"
    assert not Path(RO).exists()
    assert elapsed < 60, f"bad input took {elapsed:.0f}s: something started"


# --- unreadable shards are listed and skipped by every reader, never fatal ---------------

def _bad_shards(folder: Path) -> list[Path]:
    """A garbage file named *.parquet and a parquet table that is no result shard."""
    import pandas as pd

    folder.mkdir(parents=True, exist_ok=True)
    garbage = folder / "garbage.parquet"
    garbage.write_text("not parquet")
    other = folder / "other.parquet"
    pd.DataFrame({"kind": ["p2p"], "bytes": [4], "seconds": [1e-6]}).to_parquet(other)
    return [garbage, other]


def _warned(stderr: str, paths: list[Path]) -> None:
    for path in paths:
        lines = [ln for ln in stderr.splitlines() if str(path) in ln]
        assert lines and all(ln.startswith("ddlbench: warning: ") for ln in lines), stderr


def test_run_skips_unreadable_shards_in_its_summary(tmp_path: Path) -> None:
    res = tmp_path / "results"
    bad = _bad_shards(res)
    out = run_module("harness.run", "model=bert_tiny", "method=ddp", *TINY,
                     f"results_dir={res}", timeout=300)
    assert out.returncode == 0, out.stderr
    _warned(out.stderr, bad)
    assert "samples/s over 1 repeats" in out.stdout


def test_report_lists_unreadable_shards(tmp_path: Path) -> None:
    res, plots = tmp_path / "results", tmp_path / "plots"
    bad = _bad_shards(res)
    row = {"run_id": "r", "model": "toy", "method": "ddp", "world_size": 1, "repeat": 0,
           "throughput": 10.0, "status": "ok", "source": "measured", "network": "loopback",
           "local_batch_size": 8}
    assert results.write_shard(results.shard_path(res, "r", 0), [row])
    out = run_module("harness.report", f"results_dir={res}", f"out_dir={plots}")
    assert out.returncode == 0, out.stderr
    _warned(out.stderr, bad)
    summary = (plots / "summary.md").read_text()
    assert "Unreadable shards" in summary and all(p.name in summary for p in bad)


def test_submit_skips_unreadable_shards(tmp_path: Path) -> None:
    res = tmp_path / "results"
    bad = _bad_shards(res)
    out = run_module("harness.submit", "experiment=smoke", "dry_run=true", f"results_dir={res}",
                     f"cluster.slurm.jobs_dir={tmp_path / 'jobs'}", timeout=120)
    assert out.returncode == 0, out.stderr
    _warned(out.stderr, bad)
    assert "0 already complete" in out.stdout
