#!/usr/bin/env python3
"""Runs the split merges of kernels/decode_attention_mma.cu on the CPU, against each other.

The mma decode kernel writes each split's (max, sum, output) and one of three merges combines
them: `combine_head_t` (the decode_attn_combine kernel, one block a head: the maximum first, then
the weighted sums), and `combine_group_fast` (every split of every head loaded in one round), used
by the mma kernel's own merge (128 threads, all query heads of a KV head) and, with
DA_COMBINE_FAST=1, by decode_attn_combine itself (256 threads, one head). All must give the same
bits: the maximum is exact in any order, and each (part, dim) sum runs over the same splits in the
same order. This script cuts the three functions out of the kernel source, compiles them with g++
for the host (a block runs as std::threads, `__shared__` is a static, ex2 is exp2f), and merges
random partials for head_dim 64 and 128, 1 to 16 splits, GQA groups 1 to 4, some splits far below
the maximum (weight 0), and compares every output bit for bit. It also checks that the fast merge
declines (returns false, writes nothing) where its registers do not cover the splits.

It checks the index arithmetic and the summation order, not the GPU's memory model or ex2's
rounding: the GPU tests (mma kernel against the CPU, graphs and pdl=all bit for bit) do that.

    python3 ci/combine_host_check.py     # needs g++ (C++20)
"""
import re

from cuda_host import cut, run, source

mma = source("decode_attention_mma.cu")
merges = cut(mma, "template <int PT>\n__device__ __forceinline__ void combine_head_t", "combine_head_t(")
fast = cut(mma, "#ifndef MG_U", "combine_group_fast(")
combine_threads = re.search(r"#define DA_COMBINE_THREADS (\d+)", mma).group(1)
da_threads = re.search(r"#define DA_THREADS (\d+)", mma).group(1)
combine_r = re.search(r"#define DA_COMBINE_R (\d+)", mma).group(1)

MAIN = r"""
#define DA_COMBINE_THREADS @@COMBINE_THREADS@@
#define DA_THREADS @@DA_THREADS@@
#define DA_COMBINE_R @@COMBINE_R@@
namespace da {
static float neg_inf() { return -INFINITY; }
static float ex2(float x) { return std::exp2(x); }
}
@@MERGES@@
@@FAST@@

// The merge of `group` heads from head0 by one of the three, into out (poisoned first).
enum Kind { PER_HEAD, FAST_KERNEL_MERGE, FAST_COMBINE };
static bool merge(Kind kind, std::vector<float>& out, const std::vector<float>& po, const std::vector<float>& ml,
                  const std::vector<int>& ctx, int nh, int hd, int split_len, int ms, int head0, int group, int seq) {
  bool took = true;
  if (kind == PER_HEAD) {
    for (int j = 0; j < group; j++)
      launch(dim3{1, 1, 1}, DA_COMBINE_THREADS, [&] {
        combine_head_t<DA_COMBINE_THREADS>(out.data(), po.data(), ml.data(), ctx.data(), nh, hd, split_len, ms,
                                           head0 + j, seq);
      });
    return true;
  }
  const int ns = std::min((ctx[seq] + split_len - 1) / split_len, ms);
  if (kind == FAST_KERNEL_MERGE) {
    static float smem[2 * MG_U * DA_THREADS];
    launch(dim3{1, 1, 1}, DA_THREADS, [&] {
      bool t = combine_group_fast<DA_THREADS>(out.data(), po.data(), ml.data(), ns, nh, hd, ms, head0, group, seq, smem);
      if (threadIdx.x == 0) took = t;
    });
  } else {
    static float smem[2 * DA_COMBINE_THREADS];
    for (int j = 0; j < group; j++)
      launch(dim3{1, 1, 1}, DA_COMBINE_THREADS, [&] {
        bool t = combine_group_fast<DA_COMBINE_THREADS, 1, DA_COMBINE_R>(out.data(), po.data(), ml.data(), ns, nh, hd,
                                                                         ms, head0 + j, 1, seq, smem);
        if (threadIdx.x == 0 && !t) took = false;
      });
  }
  return took;
}

int main() {
  std::mt19937 rng(std::random_device{}());
  std::normal_distribution<float> nd(0.f, 1.f);
  int fails = 0, compared = 0, declined = 0;
  for (int trial = 0; trial < 60; trial++) {
    const int hd = trial % 2 ? 128 : 64, group = 1 + trial % 4, nkv = 2, nh = group * nkv, seqs = 2;
    const int split_len = 16 * (1 + rng() % 4), ms = 1 + rng() % 16;
    std::vector<int> ctx(seqs);
    for (auto& c : ctx) c = 1 + rng() % (split_len * ms);
    std::vector<float> po((size_t)seqs * nh * ms * hd), ml((size_t)seqs * nh * ms * 2);
    for (auto& v : po) v = nd(rng);
    for (size_t i = 0; i < ml.size(); i += 2) {
      ml[i] = nd(rng) * 4.f - (rng() % 5 == 0 ? 200.f : 0.f);  // some splits weigh nothing
      ml[i + 1] = 1.f + std::fabs(nd(rng)) * 30.f;
    }
    for (int seq = 0; seq < seqs; seq++) {
      const int ns = std::min((ctx[seq] + split_len - 1) / split_len, ms);
      if (ns <= 1) continue;  // the mma kernel writes single-split heads itself
      for (int kvh = 0; kvh < nkv; kvh++) {
        const int head0 = kvh * group;
        std::vector<float> want(po.size() / ms, NAN);
        merge(PER_HEAD, want, po, ml, ctx, nh, hd, split_len, ms, head0, group, seq);
        for (Kind k : {FAST_KERNEL_MERGE, FAST_COMBINE}) {
          std::vector<float> got(want.size(), NAN);
          if (!merge(k, got, po, ml, ctx, nh, hd, split_len, ms, head0, group, seq)) {
            // Declined: nothing may have been written.
            declined++;
            for (float v : got) fails += !std::isnan(v);
            continue;
          }
          compared++;
          int bad = 0;
          for (int j = 0; j < group; j++)
            for (int d = 0; d < hd; d++) {
              const size_t i = ((size_t)seq * nh + head0 + j) * hd + d;
              bad += __float_as_uint(got[i]) != __float_as_uint(want[i]);
            }
          if (bad && fails++ < 5)
            printf("%s merge, head_dim %d, group %d, %d splits: %d outputs differ\n",
                   k == FAST_COMBINE ? "combine-kernel fast" : "in-kernel", hd, group, ns, bad);
        }
      }
    }
  }
  printf("split merges: %d fast merges bit-compared with the per-head combine (%d declined), %d failures\n",
         compared, declined, fails);
  return fails || compared < 20 ? 1 : 0;
}
"""

code = (
    MAIN.replace("@@COMBINE_THREADS@@", combine_threads)
    .replace("@@DA_THREADS@@", da_threads)
    .replace("@@COMBINE_R@@", combine_r)
    .replace("@@MERGES@@", merges)
    .replace("@@FAST@@", fast)
)
run(code, "combine_host_check")
