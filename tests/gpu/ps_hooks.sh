#!/bin/bash
# The PS methods' gradient hooks on a GPU (tests/README.md, the open question), in steps
# chosen by STEPS: "base" backward and hook time per method alone; "switch" again with a
# 0.2 ms GIL switch interval; "spy" which threads hold the GIL in a steady wfbp_ps run
# (py-spy, carried as a wheel); "ab" the copy waits polled (before) or in CUDA, interleaved
# rounds; "profile" the measured profile's clock (tests/gpu/profile_sync.py);
# "step14" checklist step 14's one-GPU part; "verify" the PS methods lossless first.
set -u
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
PY=${PY:-python3}; DEV=${DEV:-cuda}; OUT=${OUT:-/tmp/gpuout}; R=/tmp/gpuhk
STEPS=${STEPS:-verify base switch spy ab profile step14}
mkdir -p "$OUT" "$R"; rm -rf "$R"/*
export NOLOCAL=method.transport.local_reduce=false PY DEV
METHODS=${METHODS:-wfbp_a2a bsp_ps wfbp_ps bytescheduler_ps priority_ps}
ITERS=${ITERS:-30}
T0=$(date +%s)
hdr() { echo; echo "=== $* (t+$(( $(date +%s) - T0 ))s)"; }
want() { [[ " $STEPS " == *" $1 "* ]]; }
one() {  # one RESULTS METHOD overrides...
  local res=$1 m=$2; shift 2; local x=""; case $m in *_ps) x=$NOLOCAL;; esac
  timeout -k 5 90 $PY -m harness.run model=bert_tiny method=$m $x run.repeats=1 \
    run.warmup_iters=5 run.timed_iters=$ITERS cluster.device=$DEV results_dir=$res "$@" \
    > $res.$m.log 2>&1 || { echo "$m failed:"; tail -n 5 $res.$m.log; }
}
probe() { PYTHONPATH=tests/gpu/probe:${PYTHONPATH:-} "$@"; }
{
if want verify; then
  hdr "the PS methods lossless, one GPU worker and a CPU server (harness.verify)"
  for m in bsp_ps wfbp_ps bytescheduler_ps priority_ps; do echo $m; done | xargs -P 4 -I{} bash -c \
    'o=$(timeout -k 5 120 $PY -m harness.verify model=bert_tiny method={} cluster.device=$DEV $NOLOCAL 2>&1); echo "{}: rc=$? $(echo "$o" | grep -E "max_abs_diff|rror" | tail -n 3 | tr "\n" " ")"'
fi
if want base; then
  hdr "backward and hook time per method, bert_tiny, one GPU worker (+ a CPU server for PS)"
  for m in $METHODS; do one $R/base $m; done
  $PY tests/gpu/rows.py $R/base
fi
if want switch; then
  hdr "again with the GIL switch interval at 0.2 ms (CPython's default 5 ms)"
  for m in $METHODS; do SWITCH_S=0.0002 probe one $R/switch $m; done
  $PY tests/gpu/rows.py $R/switch
fi
if want spy && command -v py-spy > /dev/null; then
  hdr "py-spy on a steady wfbp_ps worker: --gil 5 s, --idle 5 s, two native dumps"
  (ITERS=100000 one $R/spy wfbp_ps > /dev/null) &
  W=""; for _ in $(seq 60); do  # this run's worker, once its PS threads run (imports: ~20 s)
    sleep 1
    for p in $(pgrep -f "results_dir=$R/spy" | xargs -r -n 1 pgrep -P); do
      py-spy dump --pid "$p" 2>/dev/null | grep -q "ps-push" && { W=$p; break 2; }
    done
  done
  sleep 2; echo "worker pid $W, threads up at t+$(( $(date +%s) - T0 ))s"
  for how in --gil --idle; do
    timeout 20 py-spy record $how --threads --rate 1000 --duration 5 -f raw -o $R/spy$how.txt -p "$W" > /dev/null 2>&1
    echo "--- py-spy record $how"; $PY tests/gpu/gil.py $R/spy$how.txt
  done
  for k in 1 2; do
    timeout 20 py-spy dump --native --pid "$W" > $R/dump$k.txt 2>&1
    echo "--- native dump $k: $(wc -l < $R/dump$k.txt) lines"; cp $R/dump$k.txt $OUT/
  done
  cp $R/spy--*.txt $OUT/ 2>/dev/null
  pkill -f "results_dir=$R/spy"; wait
fi
if want ab; then
  hdr "A/B in ${ROUNDS:=3} interleaved rounds: copy waits polled (POLLED=1, before) or in CUDA"
  for r in $(seq $ROUNDS); do
    for m in ${AB_METHODS:-wfbp_ps bytescheduler_ps}; do
      POLLED=1 probe one $R/ab_polled $m; probe one $R/ab_cuda $m
    done
  done
  $PY - $R/ab_polled $R/ab_cuda <<'PYEOF'
import sys
from harness.measure import results
for folder in sys.argv[1:]:
    df = results.load(folder)
    for m, g in df.groupby("method"):
        b, t = 1e3 * g.backward_s, g.throughput
        print(f"{folder.rsplit('/', 1)[-1]:10s} {m:17s} backward median {b.median():6.2f} ms "
              f"[{b.min():.2f}-{b.max():.2f}]  throughput {t.median():7.1f} [{t.min():.1f}-"
              f"{t.max():.1f}] samples/s  n={len(g)}")
PYEOF
fi
if want profile; then
  hdr "the measured profile's clock: events read each iteration or at the end, plain loop"
  timeout -k 5 120 $PY tests/gpu/profile_sync.py resnet50 2>&1 | tail -n 6
fi
if want step14; then
  hdr "step 14's one-GPU parts"
  timeout -k 5 150 $PY -m pytest -m gpu tests/test_gpu_checklist.py -k "14" -s -rs -p no:cacheprovider 2>&1 | grep -E "step 14|passed|failed|Error|assert" | tail -n 8
fi
hdr done
} 2>&1 | tee $OUT/hooks.log
