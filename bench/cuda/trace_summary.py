"""Summarises a kernel timeline written with TAPEDECK_TRACE=path (engine/src/cuda/trace.rs): one CSV
row per block (kernel, sm, block, blocks, start_ns, waited_ns, end_ns).

Blocks are grouped into launches (same kernel and grid size, in start order, `blocks` at a time),
launches into steps (a step starts at `embed_tokens`), and the steps with the most common launch
sequence (the decode steps) are averaged over the middle ones: per launch of a step, when its first
block started, when its PDL wait was released (the latest release over its blocks: when the kernel
before it was done), when its last block ended, its span and the gap since the launch before it
ended (negative: it overlapped, as PDL lets it). Then per kernel the total span per step.

    python3 bench/cuda/trace_summary.py trace.csv [--steps N]
"""
import argparse
import collections
import csv
import statistics


def launches(path):
    by_kind = collections.defaultdict(list)
    with open(path) as f:
        for r in csv.DictReader(f):
            waited = int(r["waited_ns"]) if r["waited_ns"] else None
            by_kind[(r["kernel"], int(r["blocks"]))].append((int(r["start_ns"]), int(r["end_ns"]), waited))
    out = []
    for (kernel, blocks), evs in by_kind.items():
        evs.sort()
        for i in range(0, len(evs), blocks):
            chunk = evs[i : i + blocks]
            waits = [w for _, _, w in chunk if w is not None]
            out.append(
                {
                    "kernel": kernel,
                    "blocks": blocks,
                    "seen": len(chunk),
                    "start": min(s for s, _, _ in chunk),
                    "end": max(e for _, e, _ in chunk),
                    "released": max(waits) if waits else None,
                }
            )
    out.sort(key=lambda l: l["start"])
    return out


def steps(ls):
    cur, all_steps = [], []
    for l in ls:
        if l["kernel"] == "embed_tokens" and cur:
            all_steps.append(cur)
            cur = []
        cur.append(l)
    if cur:
        all_steps.append(cur)
    return all_steps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--steps", type=int, default=10, help="middle steps to average")
    a = ap.parse_args()
    st = steps(launches(a.csv))
    shape = collections.Counter(tuple((l["kernel"], l["blocks"]) for l in s) for s in st)
    if not shape:
        print("no events")
        return
    common, count = shape.most_common(1)[0]
    same = [s for s in st if tuple((l["kernel"], l["blocks"]) for l in s) == common]
    mid = len(same) // 2
    pick = same[max(0, mid - a.steps // 2) : mid + (a.steps + 1) // 2]
    total = statistics.mean(s[-1]["end"] - s[0]["start"] for s in pick)
    print(f"{len(st)} steps, {count} with the most common sequence of {len(common)} launches; "
          f"averaging {len(pick)} middle ones: {total / 1000:.1f} µs from the first block to the last")
    print()
    print("| # | kernel | blocks | start µs | wait released µs | end µs | span µs | gap µs |")
    print("|---|---|---|---|---|---|---|---|")
    per_kernel = collections.defaultdict(float)
    for i, (kernel, blocks) in enumerate(common):
        t0 = [s[0]["start"] for s in pick]
        start = statistics.mean(s[i]["start"] - b for s, b in zip(pick, t0))
        end = statistics.mean(s[i]["end"] - b for s, b in zip(pick, t0))
        rel = [s[i]["released"] - b for s, b in zip(pick, t0) if s[i]["released"] is not None]
        gap = statistics.mean(s[i]["start"] - s[i - 1]["end"] for s in pick) if i else 0.0
        per_kernel[kernel] += end - start
        released = f"{statistics.mean(rel) / 1000:.1f}" if rel else ""
        print(f"| {i} | {kernel} | {blocks} | {start / 1000:.1f} | {released} | {end / 1000:.1f} | "
              f"{(end - start) / 1000:.1f} | {gap / 1000:+.1f} |")
    print()
    print("| kernel | span µs per step (summed over its launches; overlaps counted twice) |")
    print("|---|---|")
    for k, v in sorted(per_kernel.items(), key=lambda kv: -kv[1]):
        print(f"| {k} | {v / 1000:.1f} |")


if __name__ == "__main__":
    main()
