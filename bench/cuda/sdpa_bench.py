"""PyTorch SDPA on the decode-attention benchmark shapes (Llama-3.2-1B heads: 32 query, 8 KV,
head_dim 64, bf16, contiguous KV [B, 8, L, 64]), timed like decode_attn_bench: one sample is a
run of back-to-back calls cycling through enough input sets that the L2 cannot hold them, median
over samples, through a CUDA graph and eagerly. Writes TSV lines to stdout (same columns as the
harness) and notes to stderr."""
import math
import sys

import torch
import torch.nn.functional as F

NH, NKV, D = 32, 8, 64
CTXS = [1024, 4096, 16384, 32768]
BATCHES = [1, 8, 64]


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def time_calls(fn, R, est_us):
    inner = max(R, 4)
    samples = int(min(60, max(5, 150000 / (est_us * inner))))
    for i in range(3):
        fn(i % R)
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    v = []
    for _ in range(samples):
        e0.record()
        for i in range(inner):
            fn(i % R)
        e1.record()
        e1.synchronize()
        v.append(e0.elapsed_time(e1) * 1000 / inner)
    eager = sorted(v)[len(v) // 2]
    graph = float("nan")
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for i in range(3):
                fn(i % R)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for i in range(inner):
                fn(i % R)
        g.replay()
        torch.cuda.synchronize()
        v = []
        for _ in range(samples):
            e0.record()
            g.replay()
            e1.record()
            e1.synchronize()
            v.append(e0.elapsed_time(e1) * 1000 / inner)
        graph = sorted(v)[len(v) // 2]
    except Exception as ex:  # report and keep the eager figure
        log("graph capture failed:", repr(ex))
    return graph, eager


def main():
    log("torch", torch.__version__, "device", torch.cuda.get_device_name(0))
    for ctx in CTXS:
        for b in BATCHES:
            kv_bytes = b * ctx * NKV * D * 2 * 2
            R = int(min(64, max(1, math.ceil(512e6 / kv_bytes))))
            qs = [torch.randn(b, NH, 1, D, device="cuda", dtype=torch.bfloat16) for _ in range(R)]
            ks = [torch.randn(b, NKV, ctx, D, device="cuda", dtype=torch.bfloat16) for _ in range(R)]
            vs = [torch.randn(b, NKV, ctx, D, device="cuda", dtype=torch.bfloat16) for _ in range(R)]
            outs = [None] * R

            def fn(i):
                outs[i] = F.scaled_dot_product_attention(qs[i], ks[i], vs[i], enable_gqa=True)

            if ctx == 32768 and b in (1, 64):
                try:
                    from torch.profiler import ProfilerActivity, profile

                    with profile(activities=[ProfilerActivity.CUDA]) as prof:
                        fn(0)
                        torch.cuda.synchronize()
                    names = sorted({e.name for e in prof.events() if e.device_type.name == "CUDA"})
                    log(f"SDPA kernels at batch {b} ctx {ctx}:", "; ".join(n[:90] for n in names))
                except Exception as ex:
                    log("profiler failed:", repr(ex))
            graph, eager = time_calls(fn, R, kv_bytes / 3e6 + 10)
            gb = kv_bytes / ((graph if graph == graph else eager) * 1e3)
            print(f"sdpa\tbf16\t{b}\t{ctx}\t0\t0\t{graph:.3f}\t{eager:.3f}\t{gb:.1f}\t-", flush=True)
            log(f"SDPA batch {b:3d} ctx {ctx:6d}: graph {graph:9.2f} us eager {eager:9.2f} us {gb:7.1f} GB/s (R={R})")
            del qs, ks, vs, outs
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
