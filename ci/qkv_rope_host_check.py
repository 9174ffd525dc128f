#!/usr/bin/env python3
"""Runs the fused q/k/v + RoPE + KV-write GEMV of kernels/engine.cu on the CPU.

`qkv_rope_kernel` (the `gemv_bf16_qkv_rope_*` entry points, `fuse=rope`) computes q, k and v
from the bf16 weights, rotates q and k, rounds k and v for a bf16 pool, and writes the pool rows at
the pass's cache slots. With `QKV_INDEX_EARLY` it reads each row's position, rotary frequency and
slot before its PDL wait instead of after its dot products; with `QKV_ASYNC` (TAPEDECK_QKV_ASYNC=on)
it stages its weights in shared memory, chunk by chunk as cp.async does or a row at a time as
`GEMV_TMA`'s bulk copies do (the check runs once each way). This check compiles the kernel both
ways (index data late and weights in registers; early and staged) from the same text and runs them as ci/cuda_host.py runs kernel code (blocks of 256
std::threads, barriers for __syncthreads and the shuffles) on 1 to 3 rows, bf16 and normalized
inputs, with and without biases, f32 and bf16 pools, a row with no slot (-1), head_dim 64 and 128
and inputs of 256, 520 (a partial lane round) and 2048; one-row normalized cases also run the first
layer's embedding gather (the row read from a table at the pass's id, or at the fed one) against
the row given directly, bit for bit. Every output (q, k, v and both pools,
poisoned with NaN first, so an unwritten output shows) must be bit-identical between the two, and
within bounds of a float64 reference: the dot products of the same bf16 operands, rotated in
double at the kernel's f32 angle, rounded to bf16 for a bf16 pool.

    python3 ci/qkv_rope_host_check.py     # needs g++ (C++20)
"""
from cuda_host import STAGING_STUBS, cut, macro_default, run_both_stagings, source

eng = source("engine.cu")


def default(name):
    """`#define NAME value` as engine.cu's #ifndef default gives it."""
    return macro_default(eng, name)


kernel = cut(eng, "template <int N, typename KV, bool EMBED = false>\n__device__ __forceinline__ void qkv_rope_kernel", "void qkv_rope_kernel(")

code = "\n".join(
    [
        "#define __global__\n#define __launch_bounds__(a, b)\n#define TD_SCOPE(name)\n#define TD_WAITED()",
        cut(eng, "typedef unsigned short bf16_t;", "bf16x2_bits("),
        cut(eng, "__device__ __forceinline__ void kv_put(float* p", "kv_put(bf16_t*"),
        cut(eng, "__device__ __forceinline__ float warp_sum", "block_sum("),
        cut(eng, "template <int V>\n__device__ float block_sum_as_256", "block_sum_as_256("),
        cut(eng, "__device__ __forceinline__ void pdl_wait()", "pdl_launch_dependents("),
        default("NORM_UNROLL"),
        default("GEMV_MAX_ROWS"),
        default("GEMV_WARPS"),
        default("GEMV_BLOCK_WARPS"),
        default("GEMV_PRE"),
        "#define GEMV_PERSIST 0",
        cut(eng, "template <int N, int T = 256, typename Store>", "rms_norm_rows("),
        cut(eng, "__device__ __forceinline__ float bf16_lo", "bf16_hi("),
        # The weight loads' PTX (ld.global.nc with cache hints), as a plain load.
        "static uint4 load_stream(const uint4* p) { return *p; }",
        cut(eng, "template <bool XF32>\n__device__ __forceinline__ void load_x8", "load_x8("),
        cut(eng, "__device__ __forceinline__ void gemv_prefetch_span", "gemv_prefetch("),
        # The kernels holding their weights in registers request 3 of a lane's GEMV_PRE chunks
        # before the PDL wait and the rest after the input (the *_PRE_EARLY knobs), so the
        # split's second half is checked against the staged kernels too.
        "#define QKV_PRE_EARLY 3",
        cut(eng, "template <int N, bool XF32>\n__device__ __forceinline__ void gemv_chunk", "void gemv_store("),
        # The dynamic shared memory of a GEMV block, as a fixed host array.
        cut(eng, "template <int N, int T = 32 * GEMV_WARPS>\n__device__ __forceinline__ const bf16_t* gemv_norm_prologue", "gemv_norm_prologue(")
        .replace("extern __shared__ uint4 gemv_smem[];", "static uint4 gemv_smem[4096];"),
        cut(eng, "__device__ __forceinline__ void rope_rotate", "rope_rotate("),
        # The first layer's embedding gather (EMBED, TAPEDECK_EMBED_FUSED=on).
        default("FED_TOKEN"),
        cut(eng, "__device__ __forceinline__ size_t embed_row_of", "embed_row_of("),
        # Weights staged in shared memory (QKV_ASYNC): cp.async as a copy, and GEMV_TMA's bulk
        # copies as one memcpy a row (GEMV_BULK; the check runs once each way).
        STAGING_STUBS,
        "#define QKV_STAGE_BYTES (GEMV_WARPS * 2 * GEMV_PRE * 32 * 16)",
        "static uint4 g_tail[QKV_STAGE_BYTES / 16];",
        "static uint4* smem_tail(unsigned) { return g_tail; }",
        cut(eng, "__device__ __forceinline__ uint4* two_row_stage", "two_row_stage("),
        cut(eng, "template <int P>\n__device__ __forceinline__ void gemv_stage(", "gemv_stage("),
        cut(eng, "struct StagedChunks {", "operator[](") + "\n};",
        # The kernel twice from the same text: index data read after the dot products and
        # the weights in registers, and index data read before the PDL wait with the weights
        # staged.
        kernel.replace("void qkv_rope_kernel(", "void qkv_rope_late(")
        .replace("QKV_INDEX_EARLY", "0")
        .replace("QKV_ASYNC", "0"),
        kernel.replace("void qkv_rope_kernel(", "void qkv_rope_early(")
        .replace("QKV_INDEX_EARLY", "1")
        .replace("QKV_ASYNC", "1"),
    ]
)

MAIN = r"""
static float of_bf16(bf16_t b) { return __uint_as_float((unsigned)b << 16); }
template <typename T>
static bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}
static float pool_value(float v) { return v; }
static float pool_value(bf16_t v) { return of_bf16(v); }

struct Case { int heads, kv_heads, hd, in; };

template <int N, typename KV>
static int check(const Case& c, int normalized, int with_bias, std::mt19937& rng) {
  std::normal_distribution<float> nd(0.f, 1.f);
  const int hd = c.hd, half = hd / 2, in = c.in, heads = c.heads, kvh = c.kv_heads;
  const int mode = sizeof(KV) == 2 ? 1 : 0;
  const float eps = 1e-5f;
  const int rows_of[3] = {heads * hd, kvh * hd, kvh * hd};
  std::vector<std::vector<bf16_t>> w(3);
  std::vector<std::vector<float>> b(3);
  for (int m = 0; m < 3; ++m) {
    w[m].resize((size_t)rows_of[m] * in);
    for (auto& v : w[m]) v = f32_to_bf16_bits(nd(rng) * 0.1f);
    if (with_bias) { b[m].resize(rows_of[m]); for (auto& v : b[m]) v = nd(rng); }
  }
  std::vector<float> x((size_t)N * in), norm_w(in);
  for (auto& v : x) v = nd(rng) * 3.f;
  for (auto& v : norm_w) v = 1.f + 0.3f * nd(rng);
  std::vector<bf16_t> xb(x.size());
  for (size_t i = 0; i < x.size(); ++i) xb[i] = f32_to_bf16_bits(x[i]);
  std::vector<float> inv_freq(half);
  for (int i = 0; i < half; ++i) inv_freq[i] = (float)std::pow(500000.0, -2.0 * i / hd);
  std::vector<int> pos(N), slots(N);
  const int pool_rows = 8;
  for (int r = 0; r < N; ++r) {
    pos[r] = (int)(rng() % 8000);
    slots[r] = r == 1 ? -1 : (int)((r * 5 + 3) % pool_rows);  // row 1 (when there is one) has no slot
  }
  const float nan = std::nanf("");
  KV poison;
  if constexpr (sizeof(KV) == 2) poison = 0x7fc1; else poison = nan;
  struct Out {
    std::vector<float> q, k, v;
    std::vector<KV> kp, vp;
  };
  auto fresh = [&] {
    Out o;
    o.q.assign((size_t)N * heads * hd, nan);
    o.k.assign((size_t)N * kvh * hd, nan);
    o.v.assign((size_t)N * kvh * hd, nan);
    o.kp.assign((size_t)pool_rows * kvh * hd, poison);
    o.vp.assign((size_t)pool_rows * kvh * hd, poison);
    return o;
  };
  Out late = fresh(), early = fresh();
  const void* xp = normalized ? (const void*)x.data() : (const void*)xb.data();
  const float* nw = normalized ? norm_w.data() : nullptr;
  auto bias = [&](int m) { return with_bias ? b[m].data() : nullptr; };
  const unsigned blocks = (unsigned)(((heads + 2 * kvh) * half + GEMV_WARPS - 1) / GEMV_WARPS);
  launch(dim3{blocks, 1, 1}, 32 * GEMV_WARPS, [&] {
    qkv_rope_late<N, KV>(xp, nw, eps, in, w[0].data(), bias(0), w[1].data(), bias(1), w[2].data(), bias(2),
                         late.q.data(), late.k.data(), late.v.data(), late.kp.data(), late.vp.data(), pos.data(),
                         inv_freq.data(), slots.data(), heads, kvh, hd, mode);
  });
  launch(dim3{blocks, 1, 1}, 32 * GEMV_WARPS, [&] {
    qkv_rope_early<N, KV>(xp, nw, eps, in, w[0].data(), bias(0), w[1].data(), bias(1), w[2].data(), bias(2),
                          early.q.data(), early.k.data(), early.v.data(), early.kp.data(), early.vp.data(),
                          pos.data(), inv_freq.data(), slots.data(), heads, kvh, hd, mode);
  });
  // The first layer's gather (EMBED): the input row read from a table at the pass's id, or at
  // the fed id, must give the same bits as the row given directly.
  int embed_failures = 0;
  if constexpr (N == 1) if (normalized) {
    std::vector<float> table((size_t)5 * in);
    for (auto& v : table) v = nd(rng);
    std::copy(x.begin(), x.end(), table.begin() + 3 * (size_t)in);
    const unsigned fed = 3;
    for (int via_fed = 0; via_fed < 2; ++via_fed) {
      Out e = fresh();
      launch(dim3{blocks, 1, 1}, 32 * GEMV_WARPS, [&] {
        qkv_rope_early<1, KV, true>(table.data(), nw, eps, in, w[0].data(), bias(0), w[1].data(), bias(1),
                                    w[2].data(), bias(2), e.q.data(), e.k.data(), e.v.data(), e.kp.data(),
                                    e.vp.data(), pos.data(), inv_freq.data(), slots.data(), heads, kvh, hd,
                                    mode, via_fed ? FED_TOKEN : 3u, via_fed ? &fed : nullptr);
      });
      embed_failures += !same_bits(e.q, early.q) || !same_bits(e.k, early.k) || !same_bits(e.v, early.v) ||
                        !same_bits(e.kp, early.kp) || !same_bits(e.vp, early.vp);
    }
  }
  char label[160];
  snprintf(label, sizeof label, "%d rows, %d/%d heads of %d, %d inputs, %s input, bias %d, %s pool", N, heads,
           kvh, hd, in, normalized ? "normalized" : "bf16", with_bias, mode ? "bf16" : "f32");
  int failures = 0;
  if (!same_bits(late.q, early.q) || !same_bits(late.k, early.k) || !same_bits(late.v, early.v) ||
      !same_bits(late.kp, early.kp) || !same_bits(late.vp, early.vp)) {
    printf("FAIL %s: QKV_INDEX_EARLY changes bits\n", label);
    failures++;
  }
  if (embed_failures) {
    printf("FAIL %s: the embedding gather changes bits (%d of 2)\n", label, embed_failures);
    failures += embed_failures;
  }
  // The float64 reference from the same bf16 operands (the input as the kernel rounds it).
  std::vector<float> xin(x);
  if (normalized)
    for (int r = 0; r < N; ++r) {
      double ss = 0;
      for (int i = 0; i < in; ++i) ss += (double)x[(size_t)r * in + i] * x[(size_t)r * in + i];
      for (int i = 0; i < in; ++i)
        xin[(size_t)r * in + i] = (float)(norm_w[i] * (x[(size_t)r * in + i] / std::sqrt(ss / in + eps)));
    }
  double worst = 0;
  int unwritten = 0;
  for (int r = 0; r < N; ++r)
  for (int m = 0; m < 3; ++m)
  for (int h = 0; h < rows_of[m] / hd; ++h)
  for (int i = 0; i < half; ++i) {
    double d[2], mag[2];
    for (int s = 0; s < 2; ++s) {
      const int row = h * hd + i + s * half;
      d[s] = with_bias ? b[m][row] : 0.0;
      mag[s] = std::fabs(d[s]);
      for (int j = 0; j < in; ++j) {
        double p = (double)of_bf16(w[m][(size_t)row * in + j]) * of_bf16(f32_to_bf16_bits(xin[(size_t)r * in + j]));
        d[s] += p, mag[s] += std::fabs(p);
      }
    }
    double lo = d[0], hi = d[1];
    if (m < 2) {
      double ang = (double)((float)pos[r] * inv_freq[i]);
      lo = d[0] * std::cos(ang) - d[1] * std::sin(ang);
      hi = d[1] * std::cos(ang) + d[0] * std::sin(ang);
    }
    const double scale = mag[0] + mag[1];
    const std::vector<float>& y = m == 0 ? early.q : m == 1 ? early.k : early.v;
    const int nh = m == 0 ? heads : kvh;
    const size_t at = ((size_t)r * nh + h) * hd;
    const float got[2] = {y[at + i], y[at + i + half]};
    const double want[2] = {lo, hi};
    for (int s = 0; s < 2; ++s) {
      if (!std::isfinite(got[s])) { unwritten++; continue; }
      // A bf16 pool's k and v are rounded to bf16 (half an ulp: 2^-9 of the value).
      const double allowed = 2e-4 * scale + (m > 0 && mode ? std::fabs(want[s]) / 256 : 0);
      worst = std::max(worst, std::fabs(got[s] - want[s]) / allowed);
    }
    if (m == 0) continue;
    const std::vector<KV>& pool = m == 1 ? early.kp : early.vp;
    if (slots[r] < 0) continue;
    const size_t dst = ((size_t)slots[r] * kvh + h) * hd;
    for (int s = 0; s < 2; ++s) {
      const float pv = pool_value(pool[dst + i + s * half]);
      if (memcmp(&pv, &got[s], 4) != 0) {
        printf("FAIL %s: pool row of seq %d (matrix %d head %d) differs from the output row\n", label, r, m, h);
        return failures + 1;
      }
    }
  }
  // Pool rows no sequence writes stay poisoned.
  for (int slot = 0; slot < pool_rows; ++slot) {
    bool used = false;
    for (int r = 0; r < N; ++r) used = used || slots[r] == slot;
    if (used) continue;
    for (int j = 0; j < kvh * hd; ++j) {
      KV a = early.kp[(size_t)slot * kvh * hd + j], e = poison;
      if (memcmp(&a, &e, sizeof(KV)) != 0) {
        printf("FAIL %s: pool slot %d written, no sequence has it\n", label, slot);
        return failures + 1;
      }
    }
  }
  if (unwritten || !(worst <= 1.0)) {
    printf("FAIL %s: %d outputs unwritten, worst error %.2f of its bound\n", label, unwritten, worst);
    failures++;
  } else {
    printf("%-90s error %.1e of its bound, bit-identical\n", label, worst);
  }
  return failures;
}

int main() {
  std::mt19937 rng(20261207);
  int failures = 0, cases = 0;
  const Case shapes[] = {{4, 2, 64, 256}, {4, 2, 128, 520}, {4, 1, 64, 2048}};
  for (const Case& c : shapes)
  for (int normalized = 0; normalized < 2; ++normalized)
  for (int with_bias = 0; with_bias < 2; ++with_bias) {
    failures += check<1, float>(c, normalized, with_bias, rng);
    failures += check<2, bf16_t>(c, normalized, with_bias, rng);
    cases += 2;
    if (c.in != 256) continue;
    failures += check<3, float>(c, normalized, with_bias, rng);
    failures += check<1, bf16_t>(c, normalized, with_bias, rng);
    cases += 2;
  }
  printf("qkv_rope_host_check: %d cases, %d failures\n", cases, failures);
  return failures ? 1 : 0;
}
"""

run_both_stagings(code + MAIN, "qkv_rope_host_check")
