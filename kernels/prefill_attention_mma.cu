// prefill_attention_mma.cu -- bf16 tensor-core attention for prompt chunks over the paged KV
// cache: the `attn_prefill=mma-bf16` path (flash-attention-2 style, mma.sync m16n8k16).
//
// Why: the tiled SIMT kernel (prefill_attention.cu) runs at ~27 TFLOP/s in f32 on an H100/H200,
// and at 8192 prompt tokens attention is ~80% of a llama-1b prefill. Tensor cores multiply bf16
// operands with f32 accumulation several times faster; this kernel is what a serving engine's
// "bf16 flash prefill" patch is, so it is a toggle a replay can A/B and bisect.
//
// Compiled after decode_attention_mma.cu (one NVRTC module, kernels::PREFILL_MMA) and uses its
// device helpers (da::mma_bf16_16816, ldmatrix, cp.async, the swizzle, ex2, the bf16 and FP8
// conversions). Self-contained otherwise: no #include. Builds for compute_80, compute_90 and
// compute_120: mma.sync only, no wgmma, no tcgen05.
//
// Numerics (the mma decode kernel's, docs/cuda_decode_attention.md): q rounded to bf16 (RNE), K
// and V as stored in a bf16 pool, rounded RNE from an f32 pool, FP8 codes times their scale then
// rounded RNE; S = q.k exact products, f32 accumulation; an online softmax in the log2 domain
// (t = s * scale * log2 e, p = 2^(t - m) with ex2.approx.ftz against the running max m of the
// tiles so far); l summed from the f32 p; p rounded to bf16 for the P V product, f32
// accumulation; out = O / l. The CPU emulates the same roundings with the row's final max and an
// exact exp (models/llama.rs), so the two agree to ~1e-3 relative, not bit for bit.
// A row's result depends only on its own ctx and hide and on the K/V tiles from position 0 in
// steps of PM_BN (tiles past a row's context leave it unchanged bit for bit: alpha = 2^0 = 1,
// p = 0), not on which other rows share its block: chunked and unchunked prefill give the same
// bits, as the invariance tests require.
//
// Measured (docs/benchmarks.md, "Thirteenth session"; llama-1b heads 32/8 of 64, one causal
// prompt, bf16 pool): 8192 tokens in 1377 us on an H200 (200 TFLOP/s; the SIMT tiled kernel 10.7
// ms, PyTorch SDPA's FA2 1000 us and cuDNN 627 us on the same card), 16384 in 5367 us.
//
// Entry points (extern "C"; the arguments of prefill_attention.cu's kernels, in the same order, so
// the host launches either from the same tile list; `bf16` is ignored: this kernel always rounds):
//   prefill_attn_mma_f32kv_hd64 / _hd128, prefill_attn_mma_bf16kv_hd64 / _hd128,
//   prefill_attn_mma_fp8kv_hd64 / _hd128 (out, q, k_pool, v_pool, k_scale, v_scale, tables,
//       max_blocks, seg, ctx, hide, tiles, heads, kv_heads, hd, bs, scale, bf16)
// Launch: grid (num_tiles * kv_heads) -- block b is tile b / kv_heads, KV head b % kv_heads --,
// block PM_THREADS (128), dynamic shared memory PM_SMEM_BYTES(hd, KV element bytes):
//   f32 pool 768 * hd (hd 128: 96 KB), bf16 pool 512 * hd, FP8 pool 384 * hd + 512
// (raise the function's MAX_DYNAMIC_SHARED_SIZE_BYTES to it first). The tile list and its rules
// are prefill_attention.cu's, with PM_ROWS(hd) rows of tokens x the group's query heads per tile
// instead of its PA_ROWS = 64: 128 at head_dim 64 (up to 128 / group tokens a tile), 64 at 128;
// a launch that breaks them returns without writing anything and never reads out of bounds. K/V
// rows below a tile's largest ctx are read, so they must be finite, as written KV is.
//
// Work split: warp w of the block owns rows 16 MT w .. 16 MT (w + 1) - 1 (row r = token r / group
// of the tile, query head kvh * group + r % group), MT row tiles of 16 as the A operands of the
// mma. Each K/V tile of PM_BN positions is staged once in shared memory for all the block's rows;
// a warp skips the tiles at or past its rows' largest context (the causal corner).

// The launch's dynamic shared memory in bytes (a function of its own so that the host check,
// ci/prefill_mma_host_check.py, can stand in for it).
__device__ __forceinline__ unsigned pm_dynamic_smem_bytes() {
  unsigned r;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(r));
  return r;
}

#define PM_THREADS 128
// Row tiles of 16 per warp: 2 at head_dim 64 (each K/V fragment read from shared memory feeds
// two mma), 1 at 128 (two would not fit the registers); rows per block = 4 warps x 16 x MT.
#define PM_MT(hd) ((hd) <= 64 ? 2 : 1)
#define PM_ROWS(hd) (64 * PM_MT(hd))
#define PM_BN 64
// Shared memory: bf16 pools double-buffer the swizzled K and V tiles (cp.async straight into
// them); f32 and FP8 pools stage the raw rows (one buffer, refilled while the converted copy is
// used) and convert them into one swizzled bf16 K and V pair.
#define PM_SMEM_BYTES(hd, es) \
  ((es) == 2 ? 2 * 2 * PM_BN * 2 * (hd) : 2 * PM_BN * (es) * (hd) + ((es) == 1 ? 2 * PM_BN * 4 : 0) + 2 * PM_BN * 2 * (hd))

namespace pm {

using da::neg_inf;

template <typename T, int D>
struct Geo {
  static constexpr int ES = (int)sizeof(T);
  static constexpr int TILE = PM_BN * 2 * D;                       // one swizzled bf16 matrix
  static constexpr int RAW = ES == 2 ? 0 : PM_BN * ES * D;        // one raw staged matrix
  static constexpr int SCALES = ES == 1 ? 2 * PM_BN * 4 : 0;      // K then V scales of the raw tile
  static constexpr int COMP = ES == 2 ? 0 : 2 * RAW + SCALES;     // where the converted pair starts
  static constexpr int BYTES = PM_SMEM_BYTES(D, ES);
  static constexpr int CPR = D * ES / 16;                          // 16-byte chunks per raw row
  static constexpr int CHUNKS = PM_BN * CPR / PM_THREADS;          // per thread per matrix
  static_assert(PM_BN * CPR % PM_THREADS == 0, "a K/V tile is not a whole number of chunks per thread");
  static_assert(BYTES <= 99 * 1024, "over sm_120's 99 KB of shared memory per block");
};

// Issues the cp.async copies of positions j0 .. j0+PM_BN-1 of KV head kvh (K and V rows, and an
// FP8 pool's scales): bf16 straight into the swizzled tiles at `kdst` / `kdst + TILE`, f32 and FP8
// into the raw area at `kdst` (K, then V, then the scales). Positions at or past kv_end are
// zero-filled and nothing is read for them.
template <typename T, int D>
__device__ __forceinline__ void issue_tile(unsigned kdst, const T* __restrict__ kp, const T* __restrict__ vp,
                                           const float* __restrict__ ks, const float* __restrict__ vs,
                                           const int* __restrict__ table, int j0, int kv_end, int bs, int kv_dim,
                                           int kvh) {
  typedef Geo<T, D> G;
  constexpr int EPC = 16 / G::ES;  // elements per chunk
  constexpr int MAT = G::ES == 2 ? G::TILE : G::RAW;
#pragma unroll
  for (int k = 0; k < G::CHUNKS; ++k) {
    const int idx = threadIdx.x + PM_THREADS * k;
    const int r = idx / G::CPR, cc = idx % G::CPR;
    const int j = j0 + r;
    const bool ok = j < kv_end;
    const long long row = ok ? ((long long)table[j / bs] * bs + j % bs) * kv_dim + (long long)kvh * D : 0;
    const unsigned so = G::ES == 2 ? da::swz<D>(r, cc) : (unsigned)(r * (G::ES * D) + (cc << 4));
    const int nb = ok ? 16 : 0;
    da::cp_async16(kdst + so, kp + row + cc * EPC, nb);
    da::cp_async16(kdst + MAT + so, vp + row + cc * EPC, nb);
  }
  if (G::ES == 1) {
    // Thread i < 64 stages position i's K scale, thread 64 + i its V scale.
    const int r = threadIdx.x & (PM_BN - 1);
    const int j = j0 + r;
    const bool ok = j < kv_end;
    const long long si = ok ? (((long long)table[j / bs] * bs + j % bs) * kv_dim + (long long)kvh * D) / D : 0;
    da::cp_async4(kdst + 2 * G::RAW + 4 * threadIdx.x, (threadIdx.x < PM_BN ? ks : vs) + si, ok ? 4 : 0);
  }
}

// Raw staged K and V (f32 rows, or FP8 codes with their scales) at `raw` -> the swizzled bf16
// pair at `comp` (K, then V at + TILE), each thread its share; the caller's barriers publish it.
template <typename T, int D>
__device__ __forceinline__ void convert_tile(const unsigned char* raw, unsigned char* comp) {
  typedef Geo<T, D> G;
#pragma unroll
  for (int m = 0; m < 2; ++m) {
    const unsigned char* src = raw + m * G::RAW;
    unsigned char* dst = comp + m * G::TILE;
    if constexpr (G::ES == 4) {
      // A 16-byte chunk is 4 floats -> 8 bytes of bf16: half of a swizzled 16-byte chunk.
#pragma unroll
      for (int k = 0; k < G::CHUNKS; ++k) {
        const int idx = threadIdx.x + PM_THREADS * k;
        const int r = idx / G::CPR, fc = idx % G::CPR;
        const float4 v = *reinterpret_cast<const float4*>(src + r * (4 * D) + (fc << 4));
        uint2 w;
        w.x = da::pack_bf16x2_rne(v.x, v.y);
        w.y = da::pack_bf16x2_rne(v.z, v.w);
        *reinterpret_cast<uint2*>(dst + da::swz<D>(r, fc >> 1) + ((fc & 1) << 3)) = w;
      }
    } else {
      // A 16-byte chunk is 16 codes -> 32 bytes of bf16: two swizzled chunks.
      const float* scales = reinterpret_cast<const float*>(raw + 2 * G::RAW) + m * PM_BN;
#pragma unroll
      for (int k = 0; k < G::CHUNKS; ++k) {
        const int idx = threadIdx.x + PM_THREADS * k;
        const int r = idx / G::CPR, cc = idx % G::CPR;
        const uint4 v = *reinterpret_cast<const uint4*>(src + r * D + (cc << 4));
        const float sc = scales[r];
        const unsigned w[4] = {v.x, v.y, v.z, v.w};
        unsigned pk[8];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          pk[2 * e] = da::pack_bf16x2_rne(da::fp8_scaled(w[e] & 0xffu, sc), da::fp8_scaled((w[e] >> 8) & 0xffu, sc));
          pk[2 * e + 1] = da::pack_bf16x2_rne(da::fp8_scaled((w[e] >> 16) & 0xffu, sc), da::fp8_scaled(w[e] >> 24, sc));
        }
        *reinterpret_cast<uint4*>(dst + da::swz<D>(r, 2 * cc)) = make_uint4(pk[0], pk[1], pk[2], pk[3]);
        *reinterpret_cast<uint4*>(dst + da::swz<D>(r, 2 * cc + 1)) = make_uint4(pk[4], pk[5], pk[6], pk[7]);
      }
    }
  }
}

// One warp's 16 * MT rows against one staged tile of PM_BN positions starting at j0: S = Q K^T,
// masking (position < ctx and != hide, per row), the online softmax update, O = O * alpha +
// bf16(P) V. Each K and V fragment read from shared memory feeds MT row tiles (the reuse that
// keeps ldmatrix from being the bound). Row slot i = 2 mt + h of this lane is row g + 8 h of the
// warp's row tile mt (g = lane / 4); every row goes through the same operations in the same order
// whatever MT is.
template <int D, int MT>
__device__ __forceinline__ void compute_tile(unsigned sK, unsigned sV, const unsigned (&qf)[MT][D / 16][4],
                                             float (&o)[MT][D / 8][4], float (&m)[2 * MT], float (&l)[2 * MT],
                                             int j0, const int (&rctx)[2 * MT], const int (&rhide)[2 * MT], float sl2,
                                             int lane) {
  constexpr int NT = PM_BN / 8;  // n-tiles of 8 positions
  const int c = lane & 3;
  float s[MT][NT][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int j = 0; j < NT; ++j) s[mt][j][0] = s[mt][j][1] = s[mt][j][2] = s[mt][j][3] = 0.f;

  const int prow = (lane & 7) + ((lane >> 4) << 3);
  const int pch = (lane >> 3) & 1;
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk)
#pragma unroll
    for (int nb = 0; nb < PM_BN / 16; ++nb) {
      unsigned b0, b1, b2, b3;
      da::ldsm_x4(sK + da::swz<D>(16 * nb + prow, 2 * kk + pch), b0, b1, b2, b3);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        da::mma_bf16_16816(s[mt][2 * nb], qf[mt][kk], b0, b1);
        da::mma_bf16_16816(s[mt][2 * nb + 1], qf[mt][kk], b2, b3);
      }
    }

  const float NEG = neg_inf();
  float mx[2 * MT];
#pragma unroll
  for (int i = 0; i < 2 * MT; ++i) mx[i] = NEG;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = 2 * mt + (e >> 1);
        const int pos = j0 + 8 * j + 2 * c + (e & 1);
        s[mt][j][e] = (pos < rctx[i] && pos != rhide[i]) ? s[mt][j][e] * sl2 : NEG;
        mx[i] = fmaxf(mx[i], s[mt][j][e]);
      }
  float alpha[2 * MT], base[2 * MT], ps[2 * MT];
#pragma unroll
  for (int i = 0; i < 2 * MT; ++i) {
    mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 1));
    mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 2));
    const float mn = fmaxf(m[i], mx[i]);
    // Nothing unmasked yet (mn = -inf): subtract 0, so p = 2^-inf = 0 and alpha = 0 (O, l are 0).
    base[i] = mn == NEG ? 0.f : mn;
    alpha[i] = da::ex2(m[i] - base[i]);
    m[i] = mn;
    ps[i] = 0.f;
  }
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = 2 * mt + (e >> 1);
        s[mt][j][e] = da::ex2(s[mt][j][e] - base[i]);
        ps[i] += s[mt][j][e];
      }
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    l[2 * mt] = l[2 * mt] * alpha[2 * mt] + ps[2 * mt];
    l[2 * mt + 1] = l[2 * mt + 1] * alpha[2 * mt + 1] + ps[2 * mt + 1];
#pragma unroll
    for (int j = 0; j < D / 8; ++j) {
      o[mt][j][0] *= alpha[2 * mt];
      o[mt][j][1] *= alpha[2 * mt];
      o[mt][j][2] *= alpha[2 * mt + 1];
      o[mt][j][3] *= alpha[2 * mt + 1];
    }
  }

  const int vrow = (lane & 7) + (((lane >> 3) & 1) << 3);
  const int vch = lane >> 4;
#pragma unroll
  for (int kp = 0; kp < PM_BN / 16; ++kp) {
    unsigned pa[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      pa[mt][0] = da::pack_bf16x2_rne(s[mt][2 * kp][0], s[mt][2 * kp][1]);
      pa[mt][1] = da::pack_bf16x2_rne(s[mt][2 * kp][2], s[mt][2 * kp][3]);
      pa[mt][2] = da::pack_bf16x2_rne(s[mt][2 * kp + 1][0], s[mt][2 * kp + 1][1]);
      pa[mt][3] = da::pack_bf16x2_rne(s[mt][2 * kp + 1][2], s[mt][2 * kp + 1][3]);
    }
#pragma unroll
    for (int jj = 0; jj < D / 16; ++jj) {
      unsigned b0, b1, b2, b3;
      da::ldsm_x4_t(sV + da::swz<D>(16 * kp + vrow, 2 * jj + vch), b0, b1, b2, b3);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        da::mma_bf16_16816(o[mt][2 * jj], pa[mt], b0, b1);
        da::mma_bf16_16816(o[mt][2 * jj + 1], pa[mt], b2, b3);
      }
    }
  }
}

template <typename T, int D>
__device__ __forceinline__ void prefill(float* __restrict__ out, const float* __restrict__ q,
                                        const T* __restrict__ kp, const T* __restrict__ vp,
                                        const float* __restrict__ ks, const float* __restrict__ vs,
                                        const int* __restrict__ tables, int max_blocks, const int* __restrict__ seg,
                                        const int* __restrict__ ctx, const int* __restrict__ hide,
                                        const int* __restrict__ tiles, int heads, int kv_heads, int hd, int bs,
                                        float scale, unsigned char* smem) {
  typedef Geo<T, D> G;
  constexpr int MT = PM_MT(D), ROWS = PM_ROWS(D);
  __shared__ int s_kv_end;

  if (hd != D || blockDim.x != PM_THREADS || kv_heads <= 0 || heads % kv_heads != 0 || bs <= 0) return;
  if (pm_dynamic_smem_bytes() < (unsigned)G::BYTES) return;
  const int group = heads / kv_heads;
  const int tile = blockIdx.x / kv_heads, kvh = blockIdx.x % kv_heads;
  const int t0 = tiles[2 * tile], count = tiles[2 * tile + 1];
  if (group > ROWS || count < 1 || count > ROWS / group) return;  // uniform over the block

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, c = lane & 3;
  const int kv_dim = kv_heads * D;
  const int* table = tables + (size_t)seg[t0] * max_blocks;
  if (threadIdx.x == 0) s_kv_end = 0;

  // This lane's row slots (see compute_tile): their token (or none), context and hidden position,
  // and the Q fragments of the warp's row tiles.
  int rtok[2 * MT], rctx[2 * MT], rhide[2 * MT];
  const float* qrow[2 * MT];
#pragma unroll
  for (int i = 0; i < 2 * MT; ++i) {
    const int r = 16 * MT * warp + 16 * (i >> 1) + g + 8 * (i & 1), tl = r / group;
    const bool ok = tl < count;
    rtok[i] = ok ? t0 + tl : -1;
    rctx[i] = ok ? ctx[t0 + tl] : 0;
    rhide[i] = ok ? hide[t0 + tl] : -1;
    qrow[i] = q + ((size_t)(ok ? t0 + tl : 0) * heads + kvh * group + r % group) * D;
  }
  unsigned qf[MT][D / 16][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const int d0 = kk * 16 + 2 * c;
      float2 a = make_float2(0.f, 0.f), a8 = a, b = a, b8 = a;
      if (rtok[2 * mt] >= 0) {
        a = *reinterpret_cast<const float2*>(qrow[2 * mt] + d0);
        a8 = *reinterpret_cast<const float2*>(qrow[2 * mt] + d0 + 8);
      }
      if (rtok[2 * mt + 1] >= 0) {
        b = *reinterpret_cast<const float2*>(qrow[2 * mt + 1] + d0);
        b8 = *reinterpret_cast<const float2*>(qrow[2 * mt + 1] + d0 + 8);
      }
      qf[mt][kk][0] = da::pack_bf16x2_rne(a.x, a.y);
      qf[mt][kk][1] = da::pack_bf16x2_rne(b.x, b.y);
      qf[mt][kk][2] = da::pack_bf16x2_rne(a8.x, a8.y);
      qf[mt][kk][3] = da::pack_bf16x2_rne(b8.x, b8.y);
    }
  // The warp's largest context (it skips tiles at or past it) and the block's (no position at or
  // past it is read).
  int wmax = 0;
#pragma unroll
  for (int i = 0; i < 2 * MT; ++i) wmax = max(wmax, rctx[i]);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) wmax = max(wmax, __shfl_xor_sync(0xffffffffu, wmax, o));
  __syncthreads();
  if (lane == 0 && wmax > 0) atomicMax(&s_kv_end, wmax);
  __syncthreads();
  const int kv_end = s_kv_end;
  const int ntiles = (kv_end + PM_BN - 1) / PM_BN;

  float o[MT][D / 8][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int j = 0; j < D / 8; ++j) o[mt][j][0] = o[mt][j][1] = o[mt][j][2] = o[mt][j][3] = 0.f;
  float m[2 * MT], l[2 * MT];
#pragma unroll
  for (int i = 0; i < 2 * MT; ++i) {
    m[i] = neg_inf();
    l[i] = 0.f;
  }
  const float sl2 = scale * 1.4426950408889634f;
  const unsigned sbase = da::smem_u32(smem);

  if (ntiles > 0) issue_tile<T, D>(sbase, kp, vp, ks, vs, table, 0, kv_end, bs, kv_dim, kvh);
  da::cp_async_commit();
  for (int it = 0; it < ntiles; ++it) {
    const int j0 = it * PM_BN;
    da::cp_async_wait<0>();
    __syncthreads();  // tile `it` has landed for everyone; every warp is done with tile it - 1
    unsigned sK;
    if constexpr (G::ES == 2) {
      // Double buffer: refill the other half (tile it - 1's, free now) while this one is used.
      sK = sbase + (it & 1) * 2 * G::TILE;
      if (it + 1 < ntiles)
        issue_tile<T, D>(sbase + ((it + 1) & 1) * 2 * G::TILE, kp, vp, ks, vs, table, j0 + PM_BN, kv_end, bs,
                         kv_dim, kvh);
    } else {
      convert_tile<T, D>(smem, smem + G::COMP);
      __syncthreads();  // the converted pair is visible; the raw area is free
      sK = sbase + G::COMP;
      if (it + 1 < ntiles) issue_tile<T, D>(sbase, kp, vp, ks, vs, table, j0 + PM_BN, kv_end, bs, kv_dim, kvh);
    }
    da::cp_async_commit();
    if (j0 < wmax) compute_tile<D, MT>(sK, sK + G::TILE, qf, o, m, l, j0, rctx, rhide, sl2, lane);
  }
  da::cp_async_wait<0>();

  // Row sums over the quad that shares a row; a row with nothing unmasked gives 0 * inf = NaN, as
  // in `attention`.
#pragma unroll
  for (int i = 0; i < 2 * MT; ++i) {
    l[i] += __shfl_xor_sync(0xffffffffu, l[i], 1);
    l[i] += __shfl_xor_sync(0xffffffffu, l[i], 2);
  }
#pragma unroll
  for (int i = 0; i < 2 * MT; ++i) {
    // The row slot's token again (recomputed rather than kept live across the tile loop).
    const int r = 16 * MT * warp + 16 * (i >> 1) + g + 8 * (i & 1), h = i & 1, tl = r / group;
    if (tl >= count) continue;
    const float inv = 1.0f / l[i];
    float* orow = out + ((size_t)(t0 + tl) * heads + kvh * group + r % group) * D + 2 * c;
#pragma unroll
    for (int j = 0; j < D / 8; ++j)
      *reinterpret_cast<float2*>(orow + 8 * j) =
          make_float2(o[i >> 1][j][2 * h] * inv, o[i >> 1][j][2 * h + 1] * inv);
  }
}

}  // namespace pm

#define PM_ARGS(KV)                                                                                         \
  float *out, const float *q, const KV *k_pool, const KV *v_pool, const float *k_scale, const float *v_scale, \
      const int *tables, int max_blocks, const int *seg, const int *ctx, const int *hide, const int *tiles,   \
      int heads, int kv_heads, int hd, int bs, float scale, int bf16
#define PM_CALL(KV, HD)                                                                                       \
  extern __shared__ __align__(16) unsigned char pm_smem[];                                                    \
  (void)bf16;                                                                                                \
  pm::prefill<KV, HD>(out, q, k_pool, v_pool, k_scale, v_scale, tables, max_blocks, seg, ctx, hide, tiles,   \
                      heads, kv_heads, hd, bs, scale, pm_smem)

extern "C" __global__ void __launch_bounds__(PM_THREADS) prefill_attn_mma_f32kv_hd64(PM_ARGS(float)) {
  TD_SCOPE("prefill_attn_mma_f32kv_hd64");
  PM_CALL(float, 64);
}
extern "C" __global__ void __launch_bounds__(PM_THREADS) prefill_attn_mma_f32kv_hd128(PM_ARGS(float)) {
  TD_SCOPE("prefill_attn_mma_f32kv_hd128");
  PM_CALL(float, 128);
}
extern "C" __global__ void __launch_bounds__(PM_THREADS) prefill_attn_mma_bf16kv_hd64(PM_ARGS(unsigned short)) {
  TD_SCOPE("prefill_attn_mma_bf16kv_hd64");
  PM_CALL(unsigned short, 64);
}
extern "C" __global__ void __launch_bounds__(PM_THREADS) prefill_attn_mma_bf16kv_hd128(PM_ARGS(unsigned short)) {
  TD_SCOPE("prefill_attn_mma_bf16kv_hd128");
  PM_CALL(unsigned short, 128);
}
extern "C" __global__ void __launch_bounds__(PM_THREADS) prefill_attn_mma_fp8kv_hd64(PM_ARGS(unsigned char)) {
  TD_SCOPE("prefill_attn_mma_fp8kv_hd64");
  PM_CALL(unsigned char, 64);
}
extern "C" __global__ void __launch_bounds__(PM_THREADS) prefill_attn_mma_fp8kv_hd128(PM_ARGS(unsigned char)) {
  TD_SCOPE("prefill_attn_mma_fp8kv_hd128");
  PM_CALL(unsigned char, 128);
}
