#!/usr/bin/env python3
"""Runs the tile staging and conversion code of kernels/decode_attention_mma.cu on the CPU.

The FP8 variant of the tensor-core decode kernel (decode_attn_mma_fp8kv) stages FP8 codes and
their per-row scales with cp.async and converts them in place to the swizzled bf16 tile the mma
loop reads. Its contract: the tile must hold the same bits as the f32 variant builds from an f32
pool holding code * scale. This script cuts `Geo`, `swz`, `issue_tile`, `fp8_scaled` and both
`convert_*_tile_inplace` out of the kernel source (and the FP8 store from kernels/engine.cu),
compiles them with g++ for the host with 32 threads standing in for a warp's lanes
(`__syncwarp` a std::barrier, cp.async a copy), stages random K/V tiles both ways for head_dim
64 and 128 with some rows past the context end, and compares the tiles byte for byte. It checks
the index arithmetic and the decode, not the GPU's memory model. It also holds the FP8 decode
copies of the mma and prefill kernels (each kernel file compiles on its own) to engine.cu's for
every code; the GPU test
`cuda_packed_kv_pools_are_bit_identical_to_an_f32_pool` checks the whole kernel.

    python3 ci/mma_tile_host_check.py     # needs g++ (C++20)
"""
import re

from cuda_host import SMEM_COPIES, cut, run, source

mma = source("decode_attention_mma.cu")
eng = source("engine.cu")
tiles = cut(mma, "template <typename T, int D>\nstruct Geo", "convert_f32_tile_inplace(")
tiles = re.sub(r"__device__ __forceinline__ void cp_async4\(.*?\n}\n", "", tiles, flags=re.S)
# The L2-only loads of RowFix (inline PTX) become plain loads.
tiles = re.sub(r"__device__ __forceinline__ uint4 ld_cg_u4\(.*?\n}\n", "", tiles, flags=re.S)
tiles = re.sub(r"__device__ __forceinline__ float ld_cg_f32\(.*?\n}\n", "", tiles, flags=re.S)
assert "struct RowFix" in tiles and "ld_cg_u4(const" not in tiles
fp8 = cut(eng, "__device__ __forceinline__ float round_fp8_e4m3", "fp8_store(")
# The prefill kernel's copy of the FP8 decode (each kernel file compiles on its own, no #include).
prefill_fp8 = cut(source("prefill_attention.cu"), "__device__ __forceinline__ float fp8_value", "fp8_value(")

STAGING = r"""
#define DA_SMEM_BYTES 65536
#define DA_WARPS 4
static unsigned char* g_smem;
SMEM_COPIES
"""

MAIN = r"""
typedef unsigned char fp8_t;
FP8_CODE
namespace pa {
PREFILL_FP8
}
namespace da {
static uint4 ld_cg_u4(const void* p) { uint4 r; memcpy(&r, p, 16); return r; }
static float ld_cg_f32(const float* p) { return *p; }
TILE_CODE
}
using namespace da;

// One tile through `lanes` (issue, then convert) into smem; returns the K and V bf16 areas.
// `fix`: staged without its last valid row, which RowFix then loads and stores into the tile (the
// mma kernels' DA_KV_EARLY path for the newest position): must give the same bytes.
template <typename T, int D>
static std::vector<unsigned char> stage(const T* kp, const T* vp, const float* ks, const float* vs,
                                        long long rowbase, long long rowstride, int nvalid, bool fix = false) {
  typedef Geo<T, D> G;
  std::vector<unsigned char> smem(G::STAGE, 0xAB);  // poisoned
  g_smem = smem.data();
  launch(dim3{1, 1, 1}, 32, [&] {
    const int lane = threadIdx.x;
    issue_tile<T, D>(0, kp, vp, ks, vs, rowbase, rowstride, fix ? nvalid - 1 : nvalid, lane);
    __syncwarp();
    if (fix) {
      RowFix<T, D> f;
      f.load(kp, vp, ks, vs, rowbase + (long long)(nvalid - 1) * rowstride, lane);
      f.store(g_smem, nvalid - 1, lane);
      __syncwarp();
    }
    if (G::ES == 4) {
      convert_f32_tile_inplace<D>(g_smem, lane);
      convert_f32_tile_inplace<D>(g_smem + G::MAT, lane);
    } else if (G::ES == 1) {
      const float* sc = reinterpret_cast<const float*>(g_smem + 2 * G::MAT);
      convert_fp8_tile_inplace<D>(g_smem, sc, lane);
      convert_fp8_tile_inplace<D>(g_smem + G::MAT, sc + 16, lane);
    }
  });
  std::vector<unsigned char> kv(64 * D);  // the K then the V bf16 tile
  memcpy(kv.data(), smem.data(), 32 * D);
  memcpy(kv.data() + 32 * D, smem.data() + G::MAT, 32 * D);
  return kv;
}

template <int D>
static int check(std::mt19937& rng, int nkv, int kvh, int nvalid) {
  const int rows = 40;  // pool rows (positions); the tile starts at row 5
  std::normal_distribution<float> nd(0.f, 1.f);
  std::uniform_real_distribution<float> mag(-6.f, 6.f);
  std::vector<float> kf(rows * nkv * D), vf(rows * nkv * D), ksc(rows * nkv), vsc(rows * nkv);
  std::vector<fp8_t> kc(kf.size()), vc(vf.size());
  for (int pos = 0; pos < rows; ++pos)
    for (int h = 0; h < nkv; ++h) {
      const size_t o = ((size_t)pos * nkv + h) * D;
      for (int pass = 0; pass < 2; ++pass) {
        float* f = pass ? vf.data() : kf.data();
        fp8_t* c = pass ? vc.data() : kc.data();
        const float s = std::exp2(mag(rng));
        float amax = 0.f;
        for (int d = 0; d < D; ++d) { f[o + d] = nd(rng) * s; amax = std::max(amax, std::fabs(f[o + d])); }
        if (pos == 7 && pass == 0) { amax = 0.f; for (int d = 0; d < D; ++d) f[o + d] = 0.f; }  // an all-zero head
        const float sc = fp8_head_scale(amax);
        (pass ? vsc : ksc)[o / D] = sc;
        for (int d = 0; d < D; ++d) c[o + d] = fp8_store(f[o + d], sc, &f[o + d]);  // f: what an f32 pool holds
      }
    }
  const long long rowbase = ((long long)5 * nkv + kvh) * D, stride = (long long)nkv * D;
  auto a = stage<float, D>(kf.data(), vf.data(), nullptr, nullptr, rowbase, stride, nvalid);
  auto b = stage<unsigned char, D>(kc.data(), vc.data(), ksc.data(), vsc.data(), rowbase, stride, nvalid);
  int bad = 0;
  for (size_t i = 0; i < a.size(); ++i) bad += a[i] != b[i];
  printf("head_dim %3d, %d KV heads, head %d, %2d valid rows: %s (%d of %zu bytes differ)\n", D, nkv, kvh, nvalid,
         bad ? "DIFFERENT" : "identical", bad, a.size());
  // The newest row put in by hand (DA_KV_EARLY) against staging it, for all three pool types.
  std::vector<unsigned short> kb(kf.size()), vb(vf.size());
  for (size_t i = 0; i < kf.size(); ++i) {
    kb[i] = (unsigned short)(__float_as_uint(kf[i]) >> 16);
    vb[i] = (unsigned short)(__float_as_uint(vf[i]) >> 16);
  }
  int fixed_bad = 0;
  auto same = [&](const std::vector<unsigned char>& x, const std::vector<unsigned char>& y) {
    for (size_t i = 0; i < x.size(); ++i) fixed_bad += x[i] != y[i];
  };
  same(a, stage<float, D>(kf.data(), vf.data(), nullptr, nullptr, rowbase, stride, nvalid, true));
  same(b, stage<unsigned char, D>(kc.data(), vc.data(), ksc.data(), vsc.data(), rowbase, stride, nvalid, true));
  same(stage<unsigned short, D>(kb.data(), vb.data(), nullptr, nullptr, rowbase, stride, nvalid),
       stage<unsigned short, D>(kb.data(), vb.data(), nullptr, nullptr, rowbase, stride, nvalid, true));
  printf("  newest row put in by hand (f32, FP8, bf16 pools): %s (%d bytes differ)\n",
         fixed_bad ? "DIFFERENT" : "identical", fixed_bad);
  return bad != 0 || fixed_bad != 0;
}

int main() {
  std::mt19937 rng(std::random_device{}());
  int fails = 0;
  // fp8_scaled against engine.cu's reader for every code and random scales (incl. 0 and NaN).
  std::uniform_real_distribution<float> e(-30.f, 30.f);
  for (int c = 0; c < 256; ++c)
    for (int t = 0; t < 64; ++t) {
      float s = t == 0 ? 0.f : t == 1 ? NAN : std::exp2(e(rng));
      float x = fp8_scaled(c, s), y = fp8_e4m3_value(c) * s, z = pa::fp8_value(c) * s;
      auto eq = [](float a, float b) { return __float_as_uint(a) == __float_as_uint(b) || (std::isnan(a) && std::isnan(b)); };
      if (!eq(x, y) || !eq(z, y)) {
        if (fails++ < 5) printf("code %#x, scale %g: mma %g, prefill %g, engine.cu %g\n", c, s, x, z, y);
      }
    }
  printf("FP8 decode of the mma and prefill kernels vs engine.cu's fp8_e4m3_value: %s\n",
         fails ? "DIFFERENT" : "identical on 256 codes x 64 scales");
  for (int nvalid : {16, 11, 1}) {
    fails += check<64>(rng, 8, 3, nvalid);
    fails += check<128>(rng, 2, 1, nvalid);
  }
  return fails ? 1 : 0;
}
"""

# engine.cu's fp8_e4m3_value is defined between round_fp8_e4m3 and fp8_store, so it is in FP8_CODE.
code = MAIN.replace("FP8_CODE", fp8).replace("PREFILL_FP8", prefill_fp8).replace("TILE_CODE", tiles)
run(STAGING.replace("SMEM_COPIES", SMEM_COPIES) + code, "mma_tile_host_check")
