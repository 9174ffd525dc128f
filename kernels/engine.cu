// tapedeck engine kernels for the CUDA backend (engine/src/cuda), compiled at run time by NVRTC
// for the GPU found (a virtual compute_XX target, so the PTX carries forward to newer chips).
//
// Self-contained on purpose: no #include, so NVRTC needs no header search path on the user's
// machine. bf16 is handled as raw bits. Every kernel computes the same function as the CPU
// reference in engine/src (numerics.rs, models/llama.rs): the same formulas, the same roundings for
// the reduced-precision toggles (bf16 round-to-nearest-even, FP8 E4M3 with a per-head amax/448
// scale), f32 accumulation. Only summation order differs, so f32 results agree to ~1e-6 relative.
//
// Layouts (row-major): activations (tokens, features); KV pool per layer
// (num_blocks, block_size, kv_heads, head_dim) as f32 holding what the cache dtype would hold;
// block tables (segments, max_blocks) as int.

// Tracing hooks (kernels/trace.cu, which the engine puts in front of every module); a standalone
// compile without it traces nothing.
#ifndef TD_SCOPE
#define TD_SCOPE(name)
#define TD_WAITED()
#define TD_MARK(k)
#endif

typedef unsigned short bf16_t;

#define NEG_INF (__uint_as_float(0xff800000u))

// Round to the nearest bf16, ties to even; NaN stays NaN (as numerics::round_bf16).
__device__ __forceinline__ float round_bf16(float x) {
    unsigned int b = __float_as_uint(x);
    if ((b & 0x7fffffffu) > 0x7f800000u) return x;
    unsigned int r = (b + 0x7fffu + ((b >> 16) & 1u)) & 0xffff0000u;
    return __uint_as_float(r);
}

__device__ __forceinline__ bf16_t f32_to_bf16_bits(float x) {
    return (bf16_t)(__float_as_uint(round_bf16(x)) >> 16);
}

// Two f32 rounded as f32_to_bf16_bits, packed: `lo` in bits 0..15.
__device__ __forceinline__ unsigned int bf16x2_bits(float lo, float hi) {
    return (unsigned int)f32_to_bf16_bits(lo) | ((unsigned int)f32_to_bf16_bits(hi) << 16);
}

// Round to the nearest FP8 E4M3 (e4m3fn) value, ties to even, saturating at +-448
// (as numerics::round_fp8_e4m3).
__device__ __forceinline__ float round_fp8_e4m3(float x) {
    if (isnan(x)) return x;
    float a = fabsf(x);
    if (a >= 448.0f) return copysignf(448.0f, x);
    int e = (a < 1.17549435e-38f) ? -126 : (int)(__float_as_uint(a) >> 23) - 127;
    int qe = max(e, -6) - 3;
    float quantum = __uint_as_float((unsigned int)(qe + 127) << 23);
    float r = rintf(a / quantum) * quantum;
    return copysignf(fminf(r, 448.0f), x);
}

typedef unsigned char fp8_t;

// The value of an FP8 E4M3 (e4m3fn) code: 0x7f and 0xff are NaN, there are no infinities
// (numerics::fp8_e4m3_value).
__device__ __forceinline__ float fp8_e4m3_value(unsigned int c) {
    unsigned int e = (c >> 3) & 15u, m = c & 7u;
    float a;
    if (e == 15u && m == 7u)
        a = __uint_as_float(0x7fc00000u);
    else if (e == 0u)
        a = (float)m * 0.001953125f;  // subnormal: m * 2^-9
    else
        a = __uint_as_float(((e + 120u) << 23) | (m << 20));
    return (c & 0x80u) ? -a : a;
}

// The code of round_fp8_e4m3(x) (numerics::fp8_e4m3_bits).
__device__ __forceinline__ fp8_t fp8_e4m3_bits(float x) {
    float r = round_fp8_e4m3(x);
    if (isnan(r)) return 0x7f;
    unsigned int sign = signbit(r) ? 0x80u : 0u;
    float a = fabsf(r);
    if (a == 0.0f) return (fp8_t)sign;
    if (a < 0.015625f) return (fp8_t)(sign | (unsigned int)(a * 512.0f));  // a multiple of 2^-9
    unsigned int b = __float_as_uint(a);
    return (fp8_t)(sign | ((((b >> 23) - 120u) & 15u) << 3) | ((b >> 20) & 7u));
}

// The scale of one head of FP8 E4M3 KV storage: amax / 448; 0 for an all-zero head (its codes
// keep the signs), NaN when amax is not finite (the head reads NaN), as kv_host.rs stores it.
__device__ __forceinline__ float fp8_head_scale(float amax) {
    if (amax == 0.0f) return 0.0f;
    return isfinite(amax) ? amax / 448.0f : __uint_as_float(0x7fc00000u);
}

// The FP8 code of x in a head of this scale, and in *value what the pool reads back for it
// (code value * scale; x itself, a signed zero, for an all-zero head).
__device__ __forceinline__ fp8_t fp8_store(float x, float scale, float* value) {
    if (scale == 0.0f) {
        *value = x;
        return signbit(x) ? 0x80 : 0;
    }
    if (isnan(scale)) {
        *value = scale;
        return 0x7f;
    }
    fp8_t c = fp8_e4m3_bits(x / scale);
    *value = fp8_e4m3_value(c) * scale;
    return c;
}

// One element of a KV pool, whose storage is f32 (any kv_dtype, held as f32 of the rounded
// value), bf16 bits (a kv_dtype=bf16 pool, half the bytes) or FP8 E4M3 codes with one f32 scale
// per token and KV head (a kv_dtype=fp8-e4m3 pool). The kernels that read or write the pool are
// templates over the element type, instantiated for each (the `_bf16kv` and `_fp8kv` entry
// points); a packed pool only ever receives values already rounded to its type, so all three
// read back the same f32 bits. Readers take the row's scale once (kv_row_scale: 1 but for FP8)
// and pass it to every kv_get of the row.
__device__ __forceinline__ float kv_row_scale(const float*, const float*, size_t, int) { return 1.0f; }
__device__ __forceinline__ float kv_row_scale(const bf16_t*, const float*, size_t, int) { return 1.0f; }
__device__ __forceinline__ float kv_row_scale(const fp8_t*, const float* scales, size_t off, int hd) {
    return scales[off / hd];
}
__device__ __forceinline__ float kv_get(const float* p, size_t i, float) { return p[i]; }
__device__ __forceinline__ float kv_get(const bf16_t* p, size_t i, float) {
    return __uint_as_float((unsigned int)p[i] << 16);
}
__device__ __forceinline__ float kv_get(const fp8_t* p, size_t i, float scale) {
    return fp8_e4m3_value(p[i]) * scale;
}
__device__ __forceinline__ void kv_put(float* p, size_t i, float x) { p[i] = x; }
__device__ __forceinline__ void kv_put(bf16_t* p, size_t i, float x) { p[i] = f32_to_bf16_bits(x); }

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
__device__ float block_sum(float v, float* shared32) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) shared32[warp] = v;
    __syncthreads();
    float t = lane < warps ? shared32[lane] : 0.0f;
    return warp_sum(t);
}

// block_sum over a block of 256 threads, computed by a block of 256 / V threads each holding V
// of the values (value j of thread t is virtual thread t + j * blockDim's): the same bits, as
// the warp sums and the sum of the 8 warp sums are the same operations on the same values.
template <int V>
__device__ float block_sum_as_256(const float (&v)[V], float* shared32) {
    if (V == 1) return block_sum(v[0], shared32);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    float s[V];
#pragma unroll
    for (int j = 0; j < V; j++) s[j] = warp_sum(v[j]);
    __syncthreads();
    if (lane == 0) {
#pragma unroll
        for (int j = 0; j < V; j++) shared32[warp + j * warps] = s[j];
    }
    __syncthreads();
    float t = lane < V * warps ? shared32[lane] : 0.0f;
    return warp_sum(t);
}

__device__ float block_max(float v, float* shared32) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) shared32[warp] = v;
    __syncthreads();
    float t = lane < warps ? shared32[lane] : 0.0f;
    return warp_max(t);
}

// Programmatic dependent launch (sm_90+; no-ops before): a kernel launched with the
// programmatic-stream-serialization attribute may start while the kernel before it still runs,
// once every block of that kernel has called pdl_launch_dependents. It must call pdl_wait before
// it reads anything an earlier kernel wrote, and write nothing before; pdl_wait returns once the
// kernel before it has completed (and so, transitively, every earlier one). The GEMV kernels
// prefetch their weights (constant) first, then wait: the weight fetch overlaps the previous
// kernel's tail and the launch latency. Kernels that pdl=all also launches this way (RoPE + KV
// write, decode attention and its merge, the final RMSNorm, the token pick) trigger and wait at
// their start: launched normally, both are no-ops.
__device__ __forceinline__ void pdl_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
    TD_WAITED();
}

// 1: a GEMV that normalizes its input first (the q/k/v GEMV, gate/up, the head) asks for the
// RMSNorm weights before its PDL wait (norm_prefetch), into L1; 2: into L2 only. The norm reads
// them only after the wait, the residual's load and the block reduction: without it that read
// is one more dependent round trip to memory (a layer's norm weights are not in L2 by then: a
// whole step's weights stream past), on the critical path of every block whose GEMV weights
// are already in registers. Numerically a no-op (the same loads, earlier in the cache).
// On by default since session 25 (H100, batch-1 decode, with the two knobs below: 914 -> 935
// tok/s; this one alone 921, into L2 only with the other two 934.5). A sweep knob
// (TAPEDECK_NVRTC_DEFINES=NORM_PREFETCH=0|1|2).
#ifndef NORM_PREFETCH
#define NORM_PREFETCH 1
#endif
__device__ __forceinline__ void norm_prefetch(const float* w, int in) {
#if NORM_PREFETCH
    if (!w) return;
    // One 128-byte line (32 floats) a thread.
    for (int i = threadIdx.x * 32; i < in; i += blockDim.x * 32) {
#if NORM_PREFETCH == 2
        asm volatile("prefetch.L2 [%0];" ::"l"(w + i));
#else
        asm volatile("prefetch.L1 [%0];" ::"l"(w + i));
#endif
    }
#endif
}

__device__ __forceinline__ void pdl_launch_dependents() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// A load that orders every later load of this thread after it at GPU scope (the acquire half
// of a counter handshake between blocks: the writer's __threadfence + atomicAdd is the release).
__device__ __forceinline__ unsigned ld_acquire_u32(const unsigned* p) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// Strides of a block-wide row loop whose loads are issued together. A plain
// `for (i = threadIdx.x; i < d; i += blockDim.x)` loop is not unrolled by NVRTC when d is a
// run-time value, so each stride waited for its load before issuing the next: eight dependent
// round trips for a 2048-wide row, ~10 µs for one RMSNorm on an H100 (kernel trace, twelfth
// session). The loops below load NORM_UNROLL strides into registers first and then use them in
// the original order, so every sum is accumulated exactly as before (same bits).
// TAPEDECK_NVRTC_DEFINES=NORM_UNROLL=1 restores the one-stride loops, for timing.
#ifndef NORM_UNROLL
#define NORM_UNROLL 8
#endif

// o = row, `h` floats, by the block (several strides' loads issued before their stores).
__device__ __forceinline__ void copy_row(float* o, const float* row, int h) {
    for (int base = threadIdx.x; base < h; base += NORM_UNROLL * blockDim.x) {
        float v[NORM_UNROLL];
#pragma unroll
        for (int u = 0; u < NORM_UNROLL; u++) {
            int i = base + u * blockDim.x;
            v[u] = i < h ? row[i] : 0.0f;
        }
#pragma unroll
        for (int u = 0; u < NORM_UNROLL; u++) {
            int i = base + u * blockDim.x;
            if (i < h) o[i] = v[u];
        }
    }
}

// out (n, h) = table[ids[i]] rows. grid (n), block 256.
extern "C" __global__ void embed_gather(float* out, const float* table, const unsigned int* ids,
                                        int h) {
    TD_SCOPE("embed_gather");
    pdl_launch_dependents();
    copy_row(out + (size_t)blockIdx.x * h, table + (size_t)ids[blockIdx.x] * h, h);
}

// A pass's token embeddings: embed_gather, except that an id of FED_TOKEN (0xffffffff) takes
// the token at fed[0] instead, the word the previous pass's token pick wrote (its first pick
// row's token): a decode step submitted before the step ahead of it was read back (the engine's
// run-ahead decode) is fed that step's token on the device. `fed` may be null where no id is
// FED_TOKEN. grid (n), block 256.
#define FED_TOKEN 0xffffffffu
// The offset of token `id`'s row in an embedding table of rows of h: the token at fed[0] where
// id is FED_TOKEN (fed is read only then). Also the first q/k/v kernel's choice where it gathers
// the embedding itself (TAPEDECK_EMBED_FUSED).
__device__ __forceinline__ size_t embed_row_of(unsigned int id, const unsigned int* fed, int h) {
    return (size_t)(id == FED_TOKEN ? fed[0] : id) * h;
}
extern "C" __global__ void embed_tokens(float* out, const float* table, const unsigned int* ids,
                                        int h, const unsigned int* fed) {
    TD_SCOPE("embed_tokens");
    pdl_launch_dependents();
    copy_row(out + (size_t)blockIdx.x * h, table + embed_row_of(ids[blockIdx.x], fed, h), h);
}

// The RMSNorm of N rows of `in` values (x row-major) as a block of 256 threads computes it, by a
// block of T = 256 or 128 threads, as every kernel here computes it (the rms_norm kernel, the
// GEMVs' fused prologue, the persistent step), so they all give the same bits: each of 256
// (virtual) threads' sum of squares over i = tid, tid + 256, ... in that order, the block
// reduction (block_sum_as_256), x * inv * w. With T = 128 each thread plays virtual threads tid
// and tid + 128 (the GEMVs' 4-warp blocks, TAPEDECK_GEMV_BLOCK=4). The loads of several strides of all rows are issued
// before any is used (about NORM_UNROLL values per row and pass; fewer strides per batch for more
// rows keep the registers in check, as the GEMVs' prefetched weights are live across it), so the
// norm waits on memory three or four times instead of 2 * in / 256. store(r, i, y) receives
// each normalized value.
template <int N, int T = 256, typename Store>
__device__ __forceinline__ void rms_norm_rows(const float* x, const float* w, float eps, int in,
                                              Store store) {
    static_assert(T == 256 || T == 128, "a block of 256 or 128 threads");
    constexpr int V = 256 / T;  // virtual threads per thread
    constexpr int U1 = NORM_UNROLL / N / V > 1 ? NORM_UNROLL / N / V : 1;
    constexpr int U2 = NORM_UNROLL / 2 / N > 1 ? NORM_UNROLL / 2 / N : 1;
    __shared__ float s32[32];
    float ss[N][V], inv[N];
#pragma unroll
    for (int r = 0; r < N; r++) {
#pragma unroll
        for (int j = 0; j < V; j++) ss[r][j] = 0.0f;
    }
    for (int base = threadIdx.x; base < in; base += U1 * 256) {
        float v[N][U1][V];
#pragma unroll
        for (int u = 0; u < U1; u++) {
#pragma unroll
            for (int j = 0; j < V; j++) {
                int i = base + u * 256 + j * T;
#pragma unroll
                for (int r = 0; r < N; r++) v[r][u][j] = i < in ? x[(size_t)r * in + i] : 0.0f;
            }
        }
#pragma unroll
        for (int u = 0; u < U1; u++) {
#pragma unroll
            for (int j = 0; j < V; j++) {
#pragma unroll
                for (int r = 0; r < N; r++)
                    ss[r][j] += v[r][u][j] * v[r][u][j];  // a zero past the end adds nothing
            }
        }
    }
#pragma unroll
    for (int r = 0; r < N; r++)
        inv[r] = 1.0f / sqrtf(block_sum_as_256<V>(ss[r], s32) / (float)in + eps);
    for (int base = threadIdx.x; base < in; base += U2 * T) {
        float g[U2], v[N][U2];
#pragma unroll
        for (int u = 0; u < U2; u++) {
            int i = base + u * T;
            g[u] = i < in ? w[i] : 0.0f;
#pragma unroll
            for (int r = 0; r < N; r++) v[r][u] = i < in ? x[(size_t)r * in + i] : 0.0f;
        }
#pragma unroll
        for (int u = 0; u < U2; u++) {
            int i = base + u * T;
            if (i >= in) continue;
#pragma unroll
            for (int r = 0; r < N; r++) store(r, i, g[u] * (v[r][u] * inv[r]));
        }
    }
}

// RMSNorm per row: x / sqrt(mean(x^2) + eps) * w, into out (f32), or with out_bf16 != NULL
// rounded to bf16 there instead (the next GEMM's input for matmul=bf16: one launch, not two).
// grid (rows), block 256.
// One row of rms_norm (row `row` of x), by a block of 256 threads: shared with the persistent
// decode kernel (decode_step.cu).
__device__ __forceinline__ void rms_norm_row(float* out, bf16_t* out_bf16, const float* x,
                                             const float* w, int d, float eps, int row) {
    size_t at = (size_t)row * d;
    rms_norm_rows<1>(x + at, w, eps, d, [&](int, int i, float y) {
        if (out_bf16)
            out_bf16[at + i] = f32_to_bf16_bits(y);
        else
            out[at + i] = y;
    });
}

extern "C" __global__ void rms_norm(float* out, bf16_t* out_bf16, const float* x, const float* w,
                                    int d, float eps) {
    TD_SCOPE("rms_norm");
    pdl_launch_dependents();
    pdl_wait();
    rms_norm_row(out, out_bf16, x, w, d, eps, blockIdx.x);
}

// out[rows[i]] = in[i], rows of `width` floats (the inverse of embed_gather). grid (n), block 256.
extern "C" __global__ void scatter_rows(float* out, const float* in, const int* rows, int width) {
    TD_SCOPE("scatter_rows");
    const float* src = in + (size_t)blockIdx.x * width;
    float* dst = out + (size_t)rows[blockIdx.x] * width;
    for (int i = threadIdx.x; i < width; i += blockDim.x) dst[i] = src[i];
}

// gate = silu(gate) * up, element-wise; with out_bf16 != NULL the product goes there, rounded to
// bf16, instead (the down projection's input for matmul=bf16).
extern "C" __global__ void silu_mul(float* gate, bf16_t* out_bf16, const float* up, int n) {
    TD_SCOPE("silu_mul");
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        float g = gate[i];
        float s = g / (1.0f + expf(-g));
        float y = s * up[i];
        if (out_bf16)
            out_bf16[i] = f32_to_bf16_bits(y);
        else
            gate[i] = y;
    }
}

// x += y, element-wise (the residual stream).
extern "C" __global__ void add_inplace(float* x, const float* y, int n) {
    TD_SCOPE("add_inplace");
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += y[i];
}

// y (rows, cols) += bias (cols).
extern "C" __global__ void add_bias(float* y, const float* bias, int rows, int cols) {
    TD_SCOPE("add_bias");
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < (size_t)rows * cols) y[i] += bias[i % cols];
}

// out = bf16(in), round-to-nearest-even (GEMM inputs for matmul=bf16).
extern "C" __global__ void f32_to_bf16(bf16_t* out, const float* in, int n) {
    TD_SCOPE("f32_to_bf16");
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = f32_to_bf16_bits(in[i]);
}

// ---- Linear layers of a few tokens (small_gemm=gemv, matmul=bf16) ----
//
// A decode step multiplies one to a few activation rows by every weight matrix: the work is
// reading the weights once, at memory bandwidth. cuBLAS treats it as a small GEMM (a few
// launches per matrix, tiles mostly empty). These kernels give each warp one weight row (one
// output feature), read in 16-byte loads that bypass L1, and apply it to all n <= GEMV_MAX_ROWS
// input rows at once (x is small and stays in L1/L2), accumulating in f32 like cuBLAS with bf16
// operands; several matrices sharing the input (q, k and v) run as one grid. The epilogue does
// what the separate kernels after a GEMM did (bias, residual add, SiLU·up with bf16 rounding) in
// the same order, so only the summation order differs from the cuBLAS path.
#define GEMV_MAX_ROWS 4
#define GEMV_WARPS 8
// Blocks per SM the GEMV entry points are compiled to fit (their __launch_bounds__ minimum): 1
// leaves the register count to the compiler (92 for the batch-1 gate/up kernel, two blocks per
// SM); 3 caps it at 80. A sweep knob (TAPEDECK_NVRTC_DEFINES=GEMV_MIN_BLOCKS=3).
#ifndef GEMV_MIN_BLOCKS
#define GEMV_MIN_BLOCKS 1
#endif
// Register caps for the batch-1 decode step's two big launch boundaries (sweep knobs). A kernel
// launched early under PDL can only place a block on an SM whose registers (65536 on sm_80/90/120)
// have room for it beside the blocks still running there. Uncapped, two gate/up blocks
// (gemv_bf16_swiglu_1, 96 registers x 256 threads) leave 16384, less than one down block
// (gemv_bf16_1, 72 registers: 18432). SWIGLU1_MAXNREG: the one-row gate/up kernel's register cap
// (0: the compiler's choice; 88 has no spills and leaves 20480). GEMV1_MIN_BLOCKS: the one-row
// plain GEMV's blocks per SM (the o and down projections); 4 caps it at 64 registers (no spills).
// Measured (H100, twenty-first session): both together 882.7 against 879.9 tok/s in one call,
// 877.8 against 877.6 in the next. The trace says why: down, four blocks an SM, ends 3.2 us
// sooner, but then fills every SM's registers, so the next layer's q/k/v GEMV (108 registers)
// cannot start beside it and ends 3.2 us later. Off: TAPEDECK_NVRTC_DEFINES=SWIGLU1_MAXNREG=88,
// GEMV1_MIN_BLOCKS=4 turns both on.
#ifndef SWIGLU1_MAXNREG
#define SWIGLU1_MAXNREG 0
#endif
#ifndef GEMV1_MIN_BLOCKS
#define GEMV1_MIN_BLOCKS GEMV_MIN_BLOCKS
#endif
// Warps per block of the standalone GEMV and gate/up kernels (gemv_bf16_N, gemv_bf16_merged_N,
// gemv_bf16_swiglu_N): GEMV_WARPS, or 4 (TAPEDECK_GEMV_BLOCK=4 on the host, which sets it and
// launches to match): twice the blocks, each living half as long, so a launch's last wave is
// finer and an SM refills its memory pipe block by block. The q/k/v + RoPE kernel, the streaming
// kernels and the persistent step kernel keep GEMV_WARPS.
#ifndef GEMV_BLOCK_WARPS
#define GEMV_BLOCK_WARPS GEMV_WARPS
#endif
// 1: the GEMV and gate/up kernels may run on a grid smaller than their rows (the host's
// TAPEDECK_GEMV_GRID blocks per SM), each block looping over row groups with the next weights in
// flight; it leaves SM room for the next kernel's blocks to launch early (PDL) and prefetch theirs.
// 0: one block per group of GEMV_WARPS rows, the loop compiled out (fewer registers).
#ifndef GEMV_PERSIST
#define GEMV_PERSIST 0
#endif

__device__ __forceinline__ float bf16_lo(unsigned int w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(unsigned int w) { return __uint_as_float(w & 0xffff0000u); }

// 1: weight loads carry an L2 evict-first policy, so the ~2.5 GB of weights a step streams do
// not push the KV cache, the activations and the logits out of L2 (a sweep knob:
// TAPEDECK_NVRTC_DEFINES=GEMV_L2_EVICT_FIRST=1). 0: the default L2 policy.
#ifndef GEMV_L2_EVICT_FIRST
#define GEMV_L2_EVICT_FIRST 0
#endif

// 16 bytes of weights that are read once: not kept in L1 (the inputs are).
__device__ __forceinline__ uint4 load_stream(const uint4* p) {
    uint4 r;
#if GEMV_L2_EVICT_FIRST && __CUDA_ARCH__ >= 800
    unsigned long long policy;
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(p), "l"(policy));
#else
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(p));
#endif
    return r;
}

// Eight consecutive inputs at element `off` of x as bf16 values: bf16 bits, or f32 rounded to
// bf16 as f32_to_bf16 rounds them.
template <bool XF32>
__device__ __forceinline__ void load_x8(const void* x, size_t off, float v[8]) {
    if (XF32) {
        const float4* p = (const float4*)((const float*)x + off);
        float4 a = p[0], b = p[1];
        v[0] = round_bf16(a.x), v[1] = round_bf16(a.y), v[2] = round_bf16(a.z);
        v[3] = round_bf16(a.w), v[4] = round_bf16(b.x), v[5] = round_bf16(b.y);
        v[6] = round_bf16(b.z), v[7] = round_bf16(b.w);
    } else {
        uint4 q = *(const uint4*)((const bf16_t*)x + off);
        v[0] = bf16_lo(q.x), v[1] = bf16_hi(q.x), v[2] = bf16_lo(q.y), v[3] = bf16_hi(q.y);
        v[4] = bf16_lo(q.z), v[5] = bf16_hi(q.z), v[6] = bf16_lo(q.w), v[7] = bf16_hi(q.w);
    }
}

// 16-byte chunks of a weight row each lane loads before the input is ready: a whole 2048-wide
// row (in 16-byte chunks, 8 per lane).
#define GEMV_PRE 8

// How many of those GEMV_PRE chunks a lane requests before its PDL wait, in the plain GEMV
// kernels (GEMV_PRE_EARLY), the gate/up kernels (SWIGLU_PRE_EARLY) and the fused q/k/v + RoPE
// kernels (QKV_PRE_EARLY) with weights in registers; the rest are requested once the input is
// ready. Fewer bytes requested early leave the SM's memory pipe and the DRAM queues shorter
// when the kernel before reads its input after its own wait (gate/up's first wave is resident
// beside the o GEMV, q/k/v's beside down), at the cost of one more round trip here. The same
// bits. Sweep knobs (TAPEDECK_NVRTC_DEFINES=SWIGLU_PRE_EARLY=4,...). H100, batch-1 decode,
// twenty-seventh session (gpu-s27): all 8 early 936-938 tok/s; gate/up 3 and q/k/v 6 (the
// defaults) 951.6 / 952.0; gate/up 4 alone 945, 2 alone 937, 0 alone 910, 5 (q/k/v 6) 938;
// the plain GEMVs (o, down, head) at 6 lose 4% and stay at 8. Finer knobs:
// GEMV_PRE_EARLY_SPLIT for the plain GEMV launches whose rows are split over several warps (the
// down projection), GEMV_PRE_EARLY_ADD for those that add to the residual without a split (o;
// GEMV_PRE_EARLY is then left to the head), and SWIGLU_PRE_EARLY_UP for gate/up's up row alone.
// Twenty-eighth session (gpu-s28, H100, one call): the defaults 957.0, all 8 early 939.1; down
// at 6 / 4 899.3 / 913.4, o at 6 920.5, the head at 6 884.0, gate 4 / up 2 958.4 tok/s.
// Twenty-ninth session (gpu-s29 call 1, H100): splitting only in a launch's first wave of blocks
// (blockIdx.x < N x %nsmid; the later blocks' waits return at once) lost to splitting in every
// block: N = 2 / 3 937.8 / 936.9 against the defaults' 958.9 / 960.1 (q/k/v at 110 registers
// instead of 96), so it was removed.
#ifndef GEMV_PRE_EARLY
#define GEMV_PRE_EARLY GEMV_PRE
#endif
#ifndef GEMV_PRE_EARLY_SPLIT
#define GEMV_PRE_EARLY_SPLIT GEMV_PRE_EARLY
#endif
#ifndef GEMV_PRE_EARLY_ADD
#define GEMV_PRE_EARLY_ADD GEMV_PRE_EARLY
#endif
#ifndef SWIGLU_PRE_EARLY
#define SWIGLU_PRE_EARLY 3
#endif
#ifndef SWIGLU_PRE_EARLY_UP
#define SWIGLU_PRE_EARLY_UP SWIGLU_PRE_EARLY
#endif
#ifndef QKV_PRE_EARLY
#define QKV_PRE_EARLY 6
#endif
// Chunks from..to of this lane's first GEMV_PRE (chunk lane + 32 u) of weight row w, zero past
// the end or for a warp without a row (live false). Called twice where part of the row is
// requested before the PDL wait and the rest once the input is ready (the *_PRE_EARLY knobs).
// The bounds may be run-time values: every index of `pre` stays a compile-time constant (a
// predicate per chunk), so the chunks stay in registers.
__device__ __forceinline__ void gemv_prefetch_span(const bf16_t* w, int in, int lane, bool live,
                                                   uint4 pre[GEMV_PRE], int from, int to) {
    const uint4* wr = (const uint4*)w;
    int chunks = in / 8;
#pragma unroll
    for (int u = 0; u < GEMV_PRE; u++) {
        if (u < from || u >= to) continue;
        int c = lane + 32 * u;
        pre[u] = live && c < chunks ? load_stream(wr + c) : make_uint4(0, 0, 0, 0);
    }
}

// All GEMV_PRE chunks of the lane's share of weight row w (gemv_prefetch_span's whole span).
__device__ __forceinline__ void gemv_prefetch(const bf16_t* w, int in, int lane, bool live,
                                              uint4 pre[GEMV_PRE]) {
    gemv_prefetch_span(w, in, lane, live, pre, 0, GEMV_PRE);
}

// acc[r] += x[r][k0 + 8c .. k0 + 8c + 8] · q (8 bf16 weights) for the N input rows.
template <int N, bool XF32>
__device__ __forceinline__ void gemv_chunk(uint4 q, const void* x, int in, int k0, int c,
                                           float acc[N]) {
    float wf[8] = {bf16_lo(q.x), bf16_hi(q.x), bf16_lo(q.y), bf16_hi(q.y),
                   bf16_lo(q.z), bf16_hi(q.z), bf16_lo(q.w), bf16_hi(q.w)};
#pragma unroll
    for (int r = 0; r < N; r++) {
        float xv[8];
        load_x8<XF32>(x, (size_t)r * in + (size_t)k0 + (size_t)c * 8, xv);
#pragma unroll
        for (int j = 0; j < 8; j++) acc[r] = fmaf(wf[j], xv[j], acc[r]);
    }
}

// acc[r] = x[r][k0 .. k0 + len] · w for the N input rows (rows of `in` values), w the matching
// `len` bf16 weights (len % 8 == 0, 16-byte aligned) whose first chunks are in `pre`; every lane
// of the warp gets the sums. Past the prefetched chunks, U loads of 16 bytes in flight per lane.
// `pre` is the lane's registers (uint4[GEMV_PRE], pre[u] its chunk lane + 32u) or any type
// indexed the same way with P chunks (StagedChunks: the chunks in shared memory).
template <int N, bool XF32, int P = GEMV_PRE, typename Pre = uint4[GEMV_PRE]>
__device__ __forceinline__ void gemv_row(const bf16_t* w, const Pre& pre, const void* x, int in,
                                         int k0, int len, int lane, float acc[N]) {
    // A persistent grid holds the next row's prefetched chunks too: fewer loads in flight here.
    constexpr int U = GEMV_PERSIST ? 2 : N <= 2 ? 8 : 4;
#pragma unroll
    for (int r = 0; r < N; r++) acc[r] = 0.0f;
    const uint4* wr = (const uint4*)w;
    int chunks = len / 8;
#pragma unroll
    for (int u = 0; u < P; u++) {
        int c = lane + 32 * u;
        if (c < chunks) gemv_chunk<N, XF32>(pre[u], x, in, k0, c, acc);
    }
    for (int base = lane + 32 * P; base < chunks; base += 32 * U) {
        uint4 q[U];
#pragma unroll
        for (int u = 0; u < U; u++) {
            int c = base + 32 * u;
            q[u] = c < chunks ? load_stream(wr + c) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
            int c = base + 32 * u;
            if (c < chunks) gemv_chunk<N, XF32>(q[u], x, in, k0, c, acc);
        }
    }
#pragma unroll
    for (int r = 0; r < N; r++) acc[r] = warp_sum(acc[r]);
}

// The epilogue of output feature `row` of y (n, out) = x · Wᵀ (+ b): stored or added to y (the
// residual stream); lane r writes input row r. y_old is the value of y[r, row] that lane r read
// (after the PDL wait) for `add`: early with GEMV_ADD_EARLY, else by gemv_store just before.
template <int N>
__device__ __forceinline__ void gemv_store_onto(const float acc[N], const float* b, float* y, int out,
                                                int row, int add, float y_old, int lane) {
    float bias = b ? b[row] : 0.0f;
#pragma unroll
    for (int r = 0; r < N; r++) {
        if (lane == r) {
            float v = b ? acc[r] + bias : acc[r];
            y[(size_t)r * out + row] = add ? y_old + v : v;
        }
    }
}

// gemv_store_onto with the value to add to read here, just before the store.
template <int N>
__device__ __forceinline__ void gemv_store(const float acc[N], const float* b, float* y, int out,
                                           int row, int add, int lane) {
    const float y_old = add && lane < N ? y[(size_t)lane * out + row] : 0.0f;
    gemv_store_onto<N>(acc, b, y, out, row, add, y_old, lane);
}

// 1: the plain GEMV kernels (gemv_bf16_N) with `add` load the residual they add to right after
// their PDL wait, beside the input's prologue, instead of after the dot product: one dependent
// round trip to memory less at the end of the o and down projections. The same bits. On by
// default since session 25 (H100, batch-1 decode: alone 914 -> 929.5 tok/s). A sweep knob
// (TAPEDECK_NVRTC_DEFINES=GEMV_ADD_EARLY=0|1).
#ifndef GEMV_ADD_EARLY
#define GEMV_ADD_EARLY 1
#endif

// With norm_w != NULL, x is the f32 residual stream (N rows of `in`) and the block first computes
// its RMSNorm into shared memory as bf16 (N * in * 2 bytes of dynamic shared memory) with
// rms_norm_rows, as the rms_norm kernel does, so fusing the norm changes no bit of the GEMV's
// input. Every block recomputes it (a few KB read from L2), which costs less than a launch.
// ci/norm_host_check.py holds it to rms_norm_row bit for bit.
// T: the block's threads (256, or 128 for the GEMVs' 4-warp blocks).
template <int N, int T = 32 * GEMV_WARPS>
__device__ __forceinline__ const bf16_t* gemv_norm_prologue(const float* x, const float* norm_w,
                                                            float eps, int in) {
    extern __shared__ uint4 gemv_smem[];
    bf16_t* xs = (bf16_t*)gemv_smem;
    rms_norm_rows<N, T>(x, norm_w, eps, in, [&](int r, int i, float y) {
        xs[(size_t)r * in + i] = f32_to_bf16_bits(y);
    });
    __syncthreads();
    return xs;
}

// 1: the plain GEMV entry points (gemv_bf16_N, and the merging ones of decode_fused.cu) request
// each warp's first GEMV_STAGE_PRE chunks a lane of weights into shared memory with cp.async
// instead of into registers (gemv_stage), and read them from there once the input is ready. The bytes a
// block has in flight before its PDL wait then hold no registers: registers, not bytes, are what
// limit how many GEMV blocks an SM holds (down: three, 96 KB in flight; at four, 128 KB, it ran
// 3.2 us faster a layer, twenty-first session) and whether the next kernel's blocks fit beside
// them. The stage is the last GEMV_STAGE_BYTES of the block's dynamic shared memory (the host's
// TAPEDECK_GEMV_ASYNC=8|16 sets this and adds them to every such launch). The same bits. Not with
// GEMV_PERSIST, whose loop keeps the next row's chunks in registers (GEMV_STAGED below).
// GEMV_STAGE_PRE: chunks a lane staged (default GEMV_PRE: 4 KB a warp; 16 stages a whole
// 4096-input slice, TAPEDECK_GEMV_SLICE=4096, which the registers could not hold). Measured on an
// H100 (twenty-second session): 8 is 4.6% slower, 16 with two warps a down row 10%; off.
#ifndef GEMV_ASYNC
#define GEMV_ASYNC 0
#endif
#ifndef GEMV_STAGE_PRE
#define GEMV_STAGE_PRE GEMV_PRE
#endif
#define GEMV_STAGE_BYTES (GEMV_ASYNC ? GEMV_BLOCK_WARPS * GEMV_STAGE_PRE * 32 * 16 : 0)
#define GEMV_STAGED (GEMV_ASYNC && !GEMV_PERSIST)
// 1: the gate/up kernels (gemv_bf16_swiglu_N) stage each warp's gate and up rows (GEMV_PRE
// chunks a lane of each, 8 KB a warp, 64 KB a block) in shared memory the same way, at the end
// of their dynamic shared memory (the host's TAPEDECK_SWIGLU_ASYNC=on). Their 64 registers of
// prefetched weights (96 in all) leave no room beside two of their blocks for a down block; staged,
// down does start beside them, but the whole is 6% slower (H100, twenty-second session); off.
#ifndef SWIGLU_ASYNC
#define SWIGLU_ASYNC 0
#endif
#define SWIGLU_STAGE_BYTES (SWIGLU_ASYNC ? GEMV_BLOCK_WARPS * 2 * GEMV_PRE * 32 * 16 : 0)
// 1: the fused q/k/v + RoPE kernels (qkv_rope_kernel) stage each warp's rotary pair of rows
// (GEMV_PRE chunks a lane of each, 8 KB a warp) in shared memory the same way, at the end of
// their dynamic shared memory (the host's TAPEDECK_QKV_ASYNC=on). With GEMV_TMA, by bulk copies.
// The same bits.
#ifndef QKV_ASYNC
#define QKV_ASYNC 0
#endif
#define QKV_STAGE_BYTES (QKV_ASYNC ? GEMV_WARPS * 2 * GEMV_PRE * 32 * 16 : 0)

// 1 (the default): the plain GEMV entry points copy an input given as is (not normalized) into
// shared memory first when the launch has room for it (gemv_x_prologue); the host gives the
// launches that shared memory. 0 (the host's TAPEDECK_GEMV_X_SMEM=off) compiles the copy out (it
// costs the one-row GEMV 8 registers even when not taken). Batch-1 decode on an H100: 911
// against 876 tok/s without it (twenty-second session).
#ifndef GEMV_X_SMEM
#define GEMV_X_SMEM 1
#endif

// The dynamic shared memory this launch was given, in bytes.
__device__ __forceinline__ unsigned int dynamic_smem_bytes() {
    unsigned int r;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(r));
    return r;
}

// The N rows of `in` inputs x (bf16 bits, or f32 rounded to bf16 as load_x8 rounds it) copied once
// into the block's dynamic shared memory as bf16 bits, so that the GEMV reads the values it would
// have read from x, from shared memory. Without it each warp fetches all of x itself (the o
// projection: 8 KB of f32 per warp, 16 MB from L2 across the launch, all requested at the same
// moment, right after the PDL wait; down: 4 KB per warp). In 16-byte chunks, four in flight per
// thread before any is stored (a block-stride loop that waited on each load would serialize).
template <int N, int T>
__device__ __forceinline__ const bf16_t* gemv_x_prologue(const void* x, int x_f32, int in) {
    extern __shared__ uint4 gemv_smem[];
    constexpr int U = 4;
    int chunks = N * in / 8;  // in % 8 == 0 (the GEMV's own requirement)
    for (int base = threadIdx.x; base < chunks; base += U * T) {
        uint4 v[U];
#pragma unroll
        for (int u = 0; u < U; u++) {
            int c = base + u * T;
            if (c >= chunks) continue;
            if (x_f32) {
                const float4* p = (const float4*)x + 2 * (size_t)c;
                float4 a = p[0], b = p[1];
                v[u] = make_uint4(bf16x2_bits(a.x, a.y), bf16x2_bits(a.z, a.w), bf16x2_bits(b.x, b.y),
                                  bf16x2_bits(b.z, b.w));
            } else {
                v[u] = ((const uint4*)x)[c];
            }
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
            int c = base + u * T;
            if (c < chunks) gemv_smem[c] = v[u];
        }
    }
    __syncthreads();
    return (const bf16_t*)gemv_smem;
}

// The input of the plain GEMV entry points, made ready once the previous kernel is done: x as
// given (bf16 bits, or f32 when x_f32), or with norm_w the f32 residual stream normalized into
// shared memory (gemv_norm_prologue). x as given is first copied into shared memory
// (gemv_x_prologue) when the launch has the dynamic shared memory for it (the host's
// TAPEDECK_GEMV_X_SMEM); either way the GEMV sums the same values in the same order. Other inputs
// (decode_fused.cu: attention splits merged on the fly) are other types with the same call.
// T: the block's threads.
template <int T>
struct GemvInputOf {
    const void* x;
    int x_f32;
    const float* norm_w;
    float eps;
    // Whether x is read as given in f32 (GEMV_F32_TRIGGER_LATE; every input type says).
    __device__ __forceinline__ bool f32_as_given() const { return x_f32 && !norm_w; }
    // Before the PDL wait: what can be fetched ahead of it (the norm weights, NORM_PREFETCH).
    __device__ __forceinline__ void prefetch(int in) const { norm_prefetch(norm_w, in); }
    // Whether an input given as is gets copied into shared memory (gemv_x_prologue): the launch
    // has the room. The same for every thread of the block.
    __device__ __forceinline__ bool staged(int n, int in) const {
        return GEMV_X_SMEM && dynamic_smem_bytes() >= (unsigned int)(n * in * 2) + GEMV_STAGE_BYTES;
    }
    // Whether the pointer operator() returns holds f32 values (as given, not staged as bf16): the
    // streaming kernel chooses its code by it before it calls operator().
    __device__ __forceinline__ bool reads_f32(int n, int in) const {
        return f32_as_given() && !staged(n, in);
    }
    // Where the kernel reads its n rows of `in` inputs, and whether they are f32.
    __device__ __forceinline__ const void* operator()(int n, int in, int* f32) const {
        *f32 = 0;
        if (!norm_w) {
            // The barrier inside is safe: staged() is the same for the whole block.
            if (!staged(n, in)) {
                *f32 = x_f32;
                return x;
            }
            switch (n) {
                case 1: return gemv_x_prologue<1, T>(x, x_f32, in);
                case 2: return gemv_x_prologue<2, T>(x, x_f32, in);
                case 3: return gemv_x_prologue<3, T>(x, x_f32, in);
                default: return gemv_x_prologue<GEMV_MAX_ROWS, T>(x, x_f32, in);
            }
        }
        // n is the entry point's constant row count once inlined: the switch folds away.
        const float* r = (const float*)x;
        switch (n) {
            case 1: return gemv_norm_prologue<1, T>(r, norm_w, eps, in);
            case 2: return gemv_norm_prologue<2, T>(r, norm_w, eps, in);
            case 3: return gemv_norm_prologue<3, T>(r, norm_w, eps, in);
            default: return gemv_norm_prologue<GEMV_MAX_ROWS, T>(r, norm_w, eps, in);
        }
    }
};
typedef GemvInputOf<32 * GEMV_WARPS> GemvInput;

// 1: a GEMV whose input is f32 as given (in a decode step, the o projection reading the
// attention output) lets the kernel after it launch only once its own wait is over, instead of
// as soon as its weights are requested. With the attention triggering at its start
// (DA_TRIGGER_LATE=0, pdl=all) the o GEMV then fetches its 8.4 MB during the attention, while
// gate/up (17 MB a wave) does not launch until the attention output is ready. A timing knob.
#ifndef GEMV_F32_TRIGGER_LATE
#define GEMV_F32_TRIGGER_LATE 0
#endif
// 1: such a GEMV lets the kernel after it launch once every one of its own blocks holds its
// prefetched weights, instead of at its start: gate/up's first wave (17 MB on llama-1b) then
// does not share the DRAM with the o projection's 8.4 MB, which the twenty-fifth session's trace
// marks found arriving 5.4 µs after the combine, and starts before o's own wait is over (unlike
// GEMV_F32_TRIGGER_LATE). A timing knob; nothing computed changes. Register-prefetching GEMVs
// only (not GEMV_ASYNC's staged weights or the persistent grid).
#ifndef GEMV_F32_TRIGGER_LOADED
#define GEMV_F32_TRIGGER_LOADED 0
#endif

// Returns once this thread's prefetched chunks have landed: a shared-memory store that consumes
// one word of each (a 16-byte load lands as one), which the warp cannot issue before they have.
__device__ __forceinline__ void gemv_wait_prefetched(const uint4 pre[GEMV_PRE]) {
    __shared__ unsigned int sink;
    unsigned int v = 0;
#pragma unroll
    for (int u = 0; u < GEMV_PRE; u++) v |= pre[u].x;
    asm volatile("st.shared.u32 [%0], %1;" ::"r"((unsigned int)__cvta_generic_to_shared(&sink)), "r"(v)
                 : "memory");
}

// 16 bytes of weights from global to shared memory through L2 only (cp.async, sm_80+).
__device__ __forceinline__ void gemv_stage16(uint4* dst, const uint4* src) {
    unsigned int d = (unsigned int)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d), "l"(src) : "memory");
}

// 1 (with GEMV_ASYNC or SWIGLU_ASYNC, sm_90+): a warp's staged weights come by bulk copies of
// the Hopper copy engine (cp.async.bulk, one per staged row, issued by lane 0 and counted on an
// mbarrier of the warp) instead of by 16-byte cp.async per lane. The twenty-fifth session's marks
// found each GEMV's input, read from L2 right after the PDL wait, arriving 2-4 µs after it (the o
// projection: 3.9 µs for 8 KB): on each SM it queues behind the weights that SM's blocks
// requested before the wait. Bulk copies leave the SM's load pipeline to the input. The same
// layout, so the same bits. A sweep knob (TAPEDECK_NVRTC_DEFINES=GEMV_TMA=1 beside
// TAPEDECK_GEMV_ASYNC=8 and TAPEDECK_SWIGLU_ASYNC=on); before sm_90 it changes nothing.
#ifndef GEMV_TMA
#define GEMV_TMA 0
#endif
#if GEMV_TMA && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define GEMV_BULK 1
#else
#define GEMV_BULK 0
#endif

#if GEMV_BULK
// The shared-memory address of warp `warp`'s stage mbarrier (one phase: a block stages once).
__device__ __forceinline__ unsigned int gemv_stage_bar(int warp) {
    __shared__ __align__(8) unsigned long long bars[GEMV_BLOCK_WARPS];
    return (unsigned int)__cvta_generic_to_shared(&bars[warp]);
}

// `bytes` (a multiple of 16) from global src to shared dst by the copy engine, counted on `bar`
// (which expects them first, so the phase cannot complete before they land).
__device__ __forceinline__ void gemv_stage_bulk(uint4* dst, const uint4* src, unsigned int bytes,
                                                unsigned int bar) {
    unsigned int d = (unsigned int)__cvta_generic_to_shared(dst);
    asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(bytes)
                 : "memory");
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(d),
        "l"(src), "r"(bytes), "r"(bar)
        : "memory");
}
#endif

// Before a warp's gemv_stage calls: with GEMV_BULK, lane 0 readies the warp's mbarrier (one
// arrival, lane 0's in gemv_stage_wait). Nothing otherwise.
__device__ __forceinline__ void gemv_stage_init() {
#if GEMV_BULK
    if ((threadIdx.x & 31) == 0) {
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(gemv_stage_bar(threadIdx.x >> 5))
                     : "memory");
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
#endif
}

// Waits for this thread's staged chunks (each lane reads back only the chunks it staged), with
// the warp converged again before its shared-memory reads. With GEMV_BULK, for the warp's bulk
// copies: lane 0 arrives, and every lane waits for the phase (the arrival and every byte).
__device__ __forceinline__ void gemv_stage_wait() {
#if GEMV_BULK
    unsigned int bar = gemv_stage_bar(threadIdx.x >> 5);
    __syncwarp();
    if ((threadIdx.x & 31) == 0) {
        unsigned long long state;
        asm volatile("mbarrier.arrive.shared::cta.b64 %0, [%1];" : "=l"(state) : "r"(bar) : "memory");
    }
    unsigned int done = 0;
    do {
        asm volatile(
            "{\n\t.reg .pred p;\n\tmbarrier.try_wait.parity.shared::cta.b64 p, [%1], 0;\n\t"
            "selp.u32 %0, 1, 0, p;\n\t}"
            : "=r"(done)
            : "r"(bar)
            : "memory");
    } while (!done);
#else
    asm volatile("cp.async.wait_all;" ::: "memory");
#endif
    __syncwarp();
}

// The last `bytes` of the block's dynamic shared memory.
__device__ __forceinline__ uint4* smem_tail(unsigned int bytes) {
    extern __shared__ uint4 gemv_smem[];
    return gemv_smem + (dynamic_smem_bytes() - bytes) / 16;
}

// The GEMV_STAGE_PRE chunks a lane of warp `warp`'s stage, in chunk order (chunk c at slot c).
__device__ __forceinline__ uint4* gemv_stage_slot(int warp) {
    return smem_tail(GEMV_STAGE_BYTES) + warp * GEMV_STAGE_PRE * 32;
}

// gemv_prefetch into the warp's stage: the first P chunks a lane of row w requested, none past
// the end or for a warp without a row (those slots are never read).
template <int P>
__device__ __forceinline__ void gemv_stage(const bf16_t* w, int in, int lane, bool live,
                                           uint4* slot) {
    const uint4* wr = (const uint4*)w;
    int chunks = in / 8;
#if GEMV_BULK
    // The row's first P * 32 chunks are contiguous in memory and in the stage: one copy.
    int n = min(chunks, P * 32);
    if (live && lane == 0 && n > 0)
        gemv_stage_bulk(slot, wr, (unsigned int)n * 16, gemv_stage_bar(threadIdx.x >> 5));
#else
#pragma unroll
    for (int u = 0; u < P; u++) {
        int c = lane + 32 * u;
        if (live && c < chunks) gemv_stage16(slot + c, wr + c);
    }
#endif
}

// This warp's stage of two rows (GEMV_PRE chunks a lane each, the second right after the first)
// in the last `bytes` of the block's dynamic shared memory: gate/up's and q/k/v's staging.
__device__ __forceinline__ uint4* two_row_stage(unsigned int bytes) {
    return smem_tail(bytes) + (threadIdx.x >> 5) * 2 * GEMV_PRE * 32;
}

// A lane's staged chunks as gemv_row reads them: pre[u] is chunk lane + 32u.
struct StagedChunks {
    const uint4* lane_slot;  // the stage + lane
    __device__ __forceinline__ uint4 operator[](int u) const { return lane_slot[32 * u]; }
};

// Output feature `row` of up to three matrices concatenated (q, k and v in one launch): its
// matrix, bias, output and row in it; live is false past the last one.
struct GemvTarget {
    const bf16_t* w;
    const float* b;
    float* y;
    int out, row;
    bool live;
};
__device__ __forceinline__ GemvTarget gemv_target(int row, const bf16_t* w0, const float* b0,
                                                  float* y0, int out0, const bf16_t* w1,
                                                  const float* b1, float* y1, int out1,
                                                  const bf16_t* w2, const float* b2, float* y2,
                                                  int out2) {
    GemvTarget t{w0, b0, y0, out0, row, false};
    if (row >= out0) {
        t = GemvTarget{w1, b1, y1, out1, row - out0, false};
        if (t.row >= out1) t = GemvTarget{w2, b2, y2, out2, t.row - out1, false};
    }
    t.live = t.row < t.out;
    return t;
}

// y_j (n, out_j) = x (n, in) · W_jᵀ (+ b_j) for up to three bf16 matrices W_j (out_j, in) that
// share the input (out_j = 0 for an unused one); with add != 0, y_j += instead (the residual
// stream). x comes from `input` after the PDL wait (GemvInput: bf16 bits; f32 rounded to bf16 as it
// is read; or the normalized residual stream). One entry point per row count n = N (gemv_bf16_N),
// so that each gets the registers it needs and no more. May be launched with PDL.
//
// `splits` warps (1, 2, 4 or 8, dividing GEMV_BLOCK_WARPS; in % (8 * splits) == 0) share one output
// feature, each reading an equal slice of its row: a long row (the down projection's 8192 inputs)
// is then fetched by several warps at once, all of it in their prefetched chunks, instead of by one
// warp in several dependent rounds. The slices' sums are added in slice order (deterministic).
// Only for N <= 2: with 3-4 rows the split measured slower (H200), so those entry points ignore
// `splits` and compile to the one-warp-per-feature code alone.
// grid (ceil((out_0 + out_1 + out_2) * splits / GEMV_BLOCK_WARPS)), block 32 * GEMV_BLOCK_WARPS.
template <int N, typename Input>
__device__ __forceinline__ void gemv_kernel(Input input, int in, int splits, int add,
                                            const bf16_t* w0, const float* b0, float* y0,
                                            int out0, const bf16_t* w1, const float* b1,
                                            float* y1, int out1, const bf16_t* w2,
                                            const float* b2, float* y2, int out2) {
    __shared__ float slice_sums[GEMV_BLOCK_WARPS][GEMV_MAX_ROWS];
    if (N > 2) splits = 1;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int per_block = GEMV_BLOCK_WARPS / splits, part = warp % splits;
    int len = in / splits, k0 = part * len;
    typedef GemvTarget Target;
    auto target = [&](int row) {
        return gemv_target(row, w0, b0, y0, out0, w1, b1, y1, out1, w2, b2, y2, out2);
    };
    auto weights = [&](const Target& t) { return t.w + (t.live ? (size_t)t.row * in + k0 : 0); };
    int group = blockIdx.x;
    Target cur = target(group * per_block + warp / splits);
#if GEMV_STAGED
    uint4* slot = gemv_stage_slot(warp);
    gemv_stage_init();
    gemv_stage<GEMV_STAGE_PRE>(weights(cur), len, lane, cur.live, slot);
    const StagedChunks pre{slot + lane};
#else
    // The chunks requested before the wait, by the launch's kind: rows split over several warps
    // (down), a residual add without a split (o), or neither (the head). With equal knobs (the
    // default) `early` is a constant and the prefetch compiles as before.
    const int early =
        splits > 1 ? GEMV_PRE_EARLY_SPLIT : add ? GEMV_PRE_EARLY_ADD : GEMV_PRE_EARLY;
    uint4 pre[GEMV_PRE];
    gemv_prefetch_span(weights(cur), len, lane, cur.live, pre, 0, early);
#endif
    const bool late = GEMV_F32_TRIGGER_LATE && input.f32_as_given();
    input.prefetch(in);
#if GEMV_F32_TRIGGER_LOADED && !GEMV_STAGED && !GEMV_PERSIST
    if (input.f32_as_given()) {  // the same for the whole block: the barrier is safe
        gemv_wait_prefetched(pre);
        __syncthreads();
        pdl_launch_dependents();
    } else
#endif
    if (!late) pdl_launch_dependents();
    pdl_wait();
    if (late) pdl_launch_dependents();
#if GEMV_ADD_EARLY && !GEMV_PERSIST
    // The residual this lane adds to, requested now, in flight with the input's prologue.
    float y_old = 0.0f;
    if (add && part == 0 && cur.live && lane < N) y_old = cur.y[(size_t)lane * cur.out + cur.row];
#endif
    int x_f32;
    const void* x = input(N, in, &x_f32);
#if GEMV_STAGED
    gemv_stage_wait();
#else
    gemv_prefetch_span(weights(cur), len, lane, cur.live, pre, early, GEMV_PRE);
#endif
    TD_MARK(1);
    // A persistent grid (GEMV_PERSIST, grid smaller than the row groups) loops over the groups,
    // block by block, with the next group's weights in flight while this one's are summed.
    for (;;) {
#if GEMV_PERSIST
        int next_group = group + gridDim.x;
        bool more = next_group * per_block < out0 + out1 + out2;  // the same for the whole block
        Target next = target(next_group * per_block + warp / splits);
        uint4 pre_next[GEMV_PRE];
        gemv_prefetch(weights(next), len, lane, more && next.live, pre_next);
#endif
        float acc[N];
#pragma unroll
        for (int r = 0; r < N; r++) acc[r] = 0.0f;
        if (cur.live) {
            constexpr int P = GEMV_STAGED ? GEMV_STAGE_PRE : GEMV_PRE;  // chunks held in `pre`
            if (x_f32)
                gemv_row<N, true, P>(weights(cur), pre, x, in, k0, len, lane, acc);
            else
                gemv_row<N, false, P>(weights(cur), pre, x, in, k0, len, lane, acc);
        }
        if (splits > 1) {
            if (lane == 0) {
#pragma unroll
                for (int r = 0; r < N; r++) slice_sums[warp][r] = acc[r];
            }
            __syncthreads();
            if (part == 0) {
#pragma unroll
                for (int r = 0; r < N; r++) {
                    for (int s = 1; s < splits; s++) acc[r] += slice_sums[warp + s][r];
                }
            }
        }
        TD_MARK(2);
#if GEMV_ADD_EARLY && !GEMV_PERSIST
        if (part == 0 && cur.live) gemv_store_onto<N>(acc, cur.b, cur.y, cur.out, cur.row, add, y_old, lane);
#else
        if (part == 0 && cur.live) gemv_store<N>(acc, cur.b, cur.y, cur.out, cur.row, add, lane);
#endif
#if GEMV_PERSIST
        if (!more) break;
        if (splits > 1) __syncthreads();  // slice_sums is written again
        group = next_group;
        cur = next;
#pragma unroll
        for (int u = 0; u < GEMV_PRE; u++) pre[u] = pre_next[u];
#else
        break;
#endif
    }
}

#define GEMV_PARAMS                                                                              \
    const void *x, int x_f32, const float *norm_w, float eps, int n, int in, int splits,       \
        int add,                                                                                \
        const bf16_t *w0, const float *b0, float *y0, int out0, const bf16_t *w1,               \
        const float *b1, float *y1, int out1, const bf16_t *w2, const float *b2, float *y2,     \
        int out2
#define GEMV_ARGS(T)                                                                             \
    GemvInputOf<T>{x, x_f32, norm_w, eps}, in, splits, add, w0, b0, y0, out0, w1, b1, y1, out1, w2, b2, \
        y2, out2
extern "C" __global__ void __launch_bounds__(32 * GEMV_BLOCK_WARPS, GEMV1_MIN_BLOCKS) gemv_bf16_1(GEMV_PARAMS) {
    TD_SCOPE("gemv_bf16_1");
    gemv_kernel<1>(GEMV_ARGS(32 * GEMV_BLOCK_WARPS));
}
extern "C" __global__ void __launch_bounds__(32 * GEMV_BLOCK_WARPS, GEMV_MIN_BLOCKS) gemv_bf16_2(GEMV_PARAMS) {
    TD_SCOPE("gemv_bf16_2");
    gemv_kernel<2>(GEMV_ARGS(32 * GEMV_BLOCK_WARPS));
}
extern "C" __global__ void __launch_bounds__(32 * GEMV_BLOCK_WARPS, GEMV_MIN_BLOCKS) gemv_bf16_3(GEMV_PARAMS) {
    TD_SCOPE("gemv_bf16_3");
    gemv_kernel<3>(GEMV_ARGS(32 * GEMV_BLOCK_WARPS));
}
extern "C" __global__ void __launch_bounds__(32 * GEMV_BLOCK_WARPS, GEMV_MIN_BLOCKS) gemv_bf16_4(GEMV_PARAMS) {
    TD_SCOPE("gemv_bf16_4");
    gemv_kernel<4>(GEMV_ARGS(32 * GEMV_BLOCK_WARPS));
}

// Output feature `row` of the fused gate/up kernel from its two dot products (lane r writes input
// row r): shared with the persistent decode kernel (decode_step.cu).
template <int N>
__device__ __forceinline__ void swiglu_store(const float g[N], const float u[N], const float* bg,
                                             const float* bu, bf16_t* out, int inter, int row,
                                             int lane) {
#pragma unroll
    for (int r = 0; r < N; r++) {
        if (lane == r) {
            float gv = bg ? g[r] + bg[row] : g[r];
            float uv = bu ? u[r] + bu[row] : u[r];
            // silu_mul's formula.
            float s = gv / (1.0f + expf(-gv));
            out[(size_t)r * inter + row] = f32_to_bf16_bits(s * uv);
        }
    }
}

// out (n, inter) = bf16(silu(x · Wgᵀ (+ bg)) * (x · Wuᵀ (+ bu))): the gate and up projections
// and the SiLU·up product in one pass, the product rounded to bf16 (the down projection's input).
// x as for gemv_bf16 but bf16 bits or the normalized residual stream only (x_f32 must be 0: the
// MLP's input is always a norm's output). One entry point per row count n = N. May be launched
// with PDL. grid (ceil(inter / GEMV_BLOCK_WARPS)), block 32 * GEMV_BLOCK_WARPS.
template <int N>
__device__ __forceinline__ void swiglu_kernel(const void* x, const float* norm_w, float eps,
                                              int in, const bf16_t* wg, const float* bg,
                                              const bf16_t* wu, const float* bu, bf16_t* out,
                                              int inter) {
    int lane = threadIdx.x & 31;
    int row = blockIdx.x * GEMV_BLOCK_WARPS + (threadIdx.x >> 5);
    bool live = row < inter;
    size_t at = live ? (size_t)row * in : 0;
#if SWIGLU_ASYNC && !GEMV_PERSIST
    uint4* slot_g = two_row_stage(SWIGLU_STAGE_BYTES);
    uint4* slot_u = slot_g + GEMV_PRE * 32;
    gemv_stage_init();
    gemv_stage<GEMV_PRE>(wg + at, in, lane, live, slot_g);
    gemv_stage<GEMV_PRE>(wu + at, in, lane, live, slot_u);
    norm_prefetch(norm_w, in);
    pdl_launch_dependents();
    pdl_wait();
    if (norm_w) x = gemv_norm_prologue<N, 32 * GEMV_BLOCK_WARPS>((const float*)x, norm_w, eps, in);
    gemv_stage_wait();
    if (!live) return;
    float g[N], u[N];
    gemv_row<N, false>(wg + at, StagedChunks{slot_g + lane}, x, in, 0, in, lane, g);
    gemv_row<N, false>(wu + at, StagedChunks{slot_u + lane}, x, in, 0, in, lane, u);
    swiglu_store<N>(g, u, bg, bu, out, inter, row, lane);
#else
    uint4 pre_g[GEMV_PRE], pre_u[GEMV_PRE];
    const int early_g = SWIGLU_PRE_EARLY, early_u = SWIGLU_PRE_EARLY_UP;
    gemv_prefetch_span(wg + at, in, lane, live, pre_g, 0, early_g);
    gemv_prefetch_span(wu + at, in, lane, live, pre_u, 0, early_u);
    norm_prefetch(norm_w, in);
    pdl_launch_dependents();
    pdl_wait();
    if (norm_w) x = gemv_norm_prologue<N, 32 * GEMV_BLOCK_WARPS>((const float*)x, norm_w, eps, in);
    gemv_prefetch_span(wg + at, in, lane, live, pre_g, early_g, GEMV_PRE);
    gemv_prefetch_span(wu + at, in, lane, live, pre_u, early_u, GEMV_PRE);
    TD_MARK(1);
    // A persistent grid (GEMV_PERSIST) loops over features: each projection's next row is
    // requested as soon as this one's prefetched chunks are consumed.
    for (int stride = gridDim.x * GEMV_BLOCK_WARPS; live; row += stride) {
        int next = row + stride;
        bool more = GEMV_PERSIST && next < inter;
        float g[N], u[N];
        gemv_row<N, false>(wg + (size_t)row * in, pre_g, x, in, 0, in, lane, g);
        if (more) gemv_prefetch(wg + (size_t)next * in, in, lane, true, pre_g);
        gemv_row<N, false>(wu + (size_t)row * in, pre_u, x, in, 0, in, lane, u);
        if (more) gemv_prefetch(wu + (size_t)next * in, in, lane, true, pre_u);
        TD_MARK(2);
        swiglu_store<N>(g, u, bg, bu, out, inter, row, lane);
        if (!more) break;
    }
#endif
}

#define SWIGLU_PARAMS                                                                            \
    const void *x, int x_f32, const float *norm_w, float eps, int n, int in, const bf16_t *wg,  \
        const float *bg, const bf16_t *wu, const float *bu, bf16_t *out, int inter
#define SWIGLU_ARGS x, norm_w, eps, in, wg, bg, wu, bu, out, inter
#if SWIGLU1_MAXNREG
#define SWIGLU1_BOUNDS __maxnreg__(SWIGLU1_MAXNREG)
#else
#define SWIGLU1_BOUNDS __launch_bounds__(32 * GEMV_BLOCK_WARPS, GEMV_MIN_BLOCKS)
#endif
extern "C" __global__ void SWIGLU1_BOUNDS gemv_bf16_swiglu_1(SWIGLU_PARAMS) {
    TD_SCOPE("gemv_bf16_swiglu_1");
    swiglu_kernel<1>(SWIGLU_ARGS);
}
extern "C" __global__ void __launch_bounds__(32 * GEMV_BLOCK_WARPS, GEMV_MIN_BLOCKS) gemv_bf16_swiglu_2(SWIGLU_PARAMS) {
    TD_SCOPE("gemv_bf16_swiglu_2");
    swiglu_kernel<2>(SWIGLU_ARGS);
}
extern "C" __global__ void __launch_bounds__(32 * GEMV_BLOCK_WARPS, GEMV_MIN_BLOCKS) gemv_bf16_swiglu_3(SWIGLU_PARAMS) {
    TD_SCOPE("gemv_bf16_swiglu_3");
    swiglu_kernel<3>(SWIGLU_ARGS);
}
extern "C" __global__ void __launch_bounds__(32 * GEMV_BLOCK_WARPS, GEMV_MIN_BLOCKS) gemv_bf16_swiglu_4(SWIGLU_PARAMS) {
    TD_SCOPE("gemv_bf16_swiglu_4");
    swiglu_kernel<4>(SWIGLU_ARGS);
}

// ---- The MLP as one dataflow grid (fuse=on with TAPEDECK_FUSE=...,mlp) ----
//
// gate/up + SiLU·up and the down projection + residual add of one layer, for 1-2 rows, in one
// launch instead of two. Each of the two kernels ends in a tail (its last wave drains while no
// new weights are requested) and the second starts with a ramp; at batch 1 that boundary costs
// several microseconds a layer. Here the down projection is cut along its input into the same
// slices the separate down GEMV gives its warps (`splits`, host gemv_splits): slice c of every
// output needs only the SiLU·up features of chunk c, so it starts as soon as the gate/up blocks
// of chunk c are done, while those of later chunks still stream their weights.
//
// Work items follow blockIdx.x, which is the order blocks are dispatched in (CUB's single-pass
// scan relies on the same): gate/up chunk 0, 1, ..., with down slice c placed MLP_FLOW_LAG
// gate/up chunks after gate/up chunk c. A block only ever waits for blocks of smaller index,
// already running or done, so the grid cannot deadlock. A down item prefetches its weights
// before it waits. Its slice sum goes to `partial`; the last of an output group's `splits`
// items to arrive (a counter per group) adds the slices in slice order and then the residual,
// as gemv_kernel's split path does: the same bits as the two kernels. The residual stream is
// written only by those last arrivals, each after every gate/up item is done (all slices of
// its group waited for their chunk), so no gate/up block can still be reading it for its norm.
//
// counters (u32, one set per layer, zeroed before the first launch and left zeroed by every
// launch: each counter is cleared by the block that sees its last use): [c] gate/up blocks done
// of chunk c, [8 + c] down blocks of slice c past their wait (c < 8), [MLP_FLOW_GROUPS_AT + g]
// slices done of output group g. partial: (splits, N, hidden) f32. grid splits * (inter /
// splits / GEMV_WARPS + hidden / (MLP_FLOW_DROWS * GEMV_WARPS)), block 32 * GEMV_WARPS;
// hidden % (MLP_FLOW_DROWS * GEMV_WARPS) == 0, inter % (splits * GEMV_WARPS) == 0, splits <= 8.
#ifndef MLP_FLOW_LAG
#define MLP_FLOW_LAG 1
#endif
#define MLP_FLOW_GROUPS_AT 16
// Blocks per SM the entry points are compiled to fit (a sweep knob, as GEMV_MIN_BLOCKS): the
// separate down GEMV runs 3-4 blocks per SM on 71 registers, this grid 2 on 91 at 1.
// Output features a down warp takes (its rows GEMV_WARPS apart): 2 keeps 8 KB of weights in
// flight a warp, as gate/up does; 1 is the separate down GEMV's 4 KB.
#ifndef MLP_FLOW_DROWS
#define MLP_FLOW_DROWS 2
#endif
#ifndef MLP_FLOW_MIN_BLOCKS
#define MLP_FLOW_MIN_BLOCKS 1
#endif

template <int N>
__device__ __forceinline__ void mlp_flow_kernel(const void* x, const float* norm_w, float eps,
                                                int hidden, int inter, int splits,
                                                const bf16_t* wg, const float* bg,
                                                const bf16_t* wu, const float* bu, bf16_t* act,
                                                const bf16_t* wd, const float* bd, float* y,
                                                float* partial, unsigned* counters) {
    __shared__ int s_last;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    // Which item this block is: a gate/up block of chunk `chunk` or a down block of slice `chunk`.
    int gu_items = inter / splits / GEMV_WARPS, d_items = hidden / (MLP_FLOW_DROWS * GEMV_WARPS);
    int idx = blockIdx.x, chunk = 0;
    bool down = false;
    for (int i = 0; i < splits + MLP_FLOW_LAG; i++) {
        if (i < splits) {
            if (idx < gu_items) {
                chunk = i;
                break;
            }
            idx -= gu_items;
        }
        if (i >= MLP_FLOW_LAG) {
            if (idx < d_items) {
                chunk = i - MLP_FLOW_LAG;
                down = true;
                break;
            }
            idx -= d_items;
        }
    }
    int slice = inter / splits;
    if (!down) {
        // gate/up + SiLU·up of feature `row`, as swiglu_kernel computes it.
        int row = chunk * slice + idx * GEMV_WARPS + warp;
        size_t at = (size_t)row * hidden;
        uint4 pre_g[GEMV_PRE], pre_u[GEMV_PRE];
        gemv_prefetch(wg + at, hidden, lane, true, pre_g);
        gemv_prefetch(wu + at, hidden, lane, true, pre_u);
        norm_prefetch(norm_w, hidden);
        pdl_launch_dependents();
        pdl_wait();
        if (norm_w) x = gemv_norm_prologue<N>((const float*)x, norm_w, eps, hidden);
        float g[N], u[N];
        gemv_row<N, false>(wg + at, pre_g, x, hidden, 0, hidden, lane, g);
        gemv_row<N, false>(wu + at, pre_u, x, hidden, 0, hidden, lane, u);
        swiglu_store<N>(g, u, bg, bu, act, inter, row, lane);
        __syncthreads();
        if (threadIdx.x == 0) {
            __threadfence();
            atomicAdd(counters + chunk, 1u);
        }
        return;
    }
    // Slice `chunk` of output features `row0 + j * GEMV_WARPS` (j < MLP_FLOW_DROWS) of the down
    // projection, each as one of gemv_kernel's split warps computes it: a warp keeps as many
    // weight bytes in flight as a gate/up warp.
    int row0 = idx * MLP_FLOW_DROWS * GEMV_WARPS + warp, k0 = chunk * slice;
    uint4 pre[MLP_FLOW_DROWS][GEMV_PRE];
#pragma unroll
    for (int j = 0; j < MLP_FLOW_DROWS; j++)
        gemv_prefetch(wd + (size_t)(row0 + j * GEMV_WARPS) * inter + k0, slice, lane, true,
                      pre[j]);
    pdl_launch_dependents();
    pdl_wait();
    unsigned passed = 0;
    if (threadIdx.x == 0) {
        while (ld_acquire_u32(counters + chunk) < (unsigned)gu_items) {
        }
        __threadfence();
        // Read only at the end: its latency hides behind the sums.
        passed = atomicAdd(counters + 8 + chunk, 1u);
    }
    __syncthreads();
    float acc[MLP_FLOW_DROWS][N];
#pragma unroll
    for (int j = 0; j < MLP_FLOW_DROWS; j++)
        gemv_row<N, false>(wd + (size_t)(row0 + j * GEMV_WARPS) * inter + k0, pre[j], act, inter,
                           k0, slice, lane, acc[j]);
    if (splits == 1) {
#pragma unroll
        for (int j = 0; j < MLP_FLOW_DROWS; j++)
            gemv_store<N>(acc[j], bd, y, hidden, row0 + j * GEMV_WARPS, 1, lane);
    } else {
#pragma unroll
        for (int j = 0; j < MLP_FLOW_DROWS; j++) {
#pragma unroll
            for (int r = 0; r < N; r++) {
                if (lane == r)
                    partial[((size_t)chunk * N + r) * hidden + row0 + j * GEMV_WARPS] = acc[j][r];
            }
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            __threadfence();
            unsigned* group = counters + MLP_FLOW_GROUPS_AT + idx;
            s_last = atomicAdd(group, 1u) == (unsigned)splits - 1;
            if (s_last) {
                *group = 0u;  // every slice of the group has arrived
                __threadfence();
            }
        }
        __syncthreads();
        if (s_last) {
            // The slices in slice order, as gemv_kernel adds its warps' sums.
#pragma unroll
            for (int j = 0; j < MLP_FLOW_DROWS; j++) {
                int row = row0 + j * GEMV_WARPS;
                float sum[N];
#pragma unroll
                for (int r = 0; r < N; r++) {
                    sum[r] = __ldcg(partial + (size_t)r * hidden + row);
                    for (int s = 1; s < splits; s++)
                        sum[r] += __ldcg(partial + ((size_t)s * N + r) * hidden + row);
                }
                gemv_store<N>(sum, bd, y, hidden, row, 1, lane);
            }
        }
    }
    // The last down block of the slice past its wait: no block reads the slice's counters again.
    if (threadIdx.x == 0 && passed == (unsigned)d_items - 1) {
        counters[chunk] = 0u;
        counters[8 + chunk] = 0u;
    }
}

#define MLP_FLOW_PARAMS                                                                          \
    const void *x, int x_f32, const float *norm_w, float eps, int n, int hidden, int inter,     \
        int splits, const bf16_t *wg, const float *bg, const bf16_t *wu, const float *bu,       \
        bf16_t *act, const bf16_t *wd, const float *bd, float *y, float *partial,               \
        unsigned *counters
#define MLP_FLOW_ARGS \
    x, norm_w, eps, hidden, inter, splits, wg, bg, wu, bu, act, wd, bd, y, partial, counters
extern "C" __global__ void __launch_bounds__(32 * GEMV_WARPS, MLP_FLOW_MIN_BLOCKS) mlp_flow_1(MLP_FLOW_PARAMS) {
    TD_SCOPE("mlp_flow_1");
    mlp_flow_kernel<1>(MLP_FLOW_ARGS);
}
extern "C" __global__ void __launch_bounds__(32 * GEMV_WARPS, MLP_FLOW_MIN_BLOCKS) mlp_flow_2(MLP_FLOW_PARAMS) {
    TD_SCOPE("mlp_flow_2");
    mlp_flow_kernel<2>(MLP_FLOW_ARGS);
}

// ---- Streaming GEMV for one input row (TAPEDECK_GEMV_STREAM) ----
//
// The GEMV kernels above give each block one group of rows: a block issues its weight loads, waits
// for them, sums and exits, and the next block on that SM only then issues its own. With a few
// waves per launch (gate/up: 1024 blocks, 264 resident on an H100) the blocks move in step, and
// each SM's memory pipe drains at every wave's end: the kernel trace of the thirteenth/fourteenth
// sessions shows gate/up and down at 2.0-2.3 TB/s in the step while the head GEMV (40 waves) holds
// 3.15 TB/s. Here a grid of a few blocks per SM stays resident and every warp streams its rows
// through a ring of GEMV_STREAM_DEPTH register buffers: a unit's loads are issued as soon as the
// unit DEPTH places earlier is summed, so DEPTH - 1 units stay in flight while one is summed, with
// no gap between rows. A unit is one warp's slice of one weight row (at most 2048 inputs, 8
// 16-byte chunks per lane); a task is one output feature: its `per` units in slice order (the
// GEMV's splits) or gate then up (SwiGLU). Each unit is summed exactly as gemv_row sums a slice
// (lane chunks lane + 32 u in order, then warp_sum) and the slices are added in order, so the
// results are the other kernels' bits. Warp w of the grid takes tasks w, w + warps, ...
#ifndef GEMV_STREAM_DEPTH
#define GEMV_STREAM_DEPTH 3
#endif
// Blocks per SM the streaming entry points are compiled to fit (__launch_bounds__ minimum).
#ifndef GEMV_STREAM_MIN_BLOCKS
#define GEMV_STREAM_MIN_BLOCKS 2
#endif

// Streams this warp's units: `tasks` tasks of `per` units each, unit j of task i being
// unit_w(i, j) (its weights: `len` inputs, applied to x from input j * k_step: the slices of one
// row, or the same x for every unit), summed into done(i, j, sum). The first DEPTH units are
// requested before the PDL wait (weights only), then `ready()` returns x once the previous kernel
// is done.
template <bool XF32, typename UnitW, typename Ready, typename Done>
__device__ __forceinline__ void stream_units(int tasks, int per, int in, int len, int k_step,
                                             int lane, UnitW unit_w, Ready ready, Done done) {
    constexpr int D = GEMV_STREAM_DEPTH;
    const int units = tasks * per, chunks = len / 8;
    uint4 buf[D][GEMV_PRE];
#pragma unroll
    for (int d = 0; d < D; d++) {
        if (d < units) gemv_prefetch(unit_w(d / per, d % per), len, lane, true, buf[d]);
    }
    const void* x = ready();
    for (int base = 0; base < units; base += D) {
#pragma unroll
        for (int d = 0; d < D; d++) {
            int u = base + d;
            if (u < units) {
                int i = u / per, j = u - i * per;
                float acc[1] = {0.0f};
#pragma unroll
                for (int v = 0; v < GEMV_PRE; v++) {
                    int c = lane + 32 * v;
                    if (c < chunks) gemv_chunk<1, XF32>(buf[d][v], x, in, j * k_step, c, acc);
                }
                int next = u + D;
                if (next < units) gemv_prefetch(unit_w(next / per, next % per), len, lane, true, buf[d]);
                done(i, j, warp_sum(acc[0]));
            }
        }
    }
}

// gemv_bf16_1's computation (same arguments, same bits) for slices of at most 2048 inputs
// (in / splits <= 2048), on any grid: warps of the grid take output features in turn.
// grid (a few blocks per SM), block 32 * GEMV_WARPS.
__device__ __forceinline__ void gemv_stream_kernel(GemvInput input, int in, int splits, int add,
                                                   const bf16_t* w0, const float* b0, float* y0,
                                                   int out0, const bf16_t* w1, const float* b1,
                                                   float* y1, int out1, const bf16_t* w2,
                                                   const float* b2, float* y2, int out2) {
    int lane = threadIdx.x & 31;
    int gw = blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5), warps = gridDim.x * GEMV_WARPS;
    int total = out0 + out1 + out2, len = in / splits;
    if (len > 32 * 8 * GEMV_PRE) return;  // the host never launches it so
    int tasks = gw < total ? (total - 1 - gw) / warps + 1 : 0;
    // Task i of this warp: output feature gw + i * warps of the concatenated matrices.
    auto task = [&](int i) {
        return gemv_target(gw + i * warps, w0, b0, y0, out0, w1, b1, y1, out1, w2, b2, y2, out2);
    };
    auto unit_w = [&](int i, int j) {
        GemvTarget t = task(i);
        return t.w + (size_t)t.row * in + (size_t)j * len;
    };
    int x_f32 = 0;
    // Every warp of the block must reach the norm prologue's barriers, with or without tasks.
    auto ready = [&]() {
        input.prefetch(in);
        pdl_launch_dependents();
        pdl_wait();
        return input(1, in, &x_f32);
    };
    float sum = 0.0f;
    auto done = [&](int i, int j, float s) {
        sum = j == 0 ? s : sum + s;
        if (j == splits - 1) {
            GemvTarget t = task(i);
            float acc[1] = {sum};
            gemv_store<1>(acc, t.b, t.y, t.out, t.row, add, lane);
        }
    };
    // Input rows read as f32 and rounded, or bf16 bits (the normalized rows, or an input staged in
    // shared memory: gemv_x_prologue stores bf16 bits, whatever it was given).
    if (!input.reads_f32(1, in))
        stream_units<false>(tasks, splits, in, len, len, lane, unit_w, ready, done);
    else
        stream_units<true>(tasks, splits, in, len, len, lane, unit_w, ready, done);
}

extern "C" __global__ void __launch_bounds__(32 * GEMV_WARPS, GEMV_STREAM_MIN_BLOCKS) gemv_stream_bf16_1(GEMV_PARAMS) {
    TD_SCOPE("gemv_stream_bf16_1");
    gemv_stream_kernel(GEMV_ARGS(32 * GEMV_WARPS));
}

// gemv_bf16_swiglu_1's computation (same arguments, same bits) for in <= 2048, on any grid: each
// warp's tasks are output features, each two units (the gate row, then the up row).
// grid (a few blocks per SM), block 32 * GEMV_WARPS.
extern "C" __global__ void __launch_bounds__(32 * GEMV_WARPS, GEMV_STREAM_MIN_BLOCKS) gemv_stream_swiglu_1(SWIGLU_PARAMS) {
    TD_SCOPE("gemv_stream_swiglu_1");
    int lane = threadIdx.x & 31;
    int gw = blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5), warps = gridDim.x * GEMV_WARPS;
    if (in > 32 * 8 * GEMV_PRE) return;  // the host never launches it so
    int tasks = gw < inter ? (inter - 1 - gw) / warps + 1 : 0;
    auto unit_w = [&](int i, int j) {
        return (j == 0 ? wg : wu) + (size_t)(gw + i * warps) * in;
    };
    auto ready = [&]() {
        norm_prefetch(norm_w, in);
        pdl_launch_dependents();
        pdl_wait();
        return norm_w ? (const void*)gemv_norm_prologue<1>((const float*)x, norm_w, eps, in) : x;
    };
    float g[1] = {0.0f};
    auto done = [&](int i, int j, float s) {
        if (j == 0) {
            g[0] = s;
        } else {
            float u[1] = {s};
            swiglu_store<1>(g, u, bg, bu, out, inter, gw + i * warps, lane);
        }
    };
    stream_units<false>(tasks, 2, in, in, 0, lane, unit_w, ready, done);
}

// ---- L2 prefetch of weights later kernels read (TAPEDECK_L2_PREFETCH) ----
//
// At batch 1 the attention half of a layer (q/k/v, attention, its merge, o) reads ~22 MB in
// ~15-20 µs, so the memory pipe idles most of that time, and the gate/up GEMV that follows starts
// from DRAM. This kernel, launched with PDL beside the kernel before it, asks the L2 to fetch up
// to four byte ranges (the first rows of gate and up, the o weights) while the attention runs.
// It changes no value: the prefetch is a hint the L2 may drop. It then waits for the kernel
// before it (griddepcontrol.wait) before it ends, so that the kernel after it, which waits for
// this one, still sees the one before complete. Ranges are 16-byte aligned, multiples of 16.
#ifndef L2_PREFETCH_PIECE
#define L2_PREFETCH_PIECE 16384
#endif
// 1: the prefetched lines are marked evict_last (kept over lines read once).
#ifndef L2_PREFETCH_EVICT_LAST
#define L2_PREFETCH_EVICT_LAST 0
#endif

// Thread t of `threads` requests pieces t, t + threads, ... of [p, p + bytes).
__device__ __forceinline__ void l2_prefetch_range(const char* p, unsigned long long bytes, int t,
                                                  int threads) {
#if __CUDA_ARCH__ >= 900
    const unsigned long long step = (unsigned long long)threads * L2_PREFETCH_PIECE;
    for (unsigned long long off = (unsigned long long)t * L2_PREFETCH_PIECE; off < bytes;
         off += step) {
        unsigned long long left = bytes - off;
        unsigned int size = left < L2_PREFETCH_PIECE ? (unsigned int)left : L2_PREFETCH_PIECE;
#if L2_PREFETCH_EVICT_LAST
        unsigned long long policy;
        asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(policy));
        asm volatile("cp.async.bulk.prefetch.L2.global.L2::cache_hint [%0], %1, %2;"
                     ::"l"(p + off), "r"(size), "l"(policy) : "memory");
#else
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p + off), "r"(size)
                     : "memory");
#endif
    }
#else
    // Before sm_90: one 128-byte line per instruction.
    for (unsigned long long off = (unsigned long long)t * 128; off < bytes;
         off += (unsigned long long)threads * 128)
        asm volatile("prefetch.global.L2 [%0];" ::"l"(p + off));
#endif
}

// grid (a few blocks), block 128; may be launched with PDL.
extern "C" __global__ void l2_prefetch(const char* a, unsigned long long a_bytes, const char* b,
                                       unsigned long long b_bytes, const char* c,
                                       unsigned long long c_bytes, const char* d,
                                       unsigned long long d_bytes) {
    TD_SCOPE("l2_prefetch");
    // Consecutive pieces go to consecutive blocks (so to different SMs' copy engines): with
    // fewer pieces than threads every block still issues some, where numbering threads within
    // a block first left all the work to the first few blocks (one ran 46 µs on an H100).
    int t = threadIdx.x * gridDim.x + blockIdx.x, threads = gridDim.x * blockDim.x;
    l2_prefetch_range(a, a_bytes, t, threads);
    l2_prefetch_range(b, b_bytes, t, threads);
    l2_prefetch_range(c, c_bytes, t, threads);
    l2_prefetch_range(d, d_bytes, t, threads);
    pdl_launch_dependents();
    pdl_wait();
}

// Rotary embedding of the new tokens' queries and keys, then the write of their keys and values
// into the pool at their slots, in one launch (what a RoPE kernel followed by a KV-write kernel
// computes, the same arithmetic, so the same bits).
//
// Rotary: rotate-half, dimension i pairs with i + hd/2; the angle is pos * inv_freq[i] in f32 as
// transformers computes it. Storage: as the cache dtype would hold the values (mode 0 f32, 1 bf16,
// 2 FP8 E4M3 with one amax/448 scale per token and head); the rounded keys and values are also
// written back to k and v. q (n, heads, hd), k and v (n, kv_heads, hd), slots (n): -1 for a padded
// row of a graph pass, which writes nothing to the pool.
// grid (n, heads + kv_heads): one block per query head, then per KV head; block = hd rounded up to
// 32 (hd ≤ 256).
// Dimensions (i, i + hd/2) of one head at position pos rotated by the angle pos * inv_freq[i]
// (rotate-half RoPE): shared by rope_kv_write and the fused q/k/v kernel, so both round alike.
__device__ __forceinline__ void rope_rotate(float a, float b, int pos, float inv_freq, float* lo,
                                            float* hi) {
    float s, c;
    sincosf((float)pos * inv_freq, &s, &c);
    *lo = a * c - b * s;
    *hi = b * c + a * s;
}

// The work of block (t, h) of rope_kv_write, by threads 0..hd-1 of the block (the others, and
// every thread of a block wider than rope_kv_write's, compute nothing and write nothing): shared
// with the persistent decode kernel (decode_step.cu), which writes rotated queries to q_out (the
// same layout as q) instead of in place.
// k_scale, v_scale: an FP8 pool's per-(token, KV head) scales (unused for the other pools).
template <typename KV>
__device__ __forceinline__ void rope_kv_head(float* q, float* q_out, float* k, float* v, KV* k_pool,
                                             KV* v_pool, float* k_scale, float* v_scale,
                                             const int* pos, const float* inv_freq,
                                             const int* slots, int heads, int kv_heads, int hd,
                                             int mode, int t, int h) {
    __shared__ float s32[32];
    __shared__ float rotated[256];
    int d = threadIdx.x, half = hd / 2;
    bool is_q = h < heads;
    int kvh = h - heads;
    float* row = is_q ? q + ((size_t)t * heads + h) * hd : k + ((size_t)t * kv_heads + kvh) * hd;
    float lo = 0.0f, hi = 0.0f;
    if (d < half) rope_rotate(row[d], row[d + half], pos[t], inv_freq[d], &lo, &hi);
    if (is_q) {
        if (d < half) {
            float* orow = q_out + ((size_t)t * heads + h) * hd;
            orow[d] = lo;
            orow[d + half] = hi;
        }
        return;
    }
    if (d < half) {
        rotated[d] = lo;
        rotated[d + half] = hi;
    }
    __syncthreads();
    bool live = d < hd;
    size_t src = ((size_t)t * kv_heads + kvh) * hd + d;
    float kx = live ? rotated[d] : 0.0f;
    float vx = live ? v[src] : 0.0f;
    fp8_t kc = 0, vc = 0;
    float ks = 0.0f, vs = 0.0f;
    if (mode == 1) {
        kx = round_bf16(kx);
        vx = round_bf16(vx);
    } else if (mode == 2 && sizeof(KV) == 1) {
        // An FP8 pool: codes and one scale per head, as kv_host.rs stores them.
        ks = fp8_head_scale(block_max(fabsf(kx), s32));
        vs = fp8_head_scale(block_max(fabsf(vx), s32));
        kc = fp8_store(kx, ks, &kx);
        vc = fp8_store(vx, vs, &vx);
    } else if (mode == 2) {
        float ka = block_max(fabsf(kx), s32);
        float va = block_max(fabsf(vx), s32);
        if (ka != 0.0f && isfinite(ka)) {
            float sc = ka / 448.0f;
            kx = round_fp8_e4m3(kx / sc) * sc;
        }
        if (va != 0.0f && isfinite(va)) {
            float sc = va / 448.0f;
            vx = round_fp8_e4m3(vx / sc) * sc;
        }
    }
    if (!live) return;
    k[src] = kx;
    v[src] = vx;
    if (slots[t] < 0) return;
    size_t dst = ((size_t)slots[t] * kv_heads + kvh) * hd + d;
    if constexpr (sizeof(KV) == 1) {
        k_pool[dst] = kc;
        v_pool[dst] = vc;
        if (d == 0) {
            k_scale[dst / hd] = ks;
            v_scale[dst / hd] = vs;
        }
    } else {
        kv_put(k_pool, dst, kx);
        kv_put(v_pool, dst, vx);
    }
}

#define ROPE_KV_PARAMS(KV)                                                                       \
    float *q, float *k, float *v, KV *k_pool, KV *v_pool, float *k_scale, float *v_scale,        \
        const int *pos, const float *inv_freq, const int *slots, int heads, int kv_heads, int hd, \
        int mode
#define ROPE_KV_ARGS                                                                              \
    q, q, k, v, k_pool, v_pool, k_scale, v_scale, pos, inv_freq, slots, heads, kv_heads, hd, mode, \
        blockIdx.x, blockIdx.y
extern "C" __global__ void rope_kv_write(ROPE_KV_PARAMS(float)) {
    TD_SCOPE("rope_kv_write");
    pdl_launch_dependents();
    pdl_wait();
    rope_kv_head(ROPE_KV_ARGS);
}
extern "C" __global__ void rope_kv_write_bf16kv(ROPE_KV_PARAMS(bf16_t)) {
    TD_SCOPE("rope_kv_write_bf16kv");
    pdl_launch_dependents();
    pdl_wait();
    rope_kv_head(ROPE_KV_ARGS);
}
extern "C" __global__ void rope_kv_write_fp8kv(ROPE_KV_PARAMS(fp8_t)) {
    TD_SCOPE("rope_kv_write_fp8kv");
    pdl_launch_dependents();
    pdl_wait();
    rope_kv_head(ROPE_KV_ARGS);
}
#undef ROPE_KV_PARAMS
#undef ROPE_KV_ARGS

// The q/k/v projections with RoPE and the KV write in their epilogue (`fuse=on`): what gemv_bf16_N
// over (q, k, v) followed by rope_kv_write computes, the same arithmetic in the same order, so the
// same bits, in one launch instead of two. A warp owns the rotary pair of rows (i, i + hd/2) of one
// head of q, k or v (v's pairs are not rotated, only stored), so the rotation has both of its
// inputs in registers. KV storage modes 0 (f32) and 1 (bf16) only: FP8's per-head scale needs the
// whole head, so that mode keeps the separate rope_kv_write. x: bf16 bits, or with norm_w the f32
// residual stream normalized first (x_f32 must be 0, as for the gate/up kernel). Writes q (rotated), k (rotated, rounded) and v (rounded) like
// rope_kv_write, and the pool rows at slots[t] (none for slot -1). May be launched with PDL.
// grid (ceil((heads + 2 kv_heads) * hd / 2 / GEMV_WARPS)), block 32 * GEMV_WARPS.
// 1: qkv_rope_kernel reads its rows' positions, rotary frequencies and cache slots before its PDL
// wait (into three registers), not after its dot products: one dependent round trip to memory
// less after the wait. The same bits. On by default since session 25 (H100, batch-1 decode:
// alone 914 -> 915 tok/s, within noise; kept on as part of the measured all-on set, 935).
// A sweep knob (TAPEDECK_NVRTC_DEFINES=QKV_INDEX_EARLY=0|1).
#ifndef QKV_INDEX_EARLY
#define QKV_INDEX_EARLY 1
#endif
// EMBED (the first layer's `_embed_1` entry points): x is the embedding table and the row is
// token id_raw, or fed[0] where id_raw is FED_TOKEN (embed_tokens' choice). fed[0] is read after
// the wait: in a pass launched eagerly right behind the one that picked it, that pick may still
// be running.
template <int N, typename KV, bool EMBED = false>
__device__ __forceinline__ void qkv_rope_kernel(const void* x, const float* norm_w, float eps,
                                                int in, const bf16_t* wq, const float* bq,
                                                const bf16_t* wk, const float* bk,
                                                const bf16_t* wv, const float* bv, float* q,
                                                float* k, float* v, KV* k_pool, KV* v_pool,
                                                const int* pos, const float* inv_freq,
                                                const int* slots, int heads, int kv_heads, int hd,
                                                int mode, unsigned int id_raw = 0,
                                                const unsigned int* fed = nullptr) {
    int lane = threadIdx.x & 31, half = hd / 2;
    int pair = blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5);
    int h = pair / half, i = pair % half;
    bool live = h < heads + 2 * kv_heads;
    // which: 0 q, 1 k, 2 v; hh: the head within its matrix.
    int which = h < heads ? 0 : h < heads + kv_heads ? 1 : 2;
    int hh = which == 0 ? h : which == 1 ? h - heads : h - heads - kv_heads;
    const bf16_t* w = which == 0 ? wq : which == 1 ? wk : wv;
    const float* b = which == 0 ? bq : which == 1 ? bk : bv;
    int r0 = hh * hd + i, r1 = r0 + half;
    const bf16_t* w0 = w + (live ? (size_t)r0 * in : 0);
    const bf16_t* w1 = w + (live ? (size_t)r1 * in : 0);
#if QKV_ASYNC
    uint4* slot0 = two_row_stage(QKV_STAGE_BYTES);
    uint4* slot1 = slot0 + GEMV_PRE * 32;
    gemv_stage_init();
    gemv_stage<GEMV_PRE>(w0, in, lane, live, slot0);
    gemv_stage<GEMV_PRE>(w1, in, lane, live, slot1);
    const StagedChunks pre0{slot0 + lane}, pre1{slot1 + lane};
#else
    uint4 pre0[GEMV_PRE], pre1[GEMV_PRE];
    const int early = QKV_PRE_EARLY;
    gemv_prefetch_span(w0, in, lane, live, pre0, 0, early);
    gemv_prefetch_span(w1, in, lane, live, pre1, 0, early);
#endif
    norm_prefetch(norm_w, in);
#if QKV_INDEX_EARLY
    // The position, rotary frequency and cache slot this lane's row needs, read before the wait:
    // the pass's index data (uploaded before its first kernel) and a constant table, not
    // anything the kernel before wrote.
    int pos_early = 0, slot_early = -1;
    float freq_early = 0.0f;
    if (live && lane < N) {
        if (which < 2) pos_early = pos[lane], freq_early = inv_freq[i];
        if (which > 0) slot_early = slots[lane];
    }
#endif
    pdl_launch_dependents();
    pdl_wait();
    if constexpr (EMBED) x = (const float*)x + embed_row_of(id_raw, fed, in);
    if (norm_w) x = gemv_norm_prologue<N>((const float*)x, norm_w, eps, in);
#if QKV_ASYNC
    gemv_stage_wait();
#else
    gemv_prefetch_span(w0, in, lane, live, pre0, early, GEMV_PRE);
    gemv_prefetch_span(w1, in, lane, live, pre1, early, GEMV_PRE);
#endif
    TD_MARK(1);
    if (!live) return;
    float s0[N], s1[N];
    gemv_row<N, false>(w0, pre0, x, in, 0, in, lane, s0);
    gemv_row<N, false>(w1, pre1, x, in, 0, in, lane, s1);
    TD_MARK(2);
    int nheads = which == 0 ? heads : kv_heads;
    float* y = which == 0 ? q : which == 1 ? k : v;
    KV* pool = which == 1 ? k_pool : v_pool;
#pragma unroll
    for (int r = 0; r < N; r++) {
        if (lane != r) continue;
        // gemv_store's epilogue, then rope_kv_head's.
        float a = b ? s0[r] + b[r0] : s0[r];
        float c = b ? s1[r] + b[r1] : s1[r];
#if QKV_INDEX_EARLY
        const int pos_r = pos_early, slot_r = slot_early;
        const float freq_i = freq_early;
#else
        const int pos_r = which < 2 ? pos[r] : 0, slot_r = which > 0 ? slots[r] : -1;
        const float freq_i = which < 2 ? inv_freq[i] : 0.0f;
#endif
        if (which < 2) rope_rotate(a, c, pos_r, freq_i, &a, &c);
        if (which > 0 && mode == 1) {
            a = round_bf16(a);
            c = round_bf16(c);
        }
        size_t at = ((size_t)r * nheads + hh) * hd;
        y[at + i] = a;
        y[at + i + half] = c;
        if (which == 0 || slot_r < 0) continue;
        size_t dst = ((size_t)slot_r * kv_heads + hh) * hd;
        kv_put(pool, dst + i, a);
        kv_put(pool, dst + i + half, c);
    }
}

#define QKV_ROPE_PARAMS(KV)                                                                      \
    const void *x, int x_f32, const float *norm_w, float eps, int n, int in, const bf16_t *wq, \
        const float *bq, const bf16_t *wk, const float *bk, const bf16_t *wv, const float *bv,   \
        float *q, float *k, float *v, KV *k_pool, KV *v_pool, float *k_scale, float *v_scale,   \
        const int *pos, const float *inv_freq, const int *slots, int heads, int kv_heads, int hd, \
        int mode
#define QKV_ROPE_ARGS                                                                            \
    x, norm_w, eps, in, wq, bq, wk, bk, wv, bv, q, k, v, k_pool, v_pool, pos, inv_freq, slots,  \
        heads, kv_heads, hd, mode
// The one-row entry points' register cap (0: the compiler's choice, 108). 96 (no spills) lets one
// block (24576 registers) launch early beside two 64-register down blocks of the layer before
// (see GEMV1_MIN_BLOCKS). A sweep knob (TAPEDECK_NVRTC_DEFINES=QKV1_MAXNREG=96): level beside
// GEMV1_MIN_BLOCKS=4 (H100, twenty-first session; down then fills the SMs at four blocks).
#ifndef QKV1_MAXNREG
#define QKV1_MAXNREG 0
#endif
#if QKV1_MAXNREG
#define QKV1_BOUNDS __maxnreg__(QKV1_MAXNREG)
#else
#define QKV1_BOUNDS __launch_bounds__(32 * GEMV_WARPS, GEMV_MIN_BLOCKS)
#endif
// The entry points (written out, not generated, so a reader and the engine's entry-point test
// can find them).
extern "C" __global__ void QKV1_BOUNDS gemv_bf16_qkv_rope_1(QKV_ROPE_PARAMS(float)) {
    TD_SCOPE("gemv_bf16_qkv_rope_1");
    qkv_rope_kernel<1>(QKV_ROPE_ARGS);
}
extern "C" __global__ void __launch_bounds__(32 * GEMV_WARPS, GEMV_MIN_BLOCKS) gemv_bf16_qkv_rope_2(QKV_ROPE_PARAMS(float)) {
    TD_SCOPE("gemv_bf16_qkv_rope_2");
    qkv_rope_kernel<2>(QKV_ROPE_ARGS);
}
extern "C" __global__ void __launch_bounds__(32 * GEMV_WARPS, GEMV_MIN_BLOCKS) gemv_bf16_qkv_rope_3(QKV_ROPE_PARAMS(float)) {
    TD_SCOPE("gemv_bf16_qkv_rope_3");
    qkv_rope_kernel<3>(QKV_ROPE_ARGS);
}
extern "C" __global__ void __launch_bounds__(32 * GEMV_WARPS, GEMV_MIN_BLOCKS) gemv_bf16_qkv_rope_4(QKV_ROPE_PARAMS(float)) {
    TD_SCOPE("gemv_bf16_qkv_rope_4");
    qkv_rope_kernel<4>(QKV_ROPE_ARGS);
}
extern "C" __global__ void QKV1_BOUNDS gemv_bf16_qkv_rope_bf16kv_1(QKV_ROPE_PARAMS(bf16_t)) {
    TD_SCOPE("gemv_bf16_qkv_rope_bf16kv_1");
    qkv_rope_kernel<1>(QKV_ROPE_ARGS);
}
extern "C" __global__ void __launch_bounds__(32 * GEMV_WARPS, GEMV_MIN_BLOCKS) gemv_bf16_qkv_rope_bf16kv_2(QKV_ROPE_PARAMS(bf16_t)) {
    TD_SCOPE("gemv_bf16_qkv_rope_bf16kv_2");
    qkv_rope_kernel<2>(QKV_ROPE_ARGS);
}
extern "C" __global__ void __launch_bounds__(32 * GEMV_WARPS, GEMV_MIN_BLOCKS) gemv_bf16_qkv_rope_bf16kv_3(QKV_ROPE_PARAMS(bf16_t)) {
    TD_SCOPE("gemv_bf16_qkv_rope_bf16kv_3");
    qkv_rope_kernel<3>(QKV_ROPE_ARGS);
}
extern "C" __global__ void __launch_bounds__(32 * GEMV_WARPS, GEMV_MIN_BLOCKS) gemv_bf16_qkv_rope_bf16kv_4(QKV_ROPE_PARAMS(bf16_t)) {
    TD_SCOPE("gemv_bf16_qkv_rope_bf16kv_4");
    qkv_rope_kernel<4>(QKV_ROPE_ARGS);
}
// The first layer's one-row q/k/v launch of a decode step that gathers its input itself
// (TAPEDECK_EMBED_FUSED=on): x is the embedding table, ids the pass's token ids (a fed id reads
// the previous pass's pick, as embed_tokens does; fed may be 0 when no id is fed), and block 0
// writes the row to the residual stream x_out. The step then has no embed_tokens launch: this
// kernel, the graph's first, no longer waits for it (~2.9 µs and a kernel boundary before the
// first GEMV's input in the twenty-fifth session's trace). The same values in the same order as
// embed_tokens + gemv_bf16_qkv_rope(_bf16kv)_1, so the same bits. The pass's id (its upload) is
// loaded at the start, the fed one after the PDL wait (see qkv_rope_kernel).
#define QKV_EMBED_PARAMS(KV) \
    QKV_ROPE_PARAMS(KV), const unsigned int *ids, const unsigned int *fed, float *x_out
#define QKV_EMBED_BODY(KV)                                                                 \
    const unsigned int id_raw = ids[0];                                                    \
    qkv_rope_kernel<1, KV, true>(QKV_ROPE_ARGS, id_raw, fed);                              \
    if (blockIdx.x == 0)                                                                   \
        copy_row(x_out, (const float*)x + embed_row_of(id_raw, fed, in), in);
extern "C" __global__ void QKV1_BOUNDS gemv_bf16_qkv_rope_embed_1(QKV_EMBED_PARAMS(float)) {
    TD_SCOPE("gemv_bf16_qkv_rope_embed_1");
    QKV_EMBED_BODY(float)
}
extern "C" __global__ void QKV1_BOUNDS gemv_bf16_qkv_rope_bf16kv_embed_1(QKV_EMBED_PARAMS(bf16_t)) {
    TD_SCOPE("gemv_bf16_qkv_rope_bf16kv_embed_1");
    QKV_EMBED_BODY(bf16_t)
}
#undef QKV_EMBED_PARAMS
#undef QKV_EMBED_BODY

// Per token of the batch, what attention needs (one int array, see cuda/mod.rs `Meta`):
//   seg[t]: the token's segment (row of the block tables); ctx[t]: positions it attends to
//   (0..ctx-1, itself included); hide[t]: one position masked out (the chunk-boundary fault) or -1.
#define ATT_WARPS 4
#define MAX_DPL 8  // head_dim up to 256 (dimensions per lane)

// Row offset in the pool of position j of KV head kvh of the sequence with this block table.
__device__ __forceinline__ size_t kv_offset(const int* table, int j, int bs, int kv_dim, int kvh,
                                            int hd) {
    return ((size_t)table[j / bs] * bs + j % bs) * kv_dim + (size_t)kvh * hd;
}

// Attention of one query head of one token over its context, f32 on CUDA cores (the `simt-f32`
// reference kernel), with online softmax; each warp takes every ATT_WARPS-th position and the
// warps' partial results are merged at the end. With bf16 != 0 the q·k and p·v inputs are rounded
// to bf16 (attn_scores=bf16). With rows != NULL, grid row r is token rows[r] (a subset of the
// batch); with scores != NULL the scores of grid row r come from there (the sparse top-k path:
// unselected positions hold -inf) instead of being computed.
// out, q (n, heads, hd). grid (rows, heads), block 32 * ATT_WARPS.
template <typename KV>
__device__ __forceinline__ void attention_impl(float* out, const float* q, const KV* k_pool,
                                               const KV* v_pool, const float* k_scale,
                                               const float* v_scale, const int* tables,
                                               int max_blocks, const int* seg, const int* ctx,
                                               const int* hide, const int* rows,
                                               const float* scores, int scores_stride, int heads,
                                               int kv_heads, int hd, int bs, float scale,
                                               int bf16) {
    __shared__ float s_m[ATT_WARPS], s_l[ATT_WARPS];
    __shared__ float s_acc[ATT_WARPS][MAX_DPL * 32];
    int r = blockIdx.x, h = blockIdx.y;
    int t = rows ? rows[r] : r;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int kvh = h / (heads / kv_heads), kv_dim = kv_heads * hd;
    int n_ctx = ctx[t], skip = hide[t];
    const int* table = tables + (size_t)seg[t] * max_blocks;
    const float* qh = q + ((size_t)t * heads + h) * hd;
    const float* sc_row = scores ? scores + ((size_t)r * heads + h) * scores_stride : 0;
    float qr[MAX_DPL], acc[MAX_DPL];
#pragma unroll
    for (int i = 0; i < MAX_DPL; i++) {
        int d = lane + 32 * i;
        float x = d < hd ? qh[d] : 0.0f;
        qr[i] = bf16 ? round_bf16(x) : x;
        acc[i] = 0.0f;
    }
    float m = NEG_INF, l = 0.0f;
    // A one-key software pipeline: the block-table lookup and the K and V loads (or the given
    // score) of position j + ATT_WARPS are issued before position j is summed, so a warp waits on
    // memory about once per key instead of three times (table, K, then V after the q·k
    // reduction). The arithmetic and its order are those of one key at a time.
    float kc[MAX_DPL], vc[MAX_DPL], sc = 0.0f;
    auto fetch = [&](int j, float kx[MAX_DPL], float vx[MAX_DPL], float* s) {
        bool in = j < n_ctx;
        size_t off = in ? kv_offset(table, j, bs, kv_dim, kvh, hd) : 0;
        float ksc = in ? kv_row_scale(k_pool, k_scale, off, hd) : 0.0f;
        float vsc = in ? kv_row_scale(v_pool, v_scale, off, hd) : 0.0f;
        *s = in && sc_row ? sc_row[j] : 0.0f;
#pragma unroll
        for (int i = 0; i < MAX_DPL; i++) {
            int d = lane + 32 * i;
            bool live = in && d < hd;
            kx[i] = live && !sc_row ? kv_get(k_pool, off + d, ksc) : 0.0f;
            vx[i] = live ? kv_get(v_pool, off + d, vsc) : 0.0f;
        }
    };
    fetch(warp, kc, vc, &sc);
    for (int j = warp; j < n_ctx; j += ATT_WARPS) {
        float kn[MAX_DPL], vn[MAX_DPL], sn;
        fetch(j + ATT_WARPS, kn, vn, &sn);
        float s = sc;
        bool live = j != skip && !(sc_row && s == NEG_INF);
        if (live && !sc_row) {
            float part = 0.0f;
#pragma unroll
            for (int i = 0; i < MAX_DPL; i++) {
                int d = lane + 32 * i;
                if (d < hd) part += qr[i] * (bf16 ? round_bf16(kc[i]) : kc[i]);
            }
            s = warp_sum(part) * scale;
        }
        if (live) {
            float m_new = fmaxf(m, s);
            float corr = expf(m - m_new);
            float p = expf(s - m_new);
            l = l * corr + p;
            float pv = bf16 ? round_bf16(p) : p;
#pragma unroll
            for (int i = 0; i < MAX_DPL; i++) {
                int d = lane + 32 * i;
                if (d < hd) acc[i] = acc[i] * corr + pv * (bf16 ? round_bf16(vc[i]) : vc[i]);
            }
            m = m_new;
        }
#pragma unroll
        for (int i = 0; i < MAX_DPL; i++) {
            kc[i] = kn[i];
            vc[i] = vn[i];
        }
        sc = sn;
    }
    if (lane == 0) {
        s_m[warp] = m;
        s_l[warp] = l;
    }
#pragma unroll
    for (int i = 0; i < MAX_DPL; i++) s_acc[warp][lane + 32 * i] = acc[i];
    __syncthreads();
    if (warp == 0) {
        float gm = NEG_INF;
        for (int w = 0; w < ATT_WARPS; w++) gm = fmaxf(gm, s_m[w]);
        float gl = 0.0f;
        float o[MAX_DPL];
#pragma unroll
        for (int i = 0; i < MAX_DPL; i++) o[i] = 0.0f;
        for (int w = 0; w < ATT_WARPS; w++) {
            if (s_m[w] == NEG_INF) continue;
            float c = expf(s_m[w] - gm);
            gl += s_l[w] * c;
#pragma unroll
            for (int i = 0; i < MAX_DPL; i++) o[i] += s_acc[w][lane + 32 * i] * c;
        }
        float inv = 1.0f / gl;
        float* oh = out + ((size_t)t * heads + h) * hd;
#pragma unroll
        for (int i = 0; i < MAX_DPL; i++) {
            int d = lane + 32 * i;
            if (d < hd) oh[d] = o[i] * inv;
        }
    }
}

// Scores q·k * scale of one query head of one token at every position of its context, for the
// sparse top-k decode path; positions past the context (and the hidden one) get -inf. Grid row r
// is token rows[r]. scores (rows, heads, stride). grid (rows, heads), block 32 * ATT_WARPS.
template <typename KV>
__device__ __forceinline__ void attention_scores_impl(float* scores, int scores_stride,
                                                      const float* q, const KV* k_pool,
                                                      const float* k_scale, const int* tables, int max_blocks,
                                                      const int* seg, const int* ctx,
                                                      const int* hide, const int* rows, int heads,
                                                      int kv_heads, int hd, int bs, float scale,
                                                      int bf16) {
    int r = blockIdx.x, h = blockIdx.y;
    int t = rows[r];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int kvh = h / (heads / kv_heads), kv_dim = kv_heads * hd;
    int n_ctx = ctx[t], skip = hide[t];
    const int* table = tables + (size_t)seg[t] * max_blocks;
    const float* qh = q + ((size_t)t * heads + h) * hd;
    float* row = scores + ((size_t)r * heads + h) * scores_stride;
    float qr[MAX_DPL];
#pragma unroll
    for (int i = 0; i < MAX_DPL; i++) {
        int d = lane + 32 * i;
        float x = d < hd ? qh[d] : 0.0f;
        qr[i] = bf16 ? round_bf16(x) : x;
    }
    // The next position's table lookup and K row are loaded before this one is reduced (as in
    // attention_impl): one wait on memory per key instead of two. Same arithmetic.
    float kc[MAX_DPL];
    auto fetch = [&](int j, float kx[MAX_DPL]) {
        bool in = j < n_ctx && j < scores_stride;
        size_t off = in ? kv_offset(table, j, bs, kv_dim, kvh, hd) : 0;
        float ksc = in ? kv_row_scale(k_pool, k_scale, off, hd) : 0.0f;
#pragma unroll
        for (int i = 0; i < MAX_DPL; i++) {
            int d = lane + 32 * i;
            kx[i] = in && d < hd ? kv_get(k_pool, off + d, ksc) : 0.0f;
        }
    };
    fetch(warp, kc);
    for (int j = warp; j < scores_stride; j += ATT_WARPS) {
        float kn[MAX_DPL];
        fetch(j + ATT_WARPS, kn);
        if (j >= n_ctx || j == skip) {
            if (lane == 0) row[j] = NEG_INF;
        } else {
            float part = 0.0f;
#pragma unroll
            for (int i = 0; i < MAX_DPL; i++) {
                int d = lane + 32 * i;
                if (d < hd) part += qr[i] * (bf16 ? round_bf16(kc[i]) : kc[i]);
            }
            float s = warp_sum(part) * scale;
            if (lane == 0) row[j] = s;
        }
#pragma unroll
        for (int i = 0; i < MAX_DPL; i++) kc[i] = kn[i];
    }
}

#define ATTENTION_PARAMS(KV)                                                                      \
    float *out, const float *q, const KV *k_pool, const KV *v_pool, const float *k_scale,        \
        const float *v_scale, const int *tables,                                                  \
        int max_blocks, const int *seg, const int *ctx, const int *hide, const int *rows,         \
        const float *scores, int scores_stride, int heads, int kv_heads, int hd, int bs,          \
        float scale, int bf16
#define ATTENTION_ARGS                                                                            \
    out, q, k_pool, v_pool, k_scale, v_scale, tables, max_blocks, seg, ctx, hide, rows, scores, scores_stride,      \
        heads, kv_heads, hd, bs, scale, bf16
#define SCORES_PARAMS(KV)                                                                         \
    float *scores, int scores_stride, const float *q, const KV *k_pool, const float *k_scale,     \
        const int *tables,                                                                        \
        int max_blocks, const int *seg, const int *ctx, const int *hide, const int *rows,          \
        int heads, int kv_heads, int hd, int bs, float scale, int bf16
#define SCORES_ARGS                                                                               \
    scores, scores_stride, q, k_pool, k_scale, tables, max_blocks, seg, ctx, hide, rows, heads, kv_heads,  \
        hd, bs, scale, bf16
extern "C" __global__ void attention(ATTENTION_PARAMS(float)) {
    TD_SCOPE("attention");
    attention_impl(ATTENTION_ARGS);
}
extern "C" __global__ void attention_bf16kv(ATTENTION_PARAMS(bf16_t)) {
    TD_SCOPE("attention_bf16kv");
    attention_impl(ATTENTION_ARGS);
}
extern "C" __global__ void attention_fp8kv(ATTENTION_PARAMS(fp8_t)) {
    TD_SCOPE("attention_fp8kv");
    attention_impl(ATTENTION_ARGS);
}
extern "C" __global__ void attention_scores(SCORES_PARAMS(float)) {
    TD_SCOPE("attention_scores");
    attention_scores_impl(SCORES_ARGS);
}
extern "C" __global__ void attention_scores_bf16kv(SCORES_PARAMS(bf16_t)) {
    TD_SCOPE("attention_scores_bf16kv");
    attention_scores_impl(SCORES_ARGS);
}
extern "C" __global__ void attention_scores_fp8kv(SCORES_PARAMS(fp8_t)) {
    TD_SCOPE("attention_scores_fp8kv");
    attention_scores_impl(SCORES_ARGS);
}
#undef ATTENTION_PARAMS
#undef ATTENTION_ARGS
#undef SCORES_PARAMS
#undef SCORES_ARGS

// Order-preserving map of a float to an unsigned key (larger float, larger key).
__device__ __forceinline__ unsigned int float_key(float f) {
    unsigned int b = __float_as_uint(f);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// Keeps the top_k highest scores of each row (ties go to the earlier position, as the CPU
// reference's selection does) and sets every other score to -inf. Rows whose context holds at
// most top_k positions are left as they are. Radix select over the keys, 8 bits a pass from the
// top, then an ordered scan that keeps the earliest of the tied threshold values. Grid row r is
// token rows[r]. grid (rows, heads), block 256.
extern "C" __global__ void topk_mask(float* scores, int scores_stride, const int* ctx,
                                     const int* rows, int heads, int top_k) {
    TD_SCOPE("topk_mask");
    __shared__ unsigned int hist[256];
    __shared__ unsigned int s_prefix, s_need;
    __shared__ unsigned int s_scan[256];
    __shared__ unsigned int s_taken;
    int n = ctx[rows[blockIdx.x]];
    if (n <= top_k) return;
    float* row = scores + ((size_t)blockIdx.x * heads + blockIdx.y) * scores_stride;
    if (threadIdx.x == 0) {
        s_prefix = 0;
        s_need = (unsigned int)top_k;  // rank (from the top, 1-based) still to find
    }
    __syncthreads();
    unsigned int mask = 0;
    for (int shift = 24; shift >= 0; shift -= 8) {
        hist[threadIdx.x] = 0;
        __syncthreads();
        unsigned int prefix = s_prefix;
        // NORM_UNROLL scores loaded before any is counted (a plain block-stride loop waits for
        // each load); the counts do not depend on the order.
        for (int base = threadIdx.x; base < n; base += NORM_UNROLL * blockDim.x) {
            unsigned int keys[NORM_UNROLL];
#pragma unroll
            for (int u = 0; u < NORM_UNROLL; u++) {
                int j = base + u * blockDim.x;
                keys[u] = j < n ? float_key(row[j]) : 0u;
            }
#pragma unroll
            for (int u = 0; u < NORM_UNROLL; u++) {
                int j = base + u * blockDim.x;
                if (j < n && (keys[u] & mask) == prefix)
                    atomicAdd(&hist[(keys[u] >> shift) & 255u], 1u);
            }
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            unsigned int need = s_need, acc = 0;
            int b = 255;
            for (; b > 0; b--) {
                if (acc + hist[b] >= need) break;
                acc += hist[b];
            }
            s_need = need - acc;
            s_prefix = prefix | ((unsigned int)b << shift);
        }
        mask |= 255u << shift;
        __syncthreads();
    }
    // Threshold key T = s_prefix; keep every key > T and the first s_need keys == T in order.
    unsigned int thr = s_prefix, ties = s_need;
    if (threadIdx.x == 0) s_taken = 0;
    __syncthreads();
    for (int base = 0; base < n; base += blockDim.x) {
        int j = base + threadIdx.x;
        unsigned int key = j < n ? float_key(row[j]) : 0u;
        unsigned int eq = (j < n && key == thr) ? 1u : 0u;
        s_scan[threadIdx.x] = eq;
        // Inclusive scan (Hillis-Steele) of the tie flags of this chunk; a chunk with no tie
        // (most of them) keeps its zeros and skips the scan's 16 barriers.
        if (__syncthreads_or(eq)) {
            for (int o = 1; o < 256; o <<= 1) {
                unsigned int v = threadIdx.x >= o ? s_scan[threadIdx.x - o] : 0u;
                __syncthreads();
                s_scan[threadIdx.x] += v;
                __syncthreads();
            }
        }
        unsigned int before = s_taken;
        if (j < n) {
            bool keep = key > thr || (eq && before + s_scan[threadIdx.x] <= ties);
            if (!keep) row[j] = NEG_INF;
        }
        __syncthreads();
        if (threadIdx.x == 255) s_taken = before + s_scan[255];
        __syncthreads();
    }
}

// ---- Picking the next token on the device ----------------------------------------------------
// Greedy decoding and teacher forcing need, per row of logits, only the token (the most likely
// one, or a given one), the log-sum-exp, the entropy and the top-k alternatives: these two kernels
// compute them where the logits are, so a decode step copies back PICK_WORDS(k) words a row
// instead of a vocabulary of floats. The formulas are sampling::summarize's: lse = max + ln S0,
// entropy = lse - S1/S0 with S0 = sum e^(x-max), S1 = sum e^(x-max) x, in f64; candidates are
// ordered as f32::total_cmp orders them, ties to the lower token ID.
#define PICK_CHUNK 2048
#define PICK_THREADS 256
#define PICK_PER_THREAD (PICK_CHUNK / PICK_THREADS)
#define PICK_MAX_K 32
#define PICK_MAX_CHUNKS 128

// A candidate as one integer: the value's order key above the inverted index, so the larger of
// two packed candidates is the larger value, or the lower index of two equal ones. 0 is "none".
__device__ __forceinline__ unsigned long long pick_pack(float v, unsigned int idx) {
    return ((unsigned long long)float_key(v) << 32) | (unsigned long long)(~idx);
}

__device__ __forceinline__ unsigned int pick_index(unsigned long long c) {
    return ~(unsigned int)(c & 0xffffffffull);
}

// PICK_FAST=1: the picks' warp-wide maxima are two redux.sync instructions (sm_80+) instead of
// five rounds of 8-byte shuffles, and pick_finish takes its candidates' logits from their keys
// (float_key is a bijection) instead of loading them from the row after its merge; a given token's
// logit is loaded at its start. The same bits either way; only the dependent latencies differ.
#ifndef PICK_FAST
#define PICK_FAST 0
#endif

// The largest packed candidate of the warp; every lane gets it.
__device__ __forceinline__ unsigned long long warp_max_u64(unsigned long long v) {
#if PICK_FAST
    // The largest high word, then the largest low word among the lanes that hold it.
    unsigned int hi = __reduce_max_sync(0xffffffffu, (unsigned int)(v >> 32));
    unsigned int lo = (unsigned int)(v >> 32) == hi ? (unsigned int)v : 0u;
    lo = __reduce_max_sync(0xffffffffu, lo);
    return ((unsigned long long)hi << 32) | lo;
#else
    for (int o = 16; o > 0; o >>= 1) {
        unsigned long long w = __shfl_xor_sync(0xffffffffu, v, o);
        v = w > v ? w : v;
    }
    return v;
#endif
}

// The logit bits a packed candidate was made from: float_key inverted.
__device__ __forceinline__ unsigned int pick_logit_bits(unsigned long long c) {
    unsigned int key = (unsigned int)(c >> 32);
    return (key & 0x80000000u) ? (key & 0x7fffffffu) : ~key;
}

__device__ double block_sum_f64(double v, double* shared32) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads();
    if (lane == 0) shared32[warp] = v;
    __syncthreads();
    double t = 0.0;
    if (lane == 0 && warp == 0) {
        for (int w = 0; w < warps; w++) t += shared32[w];  // in order: deterministic
        shared32[32] = t;
    }
    __syncthreads();
    return shared32[32];
}

// Per (picked row p, chunk c of PICK_CHUNK logits): the chunk's max M, S0 and S1 relative to M,
// and its k best candidates. logits row rows[p]; stats (picks, chunks, 3) f64; top (picks,
// chunks, k). grid (picks, chunks), block PICK_THREADS.
extern "C" __global__ void pick_partial(const float* logits, int vocab, const int* rows, int k,
                                        double* stats, unsigned long long* top) {
    TD_SCOPE("pick_partial");
    pdl_launch_dependents();
    pdl_wait();
    __shared__ double s_d[33];
    __shared__ float s_f[32];
    int p = blockIdx.x, c = blockIdx.y, chunks = gridDim.y;
    const float* row = logits + (size_t)rows[p] * vocab;
    int base = c * PICK_CHUNK;
    float v[PICK_PER_THREAD];
    float m = NEG_INF;
#pragma unroll
    for (int j = 0; j < PICK_PER_THREAD; j++) {
        int i = base + threadIdx.x + j * PICK_THREADS;
        v[j] = i < vocab ? row[i] : NEG_INF;
        m = fmaxf(m, v[j]);  // fmaxf skips NaN, as f32::max does
    }
    m = block_max(m, s_f);
    double s0 = 0.0, s1 = 0.0;
    if (m != NEG_INF) {
#pragma unroll
        for (int j = 0; j < PICK_PER_THREAD; j++) {
            double x = (double)v[j];
            double e = exp(x - (double)m);
            if (e > 0.0) {
                s0 += e;
                s1 += e * x;
            }
        }
    }
    s0 = block_sum_f64(s0, s_d);
    s1 = block_sum_f64(s1, s_d);
    size_t pc = (size_t)p * chunks + c;
    if (threadIdx.x == 0) {
        stats[pc * 3] = (double)m;
        stats[pc * 3 + 1] = s0;
        stats[pc * 3 + 2] = s1;
    }
    // The chunk's k best in two steps with no block barrier per round: each warp takes the k
    // best of its lanes' values (k rounds of "best not yet taken", each lane marking what it gave
    // in a bit mask), then warp 0 the k best of the warps' lists. Candidates are unique (the
    // index is in them), so this is exactly the block-wide selection.
    __shared__ unsigned long long s_wtop[PICK_THREADS / 32][PICK_MAX_K];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    unsigned int taken = 0;
    for (int r = 0; r < k; r++) {
        unsigned long long best = 0;
#pragma unroll
        for (int j = 0; j < PICK_PER_THREAD; j++) {
            int i = base + threadIdx.x + j * PICK_THREADS;
            if (i < vocab && !(taken & (1u << j))) {
                unsigned long long cand = pick_pack(v[j], (unsigned int)i);
                best = cand > best ? cand : best;
            }
        }
        unsigned long long win = warp_max_u64(best);
        if (win != 0 && win == best) {
            int local = (int)pick_index(win) - base - threadIdx.x;
            taken |= 1u << (local / PICK_THREADS);
        }
        if (lane == 0) s_wtop[warp][r] = win;
    }
    __syncthreads();
    if (warp != 0) return;
    constexpr int PER = PICK_THREADS / 32 * PICK_MAX_K / 32;
    const int all = PICK_THREADS / 32 * k;
    unsigned long long lists[PER];
#pragma unroll
    for (int q = 0; q < PER; q++) {
        int at = lane + 32 * q;
        lists[q] = at < all ? s_wtop[at / k][at % k] : 0ull;
    }
    for (int r = 0; r < k; r++) {
        unsigned long long best = 0;
#pragma unroll
        for (int q = 0; q < PER; q++) best = lists[q] > best ? lists[q] : best;
        unsigned long long win = warp_max_u64(best);
        if (win != 0 && win == best) {
#pragma unroll
            for (int q = 0; q < PER; q++) lists[q] = lists[q] == win ? 0ull : lists[q];
        }
        if (lane == 0) top[pc * k + r] = win;
    }
}

// Words of one picked row's result: lse and entropy (f64 each), the token and its logit, then k
// (token, logit) pairs, most likely first (ID 0xffffffff past the vocabulary's end).
#define PICK_WORDS(k) (6 + 2 * (k))

// Merges the chunks of each picked row: chosen[p] is the token to report (-1: the most likely).
// Warp 0 takes the k best of the chunks' lists (each sorted best first) as a k-way merge, lane l
// following lists l, l + 32, ..., one warp-wide max a round with no block barrier; warp 1 meanwhile
// combines the chunks' sums. out (picks, PICK_WORDS(k)) u32. grid (picks), block PICK_THREADS.
extern "C" __global__ void pick_finish(const float* logits, int vocab, const int* rows,
                                       const int* chosen, int k, int chunks,
                                       const double* stats, const unsigned long long* top,
                                       unsigned int* out) {
    TD_SCOPE("pick_finish");
    pdl_launch_dependents();
    pdl_wait();
    __shared__ unsigned long long cand[PICK_MAX_CHUNKS * PICK_MAX_K];
    __shared__ double s_stats[PICK_MAX_CHUNKS * 3];
    __shared__ unsigned int s_ids[PICK_MAX_K];
    int p = blockIdx.x, n = chunks * k;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const float* row = logits + (size_t)rows[p] * vocab;
#if PICK_FAST
    // A given token's logit, loaded beside the partials rather than after the merge.
    int given = chosen[p];
    unsigned int given_bits = __float_as_uint(NEG_INF);
    if (threadIdx.x == 32 && given >= 0 && given < vocab) given_bits = __float_as_uint(row[given]);
    __shared__ unsigned int s_bits[PICK_MAX_K];
#endif
    // Every load this block needs from the partials at once (not one chunk after another in
    // thread 0's loop below: each would wait for the last).
    for (int i = threadIdx.x; i < n; i += blockDim.x) cand[i] = top[(size_t)p * n + i];
    for (int i = threadIdx.x; i < chunks * 3; i += blockDim.x)
        s_stats[i] = stats[(size_t)p * chunks * 3 + i];
    __syncthreads();
    unsigned int* o = out + (size_t)p * PICK_WORDS(k);
    if (warp == 0) {
        constexpr int LISTS = PICK_MAX_CHUNKS / 32;
        int head[LISTS];
#pragma unroll
        for (int q = 0; q < LISTS; q++) head[q] = 0;
        for (int r = 0; r < k; r++) {
            unsigned long long best = 0;
            int from = 0;
#pragma unroll
            for (int q = 0; q < LISTS; q++) {
                int c = lane + 32 * q;
                unsigned long long v = c < chunks && head[q] < k ? cand[c * k + head[q]] : 0ull;
                if (v > best) best = v, from = q;
            }
            // Candidates are unique (the index is in them): one lane holds the winner.
            unsigned long long win = warp_max_u64(best);
            if (win != 0 && win == best) {
#pragma unroll
                for (int q = 0; q < LISTS; q++) head[q] += q == from;
            }
            if (lane == 0) s_ids[r] = win ? pick_index(win) : 0xffffffffu;
#if PICK_FAST
            if (lane == 0) s_bits[r] = win ? pick_logit_bits(win) : __float_as_uint(NEG_INF);
#endif
        }
    } else if (warp == 1) {
        // The chunks combined: M = max M_c, S = sum S_c e^(M_c - M), each lane over chunks
        // lane, lane + 32, ..., then a fixed butterfly (deterministic); lane 0's sums are used.
        double mx = -1.0 / 0.0, s0 = 0.0, s1 = 0.0;
        for (int c = lane; c < chunks; c += 32) mx = fmax(mx, s_stats[c * 3]);
        for (int m = 16; m > 0; m >>= 1) mx = fmax(mx, __shfl_xor_sync(0xffffffffu, mx, m));
        for (int c = lane; c < chunks; c += 32) {
            const double* st = s_stats + c * 3;
            if (st[1] > 0.0) {
                double w = exp(st[0] - mx);
                s0 += st[1] * w;
                s1 += st[2] * w;
            }
        }
        for (int m = 16; m > 0; m >>= 1) {
            s0 += __shfl_xor_sync(0xffffffffu, s0, m);
            s1 += __shfl_xor_sync(0xffffffffu, s1, m);
        }
        if (lane == 0) {
            double lse = mx + log(s0), ent = lse - s1 / s0;
            unsigned long long lb = (unsigned long long)__double_as_longlong(lse);
            unsigned long long eb = (unsigned long long)__double_as_longlong(ent);
            o[0] = (unsigned int)lb;
            o[1] = (unsigned int)(lb >> 32);
            o[2] = (unsigned int)eb;
            o[3] = (unsigned int)(eb >> 32);
        }
    }
    __syncthreads();
#if PICK_FAST
    if (threadIdx.x < k) {
        o[6 + 2 * threadIdx.x] = s_ids[threadIdx.x];
        o[7 + 2 * threadIdx.x] = s_bits[threadIdx.x];
    }
    if (threadIdx.x == 32) {
        int tok = given >= 0 ? given : k > 0 ? (int)s_ids[0] : -1;
        o[4] = (unsigned int)tok;
        o[5] = given >= 0 ? given_bits
               : (tok >= 0 && tok < vocab) ? s_bits[0] : __float_as_uint(NEG_INF);
    }
#else
    // The candidates' logits, one thread each, all loads in flight together.
    if (threadIdx.x < k) {
        unsigned int id = s_ids[threadIdx.x];
        o[6 + 2 * threadIdx.x] = id;
        o[7 + 2 * threadIdx.x] =
            id != 0xffffffffu ? __float_as_uint(row[id]) : __float_as_uint(NEG_INF);
    }
    if (threadIdx.x == 32) {
        int tok = chosen[p] >= 0 ? chosen[p] : k > 0 ? (int)s_ids[0] : -1;
        o[4] = (unsigned int)tok;
        o[5] = (tok >= 0 && tok < vocab) ? __float_as_uint(row[tok]) : __float_as_uint(NEG_INF);
    }
#endif
}
