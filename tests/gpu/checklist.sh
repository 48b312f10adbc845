#!/bin/bash
# The team's GPU checklist (tests/README.md) in one call. Logs: $OUT/{a..f}.log.
# Phase 1 (correctness, lanes in parallel): steps 3-8, 11-16. Phase 2 (timing, alone): 1, 9, 10,
# experiment=paper's settings, 2.
set -u
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
PY=${PY:-python3}; DEV=${DEV:-cuda}; P1=${P1:-200}; OUT=${OUT:-/tmp/gpuout}; R=/tmp/gpuck
mkdir -p "$OUT" "$R"; rm -rf "$R"/*
T0=$(date +%s)
hdr() { echo; echo "=== $* (t+$(( $(date +%s) - T0 ))s)"; }
run() { local s=$1; shift; echo "\$ $*"; timeout -k 5 "$s" "$@" 2>&1 | grep -v -E "^\s*$|it/s\]|s/it\]" | tail -n "${TAILN:-25}"; echo "[rc=${PIPESTATUS[0]}]"; }
METHODS="${METHODS:-bsp_a2a wfbp_a2a mgwfbp bytescheduler_a2a ddp bsp_ps wfbp_ps bytescheduler_ps priority_ps}"
NOLOCAL=method.transport.local_reduce=false  # one node with a server of its own: the PS path, not the node's reduce
# step 14's one-GPU part compares two timings: in phase 2, alone (beside phase 1's lanes the GPU is shared)
ONE_GPU_TIMING=predicts_a_one_gpu_run

byhand() {  # byhand PORT LOG MODULE overrides...: 2 workers (+1 server for PS) started by hand, LOCAL_RANK=0 each
  local port=$1 log=$2 mod=$3; shift 3
  local n=2 extra=""; if [[ " $* " == *"_ps "* ]]; then n=3; extra="cluster.servers=1"; fi
  local pids=() r
  for ((r=0; r<n; r++)); do
    RANK=$r WORLD_SIZE=$n LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
      timeout -k 5 150 $PY -m $mod "$@" cluster.nodes=2 cluster.workers_per_node=1 \
      cluster.backend=gloo cluster.device=$DEV $extra > "$log.$r" 2>&1 & pids+=($!)
  done
  local rc=0; for p in "${pids[@]}"; do wait "$p" || rc=$?; done
  echo "rc=$rc"; tail -n 3 "$log.0"; [ $rc = 0 ] || tail -n 8 "$log".*
}
export -f byhand; export PY DEV NOLOCAL

hdr "step 0: environment" > $OUT/a.log
{ $PY - <<'PYEOF'
import torch, sys, os
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(0), "count", torch.cuda.device_count(),
          "nccl", torch.cuda.nccl.version(), "cudnn", torch.backends.cudnn.version())
import transformers, pandas, pyarrow, hydra, omegaconf
print("transformers", transformers.__version__, "pandas", pandas.__version__, "pyarrow",
      pyarrow.__version__, "hydra", hydra.__version__, "omegaconf", omegaconf.__version__)
print("NCCL env", {k: v for k, v in os.environ.items() if k.startswith("NCCL")})
PYEOF
nvidia-smi --query-gpu=name,driver_version,compute_mode,memory.total --format=csv; nproc; which ip tc; } >> $OUT/a.log 2>&1

# ---------------- phase 1: correctness, lanes in parallel ----------------
( hdr "step 4: every method lossless, one GPU worker (+ a CPU server for PS)"
  for m in $METHODS; do echo "$m"; done | xargs -P 3 -I{} bash -c \
    'x=""; case {} in *_ps) x=$NOLOCAL;; esac; o=$(timeout -k 5 150 $PY -m harness.verify model=bert_tiny method={} cluster.device=$DEV $x 2>&1); echo "{}: rc=$? $(echo "$o" | grep -E "max_abs_diff|rror" | tail -n 3 | tr "\n" " ")"'
) > $OUT/b.log 2>&1 &
( hdr "step 3: PS with a GPU worker and a CPU server"
  for m in bsp_ps wfbp_ps bytescheduler_ps; do
    TAILN=6 run 60 $PY -m harness.run model=bert_tiny method=$m $NOLOCAL run.repeats=1 run.timed_iters=5 results_dir=$R/s3
  done
  $PY tests/gpu/rows.py $R/s3
  hdr "step 8: memory, bert_large bsp_ps and bytescheduler_ps, 3 repeats"
  for m in bsp_ps bytescheduler_ps; do
    TAILN=6 run 100 $PY -m harness.run model=bert_large method=$m $NOLOCAL run.repeats=3 run.warmup_iters=1 run.timed_iters=2 results_dir=$R/s8
  done
  $PY tests/gpu/rows.py $R/s8
) > $OUT/c.log 2>&1 &
( hdr "step 5: what Work.wait() means on NCCL"
  timeout -k 5 60 $PY - <<'PYEOF' 2>&1 | tail -n 12
import os, time, torch, torch.distributed as dist
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29650")
dev = torch.device("cuda", 0); torch.cuda.set_device(dev)
dist.init_process_group("nccl", rank=0, world_size=1, device_id=dev)
a = torch.randn(8192, 8192, device=dev); x = torch.ones(1 << 20, device=dev)
dist.all_reduce(x); a @ a; torch.cuda.synchronize()
t = time.perf_counter(); a @ a; torch.cuda.synchronize(); one = time.perf_counter() - t
n = max(1, int(0.3 / one)); [a @ a for _ in range(n)]
t0 = time.perf_counter(); w = dist.all_reduce(x, async_op=True); w.wait(); t1 = time.perf_counter()
done_at_wait = w.is_completed(); torch.cuda.synchronize(); t2 = time.perf_counter()
print(f"queued {n} matmuls ({n*one*1e3:.0f} ms); wait() returned after {1e3*(t1-t0):.1f} ms, "
      f"is_completed()={done_at_wait}; synchronize() took {1e3*(t2-t1):.1f} ms more; after it "
      f"is_completed()={w.is_completed()}")
dist.destroy_process_group()
PYEOF
  hdr "step 6: MG-WFBP's backward profile (CUDA events) against a synchronized backward"
  timeout -k 5 90 $PY - <<'PYEOF' 2>&1 | tail -n 14
import time, torch, statistics
from methods.profile import BackwardProfiler
from models import build
from models.synthetic import image_batch, token_batch
dev = torch.device("cuda")
for name, fam, args, batch in [
        ("resnet50", "vision", dict(arch="resnet50", image_size=224, num_classes=1000),
         lambda g: image_batch(64, 224, 1000, g)),
        ("bert_base", "bert", dict(hidden_size=768, num_layers=12, num_heads=12,
                                   intermediate_size=3072, seq_len=128),
         lambda g: token_batch(32, 128, 30522, g))]:
    m = build(fam, args, seed=0).to(dev)
    params = list(reversed([p for p in m.parameters() if p.requires_grad]))
    prof = BackwardProfiler(m, params, device=dev)
    b = {k: v.to(dev) for k, v in batch(torch.Generator().manual_seed(0)).items()}
    rows = []
    for i in range(8):
        loss = m(b); torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        h0 = time.perf_counter(); s.record(); loss.backward(); e.record(); torch.cuda.synchronize()
        h1 = time.perf_counter(); prof.end_iteration()
        rows.append((max(prof.iterations[-1]), s.elapsed_time(e) / 1e3, h1 - h0))
        m.zero_grad(set_to_none=False)
    last, ev, host = (statistics.median(c) for c in zip(*rows[2:]))
    print(f"{name}: profiler's last gradient ready {1e3*last:.2f} ms; events around backward "
          f"{1e3*ev:.2f} ms; synchronized host clock {1e3*host:.2f} ms; ratio {last/ev:.3f}")
    prof.close(); del m
PYEOF
  hdr "step 7: two ranks on one GPU over Gloo with CUDA tensors, every method"
  for m in $METHODS; do echo "$m"; done | nl -v 0 | xargs -P 3 -L 1 bash -c \
    'echo "$1: $(byhand $((29700 + 10 * $0)) /tmp/gpuck/s7_$1 harness.verify model=bert_tiny method=$1 2>&1 | tr "\n" " ")"'
) > $OUT/d.log 2>&1 &
( hdr "steps 13-16: pytest -m gpu tests/test_gpu_checklist.py"
  TAILN=60 run $P1 $PY -m pytest -m gpu tests/test_gpu_checklist.py -k "not $ONE_GPU_TIMING" -v -s -rs -p no:cacheprovider
) > $OUT/e.log 2>&1 &
( hdr "step 11/12: threads, streams and credit (traces)"
  export PYTHONPATH=tests/gpu/site:${PYTHONPATH:-}
  byhand 29900 $R/s11a harness.run model=bert_tiny method=bytescheduler_a2a run.repeats=1 run.warmup_iters=5 run.timed_iters=5 run.trace=true results_dir=$R/s11a
  grep -h "step11 thread" $R/s11a.* | sort | uniq
  TAILN=4 run 90 $PY -m harness.run model=bert_tiny method=priority_ps $NOLOCAL run.repeats=1 run.warmup_iters=5 run.timed_iters=5 run.trace=true results_dir=$R/s11b | grep -v "^\[step11"
  timeout 60 $PY -m harness.run model=bert_tiny method=priority_ps $NOLOCAL run.repeats=1 run.warmup_iters=2 run.timed_iters=2 results_dir=$R/s11c 2>&1 | grep "step11 thread" | sort | uniq
  $PY tests/gpu/streams.py $R/s11a/traces/*.json $R/s11b/traces/*.json
  # the PS hooks' cost: who holds the GIL in a GPU wfbp_ps run (py-spy, carried as a wheel)
  command -v py-spy > /dev/null && OUT=$OUT STEPS=spy bash tests/gpu/ps_hooks.sh
) > $OUT/f.log 2>&1 &
while [ -n "$(jobs -r)" ] && [ $(( $(date +%s) - T0 )) -lt $P1 ]; do sleep 2; done
[ -n "$(jobs -r)" ] && { echo "phase 1 cut at ${P1}s: $(jobs -r)" >> $OUT/a.log; pkill -9 -f "harness\.|pytest|xargs" ; }
wait

# ---------------- phase 2: timing, alone ----------------
[ "${PHASE2:-1}" = 1 ] || exit 0
{ hdr "step 1: one GPU worker, full models, bsp_a2a"
  for m in resnet50 bert_base bert_large; do
    TAILN=4 run 120 $PY -m harness.run model=$m method=bsp_a2a run.timed_iters=50 run.repeats=3 results_dir=$R/s1
  done
  hdr "step 9: resnet50 with TF32 off (tf32_cudnn=false) beside step 1's defaults"
  TAILN=4 run 90 $PY -m harness.run model=resnet50 method=bsp_a2a run.timed_iters=50 run.repeats=3 run.tf32_cudnn=false results_dir=$R/s9
  $PY tests/gpu/rows.py $R/s1 $R/s9
  hdr "step 10: simulator, measured profile on the GPU, 1 GPU: bert_base (beside step 1), resnet50 (step 14's one-GPU part, its own run)"
  TAILN=8 run 100 $PY -m harness.simulate model=bert_base method=bsp_a2a simulate.compute=measured cluster.device=$DEV results_dir=$R/s10
  TAILN=12 run 120 $PY -m pytest -m gpu tests/test_gpu_checklist.py -k "$ONE_GPU_TIMING" -s -rs -p no:cacheprovider
  hdr "experiment=paper's settings on one GPU (issue 39): the study's clock against ours, its rate, FP32, cudnn.benchmark, BERT's padded vocabulary"
  for s in device false; do
    TAILN=2 run 70 $PY -m harness.run model=bert_base method=bsp_a2a run.sync_each_step=$s run.rate=study run.cudnn_benchmark=true run.tf32_matmul=false run.tf32_cudnn=false ++model.build.vocab_size=30528 model.optimizer.name=adamw run.warmup_iters=5 run.timed_iters=30 run.repeats=1 results_dir=$R/paper
  done
  $PY tests/gpu/rows.py $R/paper
  hdr "step 2: harness overhead at 1 worker (plain, bsp_a2a, ddp)"
  TAILN=30 run $(( ${END:-560} - $(date +%s) + T0 > 40 ? ${END:-560} - $(date +%s) + T0 : 40 )) $PY -m harness.methodbench --models resnet50 --methods bsp_a2a,ddp --workers 1 --rounds 3 --timed-iters 50 --engines native --results-dir $R/s2
} >> $OUT/a.log 2>&1
hdr "done" >> $OUT/a.log
tar czf $OUT/results.tgz -C $R . 2>/dev/null
