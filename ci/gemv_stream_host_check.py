#!/usr/bin/env python3
"""Runs the streaming GEMV kernels of kernels/engine.cu on the CPU against the default ones.

`gemv_stream_bf16_1` and `gemv_stream_swiglu_1` (TAPEDECK_GEMV_STREAM) promise the bits of
`gemv_bf16_1` and `gemv_bf16_swiglu_1` on any grid: each warp streams its output features through
a ring of register buffers, summing every slice as gemv_row does and adding the slices in order.
This check runs both kernels' code as ci/cuda_host.py runs kernel code (blocks of 256 std::threads,
barriers for __syncthreads and the shuffles), on the shapes the engine gives them: one row; q/k/v as
three matrices of one launch; one slice per feature (2048 inputs and shorter, partial lane rounds)
and four (the down projection's 8192); bf16, f32 and normalized inputs; bias; the residual add; and
grids of 1 to 5 blocks, so that warps get several features, one, or none. Every output must be
bit-identical to the default kernel's (which start as NaN unless added to, so an unwritten output
shows), and within 1e-5 of Σ|w·x| of a float64 sum of the same bf16 operands.

It also runs the default kernel with its as-given input (bf16, or f32 it rounds) copied into
shared memory first (`gemv_x_prologue`, TAPEDECK_GEMV_X_SMEM: the launch's dynamic shared memory
decides, here a host variable), on one row and on three, and the streaming kernel so too (it must
read the copy as bf16 whatever it was given), and with its weights staged in shared
memory by cp.async (`GEMV_ASYNC`, 16 chunks a lane: TAPEDECK_GEMV_ASYNC=16; cp.async as a copy),
also on slices of 4096 inputs (all staged) and 8192 (half staged, half loaded after), and loading
the residual it adds to before its input's prologue (`GEMV_ADD_EARLY`): the same bits as the
kernel holding its weights in registers, compiled beside it from the same text. The
gate/up kernel likewise (`SWIGLU_ASYNC`, TAPEDECK_SWIGLU_ASYNC=on). All of it twice: the staged
rows copied chunk by chunk as cp.async does, and whole as `GEMV_TMA`'s bulk copies do.

    python3 ci/gemv_stream_host_check.py     # needs g++ (C++20)
"""
import re

from cuda_host import STAGING_STUBS, cut, macro_default, run_both_stagings, source

eng = source("engine.cu")


def define(name):
    """The #define of `name` in engine.cu with its continuation lines."""
    m = re.search(r"#define " + name + r"\b(?:[^\n]*\\\n)*[^\n]*\n", eng)
    return m.group(0)


def default(name):
    """`#define NAME value` as engine.cu's #ifndef default gives it."""
    return macro_default(eng, name)


code = "\n".join(
    [
        "#define __global__\n#define __launch_bounds__(a, b)\n#define TD_SCOPE(name)\n#define TD_WAITED()",
        cut(eng, "typedef unsigned short bf16_t;", "bf16x2_bits("),
        cut(eng, "__device__ __forceinline__ float warp_sum", "block_sum("),
        cut(eng, "template <int V>\n__device__ float block_sum_as_256", "block_sum_as_256("),
        cut(eng, "__device__ __forceinline__ void pdl_wait()", "pdl_launch_dependents("),
        default("NORM_UNROLL"),
        default("GEMV_MAX_ROWS"),
        default("GEMV_WARPS"),
        default("GEMV_BLOCK_WARPS"),
        default("GEMV_PRE"),
        default("GEMV_F32_TRIGGER_LATE"),
        # The staging is compiled in; the launch's dynamic shared memory (a host variable here)
        # decides whether a block copies its input.
        "#define GEMV_X_SMEM 1",
        "static unsigned g_dyn_smem = 0;\nstatic unsigned dynamic_smem_bytes() { return g_dyn_smem; }",
        # Weights staged by cp.async (a copy here) into a stage of their own.
        "#define GEMV_ASYNC 1\n#define GEMV_STAGE_PRE 16",
        define("GEMV_STAGE_BYTES"),
        define("GEMV_STAGED"),
        "static uint4 g_stage[GEMV_WARPS * GEMV_STAGE_PRE * 32];",
        # cp.async's per-lane chunks and GEMV_TMA's bulk copies: the check runs once each way.
        STAGING_STUBS,
        "static uint4* gemv_stage_slot(int warp) { return g_stage + warp * GEMV_STAGE_PRE * 32; }",
        "#define SWIGLU_ASYNC 1",
        define("SWIGLU_STAGE_BYTES"),
        "static uint4 g_tail[SWIGLU_STAGE_BYTES / 16];",
        "static uint4* smem_tail(unsigned) { return g_tail; }",
        cut(eng, "__device__ __forceinline__ uint4* two_row_stage", "two_row_stage("),
        default("GEMV_STREAM_DEPTH"),
        "#define GEMV_PERSIST 0",
        cut(eng, "template <int N, int T = 256, typename Store>", "rms_norm_rows("),
        cut(eng, "__device__ __forceinline__ float bf16_lo", "bf16_hi("),
        # The weight loads' PTX (ld.global.nc with cache hints), as a plain load.
        "static uint4 load_stream(const uint4* p) { return *p; }",
        cut(eng, "template <bool XF32>\n__device__ __forceinline__ void load_x8", "load_x8("),
        cut(eng, "__device__ __forceinline__ void gemv_prefetch_span", "gemv_prefetch("),
        # The kernels holding their weights in registers request part of a lane's GEMV_PRE
        # chunks before the PDL wait and the rest after the input (the *_PRE_EARLY knobs; 3,
        # 5 for rows split over warps, 2 for a residual add, 3 of gate's and 6 of up's), so the
        # second halves are checked against the staged kernels too.
        "#define GEMV_PRE_EARLY 3\n#define GEMV_PRE_EARLY_SPLIT 5\n#define GEMV_PRE_EARLY_ADD 2\n#define SWIGLU_PRE_EARLY 3\n#define SWIGLU_PRE_EARLY_UP 6",
        cut(eng, "template <int P>\n__device__ __forceinline__ void gemv_stage(", "gemv_stage("),
        cut(eng, "struct StagedChunks {", "operator[](") + "\n};",
        cut(eng, "template <int N, bool XF32>\n__device__ __forceinline__ void gemv_chunk", "void gemv_store("),
        # The dynamic shared memory of a GEMV block, as a fixed host array.
        cut(eng, "template <int N, int T = 32 * GEMV_WARPS>\n__device__ __forceinline__ const bf16_t* gemv_norm_prologue", "gemv_norm_prologue(")
        .replace("extern __shared__ uint4 gemv_smem[];", "static uint4 gemv_smem[4096];"),
        cut(eng, "template <int N, int T>\n__device__ __forceinline__ const bf16_t* gemv_x_prologue", "gemv_x_prologue(")
        .replace("extern __shared__ uint4 gemv_smem[];", "static uint4 gemv_smem[4096];"),
        cut(eng, "template <int T>\nstruct GemvInputOf {", "operator()(") + "\n};",
        "typedef GemvInputOf<32 * GEMV_WARPS> GemvInput;",
        cut(eng, "struct GemvTarget {", "gemv_target("),
        # The kernel twice: as the default build compiles it (weights in registers), renamed,
        # and with its weights staged in shared memory (GEMV_ASYNC below).
        cut(eng, "template <int N, typename Input>\n__device__ __forceinline__ void gemv_kernel", "void gemv_kernel(")
        .replace("void gemv_kernel(", "void gemv_kernel_regs(")
        .replace("GEMV_STAGED", "0")
        .replace("GEMV_ADD_EARLY", "0"),
        # The staged one also loads the residual it adds to early (GEMV_ADD_EARLY).
        cut(eng, "template <int N, typename Input>\n__device__ __forceinline__ void gemv_kernel", "void gemv_kernel(")
        .replace("GEMV_ADD_EARLY", "1"),
        define("GEMV_PARAMS"),
        define("GEMV_ARGS"),
        define("SWIGLU_PARAMS"),
        define("SWIGLU_ARGS"),
        cut(eng, "template <int N>\n__device__ __forceinline__ void swiglu_store", "void swiglu_kernel("),
        # gate/up as the default build compiles it (weights in registers), renamed, beside the
        # staged one (SWIGLU_ASYNC above).
        cut(eng, "template <int N>\n__device__ __forceinline__ void swiglu_kernel", "void swiglu_kernel(")
        .replace("void swiglu_kernel(", "void swiglu_kernel_regs(")
        .replace("#if SWIGLU_ASYNC && !GEMV_PERSIST", "#if 0"),
        cut(eng, "template <bool XF32, typename UnitW", "void gemv_stream_kernel("),
        cut(eng, 'extern "C" __global__ void __launch_bounds__(32 * GEMV_WARPS, GEMV_STREAM_MIN_BLOCKS) gemv_stream_swiglu_1',
            "gemv_stream_swiglu_1("),
    ]
)

MAIN = r"""
static std::vector<bf16_t> bf16_of(const std::vector<float>& v) {
  std::vector<bf16_t> b(v.size());
  for (size_t i = 0; i < v.size(); ++i) b[i] = f32_to_bf16_bits(v[i]);
  return b;
}
static float of_bf16(bf16_t b) { return __uint_as_float((unsigned)b << 16); }
static bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return memcmp(a.data(), b.data(), a.size() * 4) == 0;
}

int main() {
  std::mt19937 rng(20261205);
  std::normal_distribution<float> nd(0.f, 1.f);
  int failures = 0, cases = 0;
  const float eps = 1e-5f;
  const float nan = std::nanf("");
  // (matrix rows, inputs, slices per feature) per matrix of one launch.
  struct Shape { std::vector<int> outs; int in, splits; };
  const std::vector<Shape> shapes = {
      {{37}, 2048, 1}, {{29}, 8192, 4}, {{24, 8, 8}, 512, 1}, {{45}, 200, 1}, {{3}, 24, 1},
      // Slices the streaming kernels do not take (over 2048 inputs): register and staged only.
      {{29}, 8192, 2}, {{7}, 8192, 1}};
  for (const Shape& sh : shapes)
  for (int input = 0; input < 3; ++input)  // bf16, f32 rounded by the kernel, normalized f32
  for (int add = 0; add < 2; ++add) {
    const int in = sh.in, nm = (int)sh.outs.size();
    if (input == 2 && in * 2 > (int)sizeof(uint4) * 4096) continue;
    std::vector<std::vector<float>> wf(3), bias(3), start(3);
    std::vector<std::vector<bf16_t>> wb(3);
    int total = 0;
    for (int j = 0; j < nm; ++j) {
      wf[j].resize((size_t)sh.outs[j] * in);
      for (auto& v : wf[j]) v = of_bf16(f32_to_bf16_bits(nd(rng)));
      wb[j] = bf16_of(wf[j]);
      if (j % 2 == 0) { bias[j].resize(sh.outs[j]); for (auto& v : bias[j]) v = nd(rng); }
      start[j].resize(sh.outs[j]);
      for (auto& v : start[j]) v = add ? nd(rng) : nan;
      total += sh.outs[j];
    }
    std::vector<float> x(in), norm_w(in);
    for (auto& v : x) v = nd(rng) * 3.f;
    for (auto& v : norm_w) v = 1.f + 0.3f * nd(rng);
    std::vector<bf16_t> xb = bf16_of(x);
    const void* xp = input == 0 ? (const void*)xb.data() : (const void*)x.data();
    GemvInput gin{xp, input == 1, input == 2 ? norm_w.data() : nullptr, eps};
    auto args = [&](std::vector<std::vector<float>>& y, int j) {
      struct { const bf16_t* w; const float* b; float* y; int out; } a{nullptr, nullptr, nullptr, 0};
      if (j < nm) a = {wb[j].data(), bias[j].empty() ? nullptr : bias[j].data(), y[j].data(), sh.outs[j]};
      return a;
    };
    std::vector<std::vector<float>> want = start;
    {
      auto a0 = args(want, 0), a1 = args(want, 1), a2 = args(want, 2);
      int blocks = (total * sh.splits + GEMV_WARPS - 1) / GEMV_WARPS;
      launch(dim3{(unsigned)blocks, 1, 1}, 32 * GEMV_WARPS, [&] {
        gemv_kernel_regs<1>(gin, in, sh.splits, add, a0.w, a0.b, a0.y, a0.out, a1.w, a1.b, a1.y,
                            a1.out, a2.w, a2.b, a2.y, a2.out);
      });
    }
    {  // weights staged in shared memory (the host gives every launch the stage)
      std::vector<std::vector<float>> got = start;
      auto a0 = args(got, 0), a1 = args(got, 1), a2 = args(got, 2);
      int blocks = (total * sh.splits + GEMV_WARPS - 1) / GEMV_WARPS;
      g_dyn_smem = GEMV_STAGE_BYTES + (input == 2 ? in * 2 : 0);
      launch(dim3{(unsigned)blocks, 1, 1}, 32 * GEMV_WARPS, [&] {
        gemv_kernel<1>(gin, in, sh.splits, add, a0.w, a0.b, a0.y, a0.out, a1.w, a1.b, a1.y, a1.out,
                       a2.w, a2.b, a2.y, a2.out);
      });
      g_dyn_smem = 0;
      cases++;
      for (int j = 0; j < nm; ++j)
        if (!same_bits(got[j], want[j])) {
          printf("FAIL staged-weights gemv %dx%d (matrix %d) input %d add %d splits %d\n", total, in, j,
                 input, add, sh.splits);
          failures++;
        }
    }
    // The float64 reference of the first matrix's outputs (x as the kernels round it).
    std::vector<float> xin(x);
    if (input == 2) {
      double ss = 0;
      for (float v : x) ss += (double)v * v;
      float ms = 0.f;  // the kernel's own f32 statistic is not what is checked here
      (void)ms;
      for (int i = 0; i < in; ++i) xin[i] = (float)(norm_w[i] * (x[i] / std::sqrt(ss / in + eps)));
    }
    double worst = 0;
    for (int o = 0; o < sh.outs[0]; ++o) {
      double dot = 0, mag = 0;
      for (int i = 0; i < in; ++i) {
        double p = (double)wf[0][(size_t)o * in + i] * of_bf16(f32_to_bf16_bits(xin[i]));
        dot += p, mag += std::fabs(p);
      }
      double extra = (bias[0].empty() ? 0 : bias[0][o]) + (add ? start[0][o] : 0);
      mag += std::fabs(extra);
      worst = std::max(worst, std::fabs(want[0][o] - (dot + extra)) / std::max(mag, 1e-30));
    }
    // The normalized input may round the other way in one place than the f32 norm: looser.
    if (!(worst <= (input == 2 ? 1e-4 : 1e-5))) {
      printf("FAIL default gemv %dx%d input %d add %d: error %.2e of sum |terms|\n", total, in, input, add, worst);
      failures++;
    }
    if (input < 2) {  // the register kernel with its input staged in shared memory
      std::vector<std::vector<float>> got = start;
      auto a0 = args(got, 0), a1 = args(got, 1), a2 = args(got, 2);
      int blocks = (total * sh.splits + GEMV_WARPS - 1) / GEMV_WARPS;
      g_dyn_smem = (unsigned)in * 2 + GEMV_STAGE_BYTES;
      launch(dim3{(unsigned)blocks, 1, 1}, 32 * GEMV_WARPS, [&] {
        gemv_kernel_regs<1>(gin, in, sh.splits, add, a0.w, a0.b, a0.y, a0.out, a1.w, a1.b, a1.y,
                            a1.out, a2.w, a2.b, a2.y, a2.out);
      });
      g_dyn_smem = 0;
      cases++;
      for (int j = 0; j < nm; ++j)
        if (!same_bits(got[j], want[j])) {
          printf("FAIL staged gemv %dx%d (matrix %d) input %d add %d\n", total, in, j, input, add);
          failures++;
        }
    }
    // The streaming kernel with and without its input staged in shared memory: the host gives
    // its launches the room for an as-given input (x_stage_smem), and the prologue then hands
    // back bf16 bits whatever the input was, which the kernel must read as such (the
    // twenty-third session's GPU crash: an f32 input read as f32 from the bf16 copy).
    for (int staged = 0; staged < (input < 2 ? 2 : 1); ++staged)
    for (unsigned grid = 1; grid <= 5 && in / sh.splits <= 2048; grid += 2) {
      std::vector<std::vector<float>> got = start;
      auto a0 = args(got, 0), a1 = args(got, 1), a2 = args(got, 2);
      g_dyn_smem = staged ? (unsigned)in * 2 + GEMV_STAGE_BYTES : 0;
      launch(dim3{grid, 1, 1}, 32 * GEMV_WARPS, [&] {
        gemv_stream_kernel(gin, in, sh.splits, add, a0.w, a0.b, a0.y, a0.out, a1.w, a1.b, a1.y, a1.out,
                           a2.w, a2.b, a2.y, a2.out);
      });
      g_dyn_smem = 0;
      cases++;
      for (int j = 0; j < nm; ++j)
        if (!same_bits(got[j], want[j])) {
          int differ = 0;
          for (size_t i = 0; i < got[j].size(); ++i) differ += memcmp(&got[j][i], &want[j][i], 4) != 0;
          printf("FAIL stream gemv %dx%d (matrix %d) input %d add %d grid %u staged %d: %d of %zu outputs differ\n",
                 total, in, j, input, add, grid, staged, differ, got[j].size());
          failures++;
        }
    }
  }
  // Three input rows, staged or not (bf16 and f32 input): the same bits.
  for (int in : {2048, 520})
  for (int input = 0; input < 2; ++input) {
    const int n = 3, out = 21;
    std::vector<float> wf((size_t)out * in), x((size_t)n * in);
    for (auto& v : wf) v = nd(rng);
    for (auto& v : x) v = nd(rng) * 3.f;
    std::vector<bf16_t> wb = bf16_of(wf), xb = bf16_of(x);
    const void* xp = input == 0 ? (const void*)xb.data() : (const void*)x.data();
    GemvInput gin{xp, input == 1, nullptr, eps};
    std::vector<float> want((size_t)n * out, nan), got(want.size(), nan);
    for (int staged = 0; staged < 2; ++staged) {
      std::vector<float>& y = staged ? got : want;
      g_dyn_smem = staged ? (unsigned)(n * in * 2) + GEMV_STAGE_BYTES : 0;
      launch(dim3{(unsigned)((out + GEMV_WARPS - 1) / GEMV_WARPS), 1, 1}, 32 * GEMV_WARPS, [&] {
        gemv_kernel_regs<3>(gin, in, 1, 0, wb.data(), nullptr, y.data(), out, nullptr, nullptr, nullptr, 0,
                       nullptr, nullptr, nullptr, 0);
      });
    }
    g_dyn_smem = 0;
    cases++;
    bool written = true;
    for (float v : want) written = written && std::isfinite(v);
    if (!written || !same_bits(got, want)) {
      printf("FAIL staged gemv 3 rows x %d input %d (written %d)\n", in, input, written);
      failures++;
    }
  }
  // gate/up + SiLU: bf16 and normalized inputs.
  for (int inter : {45, 300})
  for (int in : {2048, 200})
  for (int normed = 0; normed < 2; ++normed) {
    std::vector<float> wgf((size_t)inter * in), wuf(wgf.size()), x(in), norm_w(in), bg(inter);
    for (auto& v : wgf) v = nd(rng);
    for (auto& v : wuf) v = nd(rng);
    for (auto& v : x) v = nd(rng);
    for (auto& v : norm_w) v = 1.f + 0.3f * nd(rng);
    for (auto& v : bg) v = nd(rng);
    std::vector<bf16_t> wg = bf16_of(wgf), wu = bf16_of(wuf), xb = bf16_of(x);
    const void* xp = normed ? (const void*)x.data() : (const void*)xb.data();
    const float* nw = normed ? norm_w.data() : nullptr;
    const float* bgp = inter == 45 ? bg.data() : nullptr;
    std::vector<bf16_t> want(inter, 0x7fc0), got;
    launch(dim3{(unsigned)((inter + GEMV_WARPS - 1) / GEMV_WARPS), 1, 1}, 32 * GEMV_WARPS, [&] {
      swiglu_kernel_regs<1>(xp, nw, eps, in, wg.data(), bgp, wu.data(), nullptr, want.data(), inter);
    });
    got.assign(inter, 0x7fc0);  // the weights staged in shared memory
    launch(dim3{(unsigned)((inter + GEMV_WARPS - 1) / GEMV_WARPS), 1, 1}, 32 * GEMV_WARPS, [&] {
      swiglu_kernel<1>(xp, nw, eps, in, wg.data(), bgp, wu.data(), nullptr, got.data(), inter);
    });
    cases++;
    if (memcmp(got.data(), want.data(), inter * 2) != 0) {
      printf("FAIL staged-weights swiglu %dx%d normed %d\n", inter, in, normed);
      failures++;
    }
    for (unsigned grid = 1; grid <= 5; grid += 2) {
      got.assign(inter, 0x7fc0);
      launch(dim3{grid, 1, 1}, 32 * GEMV_WARPS, [&] {
        gemv_stream_swiglu_1(xp, 0, nw, eps, 1, in, wg.data(), bgp, wu.data(), nullptr, got.data(), inter);
      });
      cases++;
      if (memcmp(got.data(), want.data(), inter * 2) != 0) {
        printf("FAIL stream swiglu %dx%d normed %d grid %u\n", inter, in, normed, grid);
        failures++;
      }
      for (bf16_t b : got)
        if (!std::isfinite(of_bf16(b))) { printf("FAIL swiglu %dx%d: unwritten output\n", inter, in); failures++; break; }
    }
  }
  printf("gemv_stream_host_check: %d stream and staged runs bit-compared, %d failures\n", cases, failures);
  return failures ? 1 : 0;
}
"""

if __name__ == "__main__":
    run_both_stagings(code + MAIN, "gemv_stream_host_check")
