"""Summarises an Nsight Systems GPU trace of batch-1 decode steps (`nsys stats --report
cuda_gpu_trace --format csv`, on stdin): for each kernel of a step in the middle of the run, its
start, duration and the gap since the previous kernel ended (negative: it overlapped, as PDL lets
it), then per kernel name the mean duration and mean gap over the middle steps. A step starts at
`embed_tokens`. Used by run_engine_tests.sh (TIMELINE=1)."""
import collections
import csv
import sys

rows = list(csv.DictReader(l for l in sys.stdin if l.strip() and not l.startswith("Processing")))
kern = []
for r in rows:
    name = r.get("Name", "")
    if not name or name.startswith("[CUDA"):
        continue
    try:
        start, dur = int(r["Start (ns)"]), int(r["Duration (ns)"])
    except (KeyError, ValueError):
        continue
    kern.append((start, dur, name.split("(")[0][:40]))
kern.sort()
steps, cur = [], []
for k in kern:
    if k[2] == "embed_tokens" and cur:
        steps.append(cur)
        cur = []
    cur.append(k)
if cur:
    steps.append(cur)
steps = [s for s in steps if len(s) > 20]
if len(steps) < 3:
    print(f"only {len(steps)} decode steps in the trace")
    sys.exit(0)
mid = steps[len(steps) // 2]
t0 = mid[0][0]
print(f"one decode step ({len(mid)} kernels, {(mid[-1][0] + mid[-1][1] - t0) / 1e3:.1f} us first start to last end)")
print(f"{'kernel':<40} {'start us':>9} {'dur us':>8} {'gap us':>8}")
prev_end = None
for s, d, n in mid[:40]:
    gap = "" if prev_end is None else f"{(s - prev_end) / 1e3:8.2f}"
    print(f"{n:<40} {(s - t0) / 1e3:9.2f} {d / 1e3:8.2f} {gap:>8}")
    prev_end = s + d
body = steps[len(steps) // 4: 3 * len(steps) // 4]
dur, gap, cnt = collections.defaultdict(float), collections.defaultdict(float), collections.Counter()
span = 0.0
for st in body:
    span += (st[-1][0] + st[-1][1] - st[0][0]) / 1e3
    for i, (s, d, n) in enumerate(st):
        dur[n] += d / 1e3
        cnt[n] += 1
        if i:
            gap[n] += (s - (st[i - 1][0] + st[i - 1][1])) / 1e3
print(f"\nper kernel over {len(body)} steps (mean step span {span / len(body):.1f} us)")
print(f"{'kernel':<40} {'per step':>8} {'mean us':>8} {'gap us':>8} {'us/step':>8}")
for n in sorted(dur, key=lambda n: -dur[n]):
    c = cnt[n]
    print(f"{n:<40} {c / len(body):8.1f} {dur[n] / c:8.2f} {gap[n] / c:8.2f} {dur[n] / len(body):8.1f}")
