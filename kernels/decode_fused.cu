// decode_fused.cu -- kernels of the `fuse=on` decode path that need both engine.cu and
// decode_attention_mma.cu: compiled as one NVRTC module after those two sources
// (engine/src/cuda/kernels.rs, FUSED), whose device functions it calls.
//
// gemv_bf16_merged_N: the o projection reading the attention output straight from the mma decode
// kernel's split partials. The split merge that decode_attn_combine would run as its own launch is
// done by every GEMV block into shared memory, after the PDL wait and while its prefetched o
// weights arrive: one launch fewer per layer, for a few KB of L2 reads per block.

// Outputs one thread merges at a time (MergedSplits).
#ifndef MERGE_GROUP
#define MERGE_GROUP 8
#endif

// The o projection's input (see GemvInput in engine.cu): the n rows of attention output merged from
// the splits as decode_attn_combine would write them, rounded to bf16 into shared memory. Dynamic
// shared memory: n * in * 2 bytes of inputs, then n * num_heads * (3 * max_splits + 1) floats (split
// weights, weight sums, and a copy of the splits' (max, sum) pairs). Every block merges all rows
// (it needs all of them), reading n * in * splits partial values from L2: the host fuses the merge
// only for a few splits.
//
// combine_head_t's arithmetic exactly, with its DA_COMBINE_THREADS-thread layout: the split weight
// w_s = 2^(m_s - max m) * l_s; DA_COMBINE_THREADS / head_dim parts, part p summing w_s * O_s and
// w_s over splits p, p + parts, ... in order; then the parts in order; out = A / W. A row that
// needed one split was written by the mma kernel itself; an empty context gives 0.
struct MergedSplits {
    const float* att;
    const float* partial_out;
    const float* partial_ml;
    const int* context_lens;
    int num_heads, head_dim, split_len, max_splits;

    // Not an f32 input as given (GEMV_F32_TRIGGER_LATE, engine.cu).
    __device__ __forceinline__ bool f32_as_given() const { return false; }

    // Splits of row r (0: empty context; 1: the mma kernel wrote the row).
    __device__ __forceinline__ int splits(int r) const {
        const int len = context_lens[r];
        if (len <= 0) return 0;
        return min((len + split_len - 1) / split_len, max_splits);
    }

    // The merge is latency-bound (a few KB from L2 before the GEMV can start), so it is laid out to
    // wait for memory as few times as possible: the split statistics are copied to shared memory in
    // one round; then each thread takes MERGE_GROUP outputs at once, so that for every split the
    // group's partial values are requested together.
    __device__ __forceinline__ const void* operator()(int n, int in, int* f32) const {
        constexpr int G = MERGE_GROUP;
        extern __shared__ uint4 gemv_smem[];
        bf16_t* xs = (bf16_t*)gemv_smem;
        float* wts = (float*)(xs + (size_t)n * in);               // (n, heads, max_splits)
        float* wsum = wts + (size_t)n * num_heads * max_splits;   // (n, heads)
        float* mls = wsum + (size_t)n * num_heads;                // (n, heads, max_splits, 2)
        const int parts = DA_COMBINE_THREADS / head_dim;
        for (int i = threadIdx.x; i < n * num_heads * max_splits * 2; i += blockDim.x)
            mls[i] = partial_ml[i];
        __syncthreads();
        // Split weights and their sum, once per (row, head).
        for (int rh = threadIdx.x; rh < n * num_heads; rh += blockDim.x) {
            const int ns = splits(rh / num_heads);
            if (ns <= 1) continue;
            const float* ml = mls + (size_t)rh * max_splits * 2;
            float M = da::neg_inf();
            for (int s = 0; s < ns; s++) M = fmaxf(M, ml[2 * s]);  // exact in any order
            float W = 0.f;
            for (int p = 0; p < parts; p++) {
                float part_sum = 0.f;
                for (int s = p; s < ns; s += parts) {
                    const float wt = da::ex2(ml[2 * s] - M) * ml[2 * s + 1];
                    wts[(size_t)rh * max_splits + s] = wt;
                    part_sum += wt;
                }
                W += part_sum;
            }
            wsum[rh] = W;
        }
        __syncthreads();
        const int total = n * in;
        for (int base = threadIdx.x; base < total; base += G * blockDim.x) {
            int rh[G], d[G], ns[G], most = 0;
            float A[G];
#pragma unroll
            for (int k = 0; k < G; k++) {
                const int e = base + k * blockDim.x;
                const int r = e < total ? e / in : 0, j = e < total ? e % in : 0;
                rh[k] = r * num_heads + j / head_dim;
                d[k] = j % head_dim;
                ns[k] = e < total ? splits(r) : 0;
                most = max(most, ns[k]);
                A[k] = 0.f;
            }
            // Part p sums splits p, p + parts, ... in order; the parts are added in order.
            for (int p = 0; most > 1 && p < parts; p++) {
                float acc[G];
#pragma unroll
                for (int k = 0; k < G; k++) acc[k] = 0.f;
                for (int s = p; s < most; s += parts) {
#pragma unroll
                    for (int k = 0; k < G; k++) {
                        if (s < ns[k]) {
                            const size_t at = (size_t)rh[k] * max_splits + s;
                            acc[k] += wts[at] * partial_out[at * head_dim + d[k]];
                        }
                    }
                }
#pragma unroll
                for (int k = 0; k < G; k++) A[k] += acc[k];
            }
#pragma unroll
            for (int k = 0; k < G; k++) {
                const int e = base + k * blockDim.x;
                if (e >= total) continue;
                float v = 0.f;
                if (ns[k] == 1)
                    v = att[(size_t)rh[k] * head_dim + d[k]];
                else if (ns[k] > 1)
                    v = A[k] / wsum[rh[k]];
                xs[e] = f32_to_bf16_bits(v);
            }
        }
        __syncthreads();
        *f32 = 0;
        return xs;
    }
};

#define GEMV_MERGED_PARAMS                                                                       \
    const float *att, const float *partial_out, const float *partial_ml,                        \
        const int *context_lens, int num_heads, int head_dim, int split_len, int max_splits,    \
        int n, int in, int splits, int add, const bf16_t *w, const float *b, float *y, int out
#define GEMV_MERGED_ARGS                                                                         \
    MergedSplits{att, partial_out, partial_ml, context_lens, num_heads, head_dim, split_len,    \
                 max_splits},                                                                   \
        in, splits, add, w, b, y, out, nullptr, nullptr, nullptr, 0, nullptr, nullptr, nullptr, 0

// y (n, out) (+)= merged attention (n, in = num_heads * head_dim) · Wᵀ (+ b), as gemv_bf16_N over
// the combine kernel's output would compute it, bit for bit. Requires head_dim <= 256 (as the
// combine) and every row a decode row of the mma pass, in order (row r = its sequence r).
// grid (ceil(out * splits / GEMV_BLOCK_WARPS)), block 32 * GEMV_BLOCK_WARPS, dynamic smem as MergedSplits says.
extern "C" __global__ void __launch_bounds__(32 * GEMV_BLOCK_WARPS, GEMV_MIN_BLOCKS) gemv_bf16_merged_1(GEMV_MERGED_PARAMS) {
    TD_SCOPE("gemv_bf16_merged_1");
    gemv_kernel<1>(GEMV_MERGED_ARGS);
}
extern "C" __global__ void __launch_bounds__(32 * GEMV_BLOCK_WARPS, GEMV_MIN_BLOCKS) gemv_bf16_merged_2(GEMV_MERGED_PARAMS) {
    TD_SCOPE("gemv_bf16_merged_2");
    gemv_kernel<2>(GEMV_MERGED_ARGS);
}
extern "C" __global__ void __launch_bounds__(32 * GEMV_BLOCK_WARPS, GEMV_MIN_BLOCKS) gemv_bf16_merged_3(GEMV_MERGED_PARAMS) {
    TD_SCOPE("gemv_bf16_merged_3");
    gemv_kernel<3>(GEMV_MERGED_ARGS);
}
extern "C" __global__ void __launch_bounds__(32 * GEMV_BLOCK_WARPS, GEMV_MIN_BLOCKS) gemv_bf16_merged_4(GEMV_MERGED_PARAMS) {
    TD_SCOPE("gemv_bf16_merged_4");
    gemv_kernel<4>(GEMV_MERGED_ARGS);
}
