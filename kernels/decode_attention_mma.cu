// decode_attention_mma.cu -- bf16 tensor-core decode attention over a paged KV cache,
// split-K over the context, with a separate combine kernel.
//
// Self-contained for NVRTC: no #include. Builds for compute_90 and compute_120 (and sm_80+).
// Tensor cores only through mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 (inline PTX),
// operands staged with cp.async and read with ldmatrix. No wgmma, no tcgen05.
// Design, numerics and measured figures: docs/cuda_decode_attention.md.
//
// Entry points (all extern "C"):
//   decode_attn_mma_bf16kv(out, q, k_pool, v_pool, block_tables, context_lens, partial_out,
//                          partial_ml, max_blocks_per_seq, num_heads, num_kv_heads, block_size,
//                          head_dim, split_len, max_splits, scale, done, k_scale, v_scale)
//                                                                     K/V: bf16 bits (u16)
//   decode_attn_mma_f32kv (same arguments)                            K/V elements: f32
//   decode_attn_mma_fp8kv (same arguments)                            K/V: FP8 E4M3 codes (u8)
//   k_scale, v_scale: an FP8 pool's f32 scale per (position, KV head), index = element offset of
//   the row / head_dim (kernels/engine.cu, fp8_store); unused (pass null) for the other pools, as
//   in every kernel that reads the pool.
//   decode_attn_combine(out, partial_out, partial_ml, context_lens, num_heads, head_dim,
//                       split_len, max_splits)
//   decode_attn_mma_cluster_{bf16,f32,fp8}kv (the mma kernels' arguments; `done` unused): the
//                       mma kernel whose splits of one (KV head, sequence) form a thread block
//                       cluster (sm_90+): after a cluster barrier, split 0's block merges them as
//                       decode_attn_combine would, bit for bit, and no combine launch follows
//                       (TAPEDECK_MMA_MERGE=cluster).
//
// Launch (host rule, see the doc):
//   mma kernels: grid (num_kv_heads, num_seqs, max_splits), block 128 threads,
//                dynamic shared memory DA_SMEM_BYTES (65536; raise the function's
//                MAX_DYNAMIC_SHARED_SIZE_BYTES attribute to it first).
//   combine:     grid (num_heads, num_seqs), block 256 threads, no dynamic shared memory.
//   cluster:     as the mma kernels, with cluster dimensions (1, 1, max_splits), 2 <= max_splits <= 8
//                (the portable cluster size); on an earlier architecture the kernel does nothing.
//                Launch it after the mma kernel unless `done` is given or max_splits == 1 (it writes
//                out[] for len == 0 and for sequences that needed more than one split; single-split
//                sequences are written by the mma kernel directly and the combine kernel leaves them
//                alone; with max_splits == 1 the mma kernel also writes the zeros of len == 0).
// Requirements: head_dim in {64, 128}; num_heads % num_kv_heads == 0 and
//   num_heads / num_kv_heads <= 16; block_size a multiple of 16; split_len a multiple of 16;
//   ceil(context_len / split_len) <= max_splits for every sequence. Shapes outside these are
//   left unwritten (the kernel returns), never read out of bounds.
//
// Layouts: K and V pools [num_blocks][block_size][num_kv_heads][head_dim] row-major;
//   q, out [num_seqs][num_heads][head_dim] f32; block_tables [num_seqs][max_blocks_per_seq];
//   partial_out [num_seqs][num_heads][max_splits][head_dim] (per-split output, already divided
//   by its own sum); partial_ml [num_seqs][num_heads][max_splits][2] = (max, sum), the max in
//   the log2 domain (score * scale * log2(e)).

// Tracing hooks (kernels/trace.cu, which the engine puts in front of every module); a standalone
// compile without it traces nothing.
#ifndef TD_SCOPE
#define TD_SCOPE(name)
#define TD_WAITED()
#define TD_MARK(k)
#endif

#ifndef DA_SMEM_BYTES
#define DA_SMEM_BYTES 65536
#endif
#define DA_WARPS 4
#define DA_THREADS 128
#define DA_COMBINE_THREADS 256
// 1: the mma kernels let a PDL-launched successor (the o projection's GEMV when it merges the
// splits itself, or the combine kernel under pdl=all) launch only when their blocks are done with
// the KV cache. Triggered at the start (0), the successor and, through its own early trigger, the
// gate/up GEMV after it launch while attention still runs and stream tens of MB of weights ahead
// of attention's latency-bound KV reads. 2: triggered once a block has requested its first KV
// tiles (with DA_KV_EARLY, before its wait): those reads go first, and the o GEMV's weights (and
// gate/up's first wave, launched at o's start) fill the DRAM while the attention waits for the
// q/k/v GEMV and runs. Only when kernels start changes: the waits still order every read of
// what a kernel before wrote.
#ifndef DA_TRIGGER_LATE
#define DA_TRIGGER_LATE 1
#endif
#ifndef DA_TRIGGER_AFTER_MERGE
#define DA_TRIGGER_AFTER_MERGE 0
#endif
// 1: the mma kernels (not the persistent decode kernel) stage their first KV tiles before they
// wait for the kernel before them (griddepcontrol.wait). Launched with PDL (pdl=all), a block
// then fetches its split's cached positions while the q/k/v GEMV still runs: only q and the
// newest position (which that GEMV writes) are read after the wait, the newest row into the
// staged tile by hand (ci/mma_tile_host_check.py). Launched normally, the wait is a no-op and
// nothing changes. The same bits. llama-1b batch-1 decode on an H100 (twentieth session): under
// pdl=all 865.9 -> 873.9 tok/s, but with DA_COMBINE_FAST and only the attention launched early
// (TAPEDECK_PDL_ATTN=on) 877.7 against 877.4 without: kept off then. With today's other
// defaults and TAPEDECK_PDL_ATTN=on (twenty-sixth session, one call, interleaved): 938.3/937.3
// against 929.6/930.6 tok/s for pdl=on alone and 922.5/924.3 for the early launch without it:
// the default since, with the early launch.
#ifndef DA_KV_EARLY
#define DA_KV_EARLY 1
#endif
// 1: decode_attn_combine loads every split's (m, l, O) of its head at once (up to DA_COMBINE_R
// splits a thread: 4 * 256 / head_dim splits in all), instead of the maximum first and then the
// weighted sums: one round trip to L2 after the mma kernel ends instead of three, the same bits
// (ci/combine_host_check.py). llama-1b batch-1 decode on an H100: 877.4 against 868.6 tok/s
// (twentieth session); 0 restores the three rounds, for timing.
#ifndef DA_COMBINE_FAST
#define DA_COMBINE_FAST 1
#endif
#ifndef DA_COMBINE_R
#define DA_COMBINE_R 4
#endif
// 1: reads that depend only on the pass's index data do not wait for the context length: the
// mma kernel issues its q loads and its first block-table entries (for the whole split, as far as
// the table row goes) alongside context_lens[seq], not after it, and decode_attn_combine loads
// its splits' partials on the bound max_splits and only then the length (combine_group_fast_t's
// `ns_load` and `ns_of`). One dependent round trip to memory less in each; entries and splits
// past the context are loaded and never used, so the same bits. llama-1b batch-1 decode on an H100 (twenty-fifth session,
// interleaved in one call): 917 -> 935.5 tok/s; the default since. A sweep knob
// (TAPEDECK_NVRTC_DEFINES=DA_INDEX_EARLY=0|1).
#ifndef DA_INDEX_EARLY
#define DA_INDEX_EARLY 1
#endif

namespace da {

// Programmatic dependent launch (sm_90+; no-ops before, and when launched normally): let the next
// kernel launch early (pdl_trigger), and wait for the previous kernel to complete before reading
// anything (pdl_wait_only); pdl_start does both, in that order, at a kernel's start.
__device__ __forceinline__ void pdl_trigger() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_wait_only() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
  TD_WAITED();
}
__device__ __forceinline__ void pdl_start() {
  pdl_trigger();
  pdl_wait_only();
}

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

__device__ __forceinline__ unsigned smem_u32(const void* p) {
  unsigned r;
  asm volatile("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(r) : "l"(p));
  return r;
}

// 2^x, ex2.approx.ftz (max relative error 2^-22 per the PTX ISA); ex2(-inf) = +0.
__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Two f32 -> packed bf16x2, round to nearest even. `lo` lands in bits 0..15.
__device__ __forceinline__ unsigned pack_bf16x2_rne(float lo, float hi) {
  unsigned r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

__device__ __forceinline__ float bf16_bits_to_f32(unsigned short b) {
  return __uint_as_float(((unsigned)b) << 16);
}

__device__ __forceinline__ void cp_async16(unsigned dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ void ldsm_x4(unsigned addr, unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr)
               : "memory");
}
__device__ __forceinline__ void ldsm_x4_t(unsigned addr, unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr)
               : "memory");
}

// d += a * b, m16n8k16, bf16 inputs, f32 accumulate.
__device__ __forceinline__ void mma_bf16_16816(float* d, const unsigned* a, unsigned b0, unsigned b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Per-variant compile-time geometry. A "tile" is 16 consecutive positions of one KV head.
// Each warp owns DA_SMEM_BYTES / DA_WARPS bytes of shared memory: a ring of STAGES stages, each
// holding the K tile then the V tile as staged from global memory (bf16: already in the final
// swizzled bf16 layout; f32: raw f32, converted in place to that bf16 layout before use; FP8: the
// codes in the upper half of a bf16-sized area, converted in place with the 16 rows' scales,
// which follow the two matrices: 16 K scales, then 16 V scales).
template <typename T, int D>
struct Geo {
  static constexpr int ES = (int)sizeof(T);
  static constexpr int CPR = D * ES / 16;     // 16-byte chunks per staged row
  static constexpr int CPL = 16 * CPR / 32;   // chunks per lane per matrix
  static constexpr int EPC = 16 / ES;         // elements per chunk
  static constexpr int MAT = 16 * D * (ES == 1 ? 2 : ES);  // bytes of one matrix (K or V)
  static constexpr int RAW = ES == 1 ? 16 * D : 0;         // where the staged codes start in it
  static constexpr int SCALES = ES == 1 ? 2 * 16 * 4 : 0;  // the K and V scales of the stage
  static constexpr int STAGE = 2 * MAT + SCALES;
  static constexpr int REGION = DA_SMEM_BYTES / DA_WARPS;
  static constexpr int STAGES = REGION / STAGE;
  static constexpr int RB = 2 * D;            // bytes per row of the bf16 tile
};

// Byte offset of 16-byte chunk `ch` of row `r` in a swizzled bf16 tile (conflict-free ldmatrix).
template <int D>
__device__ __forceinline__ unsigned swz(int r, int ch) {
  return (unsigned)(r * (2 * D) + ((ch ^ (r & 7)) << 4));
}

// 4 bytes global -> shared through L1 (cp.async.cg only moves 16); src_bytes 0 zero-fills.
__device__ __forceinline__ void cp_async4(unsigned dst, const void* src, int src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}

// Byte offset of 16-byte chunk `cc` of row `r` of a staged K (or V) matrix, as staged from the
// pool: bf16 swizzled in place; FP8 codes in the upper half (RAW on); f32 raw rows.
template <typename T, int D>
__device__ __forceinline__ unsigned staged_offset(int r, int cc) {
  typedef Geo<T, D> G;
  return (G::ES == 2)   ? swz<D>(r, cc)
         : (G::ES == 1) ? (unsigned)(G::RAW + r * D + (cc << 4))
                        : (unsigned)(r * (4 * D) + (cc << 4));
}

// Stages the K and V rows of one tile (rows at or past nvalid zero-filled); for FP8 also the rows'
// scales, lanes 0..15 the K scales and 16..31 the V scales (ks, vs are unused otherwise).
template <typename T, int D>
__device__ __forceinline__ void issue_tile(unsigned sdst, const T* __restrict__ kp, const T* __restrict__ vp,
                                           const float* __restrict__ ks, const float* __restrict__ vs,
                                           long long rowbase, long long rowstride, int nvalid, int lane) {
  typedef Geo<T, D> G;
#pragma unroll
  for (int k = 0; k < G::CPL; ++k) {
    const int idx = lane + 32 * k;
    const int r = idx / G::CPR;
    const int cc = idx % G::CPR;
    const unsigned so = staged_offset<T, D>(r, cc);
    const bool ok = r < nvalid;
    const long long eo = ok ? rowbase + (long long)r * rowstride + (long long)(cc * G::EPC) : 0;
    const int nb = ok ? 16 : 0;  // src-size 0: the 16 bytes are zero-filled, nothing is read
    cp_async16(sdst + so, kp + eo, nb);
    cp_async16(sdst + G::MAT + so, vp + eo, nb);
  }
  if (G::ES == 1) {
    const int r = lane & 15;
    const bool ok = r < nvalid;
    const long long si = ok ? (rowbase + (long long)r * rowstride) / D : 0;
    cp_async4(sdst + 2 * G::MAT + 4 * lane, (lane < 16 ? ks : vs) + si, ok ? 4 : 0);
  }
}

// 16 bytes through L2 only (not L1, not the read-only path): the newest KV row, written by the
// kernel this one waited for, and possibly sharing a line that L1 cached before the wait.
__device__ __forceinline__ uint4 ld_cg_u4(const void* p) {
  uint4 r;
  asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p));
  return r;
}
__device__ __forceinline__ float ld_cg_f32(const float* p) {
  float r;
  asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(r) : "l"(p));
  return r;
}

// One KV row (K and V, and an FP8 pool's two scales) held in registers, for a tile that was
// staged before the row was written (DA_KV_EARLY): lane l holds the row's 16-byte chunks l and
// l + 32 of the 2 * CPR (K's, then V's), lanes 0 and 1 the K and V scales.
template <typename T, int D>
struct RowFix {
  uint4 ch[2];
  float sc;
  // Loads row `rowelem` (element offset of the row in the pool) of both pools.
  __device__ __forceinline__ void load(const T* kp, const T* vp, const float* ks, const float* vs,
                                       long long rowelem, int lane) {
    typedef Geo<T, D> G;
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int idx = lane + 32 * u;
      if (idx < 2 * G::CPR) {
        const T* src = idx < G::CPR ? kp : vp;
        ch[u] = ld_cg_u4(src + rowelem + (long long)((idx % G::CPR) * G::EPC));
      }
    }
    if (G::ES == 1 && lane < 2) sc = ld_cg_f32((lane == 0 ? ks : vs) + rowelem / D);
  }
  // Writes it as row r of the tile issue_tile staged at `sdst` (before any in-place conversion).
  __device__ __forceinline__ void store(unsigned char* sdst, int r, int lane) const {
    typedef Geo<T, D> G;
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int idx = lane + 32 * u;
      if (idx < 2 * G::CPR) {
        const unsigned so = staged_offset<T, D>(r, idx % G::CPR);
        *reinterpret_cast<uint4*>(sdst + (idx < G::CPR ? 0 : G::MAT) + so) = ch[u];
      }
    }
    if (G::ES == 1 && lane < 2) *reinterpret_cast<float*>(sdst + 2 * G::MAT + 4 * (16 * lane + r)) = sc;
  }
};

// The value of an FP8 E4M3 code times its row's scale, as kernels/engine.cu reads the pool
// (fp8_e4m3_value(c) * scale, the same f32 bits): 0x7f and 0xff are NaN, no infinities.
__device__ __forceinline__ float fp8_scaled(unsigned c, float scale) {
  const unsigned mag = c & 0x7fu;
  float a = (mag >> 3) == 0u ? (float)mag * 0.001953125f : __uint_as_float((mag << 20) + (120u << 23));
  if (mag == 0x7fu) a = __uint_as_float(0x7fc00000u);
  return ((c & 0x80u) ? -a : a) * scale;
}

// In place: FP8 codes [16][D] at base + RAW (the upper half) with the rows' scales at `scales`
// -> swizzled bf16 [16][D] over the whole area. Every lane reads all of its codes before the
// __syncwarp, so no write (rows 8..15 land on the codes) comes before a read.
template <int D>
__device__ __forceinline__ void convert_fp8_tile_inplace(unsigned char* base, const float* scales, int lane) {
  constexpr int PER = D / 32;  // 16-code chunks per lane (16 rows * D codes / 16 / 32)
  uint4 v[PER];
  const uint4* src = reinterpret_cast<const uint4*>(base + 16 * D);
#pragma unroll
  for (int k = 0; k < PER; ++k) v[k] = src[lane + 32 * k];
  __syncwarp();
#pragma unroll
  for (int k = 0; k < PER; ++k) {
    const int idx = lane + 32 * k;
    const int r = idx / (D / 16), cc = idx % (D / 16);
    const float sc = scales[r];
    const unsigned w[4] = {v[k].x, v[k].y, v[k].z, v[k].w};
    unsigned pk[8];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      pk[2 * j] = pack_bf16x2_rne(fp8_scaled(w[j] & 0xffu, sc), fp8_scaled((w[j] >> 8) & 0xffu, sc));
      pk[2 * j + 1] = pack_bf16x2_rne(fp8_scaled((w[j] >> 16) & 0xffu, sc), fp8_scaled(w[j] >> 24, sc));
    }
    *reinterpret_cast<uint4*>(base + swz<D>(r, 2 * cc)) = make_uint4(pk[0], pk[1], pk[2], pk[3]);
    *reinterpret_cast<uint4*>(base + swz<D>(r, 2 * cc + 1)) = make_uint4(pk[4], pk[5], pk[6], pk[7]);
  }
}

// In place: f32 [16][D] row-major at `base` -> swizzled bf16 [16][D] in its first 32*D bytes.
// Rows 0..7 are read by every lane before any write; rows 8..15 are read from bytes that no
// write touches, and written over f32 rows 4..7, which were read before the first __syncwarp.
template <int D>
__device__ __forceinline__ void convert_f32_tile_inplace(unsigned char* base, int lane) {
  constexpr int PER = D / 16;  // float4 chunks per lane per half (8 rows * D floats / 4 / 32)
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    float4 v[PER];
    const float4* src = reinterpret_cast<const float4*>(base + half * 32 * D);
#pragma unroll
    for (int k = 0; k < PER; ++k) v[k] = src[lane + 32 * k];
    __syncwarp();
#pragma unroll
    for (int k = 0; k < PER; ++k) {
      const int idx = lane + 32 * k;
      const int r = half * 8 + idx / (D / 4);
      const int fc = idx % (D / 4);
      uint2 w;
      w.x = pack_bf16x2_rne(v[k].x, v[k].y);
      w.y = pack_bf16x2_rne(v[k].z, v[k].w);
      *reinterpret_cast<uint2*>(base + swz<D>(r, fc >> 1) + ((fc & 1) << 3)) = w;
    }
  }
}

// One 16-position tile: S = Q K^T (2 n-tiles of 8 positions), online softmax in the log2
// domain, O = O * alpha + bf16(P) V.
template <int D>
__device__ __forceinline__ void compute_tile(unsigned sK, unsigned sV, const unsigned (&qf)[D / 16][4],
                                             float (&o)[D / 8][4], float& m0, float& m1, float& l0, float& l1,
                                             int nvalid, float sl2, int lane) {
  const int c = lane & 3;
  float s[2][4];
#pragma unroll
  for (int j = 0; j < 2; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) s[j][e] = 0.f;

  const int prow = (lane & 7) + ((lane >> 4) << 3);
  const int pch = (lane >> 3) & 1;
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    unsigned b0, b1, b2, b3;
    ldsm_x4(sK + swz<D>(prow, 2 * kk + pch), b0, b1, b2, b3);
    mma_bf16_16816(s[0], qf[kk], b0, b1);
    mma_bf16_16816(s[1], qf[kk], b2, b3);
  }

  const float NEG = neg_inf();
  float t[2][4];
#pragma unroll
  for (int j = 0; j < 2; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const bool ok = (8 * j + 2 * c + e) < nvalid;
      t[j][e] = ok ? s[j][e] * sl2 : NEG;
      t[j][2 + e] = ok ? s[j][2 + e] * sl2 : NEG;
    }
  float mx0 = fmaxf(fmaxf(t[0][0], t[0][1]), fmaxf(t[1][0], t[1][1]));
  float mx1 = fmaxf(fmaxf(t[0][2], t[0][3]), fmaxf(t[1][2], t[1][3]));
  mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
  mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
  mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
  mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
  // Position 0 of every processed tile is valid, so mn0/mn1 are finite; m0 = -inf gives alpha 0.
  const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
  const float a0 = ex2(m0 - mn0), a1 = ex2(m1 - mn1);
  m0 = mn0;
  m1 = mn1;
  float p[2][4];
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    p[j][0] = ex2(t[j][0] - mn0);
    p[j][1] = ex2(t[j][1] - mn0);
    p[j][2] = ex2(t[j][2] - mn1);
    p[j][3] = ex2(t[j][3] - mn1);
  }
  l0 = l0 * a0 + ((p[0][0] + p[0][1]) + (p[1][0] + p[1][1]));
  l1 = l1 * a1 + ((p[0][2] + p[0][3]) + (p[1][2] + p[1][3]));
#pragma unroll
  for (int j = 0; j < D / 8; ++j) {
    o[j][0] *= a0;
    o[j][1] *= a0;
    o[j][2] *= a1;
    o[j][3] *= a1;
  }
  unsigned pa[4];
  pa[0] = pack_bf16x2_rne(p[0][0], p[0][1]);
  pa[1] = pack_bf16x2_rne(p[0][2], p[0][3]);
  pa[2] = pack_bf16x2_rne(p[1][0], p[1][1]);
  pa[3] = pack_bf16x2_rne(p[1][2], p[1][3]);

  const int vrow = (lane & 7) + (((lane >> 3) & 1) << 3);
  const int vch = lane >> 4;
#pragma unroll
  for (int jj = 0; jj < D / 16; ++jj) {
    unsigned b0, b1, b2, b3;
    ldsm_x4_t(sV + swz<D>(vrow, 2 * jj + vch), b0, b1, b2, b3);
    mma_bf16_16816(o[2 * jj], pa, b0, b1);
    mma_bf16_16816(o[2 * jj + 1], pa, b2, b3);
  }
}

// Block-table entries for a warp's local tiles 32*R .. 32*R+31, one per lane, none past entry
// `mbps` of the row (a bound for tiles counted on the split's length, not the context's).
__device__ __forceinline__ int load_bt_round(const int* __restrict__ btrow, int R, int my_n, int warp, int lane,
                                             int start, int bs, int mbps = 0x7fffffff) {
  const int x = 32 * R + lane;
  if (x >= my_n) return 0;
  const int pos0 = start + (warp + x * DA_WARPS) * 16;
  return pos0 / bs < mbps ? btrow[pos0 / bs] : 0;
}

// 8 bytes of q through L2 only: the persistent decode kernel (decode_step.cu) writes q in the same
// launch, so it must not come through the read-only path a const __restrict__ pointer allows.
__device__ __forceinline__ float2 load_f2_cg(const float* p) {
  float2 r;
  asm volatile("ld.global.cg.v2.f32 {%0, %1}, [%2];" : "=f"(r.x), "=f"(r.y) : "l"(p));
  return r;
}

// Block (kvh, seq, split) of the mma kernels, by threads 0..127 of the block. NAMED: the block is
// wider (the persistent decode kernel's 256 threads, the rest elsewhere), so the epilogue meets
// at named barrier 1 of 128 threads instead of __syncthreads. EARLY (DA_KV_EARLY): the block
// waits for the kernel before it (griddepcontrol.wait) itself, after staging its first tiles
// without the newest position; it may return before waiting, having written nothing.
template <typename T, int D, bool NAMED, bool EARLY = false>
__device__ __forceinline__ void mma_impl(float* __restrict__ out, const float* __restrict__ q,
                                         const T* __restrict__ kp, const T* __restrict__ vp,
                                         const int* __restrict__ block_tables, const int* __restrict__ context_lens,
                                         float* __restrict__ partial_out, float* __restrict__ partial_ml, int mbps,
                                         int nh, int nkv, int bs, int split_len, int max_splits, float scale,
                                         unsigned char* smem, int kvh, int seq, int split,
                                         const float* __restrict__ ks = nullptr,
                                         const float* __restrict__ vs = nullptr) {
  typedef Geo<T, D> G;
  static_assert(G::STAGES >= 1, "DA_SMEM_BYTES too small");
  static_assert(32 + 16 * D <= G::REGION / 4, "epilogue does not fit the warp region");

  if (nkv <= 0 || nh % nkv != 0) return;
  const int group = nh / nkv;
  if (group < 1 || group > 16 || (bs & 15) != 0 || bs <= 0 || (split_len & 15) != 0 || split_len <= 0) return;
  if (split >= max_splits) return;
  const int len = context_lens[seq];
  const int start = split * split_len;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, c = lane & 3;

  // Q fragments (A operand, rows = the group's query heads, padded with zeros to 16).
  unsigned qf[D / 16][4];
  auto load_q = [&]() {
    const float* qh = q + ((size_t)seq * nh + (size_t)kvh * group) * D;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const int d0 = kk * 16 + 2 * c;
      float2 a, a8, b, b8;
      a.x = a.y = a8.x = a8.y = b.x = b.y = b8.x = b8.y = 0.f;
      if (g < group) {
        a = load_f2_cg(qh + (size_t)g * D + d0);
        a8 = load_f2_cg(qh + (size_t)g * D + d0 + 8);
      }
      if (g + 8 < group) {
        b = load_f2_cg(qh + (size_t)(g + 8) * D + d0);
        b8 = load_f2_cg(qh + (size_t)(g + 8) * D + d0 + 8);
      }
      qf[kk][0] = pack_bf16x2_rne(a.x, a.y);
      qf[kk][1] = pack_bf16x2_rne(b.x, b.y);
      qf[kk][2] = pack_bf16x2_rne(a8.x, a8.y);
      qf[kk][3] = pack_bf16x2_rne(b8.x, b8.y);
    }
  };
  const int* btrow = block_tables + (size_t)seq * mbps;
  // DA_INDEX_EARLY: q and the first two rounds of block-table entries, counted on the split's
  // whole length, are requested before the context length is used (they need only the pass's
  // index data and, for q, the kernel before); the entries past the context are never used.
  int bt_even = 0, bt_odd = 0;
  if (DA_INDEX_EARLY) {
    if (!EARLY) load_q();
    const int full = split_len >> 4;
    const int full_n = full > warp ? (full - warp + DA_WARPS - 1) / DA_WARPS : 0;
    bt_even = load_bt_round(btrow, 0, full_n, warp, lane, start, bs, mbps);
    bt_odd = load_bt_round(btrow, 1, full_n, warp, lane, start, bs, mbps);
  }

  if (start >= len) return;  // uniform over the block
  const int end = min(len, start + split_len);
  const int nsplits = (len + split_len - 1) / split_len;
  unsigned char* wreg = smem + warp * G::REGION;
  const unsigned wreg_s = smem_u32(wreg);
  if (!EARLY && !DA_INDEX_EARLY) load_q();

  float o[D / 8][4];
#pragma unroll
  for (int j = 0; j < D / 8; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
  float m0 = neg_inf(), m1 = neg_inf(), l0 = 0.f, l1 = 0.f;
  const float sl2 = scale * 1.4426950408889634f;

  const int ntiles = (end - start + 15) >> 4;
  const int my_n = (ntiles > warp) ? (ntiles - warp + DA_WARPS - 1) / DA_WARPS : 0;
  const long long rowstride = (long long)nkv * D;

  // Physical block numbers, prefetched 32 tiles at a time, two rounds in flight.
  if (!DA_INDEX_EARLY) {
    bt_even = load_bt_round(btrow, 0, my_n, warp, lane, start, bs);
    bt_odd = load_bt_round(btrow, 1, my_n, warp, lane, start, bs);
  }

  int nx = 0;  // next local tile to issue
  // Positions staged from the pool: before the wait, not the newest (the kernel waited for
  // writes it); its row is put into the staged tile afterwards (`fix`).
  int lim = EARLY ? len - 1 : len;
#define DA_ISSUE_NEXT(SLOT)                                                                  \
  {                                                                                          \
    const int slot_ = (SLOT);                                                                \
    const int R_ = nx >> 5;                                                                  \
    const int phys_ = __shfl_sync(0xffffffffu, (R_ & 1) ? bt_odd : bt_even, nx & 31);        \
    if ((nx & 31) == 0 && R_ >= 1) {                                                         \
      const int nv_ = load_bt_round(btrow, R_ + 1, my_n, warp, lane, start, bs);             \
      if (R_ & 1) bt_even = nv_; else bt_odd = nv_;                                          \
    }                                                                                        \
    const int pos0_ = start + (warp + nx * DA_WARPS) * 16;                                   \
    const int blk_ = pos0_ / bs;                                                             \
    const int off_ = pos0_ - blk_ * bs;                                                      \
    const long long rowbase_ = (((long long)phys_ * bs + off_) * nkv + kvh) * (long long)D;  \
    issue_tile<T, D>(wreg_s + slot_ * G::STAGE, kp, vp, ks, vs, rowbase_, rowstride, lim - pos0_, lane); \
    ++nx;                                                                                    \
  }

#pragma unroll
  for (int i = 0; i < G::STAGES - 1; ++i) {
    if (nx < my_n) DA_ISSUE_NEXT(i);
    cp_async_commit();
  }
  if (DA_TRIGGER_LATE == 2 && !NAMED) da::pdl_trigger();
  RowFix<T, D> fix;
  int fix_i = -1;  // the loop step whose tile lacks the newest row
  if (EARLY) {
    da::pdl_wait_only();
    load_q();
    const int tn = (len - 1 - start) >> 4;  // the newest position's local tile, if end == len
    if (end == len && tn % DA_WARPS == warp && tn / DA_WARPS < G::STAGES - 1) {
      fix_i = tn / DA_WARPS;
      const int newest = len - 1;
      const long long rowelem = (((long long)btrow[newest / bs] * bs + newest % bs) * nkv + kvh) * (long long)D;
      fix.load(kp, vp, ks, vs, rowelem, lane);
    }
    lim = len;
  }
  for (int i = 0; i < my_n; ++i) {
    if (nx < my_n) DA_ISSUE_NEXT(nx % G::STAGES);
    cp_async_commit();
    cp_async_wait<G::STAGES - 1>();
    __syncwarp();
    if (i == 0) TD_MARK(1);
    const int slot = i % G::STAGES;
    if (EARLY && i == fix_i) {
      fix.store(wreg + slot * G::STAGE, (len - 1 - start) & 15, lane);
      __syncwarp();
    }
    if (G::ES == 4) {
      convert_f32_tile_inplace<D>(wreg + slot * G::STAGE, lane);
      convert_f32_tile_inplace<D>(wreg + slot * G::STAGE + G::MAT, lane);
      __syncwarp();
    } else if (G::ES == 1) {
      const float* sc = reinterpret_cast<const float*>(wreg + slot * G::STAGE + 2 * G::MAT);
      convert_fp8_tile_inplace<D>(wreg + slot * G::STAGE, sc, lane);
      convert_fp8_tile_inplace<D>(wreg + slot * G::STAGE + G::MAT, sc + 16, lane);
      __syncwarp();
    }
    const unsigned sb = wreg_s + slot * G::STAGE;
    const int pos0 = start + (warp + i * DA_WARPS) * 16;
    compute_tile<D>(sb, sb + G::MAT, qf, o, m0, m1, l0, l1, len - pos0, sl2, lane);
    __syncwarp();
  }
#undef DA_ISSUE_NEXT
  cp_async_wait<0>();

  // Row sums: each lane holds a partial over its columns.
  l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
  l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
  l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
  l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
  __syncwarp();

  TD_MARK(2);
  // Epilogue: every warp parks (m, l, O) in its own region, then the block merges the 4 warps.
  float* wf = reinterpret_cast<float*>(wreg);
  if (c == 0) {
    wf[2 * g] = m0;
    wf[2 * g + 1] = l0;
    wf[2 * (g + 8)] = m1;
    wf[2 * (g + 8) + 1] = l1;
  }
  float* wo = wf + 32;
#pragma unroll
  for (int j = 0; j < D / 8; ++j) {
    float2 u, v;
    u.x = o[j][0];
    u.y = o[j][1];
    v.x = o[j][2];
    v.y = o[j][3];
    *reinterpret_cast<float2*>(wo + g * D + 8 * j + 2 * c) = u;
    *reinterpret_cast<float2*>(wo + (g + 8) * D + 8 * j + 2 * c) = v;
  }
  if (NAMED)
    asm volatile("bar.sync 1, 128;" ::: "memory");
  else
    __syncthreads();

  for (int idx = threadIdx.x; idx < group * D; idx += DA_THREADS) {
    const int r = idx / D, d = idx % D;
    float M = neg_inf();
#pragma unroll
    for (int w = 0; w < DA_WARPS; ++w) M = fmaxf(M, reinterpret_cast<const float*>(smem + w * G::REGION)[2 * r]);
    float L = 0.f, O = 0.f;
#pragma unroll
    for (int w = 0; w < DA_WARPS; ++w) {
      const float* b = reinterpret_cast<const float*>(smem + w * G::REGION);
      const float wt = ex2(b[2 * r] - M);  // empty warp: m = -inf -> 0
      L += wt * b[2 * r + 1];
      O += wt * b[32 + r * D + d];
    }
    const size_t sh = (size_t)seq * nh + (size_t)kvh * group + r;
    if (nsplits == 1) {
      out[sh * D + d] = O / L;
    } else {
      const size_t ps = sh * max_splits + split;
      partial_out[ps * D + d] = O / L;
      if (d == 0) {
        partial_ml[ps * 2] = M;
        partial_ml[ps * 2 + 1] = L;
      }
    }
  }
}

}  // namespace da

// Merge the splits: out = sum_s w_s * O_s / sum_s w_s with w_s = 2^(m_s - max m) * l_s.
// Head h of sequence seq, by PT threads of the block (threadIdx.x < PT; all of them call it): the
// layout is always DA_COMBINE_THREADS virtual threads (DA_COMBINE_THREADS / head_dim parts, each
// summing every parts-th split), so the bits do not depend on PT. PT = DA_COMBINE_THREADS:
// decode_attn_combine and the persistent decode kernel (decode_step.cu); PT = DA_THREADS: the mma
// kernels merging their own splits.
template <int PT>
__device__ __forceinline__ void combine_head_t(float* out, const float* partial_out, const float* partial_ml,
                                               const int* context_lens, int num_heads, int head_dim,
                                               int split_len, int max_splits, int h, int seq) {
  constexpr int VT = DA_COMBINE_THREADS;
  static_assert(VT % PT == 0 && PT % 32 == 0, "PT must divide the virtual block");
  __shared__ float red_m[PT / 32];
  __shared__ float acc_s[VT];
  __shared__ float wsum_s[VT];
  const int tid = threadIdx.x;
  if (h >= num_heads || head_dim <= 0 || head_dim > VT || split_len <= 0) return;
  const int len = context_lens[seq];
  const size_t sh = (size_t)seq * num_heads + h;
  if (len <= 0) {
    for (int d = tid; d < head_dim; d += PT) out[sh * head_dim + d] = 0.f;
    return;
  }
  int ns = (len + split_len - 1) / split_len;
  if (ns <= 1) return;  // written by the mma kernel
  if (ns > max_splits) ns = max_splits;
  const float* ml = partial_ml + sh * max_splits * 2;
  const float* po = partial_out + sh * max_splits * head_dim;

  // The maximum is exact in any order.
  float M = da::neg_inf();
  for (int s = tid; s < ns; s += PT) M = fmaxf(M, ml[2 * s]);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, o));
  if ((tid & 31) == 0) red_m[tid >> 5] = M;
  __syncthreads();
  M = red_m[0];
#pragma unroll
  for (int w = 1; w < PT / 32; ++w) M = fmaxf(M, red_m[w]);

  const int parts = VT / head_dim;
#pragma unroll
  for (int vt = tid; vt < VT; vt += PT) {
    const int part = vt / head_dim, d = vt % head_dim;
    float acc = 0.f, wsum = 0.f;
    if (part < parts) {
#pragma unroll 4
      for (int s = part; s < ns; s += parts) {
        const float wt = da::ex2(ml[2 * s] - M) * ml[2 * s + 1];
        acc += wt * po[(size_t)s * head_dim + d];
        wsum += wt;
      }
    }
    acc_s[vt] = acc;
    wsum_s[vt] = wsum;
  }
  __syncthreads();
  for (int d = tid; d < head_dim; d += PT) {
    float A = 0.f, W = 0.f;
    for (int p = 0; p < parts; ++p) {
      A += acc_s[p * head_dim + d];
      W += wsum_s[p * head_dim + d];
    }
    out[sh * head_dim + d] = A / W;
  }
}

// Block (h, seq) of decode_attn_combine (blockDim DA_COMBINE_THREADS): shared with the persistent
// decode kernel (decode_step.cu).
__device__ __forceinline__ void combine_head(float* out, const float* partial_out, const float* partial_ml,
                                             const int* context_lens, int num_heads, int head_dim, int split_len,
                                             int max_splits, int h, int seq) {
  combine_head_t<DA_COMBINE_THREADS>(out, partial_out, partial_ml, context_lens, num_heads, head_dim, split_len,
                                     max_splits, h, seq);
}

// The merge of combine_head_t for query heads head0 .. head0 + group - 1 at once, with its bits
// (the same maximum; every (part, dim) sum over the same splits in the same order, then the parts
// in order), but every load of every head issued before the first is used: combine_head_t, run
// head after head, waits on memory three times a head (four heads in a row measured ~8 µs a
// layer slower than the combine kernel's one block per head). Applies where each of the PT
// threads takes at most MG_U virtual threads (group * DA_COMBINE_THREADS <= MG_U * PT) and MG_R
// splits each (ns <= MG_R * parts), and there are at least two; returns false (nothing done)
// otherwise. `smem`: 2 * MG_U * PT floats of shared memory, null for none (then false).
// combine_group_fast_t takes the split count as `ns_of()`, asked only after the loads, and loads
// `ns_load` (>= ns) splits: a caller that knows only a bound (DA_INDEX_EARLY: max_splits, before
// the context length has arrived) issues the loads before `ns` is known; splits past ns are
// loaded and then ignored, the bits of loading ns.
#ifndef MG_U
#define MG_U 8
#endif
#ifndef MG_R
#define MG_R 2
#endif
template <int PT, int U, int R, typename NsOf>
__device__ __forceinline__ bool combine_group_fast_t(float* out, const float* partial_out, const float* partial_ml,
                                                     int ns_load, NsOf ns_of, int num_heads, int head_dim,
                                                     int max_splits, int head0, int group, int seq, float* smem) {
  constexpr int VT = DA_COMBINE_THREADS, W = PT / 32;
  // Heads the virtual threads cover; thread tid's u-th virtual thread tid + u * PT belongs to head
  // u * PT / VT whatever tid is (PT divides VT).
  constexpr int G = U * PT / VT;
  static_assert(VT % PT == 0 && G >= 1, "PT must divide the virtual block");
  __shared__ float red[G * W];
  if (!smem || head_dim <= 0 || VT % head_dim != 0 || group > G) return false;
  const int parts = VT / head_dim;
  if (ns_load > R * parts) return false;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  float m[U][R], l[U][R], o[U][R];
#pragma unroll
  for (int u = 0; u < U; u++) {
    const int vt = tid + u * PT, j = u * PT / VT, r = vt % VT, part = r / head_dim, d = r % head_dim;
    const size_t sh = (size_t)seq * num_heads + head0 + j;
#pragma unroll
    for (int q = 0; q < R; q++) {
      const int s = part + q * parts;
      const bool ok = j < group && s < ns_load;
      m[u][q] = ok ? partial_ml[(sh * max_splits + s) * 2] : da::neg_inf();
      l[u][q] = ok ? partial_ml[(sh * max_splits + s) * 2 + 1] : 0.f;
      o[u][q] = ok ? partial_out[(sh * max_splits + s) * head_dim + d] : 0.f;
    }
  }
  // Uniform over the block (one sequence), before any barrier: loaded for nothing. One split or
  // none is not a merge (the mma kernel wrote its output; an empty context's zeros are the
  // caller's).
  const int ns = ns_of();
  if (ns <= 1 || ns > ns_load) return false;
  // Splits past ns (loaded only on a bound) are as if never loaded.
#pragma unroll
  for (int u = 0; u < U; u++) {
    const int part = ((tid + u * PT) % VT) / head_dim;
#pragma unroll
    for (int q = 0; q < R; q++)
      if (part + q * parts >= ns) {
        m[u][q] = da::neg_inf();
        l[u][q] = 0.f;
        o[u][q] = 0.f;
      }
  }
  // Each head's maximum over its splits (every split is loaded by some thread): exact in any order.
#pragma unroll
  for (int j = 0; j < G; j++) {
    float M = da::neg_inf();
#pragma unroll
    for (int u = 0; u < U; u++)
      if (u * PT / VT == j)
#pragma unroll
        for (int q = 0; q < R; q++) M = fmaxf(M, m[u][q]);
#pragma unroll
    for (int x = 16; x > 0; x >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, x));
    if (lane == 0) red[j * W + warp] = M;
  }
  __syncthreads();
  TD_MARK(1);
  float* acc_s = smem;
  float* wsum_s = smem + U * PT;
#pragma unroll
  for (int u = 0; u < U; u++) {
    const int vt = tid + u * PT, j = u * PT / VT;
    float M = red[j * W];
#pragma unroll
    for (int w = 1; w < W; ++w) M = fmaxf(M, red[j * W + w]);
    const int part = (vt % VT) / head_dim;
    float acc = 0.f, wsum = 0.f;
#pragma unroll
    for (int q = 0; q < R; q++) {
      if (j < group && part + q * parts < ns) {
        const float wt = da::ex2(m[u][q] - M) * l[u][q];
        acc += wt * o[u][q];
        wsum += wt;
      }
    }
    acc_s[vt] = acc;
    wsum_s[vt] = wsum;
  }
  __syncthreads();
  TD_MARK(2);
  for (int i = tid; i < group * head_dim; i += PT) {
    const int j = i / head_dim, d = i % head_dim;
    float A = 0.f, Wt = 0.f;
    for (int p = 0; p < parts; ++p) {
      A += acc_s[j * VT + p * head_dim + d];
      Wt += wsum_s[j * VT + p * head_dim + d];
    }
    out[((size_t)seq * num_heads + head0 + j) * head_dim + d] = A / Wt;
  }
  return true;
}

// combine_group_fast_t for a known split count `ns`, loading only those.
template <int PT, int U = MG_U, int R = MG_R>
__device__ __forceinline__ bool combine_group_fast(float* out, const float* partial_out, const float* partial_ml,
                                                   int ns, int num_heads, int head_dim, int max_splits, int head0,
                                                   int group, int seq, float* smem) {
  return combine_group_fast_t<PT, U, R>(out, partial_out, partial_ml, ns, [ns] { return ns; }, num_heads, head_dim,
                                        max_splits, head0, group, seq, smem);
}

// The `ns` splits of query heads head0 .. head0 + group - 1 merged by the block's PT threads, as
// decode_attn_combine would: all heads at once through `smem` where combine_group_fast applies,
// else head after head.
template <int PT>
__device__ __forceinline__ void merge_group(int ns, float* out, const float* partial_out, const float* partial_ml,
                                            const int* context_lens, int num_heads, int head_dim, int split_len,
                                            int max_splits, int head0, int group, int seq, float* smem) {
  if (combine_group_fast<PT>(out, partial_out, partial_ml, ns, num_heads, head_dim, max_splits, head0, group, seq,
                             smem))
    return;
  for (int j = 0; j < group; j++) {
    combine_head_t<PT>(out, partial_out, partial_ml, context_lens, num_heads, head_dim, split_len, max_splits,
                       head0 + j, seq);
    __syncthreads();
  }
}

// After a block has written its split's partials (and met its threads at a barrier): counts it
// in `counter` (one per sequence and KV head, zero between launches), and if it is the last of
// the `ns` splits to finish, resets the counter and merges the splits of the group's query heads
// head0 .. head0 + group - 1 (merge_group). Every one of the block's PT threads
// calls it. Used by the mma kernels' own merge and the persistent decode kernel.
template <int PT>
__device__ __forceinline__ void merge_if_last_split(unsigned* counter, int ns, float* out, const float* partial_out,
                                                    const float* partial_ml, const int* context_lens, int num_heads,
                                                    int head_dim, int split_len, int max_splits, int head0, int group,
                                                    int seq, float* smem) {
  __shared__ int last;
  if (threadIdx.x == 0) {
    __threadfence();  // this block's partials are visible before its arrival is
    last = atomicAdd(counter, 1u) == (unsigned)(ns - 1);
    if (last) atomicExch(counter, 0u);
    __threadfence();  // and, for the last, every other block's partials before the merge reads them
  }
  __syncthreads();
  if (!last) return;
  merge_group<PT>(ns, out, partial_out, partial_ml, context_lens, num_heads, head_dim, split_len, max_splits, head0,
                  group, seq, smem);
}

// A sequence with an empty context (no split ran): the zeros decode_attn_combine writes for
// query heads head0 .. head0 + group - 1, by one block of DA_THREADS threads.
__device__ __forceinline__ void combine_empty(float* out, const float* partial_out, const float* partial_ml,
                                              const int* context_lens, int num_heads, int head_dim, int split_len,
                                              int max_splits, int head0, int group, int seq) {
  for (int j = 0; j < group; j++)
    combine_head_t<DA_THREADS>(out, partial_out, partial_ml, context_lens, num_heads, head_dim, split_len,
                               max_splits, head0 + j, seq);
}

// Block (kvh, seq, split)'s attention (mma_impl) for the head_dims it takes; false (nothing
// done) for another head_dim.
template <typename T>
__device__ __forceinline__ bool mma_block(float* out, const float* q, const T* k_pool, const T* v_pool,
                                          const int* block_tables, const int* context_lens, float* partial_out,
                                          float* partial_ml, int mbps, int nh, int nkv, int bs, int head_dim,
                                          int split_len, int max_splits, float scale, unsigned char* smem, int kvh,
                                          int seq, int split, const float* k_scale, const float* v_scale) {
  if (head_dim == 64)
    da::mma_impl<T, 64, false, DA_KV_EARLY != 0>(out, q, k_pool, v_pool, block_tables, context_lens, partial_out,
                                                 partial_ml, mbps, nh, nkv, bs, split_len, max_splits, scale, smem,
                                                 kvh, seq, split, k_scale, v_scale);
  else if (head_dim == 128)
    da::mma_impl<T, 128, false, DA_KV_EARLY != 0>(out, q, k_pool, v_pool, block_tables, context_lens, partial_out,
                                                  partial_ml, mbps, nh, nkv, bs, split_len, max_splits, scale, smem,
                                                  kvh, seq, split, k_scale, v_scale);
  else
    return false;
  return true;
}

// With `done` (num_seqs * num_kv_heads zeroed words, left zeroed), the mma kernel merges its own
// splits: the block that finishes a (sequence, KV head)'s splits last merges them for the group's
// query heads, computing what decode_attn_combine computes, bit for bit; the combine launch is then
// left out. Without (`done` null) the combine kernel must follow.
template <typename T>
__device__ __forceinline__ void mma_entry(float* out, const float* q, const T* k_pool, const T* v_pool,
                                          const int* block_tables, const int* context_lens, float* partial_out,
                                          float* partial_ml, int mbps, int nh, int nkv, int bs, int head_dim,
                                          int split_len, int max_splits, float scale, unsigned* done,
                                          const float* k_scale, const float* v_scale) {
  extern __shared__ __align__(16) unsigned char da_smem[];
  if (!DA_TRIGGER_LATE) da::pdl_trigger();
  if (!DA_KV_EARLY) da::pdl_wait_only();
  const int kvh = blockIdx.x, seq = blockIdx.y, split = blockIdx.z;
  const bool ran = mma_block<T>(out, q, k_pool, v_pool, block_tables, context_lens, partial_out, partial_ml, mbps,
                                nh, nkv, bs, head_dim, split_len, max_splits, scale, da_smem, kvh, seq, split,
                                k_scale, v_scale);
  // DA_KV_EARLY: the attention may have returned before its wait; nothing below writes before it.
  if (DA_KV_EARLY) da::pdl_wait_only();
  if (!ran) return;
  // DA_TRIGGER_AFTER_MERGE: with `done`, no early trigger at all (a block then triggers as it
  // exits, the merging block after its merge), so the successor's weight prefetch does not
  // compete with the merge's reads.
  if (DA_TRIGGER_LATE && !(DA_TRIGGER_AFTER_MERGE && done)) da::pdl_trigger();
  // Without `done` the combine kernel merges the splits, unless there is one split: then no combine
  // launch follows (the host leaves it out) and an empty context's zeros are written here too.
  if ((!done && max_splits != 1) || nkv <= 0 || nh % nkv != 0 || split_len <= 0) return;
  const int group = nh / nkv;
  const int len = context_lens[seq];
  if (len <= 0) {  // no split ran: the first block writes the zeros decode_attn_combine would
    if (split == 0)
      combine_empty(out, partial_out, partial_ml, context_lens, nh, head_dim, split_len, max_splits, kvh * group,
                    group, seq);
    return;
  }
  if (!done) return;
  const int ns = min((len + split_len - 1) / split_len, max_splits);
  if (ns <= 1 || split >= ns) return;  // one split wrote out[] itself; empty splits did nothing
  __syncthreads();
  // The attention's shared memory is free again (every thread passed the barrier above).
  merge_if_last_split<DA_THREADS>(done + (size_t)seq * nkv + kvh, ns, out, partial_out, partial_ml, context_lens, nh,
                                  head_dim, split_len, max_splits, kvh * group, group, seq, (float*)da_smem);
}

// Every thread of the cluster's blocks arrives with release semantics and waits with acquire
// semantics: what any block of the cluster wrote before (its split's partials, in global memory)
// is visible to every block after. Threads of blocks that exited count as arrived. sm_90+.
__device__ __forceinline__ void cluster_sync_all() {
#if __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.release;\n\tbarrier.cluster.wait.acquire;" ::: "memory");
#endif
}

// The mma kernel with its splits merged inside their cluster (see the entry points' comment):
// no split counter, no global fences, no combine launch.
template <typename T>
__device__ __forceinline__ void mma_cluster_entry(float* out, const float* q, const T* k_pool, const T* v_pool,
                                                  const int* block_tables, const int* context_lens,
                                                  float* partial_out, float* partial_ml, int mbps, int nh, int nkv,
                                                  int bs, int head_dim, int split_len, int max_splits, float scale,
                                                  const float* k_scale, const float* v_scale) {
#if __CUDA_ARCH__ >= 900
  extern __shared__ __align__(16) unsigned char da_smem[];
  if (!DA_TRIGGER_LATE) da::pdl_trigger();
  if (!DA_KV_EARLY) da::pdl_wait_only();
  const int kvh = blockIdx.x, seq = blockIdx.y, split = blockIdx.z;
  // head_dim is the same for the whole grid, so every block of a cluster returns here or none.
  const bool ran = mma_block<T>(out, q, k_pool, v_pool, block_tables, context_lens, partial_out, partial_ml, mbps,
                                nh, nkv, bs, head_dim, split_len, max_splits, scale, da_smem, kvh, seq, split,
                                k_scale, v_scale);
  // DA_KV_EARLY: the attention may have returned before its wait; nothing below writes before it.
  if (DA_KV_EARLY) da::pdl_wait_only();
  if (!ran) return;
  // DA_TRIGGER_AFTER_MERGE: each block triggers as it exits, split 0's after its merge.
  if (DA_TRIGGER_LATE && !DA_TRIGGER_AFTER_MERGE) da::pdl_trigger();
  // Also a block barrier: the attention's shared memory is free for the merge after it.
  cluster_sync_all();
  if (split != 0 || nkv <= 0 || nh % nkv != 0 || split_len <= 0) return;
  const int group = nh / nkv;
  const int len = context_lens[seq];
  if (len <= 0) {  // no split ran: the zeros decode_attn_combine would write
    combine_empty(out, partial_out, partial_ml, context_lens, nh, head_dim, split_len, max_splits, kvh * group, group,
                  seq);
    return;
  }
  const int ns = min((len + split_len - 1) / split_len, max_splits);
  if (ns <= 1) return;  // one split wrote out[] itself
  merge_group<DA_THREADS>(ns, out, partial_out, partial_ml, context_lens, nh, head_dim, split_len, max_splits,
                          kvh * group, group, seq, (float*)da_smem);
#endif
}

#define DA_CLUSTER_PARAMS(T)                                                                                         \
  float *out, const float *q, const T *k_pool, const T *v_pool, const int *block_tables, const int *context_lens,    \
      float *partial_out, float *partial_ml, int max_blocks_per_seq, int num_heads, int num_kv_heads, int block_size, \
      int head_dim, int split_len, int max_splits, float scale, unsigned *done, const float *k_scale,                 \
      const float *v_scale
#define DA_CLUSTER_ARGS                                                                                              \
  out, q, k_pool, v_pool, block_tables, context_lens, partial_out, partial_ml, max_blocks_per_seq, num_heads,       \
      num_kv_heads, block_size, head_dim, split_len, max_splits, scale, k_scale, v_scale

extern "C" __global__ void __launch_bounds__(DA_THREADS, 3)
decode_attn_mma_cluster_bf16kv(DA_CLUSTER_PARAMS(unsigned short)) {
  TD_SCOPE("decode_attn_mma_cluster_bf16kv");
  mma_cluster_entry<unsigned short>(DA_CLUSTER_ARGS);
}

extern "C" __global__ void __launch_bounds__(DA_THREADS, 3)
decode_attn_mma_cluster_f32kv(DA_CLUSTER_PARAMS(float)) {
  TD_SCOPE("decode_attn_mma_cluster_f32kv");
  mma_cluster_entry<float>(DA_CLUSTER_ARGS);
}

extern "C" __global__ void __launch_bounds__(DA_THREADS, 3)
decode_attn_mma_cluster_fp8kv(DA_CLUSTER_PARAMS(unsigned char)) {
  TD_SCOPE("decode_attn_mma_cluster_fp8kv");
  mma_cluster_entry<unsigned char>(DA_CLUSTER_ARGS);
}

extern "C" __global__ void __launch_bounds__(DA_THREADS, 3)
decode_attn_mma_bf16kv(float* out, const float* q, const unsigned short* k_pool, const unsigned short* v_pool,
                       const int* block_tables, const int* context_lens, float* partial_out, float* partial_ml,
                       int max_blocks_per_seq, int num_heads, int num_kv_heads, int block_size, int head_dim,
                       int split_len, int max_splits, float scale, unsigned* done, const float* k_scale,
                       const float* v_scale) {
  TD_SCOPE("decode_attn_mma_bf16kv");
  mma_entry<unsigned short>(out, q, k_pool, v_pool, block_tables, context_lens, partial_out, partial_ml,
                            max_blocks_per_seq, num_heads, num_kv_heads, block_size, head_dim, split_len, max_splits,
                            scale, done, k_scale, v_scale);
}

extern "C" __global__ void __launch_bounds__(DA_THREADS, 3)
decode_attn_mma_f32kv(float* out, const float* q, const float* k_pool, const float* v_pool,
                      const int* block_tables, const int* context_lens, float* partial_out, float* partial_ml,
                      int max_blocks_per_seq, int num_heads, int num_kv_heads, int block_size, int head_dim,
                      int split_len, int max_splits, float scale, unsigned* done, const float* k_scale,
                      const float* v_scale) {
  TD_SCOPE("decode_attn_mma_f32kv");
  mma_entry<float>(out, q, k_pool, v_pool, block_tables, context_lens, partial_out, partial_ml, max_blocks_per_seq,
                   num_heads, num_kv_heads, block_size, head_dim, split_len, max_splits, scale, done, k_scale,
                   v_scale);
}

// FP8 pools: the codes are widened with the scales the pool's writer stored. With head_dim 128 a
// stage (two bf16-sized matrices and the scales) is 8320 bytes, so each warp has one stage and
// waits on each tile's loads (head_dim 64: three stages).
extern "C" __global__ void __launch_bounds__(DA_THREADS, 3)
decode_attn_mma_fp8kv(float* out, const float* q, const unsigned char* k_pool, const unsigned char* v_pool,
                      const int* block_tables, const int* context_lens, float* partial_out, float* partial_ml,
                      int max_blocks_per_seq, int num_heads, int num_kv_heads, int block_size, int head_dim,
                      int split_len, int max_splits, float scale, unsigned* done, const float* k_scale,
                      const float* v_scale) {
  TD_SCOPE("decode_attn_mma_fp8kv");
  mma_entry<unsigned char>(out, q, k_pool, v_pool, block_tables, context_lens, partial_out, partial_ml,
                           max_blocks_per_seq, num_heads, num_kv_heads, block_size, head_dim, split_len, max_splits,
                           scale, done, k_scale, v_scale);
}

extern "C" __global__ void __launch_bounds__(DA_COMBINE_THREADS)
decode_attn_combine(float* out, const float* partial_out, const float* partial_ml, const int* context_lens,
                    int num_heads, int head_dim, int split_len, int max_splits) {
  TD_SCOPE("decode_attn_combine");
  // Let the next kernel (the o projection's GEMV, launched with PDL) start fetching its weights;
  // wait for the mma kernel when this one was launched with PDL too (pdl=all).
#if DA_COMBINE_FAST
  da::pdl_trigger();
  const int h = blockIdx.x, seq = blockIdx.y;
  __shared__ float merge_s[2 * DA_COMBINE_THREADS];
#if DA_INDEX_EARLY
  // Every split the registers can hold is loaded on the bound max_splits, and the context length
  // only after those loads: ptxas moves a warp-uniform value to a uniform register right after
  // its load, which waits for it there, so a length loaded first would hold the partials' loads
  // back. The merge declines (and combine_head below decides) for one split, none, or more than
  // it holds.
  da::pdl_wait_only();
  if (h < num_heads && head_dim > 0 && split_len > 0) {
    const int bound = min(max_splits, DA_COMBINE_R * (DA_COMBINE_THREADS / head_dim));
    auto ns_of = [=] {
      const int len = context_lens[seq];
      return len > 0 ? min((len + split_len - 1) / split_len, max_splits) : 0;
    };
    if (combine_group_fast_t<DA_COMBINE_THREADS, 1, DA_COMBINE_R>(out, partial_out, partial_ml, bound, ns_of,
                                                                   num_heads, head_dim, max_splits, h, 1, seq,
                                                                   merge_s))
      return;
  }
#else
  // The context length is the pass's index data, uploaded before it: read before the wait. Then
  // every split's (m, l, O) in one round of loads (combine_group_fast, the same bits).
  const int len = h < num_heads && split_len > 0 ? context_lens[seq] : 0;
  da::pdl_wait_only();
  if (len > 0) {
    const int ns = min((len + split_len - 1) / split_len, max_splits);
    if (ns <= 1) return;  // written by the mma kernel
    if (combine_group_fast<DA_COMBINE_THREADS, 1, DA_COMBINE_R>(out, partial_out, partial_ml, ns, num_heads,
                                                                 head_dim, max_splits, h, 1, seq, merge_s))
      return;
  }
#endif
#else
  da::pdl_start();
#endif
  combine_head(out, partial_out, partial_ml, context_lens, num_heads, head_dim, split_len, max_splits, blockIdx.x,
               blockIdx.y);
}
