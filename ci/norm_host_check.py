#!/usr/bin/env python3
"""Runs the RMSNorm code of kernels/engine.cu on the CPU: batched loads, unchanged sums.

`rms_norm_row` (the rms_norm kernel, and the persistent step's norm phase) and
`gemv_norm_prologue` (the RMSNorm each GEMV block computes before its rows, `small_gemm=gemv`)
load NORM_UNROLL strides of a row before they use any, because NVRTC does not unroll a
block-stride loop over a run-time width and each stride waited for its load (twelfth session:
~10 µs for one 2048-wide RMSNorm). The sums must still be taken in the plain loop's order, and
the fused prologue must give the rms_norm kernel's bits (the GPU tests compare the fused and
separate paths bit for bit). This check runs both functions as ci/cuda_host.py runs kernel code
(a block of 256 std::threads, barriers for __syncthreads and the shuffles) against the plain
one-stride loop, over widths below, at and above one batch of strides (256 × NORM_UNROLL) and
1-4 rows:

- rms_norm_row, f32 and bf16 output: bit-identical to the plain loop;
- gemv_norm_prologue: every row bit-identical to rms_norm_row's bf16 output for that row, in a
  block of 256 threads and in one of 128 (the GEMVs' 4-warp blocks, TAPEDECK_GEMV_BLOCK=4), which
  plays two of the 256 threads each;
- the f32 output within 1e-6 (relative L2) of a float64 RMSNorm.

    python3 ci/norm_host_check.py     # needs g++ (C++20)
"""
from cuda_host import cut, run, source

eng = source("engine.cu")
code = "\n".join(
    [
        cut(eng, "typedef unsigned short bf16_t;", "bf16x2_bits("),
        cut(eng, "__device__ __forceinline__ float warp_sum", "block_sum("),
        cut(eng, "template <int V>\n__device__ float block_sum_as_256", "block_sum_as_256("),
        "#define GEMV_WARPS 8",
        "#define NORM_UNROLL " + eng.split("#define NORM_UNROLL ")[1].split()[0],
        "#define GEMV_MAX_ROWS " + eng.split("#define GEMV_MAX_ROWS ")[1].split()[0],
        cut(eng, "template <int N, int T = 256, typename Store>", "rms_norm_rows("),
        cut(eng, "__device__ __forceinline__ void rms_norm_row(", "rms_norm_row("),
        # The dynamic shared memory of a GEMV block, as a fixed host array.
        cut(eng, "template <int N, int T = 32 * GEMV_WARPS>\n__device__ __forceinline__ const bf16_t* gemv_norm_prologue", "gemv_norm_prologue(")
        .replace("extern __shared__ uint4 gemv_smem[];", "static uint4 gemv_smem[4096];"),
    ]
)

MAIN = r"""
// The rms_norm kernel's loops as they were before the batched loads: one stride at a time.
static void plain_rms_norm_row(float* out, bf16_t* out_bf16, const float* x, const float* w, int d,
                               float eps, int row) {
  __shared__ float s32[32];
  const float* xr = x + (size_t)row * d;
  float ss = 0.0f;
  for (int i = threadIdx.x; i < d; i += blockDim.x) ss += xr[i] * xr[i];
  ss = block_sum(ss, s32) / (float)d;
  float inv = 1.0f / sqrtf(ss + eps);
  for (int i = threadIdx.x; i < d; i += blockDim.x) {
    float y = w[i] * (xr[i] * inv);
    if (out_bf16) out_bf16[(size_t)row * d + i] = f32_to_bf16_bits(y);
    else out[(size_t)row * d + i] = y;
  }
}

template <typename T>
static bool same(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

int main() {
  std::mt19937 rng(20261205);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::uniform_real_distribution<float> lmag(-4.f, 3.f);  // magnitudes e^-4 .. e^3
  int failures = 0;
  const float eps = 1e-5f;
  for (int trial = 0; trial < 4; ++trial)
  for (int d : {64, 1000, 2048, 2056, 5000}) {
    for (int n = 1; n <= 4; ++n) {
      std::vector<float> x((size_t)n * d), w(d);
      for (auto& v : x) v = nd(rng) * std::exp(lmag(rng));
      for (auto& v : w) v = 1.f + 0.3f * nd(rng);
      std::vector<float> f_new(x.size(), -9.f), f_old(x.size(), -7.f);
      std::vector<bf16_t> b_new(x.size(), 1), b_old(x.size(), 2), fused(x.size(), 3),
          fused128(x.size(), 4);
      launch(dim3{(unsigned)n, 1, 1}, 256, [&] {
        rms_norm_row(f_new.data(), nullptr, x.data(), w.data(), d, eps, blockIdx.x);
        rms_norm_row(nullptr, b_new.data(), x.data(), w.data(), d, eps, blockIdx.x);
        plain_rms_norm_row(f_old.data(), nullptr, x.data(), w.data(), d, eps, blockIdx.x);
        plain_rms_norm_row(nullptr, b_old.data(), x.data(), w.data(), d, eps, blockIdx.x);
      });
      if (d % 8 == 0 && (size_t)n * d * 2 <= sizeof(uint4) * 4096) {
        launch(dim3{1, 1, 1}, 256, [&] {
          const bf16_t* xs = n == 1   ? gemv_norm_prologue<1>(x.data(), w.data(), eps, d)
                             : n == 2 ? gemv_norm_prologue<2>(x.data(), w.data(), eps, d)
                             : n == 3 ? gemv_norm_prologue<3>(x.data(), w.data(), eps, d)
                                      : gemv_norm_prologue<4>(x.data(), w.data(), eps, d);
          if (threadIdx.x == 0) memcpy(fused.data(), xs, x.size() * sizeof(bf16_t));
        });
        launch(dim3{1, 1, 1}, 128, [&] {
          const bf16_t* xs = n == 1   ? gemv_norm_prologue<1, 128>(x.data(), w.data(), eps, d)
                             : n == 2 ? gemv_norm_prologue<2, 128>(x.data(), w.data(), eps, d)
                             : n == 3 ? gemv_norm_prologue<3, 128>(x.data(), w.data(), eps, d)
                                      : gemv_norm_prologue<4, 128>(x.data(), w.data(), eps, d);
          if (threadIdx.x == 0) memcpy(fused128.data(), xs, x.size() * sizeof(bf16_t));
        });
      } else {
        fused = fused128 = b_new;  // the GEMV kernels take widths that are multiples of 8 and fit in smem
      }
      double err = 0, ref = 0;
      for (int r = 0; r < n; ++r) {
        double s = 0;
        for (int i = 0; i < d; ++i) s += (double)x[(size_t)r * d + i] * x[(size_t)r * d + i];
        double inv = 1.0 / std::sqrt(s / d + eps);
        for (int i = 0; i < d; ++i) {
          double want = (double)w[i] * x[(size_t)r * d + i] * inv;
          err += (f_new[(size_t)r * d + i] - want) * (f_new[(size_t)r * d + i] - want);
          ref += want * want;
        }
      }
      double rel = std::sqrt(err / ref);
      bool ok = same(f_new, f_old) && same(b_new, b_old) && same(fused, b_new) &&
                same(fused128, b_new) && rel < 1e-6;
      if (trial == 0 || !ok)
        printf("d %4d, %d rows: f32 same %d, bf16 same %d, fused prologue same %d (128 threads %d), rel L2 vs f64 %.2e%s\n",
             d, n, same(f_new, f_old), same(b_new, b_old), same(fused, b_new), same(fused128, b_new), rel,
             ok ? "" : "  FAIL");
      failures += !ok;
    }
  }
  if (failures) printf("norm_host_check: %d case(s) failed\n", failures);
  else printf("norm_host_check: every case bit-identical to the plain loops\n");
  return failures ? 1 : 0;
}
"""

run(code + MAIN, "norm_host_check")
