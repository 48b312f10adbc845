"""Summarize `py-spy record --gil --threads -f raw` output: which thread held the GIL, and
where (GPU checklist, the PS hooks' cost: tests/README.md)."""
import collections
import sys

threads, lines, total = collections.Counter(), collections.Counter(), 0
for line in open(sys.argv[1]):
    stack, _, count = line.rstrip().rpartition(" ")
    frames, n = stack.split(";"), int(count)
    total += n
    threads[frames[0]] += n
    ours = [f for f in frames if "/methods/" in f or "/harness/" in f]
    lines[(frames[0], ours[-1] if ours else frames[-1])] += n
print(f"{total} samples (with --gil: the GIL held)")
for thread, n in threads.most_common(12):
    print(f"  {n:6d}  {thread}")
for (thread, frame), n in lines.most_common(20):
    print(f"  {n:6d}  {thread[:40]:40s}  {frame[:90]}")
