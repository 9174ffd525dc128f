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

// 1 (the host's TAPEDECK_MERGE_STAGED=on): MergedSplits first copies every split's partial
// outputs and (max, sum) pairs of every row into shared memory with cp.async, all requested in
// one round, and merges from there: one wait for L2 after the PDL wait, with no registers held
// for the partials (the merge in registers waits three times, and takes the one-row kernel from
// 79 to 126 registers). The launch's dynamic shared memory then holds
// n * num_heads * max_splits * (head_dim + 2) floats more (the host's MergedSplits::smem). 0 (the
// default): the merge in registers. Both lose to the combine kernel on an H100 (llama-1b batch-1
// decode: staged 786, registers 812, combine 911 tok/s, twenty-third session): every o block
// fetches all the splits from L2 after its wait.
#ifndef MERGE_STAGED
#define MERGE_STAGED 0
#endif

// The one-row merging GEMV's __launch_bounds__ minimum of blocks an SM. With the staged merge, 3
// caps it at 80 registers (76, no spills; 89 uncapped), as the plain one-row GEMV's 79: two of its
// blocks then leave room on an SM for a gate/up block launched early beside them.
#ifndef MERGE1_MIN_BLOCKS
#define MERGE1_MIN_BLOCKS (MERGE_STAGED ? 3 : GEMV_MIN_BLOCKS)
#endif

// 8 bytes from global to shared memory (cp.async through L1; 8-byte copies may not bypass it).
__device__ __forceinline__ void merge_stage8(void* dst, const void* src) {
    unsigned int d = (unsigned int)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" ::"r"(d), "l"(src) : "memory");
}

// The o projection's input (see GemvInput in engine.cu): the n rows of attention output merged from
// the splits as decode_attn_combine would write them, rounded to bf16 into shared memory. Dynamic
// shared memory: n * in * 2 bytes of inputs, then either every split staged (staged(), MERGE_STAGED)
// or n * num_heads * (3 * max_splits + 1) floats (in_registers(): split weights, weight sums, and a
// copy of the splits' (max, sum) pairs). Every block merges all rows (it needs all of them),
// reading n * in * splits partial values from L2: the host fuses the merge only for a few splits.
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
    // Nothing to fetch before the wait (the partials are the kernel before's output).
    __device__ __forceinline__ void prefetch(int) const {}

    // Splits of row r (0: empty context; 1: the mma kernel wrote the row).
    __device__ __forceinline__ int splits(int r) const {
        const int len = context_lens[r];
        if (len <= 0) return 0;
        return min((len + split_len - 1) / split_len, max_splits);
    }

    // The merge is latency-bound (a few KB from L2 before the GEMV can start), so it is laid out to
    // wait for memory as few times as possible.
    __device__ __forceinline__ const void* operator()(int n, int in, int* f32) const {
        *f32 = 0;
        // One or the other compiled in: the kernel's registers are its larger path's.
#if MERGE_STAGED
        return staged(n, in);
#else
        return in_registers(n, in);
#endif
    }

    // Every split a row has, copied to shared memory in one round of cp.async (a row with one
    // split: the mma kernel's output, in split 0's place), then merged from there by threads that
    // each take 4 outputs of one head at a time (8 would hold 16 registers more across the GEMV's
    // prefetched weights). Shared memory after the merged rows xs: the partial outputs (n, heads, max_splits,
    // head_dim), then the (max, sum) pairs (n, heads, max_splits, 2), f32. Requires head_dim % 4
    // == 0, in == num_heads * head_dim and that shared memory (the host fuses the merge only then).
    __device__ __forceinline__ const void* staged(int n, int in) const {
        extern __shared__ uint4 gemv_smem[];
        bf16_t* xs = (bf16_t*)gemv_smem;
        float* po = (float*)(xs + (size_t)n * in);  // n * in * 2 is a multiple of 16 (in % 8 == 0)
        float* mls = po + (size_t)n * num_heads * max_splits * head_dim;
        int ns[GEMV_MAX_ROWS];
#pragma unroll
        for (int r = 0; r < GEMV_MAX_ROWS; r++) ns[r] = r < n ? splits(r) : 0;
        auto row_splits = [&](int r) {
            int v = ns[0];
#pragma unroll
            for (int k = 1; k < GEMV_MAX_ROWS; k++)
                if (r == k) v = ns[k];
            return v;
        };
        // Partial outputs, 16 bytes a copy: chunk c of (row, head, split) block rhs.
        const int hd4 = head_dim / 4, per_rh = max_splits * hd4;
        const int chunks = n * num_heads * per_rh;
        for (int c = threadIdx.x; c < chunks; c += blockDim.x) {
            const int rh = c / per_rh, s = c % per_rh / hd4, q = c % hd4;
            const int k = row_splits(rh / num_heads);
            if (k > 1 && s < k)
                gemv_stage16((uint4*)po + c, (const uint4*)partial_out + c);
            else if (k == 1 && s == 0)
                gemv_stage16((uint4*)po + c, (const uint4*)att + (size_t)rh * hd4 + q);
        }
        for (int i = threadIdx.x; i < n * num_heads * max_splits; i += blockDim.x) {
            const int k = row_splits(i / (num_heads * max_splits));
            if (k > 1 && i % max_splits < k) merge_stage8(mls + 2 * i, partial_ml + 2 * i);
        }
        asm volatile("cp.async.wait_all;" ::: "memory");
        __syncthreads();
        // combine_head_t's arithmetic: the maximum, then DA_COMBINE_THREADS / head_dim parts, part
        // p summing w_s * O_s and w_s over splits p, p + parts, ... in order, then the parts in
        // order; out = A / W.
        const int parts = DA_COMBINE_THREADS / head_dim;
        for (int e0 = 4 * threadIdx.x; e0 < n * in; e0 += 4 * blockDim.x) {
            const int r = e0 / in, rh = e0 / head_dim, d0 = e0 % head_dim;
            const int k = row_splits(r);
            const float* o = po + (size_t)rh * max_splits * head_dim + d0;
            float v[4];
            if (k == 1) {
#pragma unroll
                for (int i = 0; i < 4; i++) v[i] = o[i];
            } else if (k <= 0) {
#pragma unroll
                for (int i = 0; i < 4; i++) v[i] = 0.f;
            } else {
                const float* ml = mls + (size_t)rh * max_splits * 2;
                float M = da::neg_inf();
                for (int s = 0; s < k; s++) M = fmaxf(M, ml[2 * s]);  // exact in any order
                float A[4], W = 0.f;
#pragma unroll
                for (int i = 0; i < 4; i++) A[i] = 0.f;
                for (int p = 0; p < parts; p++) {
                    float acc[4], wsum = 0.f;
#pragma unroll
                    for (int i = 0; i < 4; i++) acc[i] = 0.f;
                    for (int s = p; s < k; s += parts) {
                        const float wt = da::ex2(ml[2 * s] - M) * ml[2 * s + 1];
                        const float4 a = *(const float4*)(o + (size_t)s * head_dim);
                        const float os[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
                        for (int i = 0; i < 4; i++) acc[i] += wt * os[i];
                        wsum += wt;
                    }
#pragma unroll
                    for (int i = 0; i < 4; i++) A[i] += acc[i];
                    W += wsum;
                }
#pragma unroll
                for (int i = 0; i < 4; i++) v[i] = A[i] / W;
            }
            *(uint2*)(xs + e0) = make_uint2(bf16x2_bits(v[0], v[1]), bf16x2_bits(v[2], v[3]));
        }
        __syncthreads();
        return xs;
    }

    // The merge in registers: the split statistics are copied to shared memory in one round; then
    // each thread takes MERGE_GROUP outputs at once, so that for every split the group's partial
    // values are requested together.
    __device__ __forceinline__ const void* in_registers(int n, int in) const {
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
extern "C" __global__ void __launch_bounds__(32 * GEMV_BLOCK_WARPS, MERGE1_MIN_BLOCKS) gemv_bf16_merged_1(GEMV_MERGED_PARAMS) {
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
