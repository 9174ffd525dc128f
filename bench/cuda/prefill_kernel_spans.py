"""Per-launch time of the prefill attention kernels in a kernel timeline (TAPEDECK_TRACE=path,
as bench/cuda/trace_summary.py reads it): for each kernel whose name starts with one of the
prefixes, the number of launches and the median span (first block's start to last block's end),
and the attention FLOP rate of one causal prefill of --tokens tokens from position 0 with
--heads query heads of --head-dim (4 * tokens^2 / 2 * head_dim * heads FLOPs per layer).

    python3 bench/cuda/prefill_kernel_spans.py trace.csv --tokens 8192 [--heads 32 --head-dim 64]
"""
import argparse
import statistics

from trace_summary import launches


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--tokens", type=int, required=True)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--prefix", action="append", default=None)
    a = ap.parse_args()
    prefixes = tuple(a.prefix or ["prefill_attn_mma", "prefill_attention"])
    spans = {}
    for l in launches(a.csv):
        if l["kernel"].startswith(prefixes) and l["seen"] == l["blocks"]:
            spans.setdefault((l["kernel"], l["blocks"]), []).append(l["end"] - l["start"])
    flops = 4.0 * a.tokens * a.tokens / 2 * a.head_dim * a.heads
    for (kernel, blocks), s in sorted(spans.items()):
        us = statistics.median(s) / 1000
        print(f"{kernel} ({blocks} blocks): {len(s)} launches, median {us:.1f} µs, "
              f"{flops / us / 1e6:.1f} TFLOP/s at {a.tokens} tokens")


if __name__ == "__main__":
    main()
