// prefill_attention.cu -- tiled (flash-attention style) attention for prompt chunks over the paged
// KV cache, f32 on CUDA cores: the `simt-f32` prefill path.
//
// Why: engine.cu's `attention` runs one block per (token, query head), so a prompt of n tokens
// reads every K/V row about n/2 times per query head: O(n^2 * heads) global reads, no reuse across
// the query heads of one KV head (GQA) nor across neighbouring tokens. Here one block takes a tile
// of PA_ROWS (token, query head) rows -- consecutive tokens of one segment times the query heads
// that share one KV head -- and stages each K/V tile of BN positions in shared memory once for all
// of them: K/V traffic drops by the tile's row count, and the work becomes two register-tiled
// products per K/V tile (S = Q K^T, O += P V) with an online softmax in between.
//
// Self-contained for NVRTC: no #include, bf16 as raw bits. Builds for compute_80, compute_90 and
// compute_120: CUDA cores and cp.async only, no tensor cores, no wgmma, no tcgen05.
//
// Numerics: the function of `attention` and of the CPU reference (models/llama.rs attend_with):
// scores q.k * scale in f32, softmax, p.v accumulated in f32; only the summation order differs.
// With bf16 != 0, q, k, p (after exp) and v are rounded to bf16 (nearest even) as the CPU reference
// rounds them. The CPU reference takes p = exp(s - max) with the row's final max, and rounding p to
// bf16 does not commute with the rescaling of an online softmax, so for bf16 a first pass over the
// K tiles finds every row's max and the main pass then starts from it (every rescale factor is
// exactly 1): the roundings are the reference's. That pass costs a second S = Q K^T; f32 needs none.
// (Rounding is discontinuous: where an f32 score or expf differs from the reference's in its last
// bit, as another summation order or libm makes it, an occasional p lands one bf16 step away, so
// bf16 results agree to 1e-5 .. 4e-5 relative L2, not to ~1e-6 as f32 ones do.)
//
// Measured on an H200 (bench/cuda/prefill_attn_bench.cu, Llama-3.2-1B heads 32/8, hd 64, bs 16):
// one 8192-token prompt in 10.3 ms with f32 (26.6 TFLOP/s, about 40% of the f32 FMA peak; 19.8x
// `attention`), 16.6 ms with bf16; 2.6 ms at 4096 tokens, 0.19 ms at 1024.
//
// Entry points (extern "C", one per head_dim so each gets its own register allocation; all take
// the same arguments, in the order of `attention`'s):
//   prefill_attention_hd32 / _hd64 / _hd128(out, q, k_pool, v_pool, k_scale, v_scale, tables,
//       max_blocks, seg, ctx, hide, tiles, heads, kv_heads, hd, bs, scale, bf16)
//   prefill_attention_bf16kv_hd*, prefill_attention_fp8kv_hd*: the same over a bf16 pool and an
//   FP8 E4M3 pool (k_scale, v_scale: its per-(position, KV head) scales; unused otherwise).
// Other head dims: no entry point; the host uses `attention`.
//
// Inputs as for `attention`: q, out (n, heads, hd) f32; k_pool, v_pool one layer's
// (num_blocks, bs, kv_heads, hd) f32 (bf16 bits, FP8 codes); tables (segments, max_blocks) int; per token t of the batch
// seg[t] (row of tables), ctx[t] (attends positions 0 .. ctx[t]-1), hide[t] (one position masked
// out, or -1). q, out, k_pool and v_pool must be 16-byte aligned (cudaMalloc'd, or offsets a
// multiple of 4 floats): rows are moved as 16-byte vectors. Any block size bs >= 1 works. The
// K/V rows of every position below a tile's largest ctx are read (masked ones times p = 0, the
// hidden position included), so they must be finite, as written KV is.
//
// The tile list, built by the host: tiles = int[num_tiles][2], tile i = (t0, count), the batch
// tokens t0 .. t0+count-1.
//   - 1 <= count <= PA_ROWS / (heads / kv_heads) (the tile's tokens times the group's query heads
//     fit in PA_ROWS = 64 rows: 64 tokens at group 1, 16 at 4, 8 at 8, floor(64/g) otherwise);
//   - all tokens of a tile are in one segment (same seg[]: one block table per tile);
//   - every token that needs an output is in exactly one tile (tokens in none are not written).
//   Each token is masked by its own ctx and hide, so nothing else is required for correctness. For
//   speed: a tile's K/V range is its largest ctx, so a tile should be consecutive positions of one
//   prefill chunk (split every run of consecutive same-segment tokens from its start into pieces
//   of PA_ROWS / group tokens; a decode token is a tile of one), and tiles should come in order of
//   decreasing largest ctx (longest first: the grid then ends without a long tail).
//
// Launch: grid (num_tiles * kv_heads) -- block b is tile b / kv_heads, KV head b % kv_heads --,
// block PA_THREADS (256), dynamic shared memory PA_SMEM_BYTES(hd, PA_BN(hd)):
//   hd 32: BN 64, 45056 B;  hd 64: BN 64, 69632 B;  hd 128: BN 32, 76800 B
// (raise the function's MAX_DYNAMIC_SHARED_SIZE_BYTES to it first). A launch that breaks these
// rules (wrong hd, block size, too little shared memory, heads % kv_heads != 0, a count out of
// range) returns without writing anything, and never reads out of bounds.

// Tracing hooks (kernels/trace.cu, which the engine puts in front of every module); a standalone
// compile without it traces nothing.
#ifndef TD_SCOPE
#define TD_SCOPE(name)
#define TD_WAITED()
#endif

#define PA_THREADS 256
#define PA_ROWS 64
#define PA_BN(hd) ((hd) <= 64 ? 64 : 32)
#define PA_SMEM_BYTES(hd, bn) (4 * ((PA_ROWS + 2 * (bn)) * ((hd) + 4) + PA_ROWS * ((bn) + 4)))

namespace pa {

__device__ __forceinline__ float neg_inf() { return __uint_as_float(0xff800000u); }

// Round to the nearest bf16, ties to even; NaN stays NaN (engine.cu's round_bf16).
__device__ __forceinline__ float round_bf16(float x) {
    unsigned int b = __float_as_uint(x);
    if ((b & 0x7fffffffu) > 0x7f800000u) return x;
    return __uint_as_float((b + 0x7fffu + ((b >> 16) & 1u)) & 0xffff0000u);
}

__device__ __forceinline__ float4 round_bf16(float4 v) {
    return make_float4(round_bf16(v.x), round_bf16(v.y), round_bf16(v.z), round_bf16(v.w));
}

// Max over the 16 lanes of a half warp (the 16 threads that share a row, see the thread map).
__device__ __forceinline__ float max16(float v) {
    for (int o = 8; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

__device__ __forceinline__ float sum16(float v) {
    for (int o = 8; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ unsigned smem_u32(const void* p) {
    unsigned r;
    asm volatile("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(r) : "l"(p));
    return r;
}

// 16 bytes global -> shared, bypassing L1 (K/V rows are shared between blocks through L2).
// src_bytes 0: the 16 bytes are zero-filled and nothing is read.
__device__ __forceinline__ void cp_async16(float* dst, const float* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(dst)), "l"(src),
                 "r"(src_bytes)
                 : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// VEC (4 or 2) consecutive floats.
template <int VEC>
__device__ __forceinline__ void ld_vec(const float* p, float* v) {
    if constexpr (VEC == 4) {
        float4 t = *reinterpret_cast<const float4*>(p);
        v[0] = t.x;
        v[1] = t.y;
        v[2] = t.z;
        v[3] = t.w;
    } else {
        float2 t = *reinterpret_cast<const float2*>(p);
        v[0] = t.x;
        v[1] = t.y;
    }
}
template <int VEC>
__device__ __forceinline__ void st_vec(float* p, const float* v) {
    if constexpr (VEC == 4)
        *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
    else
        *reinterpret_cast<float2*>(p) = make_float2(v[0], v[1]);
}

// Shared-memory geometry of one <HD, BN> variant, in floats. Q, K and V rows are padded by 4
// floats so that the 8 lanes of one 16-byte access phase, which read 8 different K rows at the
// same column, hit 8 different bank groups.
template <int HD, int BN>
struct Geo {
    static constexpr int RS = HD + 4;                // row stride of Q, K, V
    static constexpr int PS = BN + 4;                // row stride of P
    static constexpr int K_OFF = PA_ROWS * RS;
    static constexpr int V_OFF = K_OFF + BN * RS;
    static constexpr int P_OFF = V_OFF + BN * RS;
    static constexpr int FLOATS = P_OFF + PA_ROWS * PS;
    static constexpr int CPR = HD / 4;               // 16-byte chunks per K/V row
    static constexpr int CHUNKS = BN * CPR / PA_THREADS;  // chunks per thread per K/V tile
    static_assert(4 * FLOATS == PA_SMEM_BYTES(HD, BN), "PA_SMEM_BYTES out of step");
    static_assert(BN * CPR % PA_THREADS == 0, "K/V tile not a whole number of chunks per thread");
    static_assert(4 * FLOATS <= 99 * 1024, "over sm_120's 99 KB of shared memory per block");
};

// Stages 4 consecutive pool elements (f32; bf16 bits from a kv_dtype=bf16 pool; FP8 E4M3 codes
// of a row with this scale from a kv_dtype=fp8-e4m3 pool) as f32 in shared memory; ok false:
// zeros, nothing read. f32 goes through cp.async (complete after the thread's wait_group); the
// packed types are loaded and widened by the thread itself, so they are in place before the same
// wait_group and barrier that publish the cp.async chunks.
__device__ __forceinline__ void stage4(float* dst, const float* src, bool ok, float) {
    cp_async16(dst, src, ok ? 16 : 0);
}
__device__ __forceinline__ void stage4(float* dst, const unsigned short* src, bool ok, float) {
    uint2 b = ok ? *reinterpret_cast<const uint2*>(src) : make_uint2(0u, 0u);
    *reinterpret_cast<float4*>(dst) = make_float4(__uint_as_float(b.x << 16), __uint_as_float(b.x & 0xffff0000u),
                                                  __uint_as_float(b.y << 16), __uint_as_float(b.y & 0xffff0000u));
}
// engine.cu's fp8_e4m3_value (this file is compiled on its own).
__device__ __forceinline__ float fp8_value(unsigned int c) {
    unsigned int e = (c >> 3) & 15u, m = c & 7u;
    float a;
    if (e == 15u && m == 7u)
        a = __uint_as_float(0x7fc00000u);
    else if (e == 0u)
        a = (float)m * 0.001953125f;
    else
        a = __uint_as_float(((e + 120u) << 23) | (m << 20));
    return (c & 0x80u) ? -a : a;
}
__device__ __forceinline__ void stage4(float* dst, const unsigned char* src, bool ok, float scale) {
    if (!ok) {
        *reinterpret_cast<float4*>(dst) = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        return;
    }
    unsigned int b = *reinterpret_cast<const unsigned int*>(src);
    *reinterpret_cast<float4*>(dst) = make_float4(fp8_value(b & 0xffu) * scale, fp8_value((b >> 8) & 0xffu) * scale,
                                                  fp8_value((b >> 16) & 0xffu) * scale, fp8_value(b >> 24) * scale);
}

// Gathers positions j0 .. j0+BN-1 of KV head kvh into a staged tile (row c = position j0 + c),
// through the block table; positions >= kv_end are zero-filled, never read.
template <int HD, int BN, typename KV>
__device__ __forceinline__ void issue_tile(float* dst, const KV* __restrict__ pool, const float* __restrict__ scales,
                                           const int* __restrict__ table, int j0, int kv_end, int bs, int kv_dim,
                                           int kvh) {
    typedef Geo<HD, BN> G;
#pragma unroll
    for (int k = 0; k < G::CHUNKS; ++k) {
        const int idx = threadIdx.x + PA_THREADS * k;
        const int c = idx / G::CPR, c4 = idx % G::CPR;
        const int j = j0 + c;
        const bool ok = j < kv_end;
        const KV* src = pool;
        float scale = 1.0f;
        if (ok) {
            const size_t row = ((size_t)table[j / bs] * bs + j % bs) * kv_dim + (size_t)kvh * HD;
            src += row + 4 * c4;
            if constexpr (sizeof(KV) == 1) scale = scales[row / HD];
        }
        stage4(dst + c * G::RS + 4 * c4, src, ok, scale);
    }
}

// bf16: rounds in place the chunks this thread staged (its own cp.async writes are complete
// after its wait_group, so no barrier is needed before; one is needed after).
template <int HD, int BN>
__device__ __forceinline__ void round_own_chunks(float* tile) {
    typedef Geo<HD, BN> G;
#pragma unroll
    for (int k = 0; k < G::CHUNKS; ++k) {
        const int idx = threadIdx.x + PA_THREADS * k;
        float4* p = reinterpret_cast<float4*>(tile + (idx / G::CPR) * G::RS + 4 * (idx % G::CPR));
        *p = round_bf16(*p);
    }
}

// Thread map: tx = tid % 16, ty = tid / 16. The thread holds rows ty + 16 i (i < 4) of the tile
// (for S and for O alike, so the softmax state stays in registers), S columns tx + 16 j
// (j < BN/16) and O columns tx*VEC + 16*VEC*v (VEC consecutive, v < HD/16/VEC). The 16 threads of
// a row are one half warp, so row reductions are 4 shuffles.

// s[i][j] = Q[ty + 16 i] . K[tx + 16 j] over HD, then scale and the mask: -inf where the position
// is at or past the row's ctx, or is its hidden position.
template <int HD, int BN>
__device__ __forceinline__ void scores(const float* Qs, const float* Ks, float (&s)[4][BN / 16], int j0,
                                       const int (&rctx)[4], const int (&rhide)[4], float scale) {
    typedef Geo<HD, BN> G;
    constexpr int CPT = BN / 16;
    const int tx = threadIdx.x & 15, ty = threadIdx.x >> 4;
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < CPT; ++j) s[i][j] = 0.0f;
#pragma unroll 1  // unrolled further, ptxas spills at the 128-register cap of 2 blocks per SM
    for (int d = 0; d < HD; d += 4) {
        float4 a[4], b[CPT];
#pragma unroll
        for (int i = 0; i < 4; ++i) a[i] = *reinterpret_cast<const float4*>(Qs + (ty + 16 * i) * G::RS + d);
#pragma unroll
        for (int j = 0; j < CPT; ++j) b[j] = *reinterpret_cast<const float4*>(Ks + (tx + 16 * j) * G::RS + d);
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int j = 0; j < CPT; ++j) {
                s[i][j] += a[i].x * b[j].x;
                s[i][j] += a[i].y * b[j].y;
                s[i][j] += a[i].z * b[j].z;
                s[i][j] += a[i].w * b[j].w;
            }
    }
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < CPT; ++j) {
            const int pos = j0 + tx + 16 * j;
            s[i][j] = (pos < rctx[i] && pos != rhide[i]) ? s[i][j] * scale : neg_inf();
        }
}

template <int HD, int BN, typename KV>
__device__ __forceinline__ void prefill(float* __restrict__ out, const float* __restrict__ q,
                                        const KV* __restrict__ k_pool, const KV* __restrict__ v_pool,
                                        const float* __restrict__ k_scale, const float* __restrict__ v_scale,
                                        const int* __restrict__ tables, int max_blocks, const int* __restrict__ seg,
                                        const int* __restrict__ ctx, const int* __restrict__ hide,
                                        const int* __restrict__ tiles, int heads, int kv_heads, int hd, int bs,
                                        float scale, int bf16, float* smem) {
    typedef Geo<HD, BN> G;
    constexpr int CPT = BN / 16, DPT = HD / 16, VEC = DPT < 4 ? DPT : 4, NV = DPT / VEC;
    __shared__ int s_kv_end;

    if (hd != HD || blockDim.x != PA_THREADS || kv_heads <= 0 || heads % kv_heads != 0 || bs <= 0) return;
    unsigned dyn_smem;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn_smem));
    if (dyn_smem < 4u * G::FLOATS) return;
    const int group = heads / kv_heads;
    const int tile = blockIdx.x / kv_heads, kvh = blockIdx.x % kv_heads;
    const int t0 = tiles[2 * tile], count = tiles[2 * tile + 1];
    if (group > PA_ROWS || count < 1 || count > PA_ROWS / group) return;  // uniform over the block

    float* Qs = smem;
    float* Ks = smem + G::K_OFF;
    float* Vs = smem + G::V_OFF;
    float* Ps = smem + G::P_OFF;
    const int tid = threadIdx.x, tx = tid & 15, ty = tid >> 4;
    const int kv_dim = kv_heads * HD;
    const int* table = tables + (size_t)seg[t0] * max_blocks;

    // Row r of the tile is token t0 + r / group, query head kvh * group + r % group; rows past the
    // tile's tokens have ctx 0 (everything masked) and are not written.
    if (tid == 0) s_kv_end = 0;
    for (int idx = tid; idx < PA_ROWS * G::CPR; idx += PA_THREADS) {
        const int r = idx / G::CPR, c4 = idx % G::CPR, tl = r / group;
        float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (tl < count) {
            v = *reinterpret_cast<const float4*>(q + ((size_t)(t0 + tl) * heads + kvh * group + r % group) * HD + 4 * c4);
            if (bf16) v = round_bf16(v);
        }
        *reinterpret_cast<float4*>(Qs + r * G::RS + 4 * c4) = v;
    }
    int rctx[4], rhide[4], my_end = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int tl = (ty + 16 * i) / group;
        rctx[i] = tl < count ? ctx[t0 + tl] : 0;
        rhide[i] = tl < count ? hide[t0 + tl] : -1;
        my_end = max(my_end, rctx[i]);
    }
    __syncthreads();
    if (my_end > 0) atomicMax(&s_kv_end, my_end);
    __syncthreads();
    const int kv_end = s_kv_end;  // causal: no position at or past the tile's largest ctx is read
    const int ntiles = (kv_end + BN - 1) / BN;

    float m[4], l[4], o[4][DPT];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        m[i] = neg_inf();
        l[i] = 0.0f;
#pragma unroll
        for (int e = 0; e < DPT; ++e) o[i][e] = 0.0f;
    }
    float s[4][CPT];

    if (bf16) {
        // Pass 1: every row's max score. K tiles only, double-buffered in the K and V regions.
        issue_tile<HD, BN, KV>(Ks, k_pool, k_scale, table, 0, kv_end, bs, kv_dim, kvh);
        cp_async_commit();
        for (int it = 0; it < ntiles; ++it) {
            float* cur = (it & 1) ? Vs : Ks;
            if (it + 1 < ntiles) issue_tile<HD, BN, KV>((it & 1) ? Ks : Vs, k_pool, k_scale, table, (it + 1) * BN, kv_end, bs, kv_dim, kvh);
            cp_async_commit();
            cp_async_wait<1>();
            round_own_chunks<HD, BN>(cur);
            __syncthreads();
            scores<HD, BN>(Qs, cur, s, it * BN, rctx, rhide, scale);
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                float mx = s[i][0];
#pragma unroll
                for (int j = 1; j < CPT; ++j) mx = fmaxf(mx, s[i][j]);
                m[i] = fmaxf(m[i], max16(mx));
            }
            __syncthreads();  // `cur` is refilled two iterations on
        }
        cp_async_wait<0>();
    }

    // Main pass. One K and one V buffer, staged alternately: K(it+1) loads while P V of tile it
    // runs, V(it+1) while S of tile it+1 runs. Groups in flight at the top of iteration it:
    // K(it), V(it).
    issue_tile<HD, BN, KV>(Ks, k_pool, k_scale, table, 0, kv_end, bs, kv_dim, kvh);
    cp_async_commit();
    issue_tile<HD, BN, KV>(Vs, v_pool, v_scale, table, 0, kv_end, bs, kv_dim, kvh);
    cp_async_commit();
    for (int it = 0; it < ntiles; ++it) {
        const int j0 = it * BN;
        cp_async_wait<1>();  // K(it)
        if (bf16) round_own_chunks<HD, BN>(Ks);
        __syncthreads();
        scores<HD, BN>(Qs, Ks, s, j0, rctx, rhide, scale);
        __syncthreads();  // every thread is done with Ks
        if (it + 1 < ntiles) issue_tile<HD, BN, KV>(Ks, k_pool, k_scale, table, j0 + BN, kv_end, bs, kv_dim, kvh);
        cp_async_commit();

        // Online softmax per row. A row with nothing unmasked yet keeps m = -inf, l = 0, o = 0.
        // With bf16, m already holds the row's final max, so mn == m and corr == 1 exactly.
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            float mx = s[i][0];
#pragma unroll
            for (int j = 1; j < CPT; ++j) mx = fmaxf(mx, s[i][j]);
            const float mn = fmaxf(m[i], max16(mx));
            const float corr = mn == neg_inf() ? 1.0f : expf(m[i] - mn);
            float psum = 0.0f;
#pragma unroll
            for (int j = 0; j < CPT; ++j) {
                const float p = s[i][j] == neg_inf() ? 0.0f : expf(s[i][j] - mn);
                psum += p;
                Ps[(ty + 16 * i) * G::PS + tx + 16 * j] = bf16 ? round_bf16(p) : p;
            }
            l[i] = l[i] * corr + psum;  // this thread's columns; summed over the half warp at the end
            m[i] = mn;
#pragma unroll
            for (int e = 0; e < DPT; ++e) o[i][e] *= corr;
        }

        cp_async_wait<1>();  // V(it)
        if (bf16) round_own_chunks<HD, BN>(Vs);
        __syncthreads();  // V(it) and P visible to all
#pragma unroll 2
        for (int c = 0; c < BN; c += 4) {
            float4 p4[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) p4[i] = *reinterpret_cast<const float4*>(Ps + (ty + 16 * i) * G::PS + c);
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) {
                const float* vrow = Vs + (c + kk) * G::RS + tx * VEC;
#pragma unroll
                for (int v = 0; v < NV; ++v) {
                    float vv[VEC];
                    ld_vec<VEC>(vrow + 16 * VEC * v, vv);
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        const float pk = kk == 0 ? p4[i].x : kk == 1 ? p4[i].y : kk == 2 ? p4[i].z : p4[i].w;
#pragma unroll
                        for (int e = 0; e < VEC; ++e) o[i][VEC * v + e] += pk * vv[e];
                    }
                }
            }
        }
        __syncthreads();  // every thread is done with Vs and Ps
        if (it + 1 < ntiles) issue_tile<HD, BN, KV>(Vs, v_pool, v_scale, table, j0 + BN, kv_end, bs, kv_dim, kvh);
        cp_async_commit();
    }
    cp_async_wait<0>();

#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int r = ty + 16 * i, tl = r / group;
        const float inv = 1.0f / sum16(l[i]);  // as `attention`: a row with nothing unmasked gives NaN
        if (tl < count) {
            float* orow = out + ((size_t)(t0 + tl) * heads + kvh * group + r % group) * HD + tx * VEC;
#pragma unroll
            for (int v = 0; v < NV; ++v) {
                float w[VEC];
#pragma unroll
                for (int e = 0; e < VEC; ++e) w[e] = o[i][VEC * v + e] * inv;
                st_vec<VEC>(orow + 16 * VEC * v, w);
            }
        }
    }
}

}  // namespace pa

// The entry points, one per head_dim (written out, not generated, so a reader and the engine's
// entry-point test can find them).
#define PA_ARGS(KV)                                                                                \
    float *out, const float *q, const KV *k_pool, const KV *v_pool, const float *k_scale,         \
        const float *v_scale, const int *tables,                                                   \
        int max_blocks, const int *seg, const int *ctx, const int *hide, const int *tiles,        \
        int heads, int kv_heads, int hd, int bs, float scale, int bf16
#define PA_CALL(HD)                                                                                \
    extern __shared__ __align__(16) float pa_smem[];                                               \
    pa::prefill<HD, PA_BN(HD)>(out, q, k_pool, v_pool, k_scale, v_scale, tables, max_blocks, seg, ctx, hide, tiles,  \
                               heads, kv_heads, hd, bs, scale, bf16, pa_smem)

extern "C" __global__ void __launch_bounds__(PA_THREADS, 2) prefill_attention_hd32(PA_ARGS(float)) {
    TD_SCOPE("prefill_attention_hd32");
    PA_CALL(32);
}
extern "C" __global__ void __launch_bounds__(PA_THREADS, 2) prefill_attention_hd64(PA_ARGS(float)) {
    TD_SCOPE("prefill_attention_hd64");
    PA_CALL(64);
}
extern "C" __global__ void __launch_bounds__(PA_THREADS, 2) prefill_attention_hd128(PA_ARGS(float)) {
    TD_SCOPE("prefill_attention_hd128");
    PA_CALL(128);
}
// The same over a kv_dtype=bf16 pool (K/V as bf16 bits, widened to f32 as staged).
extern "C" __global__ void __launch_bounds__(PA_THREADS, 2) prefill_attention_bf16kv_hd32(PA_ARGS(unsigned short)) {
    TD_SCOPE("prefill_attention_bf16kv_hd32");
    PA_CALL(32);
}
extern "C" __global__ void __launch_bounds__(PA_THREADS, 2) prefill_attention_bf16kv_hd64(PA_ARGS(unsigned short)) {
    TD_SCOPE("prefill_attention_bf16kv_hd64");
    PA_CALL(64);
}
extern "C" __global__ void __launch_bounds__(PA_THREADS, 2) prefill_attention_bf16kv_hd128(PA_ARGS(unsigned short)) {
    TD_SCOPE("prefill_attention_bf16kv_hd128");
    PA_CALL(128);
}

// The same over a kv_dtype=fp8-e4m3 pool (codes and per-row scales, widened to f32 as staged).
extern "C" __global__ void __launch_bounds__(PA_THREADS, 2) prefill_attention_fp8kv_hd32(PA_ARGS(unsigned char)) {
    TD_SCOPE("prefill_attention_fp8kv_hd32");
    PA_CALL(32);
}
extern "C" __global__ void __launch_bounds__(PA_THREADS, 2) prefill_attention_fp8kv_hd64(PA_ARGS(unsigned char)) {
    TD_SCOPE("prefill_attention_fp8kv_hd64");
    PA_CALL(64);
}
extern "C" __global__ void __launch_bounds__(PA_THREADS, 2) prefill_attention_fp8kv_hd128(PA_ARGS(unsigned char)) {
    TD_SCOPE("prefill_attention_fp8kv_hd128");
    PA_CALL(128);
}

#undef PA_CALL
#undef PA_ARGS
