#!/usr/bin/env python3
"""Runs the KV-pool kernels of kernels/engine.cu on the CPU: packed pools against an f32 pool.

A kv_dtype=bf16 pool stores bf16 bits and a kv_dtype=fp8-e4m3 pool FP8 codes with one f32 scale
per (position, KV head); an f32 pool holds the same rounded values as f32. The kernels that write
and read the pool are templates over the element type, and the GPU test
`cuda_packed_kv_pools_are_bit_identical_to_an_f32_pool` wants every bit of the logits to agree.
This check runs the same kernel code on the host (ci/cuda_host.py: blocks of std::threads,
barriers for __syncthreads and the warp shuffles) so a CPU-only machine catches a broken template
before a GPU session does:

- `rope_kv_head` (rope_kv_write's body) for 3 sequences written into paged pools through
  shuffled block tables: rotated queries, the keys and values written back, and the pool read
  back through `kv_get` must be bit-identical between the f32 pool and the bf16 / FP8 pool; one
  head is all zeros (the FP8 scale-0 case);
- `attention_impl` (the simt-f32 decode/prefill kernel) and `attention_scores_impl` (the top-k
  path's scores) over those pools, with bf16 operand rounding off and on and a hidden position:
  bit-identical across pools, and the f32 pool within 1e-5 (relative L2) of a float64 reference.

    python3 ci/engine_kernels_host_check.py     # needs g++ (C++20)
"""
from cuda_host import cut, run, source

eng = source("engine.cu")
code = "\n".join(
    [
        cut(eng, "typedef unsigned short bf16_t;", "block_max("),
        cut(eng, "__device__ __forceinline__ void rope_rotate", "rope_kv_head("),
        cut(eng, "#define ATT_WARPS", "attention_scores_impl("),
    ]
)

MAIN = r"""
template <typename KV>
struct Pool {
  std::vector<KV> k, v;
  std::vector<float> ks, vs;
  Pool(size_t rows, int kv_heads, int hd) : k(rows * kv_heads * hd), v(rows * kv_heads * hd),
                                             ks(rows * kv_heads, -7.f), vs(rows * kv_heads, -7.f) {}
  float kat(size_t i, int hd) const { return kv_get(k.data(), i, kv_row_scale(k.data(), ks.data(), i, hd)); }
  float vat(size_t i, int hd) const { return kv_get(v.data(), i, kv_row_scale(v.data(), vs.data(), i, hd)); }
};

static bool same(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (__float_as_uint(a[i]) != __float_as_uint(b[i])) return false;
  return true;
}

struct Batch {
  int heads, kv_heads, hd, bs = 16, max_blocks = 8, blocks = 24;
  std::vector<int> tables, seg, ctx, hide, pos, slots, rows;
  std::vector<float> q, k, v, inv_freq;
  int n = 0;
};

static Batch make(std::mt19937& rng, int heads, int kv_heads, int hd) {
  Batch b{heads, kv_heads, hd};
  const int lens[3] = {21, 34, 5};
  std::vector<int> phys(b.blocks);
  for (int i = 0; i < b.blocks; ++i) phys[i] = i;
  std::shuffle(phys.begin(), phys.end(), rng);
  b.tables.assign(3 * b.max_blocks, 0);
  for (int s = 0, next = 0; s < 3; ++s)
    for (int i = 0; i < (lens[s] + b.bs - 1) / b.bs; ++i) b.tables[s * b.max_blocks + i] = phys[next++];
  for (int s = 0; s < 3; ++s)
    for (int p = 0; p < lens[s]; ++p) {
      b.seg.push_back(s);
      b.ctx.push_back(p + 1);
      b.hide.push_back(s == 1 && p > 16 ? 13 : -1);  // the chunk-boundary fault's masked position
      b.pos.push_back(p);
      b.slots.push_back(b.tables[s * b.max_blocks + p / b.bs] * b.bs + p % b.bs);
    }
  b.n = (int)b.seg.size();
  for (int t = 0; t < b.n; t += 7) b.rows.push_back(t);
  b.rows.push_back(b.n - 1);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::uniform_real_distribution<float> mag(-3.f, 3.f);
  auto fill = [&](std::vector<float>& x, int nh) {
    x.resize((size_t)b.n * nh * hd);
    for (size_t h0 = 0; h0 < x.size(); h0 += hd) {
      const float s = std::exp2(mag(rng));
      for (int d = 0; d < hd; ++d) x[h0 + d] = nd(rng) * s;
    }
  };
  fill(b.q, heads);
  fill(b.k, kv_heads);
  fill(b.v, kv_heads);
  for (int d = 0; d < hd; ++d) b.k[(size_t)(2 * kv_heads) * hd + d] = 0.f;  // token 2, KV head 0
  for (int i = 0; i < hd / 2; ++i) b.inv_freq.push_back(std::pow(10000.f, -2.f * i / hd));
  return b;
}

struct Written {
  std::vector<float> q, k, v, kpool, vpool;  // the pool read back as f32
};

template <typename KV>
static Written write(const Batch& b, Pool<KV>& pool, int mode) {
  Written w{b.q, b.k, b.v, {}, {}};
  const unsigned threads = (b.hd + 31) / 32 * 32;
  launch(dim3{(unsigned)b.n, (unsigned)(b.heads + b.kv_heads), 1}, threads, [&] {
    rope_kv_head<KV>(w.q.data(), w.q.data(), w.k.data(), w.v.data(), pool.k.data(), pool.v.data(), pool.ks.data(),
                     pool.vs.data(), b.pos.data(), b.inv_freq.data(), b.slots.data(), b.heads, b.kv_heads, b.hd, mode,
                     blockIdx.x, blockIdx.y);
  });
  // Read back as f32, the written rows only (the rest is poison that no kernel reads).
  w.kpool.assign(pool.k.size(), 0.f);
  w.vpool.assign(pool.v.size(), 0.f);
  for (int slot : b.slots)
    for (size_t i = (size_t)slot * b.kv_heads * b.hd; i < (size_t)(slot + 1) * b.kv_heads * b.hd; ++i) {
      w.kpool[i] = pool.kat(i, b.hd);
      w.vpool[i] = pool.vat(i, b.hd);
    }
  return w;
}

template <typename KV>
static std::vector<float> scores(const Batch& b, const Written& w, const Pool<KV>& pool, int bf16) {
  const int stride = 64;
  std::vector<float> s(b.rows.size() * b.heads * stride, -99.f);
  launch(dim3{(unsigned)b.rows.size(), (unsigned)b.heads, 1}, 32 * ATT_WARPS, [&] {
    attention_scores_impl<KV>(s.data(), stride, w.q.data(), pool.k.data(), pool.ks.data(), b.tables.data(),
                              b.max_blocks, b.seg.data(), b.ctx.data(), b.hide.data(), b.rows.data(), b.heads,
                              b.kv_heads, b.hd, b.bs, 1.f / std::sqrt((float)b.hd), bf16);
  });
  return s;
}

// float64 attention of the f32 pool, for grid row r's token (attention_impl writes token rows[r]).
static double ref_error(const Batch& b, const Written& w, const std::vector<float>& out) {
  double num = 0, den = 0;
  const int group = b.heads / b.kv_heads;
  for (int t : b.rows)
    for (int h = 0; h < b.heads; ++h) {
      const int kvh = h / group, s = b.seg[t];
      std::vector<double> sc, o(b.hd, 0.0);
      std::vector<size_t> offs;
      for (int j = 0; j < b.ctx[t]; ++j) {
        if (j == b.hide[t]) continue;
        const size_t off = ((size_t)b.tables[s * b.max_blocks + j / b.bs] * b.bs + j % b.bs) * b.kv_heads * b.hd +
                           (size_t)kvh * b.hd;
        double dot = 0;
        for (int d = 0; d < b.hd; ++d) dot += (double)w.q[((size_t)t * b.heads + h) * b.hd + d] * w.kpool[off + d];
        sc.push_back(dot / std::sqrt((double)b.hd));
        offs.push_back(off);
      }
      const double m = *std::max_element(sc.begin(), sc.end());
      double l = 0;
      for (size_t i = 0; i < sc.size(); ++i) {
        const double p = std::exp(sc[i] - m);
        l += p;
        for (int d = 0; d < b.hd; ++d) o[d] += p * w.vpool[offs[i] + d];
      }
      for (int d = 0; d < b.hd; ++d) {
        const double want = o[d] / l, got = out[((size_t)t * b.heads + h) * b.hd + d];
        num += (got - want) * (got - want);
        den += want * want;
      }
    }
  return std::sqrt(num / den);
}

template <typename KV>
static int check(std::mt19937& rng, int heads, int kv_heads, int hd, int mode, const char* name) {
  const Batch b = make(rng, heads, kv_heads, hd);
  const size_t rows = (size_t)b.blocks * b.bs;
  Pool<float> wide(rows, kv_heads, hd);
  Pool<KV> packed(rows, kv_heads, hd);
  const Written a = write(b, wide, mode), p = write(b, packed, mode);
  int fails = 0;
  auto say = [&](const char* what, bool ok) {
    printf("head_dim %3d, %d/%d heads, %-4s pool: %-44s %s\n", hd, heads, kv_heads, name, what,
           ok ? "identical" : "DIFFERENT");
    fails += !ok;
  };
  say("rope: queries, keys and values written back", same(a.q, p.q) && same(a.k, p.k) && same(a.v, p.v));
  say("rope: the pool read back", same(a.kpool, p.kpool) && same(a.vpool, p.vpool));
  // attention_impl writes out[token]; size the output by tokens.
  for (int bf16 = 0; bf16 < 2; ++bf16) {
    std::vector<float> oa((size_t)b.n * heads * hd, -99.f), op = oa;
    const float scale = 1.f / std::sqrt((float)hd);
    auto run_att = [&](auto& pool, std::vector<float>& out, const Written& w) {
      launch(dim3{(unsigned)b.rows.size(), (unsigned)heads, 1}, 32 * ATT_WARPS, [&] {
        attention_impl(out.data(), w.q.data(), pool.k.data(), pool.v.data(), pool.ks.data(), pool.vs.data(),
                       b.tables.data(), b.max_blocks, b.seg.data(), b.ctx.data(), b.hide.data(), b.rows.data(),
                       (const float*)nullptr, 0, heads, kv_heads, hd, b.bs, scale, bf16);
      });
    };
    run_att(wide, oa, a);
    run_att(packed, op, p);
    say(bf16 ? "attention, bf16 operands" : "attention, f32", same(oa, op));
    if (!bf16) {
      const double e = ref_error(b, a, oa);
      printf("head_dim %3d, %d/%d heads, %-4s pool: attention vs float64: rel L2 %.2e (bound 1e-5)\n", hd, heads,
             kv_heads, name, e);
      fails += !(e <= 1e-5);
    }
    say(bf16 ? "top-k scores, bf16 operands" : "top-k scores, f32", same(scores(b, a, wide, bf16), scores(b, p, packed, bf16)));
  }
  return fails;
}

int main() {
  setvbuf(stdout, nullptr, _IONBF, 0);
  std::mt19937 rng(std::random_device{}());
  int fails = 0;
  fails += check<bf16_t>(rng, 4, 2, 64, 1, "bf16");
  fails += check<fp8_t>(rng, 4, 2, 64, 2, "fp8");
  fails += check<bf16_t>(rng, 2, 1, 128, 1, "bf16");
  fails += check<fp8_t>(rng, 2, 1, 128, 2, "fp8");
  return fails ? 1 : 0;
}
"""

run(code + MAIN, "engine_kernels_host_check")
