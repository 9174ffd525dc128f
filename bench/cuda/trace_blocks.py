"""Block-level view of one decode step of a TAPEDECK_TRACE timeline (the CSV trace_summary.py
reads): for each launch of the step, how its blocks were placed and how long they lived, to tell
a bandwidth-bound kernel (blocks end at a steady rate) from one that loses time to launch
waves, tails or waits.

Per launch: blocks; the most blocks resident at once on the GPU and on one SM; block lifetime
(end - start) and time after the PDL wait (end - wait released) at the median and the 90th
percentile; and, counted from when the launch before it ended, when 50%, 90% and 100% of its
blocks had ended; and how many of its blocks started on an SM while a block of the launch before
was still running there (what PDL's early launch buys: a block needs the SM's registers and
shared memory left beside the running ones). With --bytes KERNEL=MB (repeatable) it also prints
the rate over that last
interval for the kernels whose weight traffic you give (KERNEL/BLOCKS to tell apart launches of
one kernel by grid size, or @K for the layer's K-th launch, from 0: the streaming GEMV runs o
and down on the same grid).

With the kernels compiled with TD_MARK_POINT=1 or 2 (kernels/trace.cu; pass it to trace_step.sh as
`TAPEDECK_NVRTC_DEFINES=TD_MARK_POINT=1`), every "wait" column reads as that mark instead: 1 when a
block's input is ready (a GEMV's prologue done, the attention's first KV tile arrived, the
combine's partials loaded), 2 when its dot products are summed. Three traces (0, 1, 2) then split
a block's time after its wait into prologue, arithmetic and epilogue.

    python3 bench/cuda/trace_blocks.py trace.csv [--layer 3] [--bytes gemv_bf16_swiglu_1=67.1 --bytes gemv_bf16_1/1024=33.6]
"""
import argparse
import collections
import csv
import statistics


def blocks_by_launch(path):
    by_kind = collections.defaultdict(list)
    with open(path) as f:
        for r in csv.DictReader(f):
            waited = int(r["waited_ns"]) if r["waited_ns"] else None
            by_kind[(r["kernel"], int(r["blocks"]))].append(
                (int(r["start_ns"]), int(r["end_ns"]), waited, int(r["sm"]))
            )
    out = []
    for (kernel, blocks), evs in by_kind.items():
        evs.sort()
        for i in range(0, len(evs), blocks):
            chunk = evs[i : i + blocks]
            out.append({"kernel": kernel, "blocks": blocks, "evs": chunk,
                        "start": min(e[0] for e in chunk), "end": max(e[1] for e in chunk)})
    out.sort(key=lambda l: l["start"])
    return out


def most_resident(intervals):
    """The most intervals (start, end) open at one instant."""
    points = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    cur = best = 0
    for _, d in points:
        cur += d
        best = max(best, cur)
    return best


def q(xs, f):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(f * len(xs)))] if xs else float("nan")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--layer", type=int, default=3, help="which layer's launches (0-based)")
    ap.add_argument("--bytes", action="append", default=[], help="KERNEL=MB of weights it reads")
    a = ap.parse_args()
    mb = {k: float(v) for k, v in (b.split("=", 1) for b in a.bytes)}
    ls = blocks_by_launch(a.csv)
    steps, cur = [], []
    for l in ls:
        if l["kernel"] == "embed_tokens" and cur:
            steps.append(cur)
            cur = []
        cur.append(l)
    if cur:
        steps.append(cur)
    shape = collections.Counter(tuple((l["kernel"], l["blocks"]) for l in s) for s in steps)
    if not shape:
        print("no events")
        return
    common, _ = shape.most_common(1)[0]
    same = [s for s in steps if tuple((l["kernel"], l["blocks"]) for l in s) == common]
    step = same[len(same) // 2]
    # A layer is the launches between two launches of the step's second kernel (the q/k/v GEMV).
    first = step[1]["kernel"]
    marks = [i for i, l in enumerate(step) if l["kernel"] == first]
    lo = marks[min(a.layer, len(marks) - 1)]
    hi = marks[a.layer + 1] if a.layer + 1 < len(marks) else len(step)
    print(f"step of {len(step)} launches, layer {a.layer}: launches {lo}..{hi - 1}")
    print()
    print("| # | kernel | blocks | resident GPU / SM | life µs p50 / p90 | after wait µs p50 / p90 "
          "| 50% / 90% / 100% ended µs | GB/s | beside the one before | early: blocks, wait released µs p10 / p50 |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for i in range(lo, hi):
        l, prev_end = step[i], step[i - 1]["end"]
        evs = l["evs"]
        per_sm = collections.defaultdict(list)
        for s, e, _, sm in evs:
            per_sm[sm].append((s, e))
        gpu = most_resident([(s, e) for s, e, _, _ in evs])
        sm = max(most_resident(v) for v in per_sm.values())
        life = [(e - s) / 1000 for s, e, _, _ in evs]
        after = [(e - w) / 1000 for _, e, w, _ in evs if w is not None]
        ends = sorted((e - prev_end) / 1000 for _, e, _, _ in evs)
        p = lambda f: ends[min(len(ends) - 1, int(f * len(ends)))]
        rate = ""
        keys = [f"@{i - lo}", f"{l['kernel']}/{len(evs)}", l["kernel"]]
        key = next((k for k in keys if k in mb), None)
        if key is not None and ends[-1] > 0:
            rate = f"{mb[key] * 1e6 / (ends[-1] * 1e3):.0f}"
        aw = f"{q(after, .5):.1f} / {q(after, .9):.1f}" if after else ""
        before = collections.defaultdict(list)
        for ps, pe, _, psm in step[i - 1]["evs"]:
            before[psm].append((ps, pe))
        beside = sum(any(ps <= s < pe for ps, pe in before[sm_]) for s, _, _, sm_ in evs)
        # Blocks that started before the launch before ended: their wait was released by its end
        # (PDL), so the release's delay after that end is the boundary's own cost.
        early = [(w - prev_end) / 1000 for s, _, w, _ in evs if w is not None and s < prev_end]
        rel = f"{len(early)}, {q(early, .1):.1f} / {q(early, .5):.1f}" if early else "0"
        print(f"| {i} | {l['kernel']} | {len(evs)} | {gpu} / {sm} | {q(life, .5):.1f} / "
              f"{q(life, .9):.1f} | {aw} | {p(.5):.1f} / {p(.9):.1f} / {ends[-1]:.1f} | {rate} | {beside} "
              f"| {rel} |")
    print()
    print("(ended: from the end of the launch before; negative: before it ended, as PDL allows;")
    print(" early: the blocks that started before the launch before ended, and when their PDL wait")
    print(" was released, from that end)")


if __name__ == "__main__":
    main()
