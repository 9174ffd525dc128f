#!/usr/bin/env python3
"""Runs the sparse decode path's selection kernel (`topk_mask`, kernels/engine.cu) on the CPU.

`decode_topk=N` attends over the N highest-scoring cached positions: `topk_mask` keeps, per
(row, head), the top_k scores (a radix select over the scores' order keys, 8 bits a pass) and the
earliest of the tied threshold values, and sets every other score of the context to -inf; a
context of at most top_k positions is left alone. This check runs it as ci/cuda_host.py runs
kernel code (blocks of 256 std::threads, barriers, shared-memory atomics) against a stable sort
(score descending by f32 total order, ties to the earlier position), over contexts shorter than,
equal to and longer than top_k, several 256-wide chunks, many ties at the threshold, negative
scores and -inf entries; positions past the context must stay untouched.

    python3 ci/topk_host_check.py     # needs g++ (C++20)
"""
from cuda_host import cut, run, source

eng = source("engine.cu")
code = "\n".join(
    [
        "#define __global__\n#define TD_SCOPE(name)",
        cut(eng, "typedef unsigned short bf16_t;", "bf16x2_bits("),
        "#define NORM_UNROLL " + eng.split("#define NORM_UNROLL ")[1].split()[0],
        cut(eng, "__device__ __forceinline__ unsigned int float_key", "float_key("),
        cut(eng, 'extern "C" __global__ void topk_mask', "topk_mask("),
    ]
)

MAIN = r"""
int main() {
  std::mt19937 rng(20261205);
  std::normal_distribution<float> nd(0.f, 2.f);
  int failures = 0, cases = 0;
  const int heads = 2, stride = 3000;
  // tie_every: every tie_every-th score is tie_value (9 is above every N(0, 2) draw here, so
  // the threshold itself is tied and only the earliest tied positions may stay).
  struct Case { int top_k; std::vector<int> ctx; int tie_every; float tie_value; };
  std::vector<Case> all = {
      {24, {10, 24, 25, 300, 2999}, 0, 0.f},  // shorter, equal, one more, a few chunks, long
      {64, {1000, 777}, 7, 1.25f},            // many exact ties below the threshold
      {24, {1000, 2999}, 11, 9.f},            // ~90-270 ties at the threshold: keep the first 24
      {1, {513, 2}, 3, 9.f},                  // the single best among many equal ones
      {200, {2048, 201}, 5, 9.f},             // ties spanning several 256-wide chunks
  };
  for (const Case& c : all) {
    const int rows = (int)c.ctx.size();
    std::vector<int> row_ids(rows), ctx(rows);
    for (int r = 0; r < rows; ++r) row_ids[r] = rows - 1 - r, ctx[rows - 1 - r] = c.ctx[r];
    std::vector<float> scores((size_t)rows * heads * stride);
    for (auto& v : scores) v = nd(rng);
    for (size_t i = 0; i < scores.size(); ++i) {
      if (c.tie_every && i % c.tie_every == 0) scores[i] = c.tie_value;
      if (i % 97 == 5) scores[i] = NEG_INF;
    }
    const std::vector<float> before = scores;
    launch(dim3{(unsigned)rows, (unsigned)heads, 1}, 256, [&] {
      topk_mask(scores.data(), stride, ctx.data(), row_ids.data(), heads, c.top_k);
    });
    for (int r = 0; r < rows; ++r)
      for (int h = 0; h < heads; ++h) {
        const int n = ctx[row_ids[r]];
        const float* in = before.data() + ((size_t)r * heads + h) * stride;
        const float* out = scores.data() + ((size_t)r * heads + h) * stride;
        std::vector<float> want(in, in + stride);
        if (n > c.top_k) {
          std::vector<int> ids(n);
          for (int j = 0; j < n; ++j) ids[j] = j;
          std::stable_sort(ids.begin(), ids.end(), [&](int a, int b) { return float_key(in[a]) > float_key(in[b]); });
          for (int q = c.top_k; q < n; ++q) want[ids[q]] = NEG_INF;
        }
        bool ok = memcmp(want.data(), out, stride * sizeof(float)) == 0;
        int kept = 0;
        for (int j = 0; j < n; ++j) kept += out[j] != NEG_INF || in[j] == NEG_INF;
        ++cases;
        if (!ok) {
          ++failures;
          printf("top_k %d, context %d, head %d: WRONG (kept %d)\n", c.top_k, n, h, kept);
        }
      }
    printf("top_k %3d, contexts", c.top_k);
    for (int n : c.ctx) printf(" %d", n);
    printf(": checked\n");
  }
  if (failures) printf("topk_host_check: %d of %d (row, head) selections wrong\n", failures, cases);
  else printf("topk_host_check: all %d (row, head) selections equal a stable sort's\n", cases);
  return failures ? 1 : 0;
}
"""

run(code + MAIN, "topk_host_check")
