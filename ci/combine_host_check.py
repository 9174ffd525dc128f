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

It then runs the o GEMV's own merge (kernels/decode_fused.cu, `MergedSplits`: `staged`, every
split copied into shared memory first, and `in_registers`) over 1 to 4 rows of 2 to 8 query heads
with 0 to 8 splits each (an empty context, one split written by the mma kernel, several merged),
and compares the bf16 inputs it leaves in shared memory bit for bit with the combine's output
rounded as the plain GEMV rounds it.

It checks the index arithmetic and the summation order, not the GPU's memory model or ex2's
rounding: the GPU tests (mma kernel against the CPU, graphs and pdl=all bit for bit) do that.

    python3 ci/combine_host_check.py     # needs g++ (C++20)
"""
import re

from cuda_host import cut, run, source

mma = source("decode_attention_mma.cu")
eng = source("engine.cu")
fused = source("decode_fused.cu")
merged = cut(fused, "struct MergedSplits {", "const void* in_registers(") + "\n};"
# Host copies are done when issued: nothing to wait for; the block's shared memory is a static.
merged = merged.replace('asm volatile("cp.async.wait_all;" ::: "memory");', "").replace(
    "extern __shared__ uint4 gemv_smem[];", ""
)
merge_group = re.search(r"#define MERGE_GROUP (\d+)", fused).group(1)
gemv_max_rows = re.search(r"#define GEMV_MAX_ROWS (\d+)", eng).group(1)
bf16 = cut(eng, "typedef unsigned short bf16_t;", "bf16x2_bits(")
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
#define MERGE_GROUP @@MERGE_GROUP@@
#define GEMV_MAX_ROWS @@GEMV_MAX_ROWS@@
static uint2 make_uint2(unsigned a, unsigned b) { return {a, b}; }
@@BF16@@
static uint4 gemv_smem[(100 << 10) / 16];
static void gemv_stage16(uint4* dst, const uint4* src) { *dst = *src; }
static void merge_stage8(void* dst, const void* src) { memcpy(dst, src, 8); }
@@MERGED@@

// The o GEMV's merge of n rows (heads nh, head_dim hd; sequence r = row r) by one of its two
// paths: the bf16 inputs it leaves for the GEMV.
static std::vector<bf16_t> gemv_merge(bool staged, int n, const std::vector<float>& att, const std::vector<float>& po,
                                      const std::vector<float>& ml, const std::vector<int>& ctx, int nh, int hd,
                                      int split_len, int ms) {
  const int in = nh * hd;
  memset(gemv_smem, 0xff, sizeof gemv_smem);  // poisoned
  MergedSplits m{att.data(), po.data(), ml.data(), ctx.data(), nh, hd, split_len, ms};
  launch(dim3{1, 1, 1}, 256, [&] {
    if (staged) m.staged(n, in); else m.in_registers(n, in);
  });
  const bf16_t* xs = (const bf16_t*)gemv_smem;
  return std::vector<bf16_t>(xs, xs + (size_t)n * in);
}

static int check_gemv_merges(std::mt19937& rng) {
  std::normal_distribution<float> nd(0.f, 1.f);
  int fails = 0, compared = 0;
  for (int trial = 0; trial < 60; trial++) {
    const int hd = trial % 2 ? 128 : 64, nh = 2 * (1 + rng() % 4), n = 1 + rng() % 4, in = nh * hd;
    const int split_len = 16 * (1 + rng() % 4), ms = 1 + rng() % 8;
    std::vector<int> ctx(n);
    for (auto& c : ctx) c = (int)(rng() % (split_len * ms + 1)) - (rng() % 8 == 0 ? split_len : 0);
    std::vector<float> po((size_t)n * nh * ms * hd), ml((size_t)n * nh * ms * 2), att((size_t)n * in);
    for (auto& v : po) v = nd(rng);
    for (auto& v : att) v = nd(rng);
    for (size_t i = 0; i < ml.size(); i += 2) {
      ml[i] = nd(rng) * 4.f - (rng() % 5 == 0 ? 200.f : 0.f);
      ml[i + 1] = 1.f + std::fabs(nd(rng)) * 30.f;
    }
    // What the plain GEMV would read: the combine's output (the mma kernel's own for one split, 0
    // for an empty context), rounded to bf16.
    std::vector<float> out = att;
    for (int r = 0; r < n; r++)
      for (int h = 0; h < nh; h++)
        launch(dim3{1, 1, 1}, DA_COMBINE_THREADS, [&] {
          combine_head_t<DA_COMBINE_THREADS>(out.data(), po.data(), ml.data(), ctx.data(), nh, hd, split_len, ms, h, r);
        });
    for (bool staged : {true, false}) {
      // The host stages only what fits its 72 KB (MERGE_STAGED_SMEM, engine/src/cuda/linears.rs).
      const size_t need = (size_t)n * in * 2 + 4 * (size_t)n * nh * ms * (hd + 2);
      if (staged && need > (72 << 10)) continue;
      std::vector<bf16_t> got = gemv_merge(staged, n, att, po, ml, ctx, nh, hd, split_len, ms);
      compared++;
      int bad = 0;
      for (size_t i = 0; i < got.size(); i++) bad += got[i] != f32_to_bf16_bits(out[i]);
      if (bad && fails++ < 5)
        printf("o GEMV merge (%s), %d rows, head_dim %d, %d heads, %d max splits: %d inputs differ\n",
               staged ? "staged" : "in registers", n, hd, nh, ms, bad);
    }
  }
  printf("o GEMV merges: %d bit-compared with the combine, %d failures\n", compared, fails);
  return fails || compared < 80;
}

// The merge of `group` heads from head0 by one of the three, into out (poisoned first).
enum Kind { PER_HEAD, FAST_KERNEL_MERGE, FAST_COMBINE, FAST_COMBINE_EARLY };
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
  if (kind == FAST_COMBINE_EARLY) {
    // decode_attn_combine with DA_INDEX_EARLY: every split the registers hold loaded on the bound
    // max_splits, the count known only after the loads.
    static float smem[2 * DA_COMBINE_THREADS];
    const int len = ctx[seq], bound = std::min(ms, DA_COMBINE_R * (DA_COMBINE_THREADS / hd));
    for (int j = 0; j < group; j++)
      launch(dim3{1, 1, 1}, DA_COMBINE_THREADS, [&] {
        auto ns_of = [=] { return len > 0 ? std::min((len + split_len - 1) / split_len, ms) : 0; };
        bool t = combine_group_fast_t<DA_COMBINE_THREADS, 1, DA_COMBINE_R>(out.data(), po.data(), ml.data(), bound,
                                                                           ns_of, nh, hd, ms, head0 + j, 1, seq, smem);
        if (threadIdx.x == 0 && !t) took = false;
      });
    return took;
  }
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
  int fails = 0, compared = 0, declined = 0, early_declined = 0;
  for (int trial = 0; trial < 60; trial++) {
    const int hd = trial % 2 ? 128 : 64, group = 1 + trial % 4, nkv = 2, nh = group * nkv, seqs = 2;
    const int split_len = 16 * (1 + rng() % 4), ms = 1 + rng() % 16;
    std::vector<int> ctx(seqs);
    // Some contexts empty or within one split: the early merge must decline those (no merge).
    for (auto& c : ctx) c = rng() % 6 == 0 ? -(int)(rng() % 2) : 1 + rng() % (split_len * ms);
    std::vector<float> po((size_t)seqs * nh * ms * hd), ml((size_t)seqs * nh * ms * 2);
    for (auto& v : po) v = nd(rng);
    for (size_t i = 0; i < ml.size(); i += 2) {
      ml[i] = nd(rng) * 4.f - (rng() % 5 == 0 ? 200.f : 0.f);  // some splits weigh nothing
      ml[i + 1] = 1.f + std::fabs(nd(rng)) * 30.f;
    }
    for (int seq = 0; seq < seqs; seq++) {
      const int ns = std::min((ctx[seq] + split_len - 1) / split_len, ms);
      if (ns <= 1) {  // the mma kernel writes single-split heads itself
        std::vector<float> got(po.size() / ms, NAN);
        early_declined++;
        if (merge(FAST_COMBINE_EARLY, got, po, ml, ctx, nh, hd, split_len, ms, 0, nh, seq)) fails++;
        for (float v : got) fails += !std::isnan(v);
        continue;
      }
      for (int kvh = 0; kvh < nkv; kvh++) {
        const int head0 = kvh * group;
        std::vector<float> want(po.size() / ms, NAN);
        merge(PER_HEAD, want, po, ml, ctx, nh, hd, split_len, ms, head0, group, seq);
        for (Kind k : {FAST_KERNEL_MERGE, FAST_COMBINE, FAST_COMBINE_EARLY}) {
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
                   k == FAST_COMBINE ? "combine-kernel fast"
                   : k == FAST_COMBINE_EARLY ? "combine-kernel early" : "in-kernel",
                   hd, group, ns, bad);
        }
      }
    }
  }
  printf("split merges: %d fast merges bit-compared with the per-head combine (%d declined; %d contexts of one "
         "split or none declined by the early merge), %d failures\n",
         compared, declined, early_declined, fails);
  fails += check_gemv_merges(rng);
  return fails || compared < 20 || early_declined < 3 ? 1 : 0;
}
"""

code = (
    MAIN.replace("@@COMBINE_THREADS@@", combine_threads)
    .replace("@@DA_THREADS@@", da_threads)
    .replace("@@COMBINE_R@@", combine_r)
    .replace("@@MERGES@@", merges)
    .replace("@@FAST@@", fast)
    .replace("@@MERGE_GROUP@@", merge_group)
    .replace("@@GEMV_MAX_ROWS@@", gemv_max_rows)
    .replace("@@BF16@@", bf16)
    .replace("@@MERGED@@", merged)
)
run(code, "combine_host_check")
