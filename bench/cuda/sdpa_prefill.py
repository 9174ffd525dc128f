"""The peer for the prefill attention kernels: PyTorch's scaled_dot_product_attention on one
causal prompt of each length (bf16 q/k/v, GQA through enable_gqa), timed with CUDA events, with
the backend PyTorch picks and with each backend forced where it runs.

    python3 bench/cuda/sdpa_prefill.py [--heads 32 --kv-heads 8 --head-dim 64] 2048 8192 16384
"""
import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def time_ms(fn, reps=20):
    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / reps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("lengths", type=int, nargs="+")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    a = ap.parse_args()
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    for n in a.lengths:
        q = torch.randn(1, a.heads, n, a.head_dim, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, a.kv_heads, n, a.head_dim, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        flops = 4.0 * n * n / 2 * a.head_dim * a.heads
        for name, backend in [("default", None), ("flash", SDPBackend.FLASH_ATTENTION),
                              ("cudnn", SDPBackend.CUDNN_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION)]:
            def run():
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            try:
                if backend is None:
                    ms = time_ms(run)
                else:
                    with sdpa_kernel(backend):
                        ms = time_ms(run)
                print(f"SDPA {name:9s} {n:6d} tokens: {ms * 1000:9.1f} µs, {flops / ms / 1e9:6.1f} TFLOP/s")
            except RuntimeError as e:
                print(f"SDPA {name:9s} {n:6d} tokens: not available ({str(e).splitlines()[0][:80]})")


if __name__ == "__main__":
    main()
