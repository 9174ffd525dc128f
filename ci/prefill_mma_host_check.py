#!/usr/bin/env python3
"""Runs the tensor-core prefill kernel (kernels/prefill_attention_mma.cu) on the CPU.

The kernel's tile staging, swizzle, fragment indexing, causal masking, online softmax and
epilogue are plain CUDA C++ around four kinds of PTX: cp.async, ldmatrix (plain and transposed),
mma.sync m16n8k16 (bf16 in, f32 accumulate) and ex2. This script takes the kernel's whole `pm`
namespace out of the source and compiles it with g++ against host versions of those instructions,
written from the PTX ISA's fragment layouts (a warp's lanes exchange their registers through
cuda_host.py's per-warp buffer, each lane then computes its own elements; the mma sums in
float64, ex2 is exp2f, cp.async copies at once). It then runs prompt chunks of random lengths
over paged pools with shuffled block tables, for head_dim 64 and 128, GQA groups 1, 4, 7 (padded
rows) and 16, block sizes 7, 16 and 32, with hidden positions and one-token chunks, and checks:

  * against a float64 attention over the same bf16-rounded q, K and V (p left unrounded): every
    row within 1e-2 relative L2 (bf16 p and the running max cost a few 1e-3), and rows outside
    the tile list left untouched;
  * that f32, bf16 and FP8 pools holding the same values give the same bits (the raw staging and
    conversion paths against the direct bf16 one).

It checks the index arithmetic and the algorithm, not the GPU's memory model, the real tensor
cores' summation order, or speed: the GPU test `cuda_mma_bf16_prefill_kernel_on_head_dim_64_and_128`
does that. A layout mistake (a swapped fragment half, a wrong swizzle, a skipped tile) fails here.

    python3 ci/prefill_mma_host_check.py     # needs g++ (C++20)
"""
from cuda_host import SMEM_COPIES, cut, run, source

mma = source("decode_attention_mma.cu")
pm_src = source("prefill_attention_mma.cu")
eng = source("engine.cu")
kernel = pm_src[pm_src.index("#define PM_THREADS") : pm_src.index("}  // namespace pm") + len("}  // namespace pm")]
swz = cut(mma, "template <int D>\n__device__ __forceinline__ unsigned swz", "swz(")
fp8_scaled = cut(mma, "__device__ __forceinline__ float fp8_scaled", "fp8_scaled(")
fp8 = cut(eng, "__device__ __forceinline__ float round_fp8_e4m3", "fp8_store(")

HOST_PTX = r"""
typedef unsigned char fp8_t;
struct float2 { float x, y; };
static float2 make_float2(float a, float b) { return {a, b}; }
static int atomicMax(int* p, int v) {
  std::atomic_ref<int> a(*p);
  int old = a.load();
  while (old < v && !a.compare_exchange_weak(old, v)) {}
  return old;
}
static int __shfl_xor_sync(unsigned, int v, int m) {
  return (int)__float_as_uint(shfl_from(__uint_as_float((unsigned)v), (threadIdx.x & 31) ^ m));
}
static unsigned pm_dynamic_smem_bytes();
FP8_CODE
namespace da {
static unsigned char* g_smem;  // the block's dynamic shared memory; "shared addresses" are offsets
static float neg_inf() { return -INFINITY; }
static unsigned smem_u32(const void* p) { return (unsigned)((const unsigned char*)p - g_smem); }
static float ex2(float x) { return std::exp2(x); }
SMEM_COPIES
static void cp_async_commit() {}
template <int N>
static void cp_async_wait() {}
// ldmatrix .x4: lanes 8m .. 8m+7 give the row addresses of matrix m; lane l receives, of each
// matrix, row l / 4, 32-bit word l % 4 (.trans: rows 2 (l % 4) and 2 (l % 4) + 1, column l / 4).
static std::vector<unsigned> g_addr(32 * 32);
static unsigned short ld16(unsigned a) { unsigned short v; memcpy(&v, g_smem + a, 2); return v; }
static void ldsm(unsigned addr, unsigned (&r)[4], bool trans) {
  const int w = threadIdx.x >> 5, l = threadIdx.x & 31;
  g_addr[w * 32 + l] = addr;
  __syncwarp();
  for (int m = 0; m < 4; ++m) {
    if (!trans) {
      memcpy(&r[m], g_smem + g_addr[w * 32 + 8 * m + l / 4] + 4 * (l % 4), 4);
    } else {
      const unsigned lo = ld16(g_addr[w * 32 + 8 * m + 2 * (l % 4)] + 2 * (l / 4));
      const unsigned hi = ld16(g_addr[w * 32 + 8 * m + 2 * (l % 4) + 1] + 2 * (l / 4));
      r[m] = lo | (hi << 16);
    }
  }
  __syncwarp();
}
static void ldsm_x4(unsigned a, unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3) {
  unsigned r[4];
  ldsm(a, r, false);
  r0 = r[0], r1 = r[1], r2 = r[2], r3 = r[3];
}
static void ldsm_x4_t(unsigned a, unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3) {
  unsigned r[4];
  ldsm(a, r, true);
  r0 = r[0], r1 = r[1], r2 = r[2], r3 = r[3];
}
// mma.m16n8k16.row.col, bf16 -> f32: lane l = 4 g + c holds A[g][2c..], A[g+8][2c..],
// A[g][2c+8..], A[g+8][2c+8..]; B[2c..][g], B[2c+8..][g]; C[g][2c..2c+1], C[g+8][2c..2c+1].
struct Frag { unsigned a[4], b[2]; };
static std::vector<Frag> g_frag(32 * 32);
static float bf(unsigned reg, int half) { return __uint_as_float((half ? reg >> 16 : reg & 0xffffu) << 16); }
static void mma_bf16_16816(float* d, const unsigned* a, unsigned b0, unsigned b1) {
  const int w = threadIdx.x >> 5, l = threadIdx.x & 31, g = l >> 2, c = l & 3;
  g_frag[w * 32 + l] = Frag{{a[0], a[1], a[2], a[3]}, {b0, b1}};
  __syncwarp();
  const Frag* f = &g_frag[w * 32];
  auto A = [&](int r, int k) { return bf(f[(r % 8) * 4 + (k % 8) / 2].a[r / 8 + 2 * (k / 8)], k % 2); };
  auto B = [&](int k, int n) { return bf(f[n * 4 + (k % 8) / 2].b[k / 8], k % 2); };
  for (int e = 0; e < 4; ++e) {
    const int r = g + 8 * (e / 2), n = 2 * c + (e % 2);
    double acc = d[e];
    for (int k = 0; k < 16; ++k) acc += (double)A(r, k) * (double)B(k, n);
    d[e] = (float)acc;
  }
  __syncwarp();
}
SWZ
FP8_SCALED
}  // namespace da
"""

MAIN = r"""
static unsigned g_dyn_smem;
static unsigned pm_dynamic_smem_bytes() { return g_dyn_smem; }

static float bf16_round(float x) { return __uint_as_float(da::bf16_rne(x) << 16); }

struct Pools {
  std::vector<float> f32;                 // what an f32 pool holds
  std::vector<unsigned short> b16;        // bf16 bits of the same values, rounded
  std::vector<fp8_t> f8;                  // FP8 codes whose value * scale is f32's value
  std::vector<float> scale;               // per (position, KV head)
};

// K or V for num_blocks * bs positions: random rows at random scales; f32 holds the FP8 decode.
static Pools make_pool(std::mt19937& rng, int positions, int nkv, int D, float spread) {
  std::normal_distribution<float> nd(0.f, 1.f);
  std::uniform_real_distribution<float> mag(-spread, spread);
  Pools p;
  p.f32.resize((size_t)positions * nkv * D);
  p.b16.resize(p.f32.size());
  p.f8.resize(p.f32.size());
  p.scale.resize((size_t)positions * nkv);
  for (int r = 0; r < positions * nkv; ++r) {
    const float s = std::exp2(mag(rng));
    float amax = 0.f;
    float* row = &p.f32[(size_t)r * D];
    for (int d = 0; d < D; ++d) { row[d] = nd(rng) * s; amax = std::max(amax, std::fabs(row[d])); }
    p.scale[r] = fp8_head_scale(amax);
    for (int d = 0; d < D; ++d) {
      p.f8[(size_t)r * D + d] = fp8_store(row[d], p.scale[r], &row[d]);
      p.b16[(size_t)r * D + d] = (unsigned short)da::bf16_rne(row[d]);
    }
  }
  return p;
}

template <typename T, int D>
static void launch_pm(std::vector<float>& out, const std::vector<float>& q, const T* kp, const T* vp,
                      const float* ks, const float* vs, const std::vector<int>& tables, int max_blocks,
                      const std::vector<int>& seg, const std::vector<int>& ctx, const std::vector<int>& hide,
                      const std::vector<int>& tiles, int heads, int kv_heads, int bs, float scale) {
  typedef pm::Geo<T, D> G;
  std::vector<unsigned char> smem(G::BYTES, 0xAB);  // poisoned
  da::g_smem = smem.data();
  g_dyn_smem = G::BYTES;
  const int ntiles = (int)tiles.size() / 2;
  launch(dim3{(unsigned)(ntiles * kv_heads), 1, 1}, PM_THREADS, [&] {
    pm::prefill<T, D>(out.data(), q.data(), kp, vp, ks, vs, tables.data(), max_blocks, seg.data(), ctx.data(),
                      hide.data(), tiles.data(), heads, kv_heads, D, bs, scale, smem.data());
  });
}

// One batch: segments (prompt chunks) of random lengths at random starting positions over a
// shared paged pool; returns the number of failures.
template <int D>
static int check(std::mt19937& rng, int heads, int kv_heads, int bs) {
  const int group = heads / kv_heads, per = PM_ROWS(D) / group;
  std::uniform_int_distribution<int> len_d(1, 140), start_d(0, 130);
  const int nseg = 3;
  std::vector<int> lens, starts;
  for (int s = 0; s < nseg; ++s) {
    lens.push_back(s == nseg - 1 ? 1 : len_d(rng));  // the last is a one-token chunk
    starts.push_back(start_d(rng));
  }
  // Block tables: each segment's blocks drawn from a shuffled pool of physical blocks.
  int max_blocks = 0;
  for (int s = 0; s < nseg; ++s) max_blocks = std::max(max_blocks, (starts[s] + lens[s] + bs - 1) / bs);
  const int num_blocks = nseg * max_blocks + 3;
  std::vector<int> phys(num_blocks);
  for (int i = 0; i < num_blocks; ++i) phys[i] = i;
  std::shuffle(phys.begin(), phys.end(), rng);
  std::vector<int> tables(nseg * max_blocks, -1);
  for (int s = 0; s < nseg; ++s)
    for (int b = 0; b < (starts[s] + lens[s] + bs - 1) / bs; ++b) tables[s * max_blocks + b] = phys[s * max_blocks + b];
  const int positions = num_blocks * bs;
  Pools K = make_pool(rng, positions, kv_heads, D, 2.f), V = make_pool(rng, positions, kv_heads, D, 3.f);

  // Tokens, their metadata, and the tile list as the host builds it (longest context first).
  std::vector<int> seg, ctx, hide;
  std::vector<std::array<int, 3>> tl;  // (largest ctx, first token, count)
  for (int s = 0; s < nseg; ++s) {
    const int t0 = (int)seg.size();
    for (int i = 0; i < lens[s]; ++i) {
      seg.push_back(s);
      ctx.push_back(starts[s] + i + 1);
      hide.push_back(i == 3 ? starts[s] / 2 : -1);  // one token hides an earlier position
    }
    for (int j = 0; j < lens[s]; j += per) {
      const int count = std::min(per, lens[s] - j);
      tl.push_back({starts[s] + j + count, t0 + j, count});
    }
  }
  std::sort(tl.begin(), tl.end(), [](auto& a, auto& b) { return a[0] != b[0] ? a[0] > b[0] : a[1] < b[1]; });
  const int n = (int)seg.size();
  // The last token of the first segment is left out of the tiles: its row must stay untouched.
  const int skipped = lens[0] > 1 ? lens[0] - 1 : -1;
  std::vector<int> tiles;
  for (auto& t : tl) {
    int count = t[2];
    if (skipped >= t[1] && skipped < t[1] + count) {
      if (skipped != t[1] + count - 1) { tiles.push_back(t[1]); tiles.push_back(count); continue; }
      if (--count == 0) continue;
    }
    tiles.push_back(t[1]);
    tiles.push_back(count);
  }
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> q((size_t)n * heads * D);
  for (size_t i = 0; i < q.size(); ++i) q[i] = nd(rng) * (i % 7 == 0 ? 3.f : 1.f);
  const float scale = 1.f / std::sqrt((float)D);

  std::vector<float> o32(q.size(), NAN), o16(q.size(), NAN), o8(q.size(), NAN);
  launch_pm<float, D>(o32, q, K.f32.data(), V.f32.data(), nullptr, nullptr, tables, max_blocks, seg, ctx, hide,
                      tiles, heads, kv_heads, bs, scale);
  launch_pm<unsigned short, D>(o16, q, K.b16.data(), V.b16.data(), nullptr, nullptr, tables, max_blocks, seg, ctx,
                               hide, tiles, heads, kv_heads, bs, scale);
  launch_pm<fp8_t, D>(o8, q, K.f8.data(), V.f8.data(), K.scale.data(), V.scale.data(), tables, max_blocks, seg,
                      ctx, hide, tiles, heads, kv_heads, bs, scale);

  int fails = 0;
  double worst = 0;
  size_t diff16 = 0, diff8 = 0;
  for (size_t i = 0; i < q.size(); ++i) {
    diff16 += __float_as_uint(o16[i]) != __float_as_uint(o32[i]) && !(std::isnan(o16[i]) && std::isnan(o32[i]));
    diff8 += __float_as_uint(o8[i]) != __float_as_uint(o32[i]) && !(std::isnan(o8[i]) && std::isnan(o32[i]));
  }
  for (int t = 0; t < n; ++t)
    for (int h = 0; h < heads; ++h) {
      const float* got = &o32[((size_t)t * heads + h) * D];
      if (t == skipped) {
        for (int d = 0; d < D; ++d) fails += !std::isnan(got[d]);
        continue;
      }
      const int kvh = h / group;
      std::vector<double> qd(D), s(ctx[t]), ref(D, 0.0);
      for (int d = 0; d < D; ++d) qd[d] = bf16_round(q[((size_t)t * heads + h) * D + d]);
      double mx = -INFINITY, sum = 0;
      auto row = [&](int j) { return ((size_t)tables[seg[t] * max_blocks + j / bs] * bs + j % bs) * kv_heads * D + (size_t)kvh * D; };
      for (int j = 0; j < ctx[t]; ++j) {
        if (j == hide[t]) { s[j] = -INFINITY; continue; }
        double acc = 0;
        for (int d = 0; d < D; ++d) acc += qd[d] * bf16_round(K.f32[row(j) + d]);
        s[j] = acc * scale;
        mx = std::max(mx, s[j]);
      }
      for (int j = 0; j < ctx[t]; ++j) {
        const double p = std::exp(s[j] - mx);
        sum += p;
        for (int d = 0; d < D; ++d) ref[d] += p * bf16_round(V.f32[row(j) + d]);
      }
      double num = 0, den = 0;
      for (int d = 0; d < D; ++d) {
        ref[d] /= sum;
        num += (got[d] - ref[d]) * (got[d] - ref[d]);
        den += ref[d] * ref[d];
      }
      const double err = std::sqrt(num / den);
      if (!(err <= 1e-2)) {
        if (fails < 5) printf("  token %d (ctx %d, hide %d) head %d: rel L2 %.3e\n", t, ctx[t], hide[t], h, err);
        ++fails;
      }
      worst = std::max(worst, std::isnan(err) ? INFINITY : err);
    }
  printf("head_dim %3d, heads %2d/%d, bs %2d, chunks of %3d/%3d/%d tokens at %3d/%3d/%3d, %2zu tiles: worst rel L2 %.2e "
         "(bound 1e-2); bf16 pool %s, FP8 pool %s the f32 pool's bits\n",
         D, heads, kv_heads, bs, lens[0], lens[1], lens[2], starts[0], starts[1], starts[2], tiles.size() / 2, worst,
         diff16 ? "DIFFERS FROM" : "gives", diff8 ? "DIFFERS FROM" : "gives");
  return fails + (diff16 != 0) + (diff8 != 0);
}

int main() {
  std::mt19937 rng(std::random_device{}());
  int fails = 0;
  fails += check<64>(rng, 8, 2, 16);
  fails += check<64>(rng, 14, 2, 16);  // group 7: 18 tokens a tile, two padded rows
  fails += check<64>(rng, 4, 4, 32);   // group 1
  fails += check<128>(rng, 4, 1, 16);
  fails += check<128>(rng, 16, 1, 7);  // group 16, an odd block size
  printf("%s\n", fails ? "FAILED" : "ok");
  return fails ? 1 : 0;
}
"""

code = (
    HOST_PTX.replace("SMEM_COPIES", SMEM_COPIES)
    .replace("FP8_CODE", fp8).replace("SWZ", swz).replace("FP8_SCALED", fp8_scaled)
    + kernel
    + MAIN
)
run("#include <array>\n" + code, "prefill_mma_host_check")
