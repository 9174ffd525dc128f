#!/usr/bin/env python3
"""Runs the MLP dataflow kernel of kernels/engine.cu on the CPU against the two it replaces.

`mlp_flow_1` (`TAPEDECK_FUSE=...,mlp`) promises the bits of `gemv_bf16_swiglu_1` followed by the
down projection's `gemv_bf16_1` with its slices (`splits` warps a feature) and the residual add:
gate/up blocks of chunk c release down slice c through a counter, and the last slice of an output
group adds the slice sums in slice order. This check runs all three kernels' code as
ci/cuda_host.py runs kernel code (blocks of 256 std::threads, one block after another in blockIdx
order, which is the order the grid's waits rely on), with 1, 2 and 4 slices, bf16 and normalized
inputs, with and without biases, and requires the SiLU·up features and the residual stream to be
bit-identical, and every counter to be zero again after the launch (the next launch reuses them).

    python3 ci/mlp_flow_host_check.py     # needs g++ (C++20)
"""
from cuda_host import cut, run
from gemv_stream_host_check import code as gemv_code, default, eng

code = "\n".join(
    [
        gemv_code,
        # The GPU-scope fence, the acquire load and the L1-bypassing load, on one host memory.
        "static void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }",
        "static float __ldcg(const float* p) { return *p; }",
        "static unsigned ld_acquire_u32(const unsigned* p) {\n"
        "  return std::atomic_ref<unsigned>(*const_cast<unsigned*>(p)).load(std::memory_order_acquire);\n}",
        default("MLP_FLOW_LAG"),
        default("MLP_FLOW_GROUPS_AT"),
        default("MLP_FLOW_DROWS"),
        cut(eng, "template <int N>\n__device__ __forceinline__ void mlp_flow_kernel", "void mlp_flow_kernel("),
    ]
)

MAIN = r"""
static std::vector<bf16_t> bf16_of(const std::vector<float>& v) {
  std::vector<bf16_t> b(v.size());
  for (size_t i = 0; i < v.size(); ++i) b[i] = f32_to_bf16_bits(v[i]);
  return b;
}

int main() {
  std::mt19937 rng(20261206);
  std::normal_distribution<float> nd(0.f, 1.f);
  const int hidden = 64, inter = 512;
  const float eps = 1e-5f;
  int failures = 0, cases = 0;
  for (int splits : {1, 2, 4})
  for (int normed = 0; normed < 2; ++normed)
  for (int biased = 0; biased < 2; ++biased) {
    std::vector<float> wgf((size_t)inter * hidden), wuf(wgf.size()), wdf((size_t)hidden * inter);
    for (auto* w : {&wgf, &wuf, &wdf}) for (auto& v : *w) v = nd(rng);
    std::vector<float> x(hidden), norm_w(hidden), bg(inter), bu(inter), bd(hidden), res(hidden);
    for (auto* v : {&x, &norm_w, &bg, &bu, &bd, &res}) for (auto& e : *v) e = nd(rng);
    std::vector<bf16_t> wg = bf16_of(wgf), wu = bf16_of(wuf), wd = bf16_of(wdf), xb = bf16_of(x);
    // The normalized input reads the f32 residual stream; the plain one bf16 bits.
    const void* xp = normed ? (const void*)x.data() : (const void*)xb.data();
    const float* nw = normed ? norm_w.data() : nullptr;
    const float* bgp = biased ? bg.data() : nullptr;
    const float* bup = biased ? bu.data() : nullptr;
    const float* bdp = biased ? bd.data() : nullptr;
    // The two kernels: gate/up into act, then y += down(act) over `splits` slices.
    std::vector<bf16_t> act_want(inter, 0x7fc0);
    std::vector<float> y_want(res);
    launch(dim3{(unsigned)(inter / GEMV_WARPS), 1, 1}, 32 * GEMV_WARPS, [&] {
      swiglu_kernel<1>(xp, nw, eps, hidden, wg.data(), bgp, wu.data(), bup, act_want.data(), inter);
    });
    GemvInput din{act_want.data(), 0, nullptr, 0.f};
    launch(dim3{(unsigned)(hidden * splits / GEMV_WARPS), 1, 1}, 32 * GEMV_WARPS, [&] {
      gemv_kernel<1>(din, inter, splits, 1, wd.data(), bdp, y_want.data(), hidden, nullptr, nullptr,
                     nullptr, 0, nullptr, nullptr, nullptr, 0);
    });
    // The one grid.
    std::vector<bf16_t> act(inter, 0x7fc0);
    std::vector<float> y(res), partial((size_t)splits * hidden, std::nanf(""));
    std::vector<unsigned> counters(MLP_FLOW_GROUPS_AT + hidden / GEMV_WARPS, 0u);
    int blocks = splits * (inter / splits / GEMV_WARPS + hidden / (MLP_FLOW_DROWS * GEMV_WARPS));
    launch(dim3{(unsigned)blocks, 1, 1}, 32 * GEMV_WARPS, [&] {
      mlp_flow_kernel<1>(xp, nw, eps, hidden, inter, splits, wg.data(), bgp, wu.data(), bup,
                         act.data(), wd.data(), bdp, y.data(), partial.data(), counters.data());
    });
    cases++;
    int act_differ = 0, y_differ = 0, dirty = 0;
    for (int i = 0; i < inter; ++i) act_differ += act[i] != act_want[i];
    for (int i = 0; i < hidden; ++i) y_differ += memcmp(&y[i], &y_want[i], 4) != 0;
    for (unsigned c : counters) dirty += c != 0;
    if (act_differ || y_differ || dirty) {
      printf("FAIL mlp flow %dx%d splits %d normed %d biased %d: %d SiLU·up and %d residual "
             "values differ, %d counters left set\n",
             hidden, inter, splits, normed, biased, act_differ, y_differ, dirty);
      failures++;
    }
  }
  printf("mlp_flow_host_check: %d launches bit-compared with the two kernels, %d failures\n", cases,
         failures);
  return failures ? 1 : 0;
}
"""

if __name__ == "__main__":
    run(code + MAIN, "mlp_flow_host_check")
