#!/usr/bin/env python3
"""Runs the token-pick kernels of kernels/engine.cu on the CPU against a sort-based reference.

A decode step copies back, per picked row of logits, only the token, the log-sum-exp, the
entropy and the k best alternatives, computed on the device by `pick_partial` (per chunk of
PICK_CHUNK logits: max, f64 sums, k best) and `pick_finish` (merges the chunks). This check runs
both as ci/cuda_host.py runs kernel code (blocks of 256 std::threads, barriers, 8-byte shuffles)
on rows of random logits with ties, -inf entries and several chunks, with `PICK_FAST` 0 and 1,
and wants:

- the k alternatives exactly those of a stable sort (value descending by f32 total order, ties
  to the lower token ID), with their logits' bits; the chosen token (given or most likely);
- lse and entropy within 1e-12 (relative) of a long-double reference.

    python3 ci/pick_host_check.py     # needs g++ (C++20)
"""
from cuda_host import cut, run, source

eng = source("engine.cu")
code = "\n".join(
    [
        "#define __global__\n#define TD_SCOPE(name)\n"
        "static void pdl_launch_dependents() {}\nstatic void pdl_wait() {}",
        cut(eng, "typedef unsigned short bf16_t;", "block_max("),
        cut(eng, "__device__ __forceinline__ unsigned int float_key", "float_key("),
        cut(eng, "#define PICK_CHUNK", "pick_finish("),
    ]
)

MAIN = r"""
int main() {
  std::mt19937 rng(20261205);
  std::normal_distribution<float> nd(0.f, 3.f);
  int failures = 0;
  for (int trial = 0; trial < 4; ++trial) {
    const int vocab = trial == 0 ? 20000 : trial == 1 ? 8192 : trial == 2 ? 30011 : 200003;
    const int k = trial == 2 ? 32 : trial == 3 ? 20 : 8;
    const int picks = 2, chunks = (vocab + PICK_CHUNK - 1) / PICK_CHUNK, nrows = 3;
    std::vector<float> logits((size_t)nrows * vocab);
    for (auto& v : logits) v = nd(rng);
    // Ties across chunks and within one, and entries that are -inf.
    for (int r = 0; r < nrows; ++r) {
      float* row = logits.data() + (size_t)r * vocab;
      row[vocab - 1] = row[5] = row[8191 % vocab] = 14.5f;
      row[17] = NEG_INF;
      row[vocab / 2] = NEG_INF;
    }
    std::vector<int> rows = {2, 0}, chosen = {-1, 1234};
    std::vector<double> stats((size_t)picks * chunks * 3, -1.0);
    std::vector<unsigned long long> top((size_t)picks * chunks * k, 7ull);
    std::vector<unsigned int> out((size_t)picks * PICK_WORDS(k), 0xdeadbeefu);
    launch(dim3{(unsigned)picks, (unsigned)chunks, 1}, PICK_THREADS, [&] {
      pick_partial(logits.data(), vocab, rows.data(), k, stats.data(), top.data());
    });
    launch(dim3{(unsigned)picks, 1, 1}, PICK_THREADS, [&] {
      pick_finish(logits.data(), vocab, rows.data(), chosen.data(), k, chunks, stats.data(),
                  top.data(), out.data());
    });
    for (int p = 0; p < picks; ++p) {
      const float* row = logits.data() + (size_t)rows[p] * vocab;
      std::vector<int> ids(vocab);
      for (int i = 0; i < vocab; ++i) ids[i] = i;
      std::stable_sort(ids.begin(), ids.end(), [&](int a, int b) { return float_key(row[a]) > float_key(row[b]); });
      long double mx = -INFINITY, s0 = 0, s1 = 0;
      for (int i = 0; i < vocab; ++i) mx = std::max<long double>(mx, row[i]);
      for (int i = 0; i < vocab; ++i) {
        long double e = std::exp((long double)row[i] - mx);
        if (e == 0) continue;  // -inf logits: no mass (and no 0 * -inf in S1)
        s0 += e;
        s1 += e * row[i];
      }
      long double lse = mx + std::log(s0), ent = lse - s1 / s0;
      const unsigned int* o = out.data() + (size_t)p * PICK_WORDS(k);
      double got_lse, got_ent;
      unsigned long long lb = o[0] | ((unsigned long long)o[1] << 32), eb = o[2] | ((unsigned long long)o[3] << 32);
      memcpy(&got_lse, &lb, 8);
      memcpy(&got_ent, &eb, 8);
      bool ok = std::fabs(got_lse - (double)lse) <= 1e-12 * std::fabs((double)lse) &&
                std::fabs(got_ent - (double)ent) <= 1e-12 * std::fabs((double)ent);
      int want_tok = chosen[p] >= 0 ? chosen[p] : ids[0];
      ok = ok && (int)o[4] == want_tok && o[5] == __float_as_uint(row[want_tok]);
      for (int r = 0; r < k; ++r)
        ok = ok && (int)o[6 + 2 * r] == ids[r] && o[7 + 2 * r] == __float_as_uint(row[ids[r]]);
      printf("vocab %5d, k %2d, %d chunks, pick %d: top %d/%d/%d, lse %.15g (want %.15g), entropy %.6g%s\n",
             vocab, k, chunks, p, (int)o[6], (int)o[8], (int)o[10], got_lse, (double)lse, got_ent,
             ok ? "" : "  FAIL");
      failures += !ok;
    }
  }
  if (failures) printf("pick_host_check: %d pick(s) wrong\n", failures);
  else printf("pick_host_check: every pick matches the sort-based reference\n");
  return failures ? 1 : 0;
}
"""

run(code + MAIN, "pick_host_check")
# PICK_FAST: redux.sync maxima, the candidates' logits from their keys.
run("#define PICK_FAST 1\n" + code + MAIN, "pick_host_check (PICK_FAST=1)")
