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

__device__ float block_max(float v, float* shared32) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) shared32[warp] = v;
    __syncthreads();
    float t = lane < warps ? shared32[lane] : 0.0f;
    return warp_max(t);
}

// out (n, h) = table[ids[i]] rows. grid (n), block 256.
extern "C" __global__ void embed_gather(float* out, const float* table, const unsigned int* ids,
                                        int h) {
    const float* row = table + (size_t)ids[blockIdx.x] * h;
    float* o = out + (size_t)blockIdx.x * h;
    for (int i = threadIdx.x; i < h; i += blockDim.x) o[i] = row[i];
}

// RMSNorm per row: x / sqrt(mean(x^2) + eps) * w, into out (f32), or with out_bf16 != NULL
// rounded to bf16 there instead (the next GEMM's input for matmul=bf16: one launch, not two).
// grid (rows), block 256.
extern "C" __global__ void rms_norm(float* out, bf16_t* out_bf16, const float* x, const float* w,
                                    int d, float eps) {
    __shared__ float s32[32];
    const float* xr = x + (size_t)blockIdx.x * d;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) ss += xr[i] * xr[i];
    ss = block_sum(ss, s32) / (float)d;
    float inv = 1.0f / sqrtf(ss + eps);
    if (out_bf16) {
        bf16_t* orow = out_bf16 + (size_t)blockIdx.x * d;
        for (int i = threadIdx.x; i < d; i += blockDim.x)
            orow[i] = f32_to_bf16_bits(w[i] * (xr[i] * inv));
    } else {
        float* orow = out + (size_t)blockIdx.x * d;
        for (int i = threadIdx.x; i < d; i += blockDim.x) orow[i] = w[i] * (xr[i] * inv);
    }
}

// Rotary embedding, rotate-half: dimension i pairs with i + hd/2; the angle is pos * inv_freq[i]
// in f32 as transformers computes it. x (n, heads, hd). grid (n), block 256.
extern "C" __global__ void rope(float* x, const int* pos, const float* inv_freq, int heads,
                                int hd) {
    int half = hd / 2;
    float p = (float)pos[blockIdx.x];
    float* row = x + (size_t)blockIdx.x * heads * hd;
    for (int idx = threadIdx.x; idx < heads * half; idx += blockDim.x) {
        int head = idx / half, i = idx % half;
        float s, c;
        sincosf(p * inv_freq[i], &s, &c);
        float* hp = row + head * hd;
        float a = hp[i], b = hp[i + half];
        hp[i] = a * c - b * s;
        hp[i + half] = b * c + a * s;
    }
}

// out[rows[i]] = in[i], rows of `width` floats (the inverse of embed_gather). grid (n), block 256.
extern "C" __global__ void scatter_rows(float* out, const float* in, const int* rows, int width) {
    const float* src = in + (size_t)blockIdx.x * width;
    float* dst = out + (size_t)rows[blockIdx.x] * width;
    for (int i = threadIdx.x; i < width; i += blockDim.x) dst[i] = src[i];
}

// gate = silu(gate) * up, element-wise; with out_bf16 != NULL the product goes there, rounded to
// bf16, instead (the down projection's input for matmul=bf16).
extern "C" __global__ void silu_mul(float* gate, bf16_t* out_bf16, const float* up, int n) {
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
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += y[i];
}

// y (rows, cols) += bias (cols).
extern "C" __global__ void add_bias(float* y, const float* bias, int rows, int cols) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < (size_t)rows * cols) y[i] += bias[i % cols];
}

// out = bf16(in), round-to-nearest-even (GEMM inputs for matmul=bf16).
extern "C" __global__ void f32_to_bf16(bf16_t* out, const float* in, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = f32_to_bf16_bits(in[i]);
}

// Writes the new tokens' keys and values into the pool at their slots, stored as the cache dtype
// would hold them (mode 0 f32, 1 bf16, 2 FP8 E4M3 with one amax/448 scale per token and head).
// The rounded values are also written back to k and v. k, v (n, kv_heads, hd); slots (n), -1 for
// none.
// grid (n, kv_heads), block = hd rounded up to 32.
extern "C" __global__ void kv_write(float* k_pool, float* v_pool, float* k, float* v,
                                    const int* slots, int kv_heads, int hd, int mode) {
    __shared__ float s32[32];
    int t = blockIdx.x, head = blockIdx.y, d = threadIdx.x;
    if (slots[t] < 0) return;  // a padded row of a graph pass: writes nothing
    size_t src = ((size_t)t * kv_heads + head) * hd + d;
    size_t dst = ((size_t)slots[t] * kv_heads + head) * hd + d;
    bool live = d < hd;
    float kv = live ? k[src] : 0.0f;
    float vv = live ? v[src] : 0.0f;
    if (mode == 1) {
        kv = round_bf16(kv);
        vv = round_bf16(vv);
    } else if (mode == 2) {
        float ka = block_max(fabsf(kv), s32);
        float va = block_max(fabsf(vv), s32);
        if (ka != 0.0f && isfinite(ka)) {
            float sc = ka / 448.0f;
            kv = round_fp8_e4m3(kv / sc) * sc;
        }
        if (va != 0.0f && isfinite(va)) {
            float sc = va / 448.0f;
            vv = round_fp8_e4m3(vv / sc) * sc;
        }
    }
    if (live) {
        k[src] = kv;
        v[src] = vv;
        k_pool[dst] = kv;
        v_pool[dst] = vv;
    }
}

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
extern "C" __global__ void attention(float* out, const float* q, const float* k_pool,
                                     const float* v_pool, const int* tables, int max_blocks,
                                     const int* seg, const int* ctx, const int* hide,
                                     const int* rows, const float* scores, int scores_stride,
                                     int heads, int kv_heads, int hd, int bs, float scale,
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
    for (int j = warp; j < n_ctx; j += ATT_WARPS) {
        if (j == skip) continue;
        size_t off = kv_offset(table, j, bs, kv_dim, kvh, hd);
        float s;
        if (sc_row) {
            s = sc_row[j];
            if (s == NEG_INF) continue;
        } else {
            float part = 0.0f;
#pragma unroll
            for (int i = 0; i < MAX_DPL; i++) {
                int d = lane + 32 * i;
                if (d < hd) {
                    float kx = k_pool[off + d];
                    part += qr[i] * (bf16 ? round_bf16(kx) : kx);
                }
            }
            s = warp_sum(part) * scale;
        }
        float m_new = fmaxf(m, s);
        float corr = expf(m - m_new);
        float p = expf(s - m_new);
        l = l * corr + p;
        float pv = bf16 ? round_bf16(p) : p;
#pragma unroll
        for (int i = 0; i < MAX_DPL; i++) {
            int d = lane + 32 * i;
            if (d < hd) {
                float vx = v_pool[off + d];
                acc[i] = acc[i] * corr + pv * (bf16 ? round_bf16(vx) : vx);
            }
        }
        m = m_new;
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
extern "C" __global__ void attention_scores(float* scores, int scores_stride, const float* q,
                                            const float* k_pool, const int* tables,
                                            int max_blocks, const int* seg, const int* ctx,
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
    for (int j = warp; j < scores_stride; j += ATT_WARPS) {
        if (j >= n_ctx || j == skip) {
            if (lane == 0) row[j] = NEG_INF;
            continue;
        }
        size_t off = kv_offset(table, j, bs, kv_dim, kvh, hd);
        float part = 0.0f;
#pragma unroll
        for (int i = 0; i < MAX_DPL; i++) {
            int d = lane + 32 * i;
            if (d < hd) {
                float kx = k_pool[off + d];
                part += qr[i] * (bf16 ? round_bf16(kx) : kx);
            }
        }
        float s = warp_sum(part) * scale;
        if (lane == 0) row[j] = s;
    }
}

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
        for (int j = threadIdx.x; j < n; j += blockDim.x) {
            unsigned int key = float_key(row[j]);
            if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 255u], 1u);
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
        __syncthreads();
        // Inclusive scan (Hillis-Steele) of the tie flags of this chunk.
        for (int o = 1; o < 256; o <<= 1) {
            unsigned int v = threadIdx.x >= o ? s_scan[threadIdx.x - o] : 0u;
            __syncthreads();
            s_scan[threadIdx.x] += v;
            __syncthreads();
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
#define PICK_CHUNK 8192
#define PICK_THREADS 256
#define PICK_PER_THREAD (PICK_CHUNK / PICK_THREADS)
#define PICK_MAX_K 32
#define PICK_MAX_CHUNKS 64

// A candidate as one integer: the value's order key above the inverted index, so the larger of
// two packed candidates is the larger value, or the lower index of two equal ones. 0 is "none".
__device__ __forceinline__ unsigned long long pick_pack(float v, unsigned int idx) {
    return ((unsigned long long)float_key(v) << 32) | (unsigned long long)(~idx);
}

__device__ __forceinline__ unsigned int pick_index(unsigned long long c) {
    return ~(unsigned int)(c & 0xffffffffull);
}

// The largest packed candidate of the block; every thread gets it.
__device__ unsigned long long block_max_u64(unsigned long long v, unsigned long long* shared32) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    for (int o = 16; o > 0; o >>= 1) {
        unsigned long long w = __shfl_xor_sync(0xffffffffu, v, o);
        v = w > v ? w : v;
    }
    __syncthreads();
    if (lane == 0) shared32[warp] = v;
    __syncthreads();
    unsigned long long t = lane < warps ? shared32[lane] : 0ull;
    for (int o = 16; o > 0; o >>= 1) {
        unsigned long long w = __shfl_xor_sync(0xffffffffu, t, o);
        t = w > t ? w : t;
    }
    return t;
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
    __shared__ unsigned long long s_u[32];
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
    // k rounds of "best not yet taken"; each thread marks what it gave in a bit mask.
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
        unsigned long long win = block_max_u64(best, s_u);
        if (win != 0 && win == best) {
            int local = (int)pick_index(win) - base - threadIdx.x;
            taken |= 1u << (local / PICK_THREADS);
        }
        if (threadIdx.x == 0) top[pc * k + r] = win;
    }
}

// Words of one picked row's result: lse and entropy (f64 each), the token and its logit, then k
// (token, logit) pairs, most likely first (ID 0xffffffff past the vocabulary's end).
#define PICK_WORDS(k) (6 + 2 * (k))

// Merges the chunks of each picked row: chosen[p] is the token to report (-1: the most likely).
// out (picks, PICK_WORDS(k)) u32. grid (picks), block PICK_THREADS.
extern "C" __global__ void pick_finish(const float* logits, int vocab, const int* rows,
                                       const int* chosen, int k, int chunks,
                                       const double* stats, const unsigned long long* top,
                                       unsigned int* out) {
    __shared__ unsigned long long cand[PICK_MAX_CHUNKS * PICK_MAX_K];
    __shared__ unsigned long long s_u[32];
    int p = blockIdx.x, n = chunks * k;
    const float* row = logits + (size_t)rows[p] * vocab;
    for (int i = threadIdx.x; i < n; i += blockDim.x) cand[i] = top[(size_t)p * n + i];
    __syncthreads();
    unsigned int* o = out + (size_t)p * PICK_WORDS(k);
    unsigned int first = 0xffffffffu;
    for (int r = 0; r < k; r++) {
        unsigned long long best = 0;
        int at = -1;
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            if (cand[i] > best) {
                best = cand[i];
                at = i;
            }
        }
        unsigned long long win = block_max_u64(best, s_u);
        if (win != 0 && win == best) cand[at] = 0;
        __syncthreads();
        unsigned int id = win ? pick_index(win) : 0xffffffffu;
        if (r == 0) first = id;
        if (threadIdx.x == 0) {
            o[6 + 2 * r] = id;
            o[7 + 2 * r] = win ? __float_as_uint(row[id]) : __float_as_uint(NEG_INF);
        }
    }
    if (threadIdx.x == 0) {
        // The chunks combined in order: M = max M_c, S = sum S_c e^(M_c - M).
        double mx = -1.0 / 0.0, s0 = 0.0, s1 = 0.0;
        for (int c = 0; c < chunks; c++) mx = fmax(mx, stats[((size_t)p * chunks + c) * 3]);
        for (int c = 0; c < chunks; c++) {
            const double* st = stats + ((size_t)p * chunks + c) * 3;
            if (st[1] > 0.0) {
                double w = exp(st[0] - mx);
                s0 += st[1] * w;
                s1 += st[2] * w;
            }
        }
        double lse = mx + log(s0), ent = lse - s1 / s0;
        unsigned long long lb = (unsigned long long)__double_as_longlong(lse);
        unsigned long long eb = (unsigned long long)__double_as_longlong(ent);
        o[0] = (unsigned int)lb;
        o[1] = (unsigned int)(lb >> 32);
        o[2] = (unsigned int)eb;
        o[3] = (unsigned int)(eb >> 32);
        int tok = chosen[p] >= 0 ? chosen[p] : (int)first;
        o[4] = (unsigned int)tok;
        o[5] = (tok >= 0 && tok < vocab) ? __float_as_uint(row[tok]) : __float_as_uint(NEG_INF);
    }
}
