"""Join decode_attn_bench's perf TSV and sdpa_bench.py's TSV into the comparison table."""
import sys

rows = []
for path in sys.argv[1:]:
    try:
        for line in open(path):
            f = line.rstrip("\n").split("\t")
            if len(f) >= 10:
                rows.append(f)
    except OSError as e:
        print("missing", path, e)

def get(impl, kv, b, ctx, note="rule"):
    for f in rows:
        if f[0] == impl and f[1] == kv and int(f[2]) == b and int(f[3]) == ctx and (note is None or f[9] in (note, "-")):
            return f
    return None

ceil = [f for f in rows if f[0] == "readbw"]
if ceil:
    print(f"read-only bandwidth ceiling (4 GiB read): {float(ceil[0][8]):.0f} GB/s")
print()
print("| ctx | batch | mma-bf16 us | GB/s | split_len x splits | simt-f32-ref us | GB/s | SDPA us | GB/s | mma vs SDPA | mma vs simt |")
print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
for ctx in (1024, 4096, 16384, 32768):
    for b in (1, 8, 64):
        m = get("mma-nvcc", "bf16", b, ctx)
        r = get("simt-f32-ref", "bf16", b, ctx)
        s = get("sdpa", "bf16", b, ctx, None)
        def us(f): return float(f[6]) if f else float("nan")
        def gb(f): return float(f[8]) if f else float("nan")
        sp = f"{m[4]} x {m[5]}" if m else "-"
        print(f"| {ctx} | {b} | {us(m):.2f} | {gb(m):.0f} | {sp} | {us(r):.1f} | {gb(r):.0f} | {us(s):.2f} | {gb(s):.0f} | "
              f"{us(s)/us(m):.2f}x | {us(r)/us(m):.2f}x |")
print()
print("f32 KV (mma-f32kv rounds K/V to bf16 on load):")
for b in (1, 8, 64):
    m = get("mma-nvcc", "f32", b, 32768)
    r = get("simt-f32-ref", "f32", b, 32768)
    if m:
        print(f"  batch {b:2d} ctx 32768: mma {float(m[6]):9.2f} us {float(m[8]):6.0f} GB/s | simt-f32-ref "
              f"{float(r[6]) if r else float('nan'):9.1f} us")
print()
print("split_len sweeps (graph us):")
for f in rows:
    if f[9] in ("sweep", "diag") or f[0] == "mma-nvrtc":
        print(f"  {f[0]:10s} kv {f[1]} batch {f[2]:>3s} ctx {f[3]:>6s} split_len {f[4]:>6s} x {f[5]:>4s}: "
              f"{float(f[6]):9.2f} us {float(f[8]):6.0f} GB/s ({f[9]})")
for f in rows:
    if f[0] == "mma-nvcc" and f[9] == "rule" and f[1] == "bf16":
        print(f"  mma-nvcc   kv bf16 batch {f[2]:>3s} ctx {f[3]:>6s} split_len {f[4]:>6s} x {f[5]:>4s}: "
              f"{float(f[6]):9.2f} us (rule)")
