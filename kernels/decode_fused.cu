// decode_fused.cu -- kernels of the `fuse=on` decode path that need both engine.cu and
// decode_attention_mma.cu: compiled as one NVRTC module after those two sources
// (engine/src/cuda/kernels.rs, FUSED), whose device functions it calls.
//
// gemv_bf16_merged_N: the o projection reading the attention output straight from the mma decode
// kernel's split partials. The split merge that decode_attn_combine would run as its own launch is
// done by every GEMV block into shared memory, after the PDL wait and while its prefetched o
// weights arrive: one launch fewer per layer, for a few KB of L2 reads per block.

// The o projection's input (see GemvInput in engine.cu): the n rows of attention output merged from
// the splits as decode_attn_combine would write them, rounded to bf16 into shared memory. Dynamic
// shared memory: n * in * 2 bytes of inputs, then n * num_heads * (max_splits + 1) floats of split
// weights and weight sums. Every block merges all rows (it needs all of them), reading
// n * in * splits partial values from L2: the host fuses the merge only for a few splits.
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

    // Splits of row r (0: empty context; 1: the mma kernel wrote the row).
    __device__ __forceinline__ int splits(int r) const {
        const int len = context_lens[r];
        if (len <= 0) return 0;
        return min((len + split_len - 1) / split_len, max_splits);
    }

    __device__ __forceinline__ const void* operator()(int n, int in, int* f32) const {
        extern __shared__ uint4 gemv_smem[];
        bf16_t* xs = (bf16_t*)gemv_smem;
        float* wts = (float*)(xs + (size_t)n * in);  // (n, heads, max_splits)
        float* wsum = wts + (size_t)n * num_heads * max_splits;  // (n, heads)
        const int parts = DA_COMBINE_THREADS / head_dim;
        // Split weights and their sum, once per (row, head).
        for (int rh = threadIdx.x; rh < n * num_heads; rh += blockDim.x) {
            const int ns = splits(rh / num_heads);
            if (ns <= 1) continue;
            const float* ml = partial_ml + (size_t)rh * max_splits * 2;
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
        for (int e = threadIdx.x; e < n * in; e += blockDim.x) {
            const int r = e / in, j = e % in;
            const int rh = r * num_heads + j / head_dim, d = j % head_dim;
            const int ns = splits(r);
            float v = 0.f;
            if (ns == 1) {
                v = att[(size_t)rh * head_dim + d];
            } else if (ns > 1) {
                const float* po = partial_out + (size_t)rh * max_splits * head_dim + d;
                const float* wt = wts + (size_t)rh * max_splits;
                float A = 0.f;
                for (int p = 0; p < parts; p++) {
                    float acc = 0.f;
#pragma unroll 4
                    for (int s = p; s < ns; s += parts) acc += wt[s] * po[(size_t)s * head_dim];
                    A += acc;
                }
                v = A / wsum[rh];
            }
            xs[e] = f32_to_bf16_bits(v);
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
// grid (ceil(out * splits / GEMV_WARPS)), block 32 * GEMV_WARPS, dynamic smem as MergedSplits says.
extern "C" __global__ void __launch_bounds__(32 * GEMV_WARPS) gemv_bf16_merged_1(GEMV_MERGED_PARAMS) {
    TD_SCOPE("gemv_bf16_merged_1");
    gemv_kernel<1>(GEMV_MERGED_ARGS);
}
extern "C" __global__ void __launch_bounds__(32 * GEMV_WARPS) gemv_bf16_merged_2(GEMV_MERGED_PARAMS) {
    TD_SCOPE("gemv_bf16_merged_2");
    gemv_kernel<2>(GEMV_MERGED_ARGS);
}
extern "C" __global__ void __launch_bounds__(32 * GEMV_WARPS) gemv_bf16_merged_3(GEMV_MERGED_PARAMS) {
    TD_SCOPE("gemv_bf16_merged_3");
    gemv_kernel<3>(GEMV_MERGED_ARGS);
}
extern "C" __global__ void __launch_bounds__(32 * GEMV_WARPS) gemv_bf16_merged_4(GEMV_MERGED_PARAMS) {
    TD_SCOPE("gemv_bf16_merged_4");
    gemv_kernel<4>(GEMV_MERGED_ARGS);
}
