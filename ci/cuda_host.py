"""Runs pieces of our CUDA kernels on the CPU, for checks that must not wait for a GPU.

The kernels are plain CUDA C++; what makes them GPU code is a handful of built-ins. `PRELUDE`
defines those for the host: a block runs as blockDim.x std::threads (blocks one after another, so
`__shared__` can be a function-local static), `__syncthreads` and `__syncwarp` are std::barriers,
and the warp shuffles go through a per-warp exchange buffer between two warp barriers. `cut`
takes a function (or a span of them) out of a kernel source by name, so a check runs the code the
GPU runs, not a copy. Math functions are the host's (expf, sincosf may differ from CUDA's in the
last bits), so a check compares two paths through the same code, or bounds the error against a
double-precision reference; it says nothing about the GPU's memory model or speed.
"""
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def source(name):
    """The text of kernels/<name>."""
    with open(os.path.join(ROOT, "kernels", name)) as f:
        return f.read()


def macro_default(src, name):
    """`#define NAME value` as the #ifndef default in `src` gives it."""
    return f"#define {name} " + src.split(f"#define {name} ")[1].split()[0]


def cut(src, start, end_fn):
    """The text from `start` to the closing brace of the first function named end_fn after it."""
    i = src.index(start)
    j = src.index(end_fn, i)
    k = src.index("{", j)
    depth = 0
    for n in range(k, len(src)):
        if src[n] == "{":
            depth += 1
        elif src[n] == "}":
            depth -= 1
            if depth == 0:
                return src[i : n + 1]
    raise SystemExit(f"unbalanced braces after {end_fn}")


PRELUDE = r"""
#include <algorithm>
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <thread>
#include <vector>
#define __device__
#define __forceinline__ inline
#define __restrict__
#define __shared__ static
// The kernel tracer's marks (kernels/trace.cu) record nothing on the host, and the norm
// weights' prefetch before a PDL wait (engine.cu's NORM_PREFETCH, PTX) moves no value.
#define TD_MARK(k)
#define NORM_PREFETCH 0
using std::isfinite; using std::isnan; using std::signbit; using std::max; using std::min;
struct uint4 { unsigned x, y, z, w; };
struct float4 { float x, y, z, w; };
struct uint2 { unsigned x, y; };
struct dim3 { unsigned x = 0, y = 0, z = 0; };
static uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }
static float __uint_as_float(unsigned u) { float f; memcpy(&f, &u, 4); return f; }
static unsigned __float_as_uint(float f) { unsigned u; memcpy(&u, &f, 4); return u; }
static float __int_as_float(int u) { float f; memcpy(&f, &u, 4); return f; }
static thread_local dim3 threadIdx;
static dim3 blockIdx, blockDim, gridDim;
static std::unique_ptr<std::barrier<>> g_block_bar;
static std::vector<std::unique_ptr<std::barrier<>>> g_warp_bars;
static std::vector<float> g_xchg;
static void __syncthreads() { g_block_bar->arrive_and_wait(); }
static void __syncwarp(unsigned = 0xffffffffu) { g_warp_bars[threadIdx.x >> 5]->arrive_and_wait(); }
// __syncthreads that also returns whether any thread's predicate was non-zero.
static std::atomic<int> g_or{0};
static int __syncthreads_or(int pred) {
  __syncthreads();  // the previous call's readers are done
  if (pred) g_or.store(1);
  __syncthreads();
  const int r = g_or.load();
  __syncthreads();
  if (threadIdx.x == 0) g_or.store(0);
  return r;
}
static unsigned atomicAdd(unsigned* p, unsigned v) { return std::atomic_ref<unsigned>(*p).fetch_add(v); }
// A warp shuffle: every lane of the warp must call it (as the kernels' full-mask shuffles require).
static float shfl_from(float v, int src_lane) {
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
  g_xchg[w * 32 + lane] = v;
  __syncwarp();
  const float r = g_xchg[w * 32 + (src_lane & 31)];
  __syncwarp();
  return r;
}
static float __shfl_xor_sync(unsigned, float v, int m) { return shfl_from(v, (threadIdx.x & 31) ^ m); }
static float __shfl_sync(unsigned, float v, int l) { return shfl_from(v, l); }
// 8-byte shuffles (the token pick's packed candidates and f64 sums) through their own buffer.
static std::vector<unsigned long long> g_xchg64;
template <typename T>
static T shfl_from64(T v, int src_lane) {
  static_assert(sizeof(T) == 8, "8-byte values only");
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
  memcpy(&g_xchg64[w * 32 + lane], &v, 8);
  __syncwarp();
  T r;
  memcpy(&r, &g_xchg64[w * 32 + (src_lane & 31)], 8);
  __syncwarp();
  return r;
}
static unsigned long long __shfl_xor_sync(unsigned, unsigned long long v, int m) { return shfl_from64(v, (threadIdx.x & 31) ^ m); }
static double __shfl_xor_sync(unsigned, double v, int m) { return shfl_from64(v, (threadIdx.x & 31) ^ m); }
// redux.sync's unsigned maximum over the warp (the token picks under PICK_FAST).
static unsigned __reduce_max_sync(unsigned, unsigned v) {
  const int w = threadIdx.x >> 5;
  g_xchg64[w * 32 + (threadIdx.x & 31)] = v;
  __syncwarp();
  unsigned m = 0;
  for (int l = 0; l < 32; ++l) m = std::max(m, (unsigned)g_xchg64[w * 32 + l]);
  __syncwarp();
  return m;
}
static long long __double_as_longlong(double d) { long long r; memcpy(&r, &d, 8); return r; }
static float __shfl_down_sync(unsigned, float v, int d) {
  const int l = (threadIdx.x & 31) + d;
  const float r = shfl_from(v, l < 32 ? l : (threadIdx.x & 31));
  return r;
}
// Runs kernel body `f` over a grid, one block at a time, blockDim.x threads per block.
static void launch(dim3 grid, unsigned threads, const std::function<void()>& f) {
  gridDim = grid;
  blockDim = dim3{threads, 1, 1};
  const unsigned warps = (threads + 31) / 32;
  g_xchg.assign(warps * 32, 0.f);
  g_xchg64.assign(warps * 32, 0ull);
  for (unsigned z = 0; z < std::max(grid.z, 1u); ++z)
    for (unsigned y = 0; y < std::max(grid.y, 1u); ++y)
      for (unsigned x = 0; x < grid.x; ++x) {
        blockIdx = dim3{x, y, z};
        g_block_bar = std::make_unique<std::barrier<>>(threads);
        g_warp_bars.clear();
        for (unsigned w = 0; w < warps; ++w) g_warp_bars.push_back(std::make_unique<std::barrier<>>(std::min(32u, threads - 32 * w)));
        std::vector<std::thread> ts;
        for (unsigned t = 0; t < threads; ++t)
          ts.emplace_back([&, t] { threadIdx = dim3{t, 0, 0}; f(); });
        for (auto& th : ts) th.join();
      }
}
"""

# Host stand-ins for the PTX the tensor-core kernels stage tiles with, over a byte array `g_smem`
# that the including code declares (shared-memory "addresses" are offsets into it): cp.async
# copies at once (src-size 0 zero-fills, as on the GPU), cvt.rn.bf16x2.f32 rounds to nearest even.
SMEM_COPIES = r"""
static void cp_async16(unsigned dst, const void* src, int n) {
  memset(g_smem + dst, 0, 16);
  if (n) memcpy(g_smem + dst, src, 16);
}
static void cp_async4(unsigned dst, const void* src, int n) {
  memset(g_smem + dst, 0, 4);
  if (n) memcpy(g_smem + dst, src, 4);
}
// cvt.rn.bf16x2.f32: round to nearest even, NaN kept a (quiet) NaN.
static unsigned bf16_rne(float x) {
  unsigned b = __float_as_uint(x);
  if ((b & 0x7fffffffu) > 0x7f800000u) return (b >> 16) | 0x40u;
  return (b + 0x7fffu + ((b >> 16) & 1u)) >> 16;
}
static unsigned pack_bf16x2_rne(float lo, float hi) { return bf16_rne(lo) | (bf16_rne(hi) << 16); }
"""


def run(code, label):
    """Compiles `code` (after PRELUDE) with g++ and runs it; exits with its status if it failed."""
    with tempfile.TemporaryDirectory() as d:
        src, exe = os.path.join(d, "check.cpp"), os.path.join(d, "check")
        with open(src, "w") as f:
            f.write(PRELUDE + code)
        r = subprocess.run(["g++", "-std=c++20", "-O1", "-pthread", "-w", src, "-o", exe])
        if r.returncode:
            sys.exit(f"{label}: g++ failed")
        rc = subprocess.run([exe]).returncode
        if rc:
            sys.exit(rc)


# The GEMV weight staging of kernels/engine.cu on the host: cp.async as a 16-byte copy, and
# GEMV_TMA's bulk copies (one per staged row) as a memcpy, under `#define GEMV_BULK 0`, which
# run_both_stagings flips.
STAGING_STUBS = r"""
#define GEMV_BULK 0
static void gemv_stage16(uint4* dst, const uint4* src) { *dst = *src; }
static void gemv_stage_wait() { __syncwarp(); }
static void gemv_stage_init() {}
static unsigned gemv_stage_bar(int) { return 0; }
static void gemv_stage_bulk(uint4* dst, const uint4* src, unsigned bytes, unsigned) {
    memcpy(dst, src, bytes);
}
"""


def run_both_stagings(code, label):
    """`run`s `code` (which holds STAGING_STUBS) with the chunk copies, then with the bulk ones."""
    run(code, label)
    run(code.replace("#define GEMV_BULK 0", "#define GEMV_BULK 1"), f"{label} (bulk copies)")
