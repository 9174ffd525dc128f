"""Sums Nsight Compute's per-launch durations (`ncu --csv --metrics gpu__time_duration.sum`, on
stdin) by kernel: launches, total and mean time, share. Used by run_engine_tests.sh (PROFILE=1)."""
import collections
import csv
import sys

lines = [l for l in sys.stdin if l.startswith('"')]
rows = list(csv.DictReader(lines))
by = collections.defaultdict(list)
for r in rows:
    if r.get("Metric Name") != "gpu__time_duration.sum":
        continue
    v = float(r["Metric Value"].replace(",", ""))
    unit = r.get("Metric Unit", "nsecond")
    scale = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}.get(unit, 1e-3)
    name = r["Kernel Name"].split("(")[0][:46]
    by[name].append(v * scale)
if not by:
    print("no kernel durations in the ncu output")
    sys.exit(0)
total = sum(sum(v) for v in by.values())
print(f"{'kernel':<46} {'launches':>8} {'total us':>10} {'mean us':>8} {'share':>6}")
for name, v in sorted(by.items(), key=lambda kv: -sum(kv[1])):
    print(f"{name:<46} {len(v):>8} {sum(v):>10.1f} {sum(v) / len(v):>8.2f} {100 * sum(v) / total:>5.1f}%")
print(f"{sum(len(v) for v in by.values())} launches, {total:.0f} us of kernel time")
