"""GPU checklist steps 11-12 from run.trace files: which host thread queued work on which
CUDA stream; whether the next forward starts before the last unit is done; the gap from a
unit's completion to the next unit's issue."""
import collections
import json
import statistics
import sys

DEFAULT_STREAM = 7  # kineto's id of the legacy default stream

for path in sys.argv[1:]:
    trace = json.load(open(path))
    ev = trace["traceEvents"]
    print(f"--- {path}")
    names = {(e.get("pid"), e.get("tid")): e["args"].get("name") for e in ev
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
    launch = {e["args"]["correlation"]: (e.get("pid"), e.get("tid")) for e in ev
              if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
    count = collections.Counter()
    sample = collections.defaultdict(collections.Counter)
    for e in ev:
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            a = e.get("args", {})
            host = launch.get(a.get("correlation"), (None, "?"))
            key = (host[1], a.get("stream"), e["cat"])
            count[key] += 1
            sample[key][e["name"][:48]] += 1
    for (tid, stream, cat), n in sorted(count.items(), key=str):
        flag = "  <-- legacy default stream" if stream == DEFAULT_STREAM else ""
        top = ", ".join(f"{k} x{v}" for k, v in sample[(tid, stream, cat)].most_common(3))
        print(f"  host tid {tid} ({names.get((None, tid)) or ''}) stream {stream} {cat}: {n}"
              f"{flag}  [{top}]")
    traced = trace.get("ddlbench", {}).get("traced_us")
    units, begin = [], {}
    for e in ev:
        if e.get("cat") == "ddlbench.comm":
            if e["ph"] == "b":
                begin[e["id"]] = e
            elif e["ph"] == "e" and e["id"] in begin:
                units.append((begin[e["id"]]["ts"], e["ts"], begin[e["id"]]["name"]))
    if not units or not traced:
        print(f"  units: {len(units)}; traced: {traced}")
        continue
    units.sort()
    start = traced[0]
    back = [e["ts"] for e in ev if e.get("cat") == "ddlbench" and e.get("name") == "backward"
            and e["ts"] >= start]
    earlier = [u for u in units if back and u[0] < back[0]]  # the lead-in's pieces (some are
    if earlier:                                              # issued after `start`)
        last = max(u[1] for u in earlier)
        print(f"  the lead-in iteration's last piece is done {(last - start) / 1e3:+.2f} ms "
              f"from the traced iteration's start: the next forward "
              f"{'overlaps it' if last > start else 'starts after it'}")
    gaps = []
    for issue, _, _ in units:
        done = [d for _, d, _ in units if d <= issue]
        if done:
            gaps.append(issue - max(done))
    close = sorted(g for g in gaps if g < 5000)
    if close:
        print(f"  completion -> next issue (us), {len(close)} of {len(units)} units issued "
              f"within 5 ms of a completion: min {close[0]:.0f} median "
              f"{statistics.median(close):.0f} p90 {close[int(0.9 * (len(close) - 1))]:.0f}")
