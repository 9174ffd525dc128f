// decode_step.cu -- a whole single-sequence decode step as one persistent kernel (toggle
// megakernel=on), for the CUDA backend (engine/src/cuda).
//
// Compiled as one NVRTC module after engine.cu and decode_attention_mma.cu (cuda/kernels.rs
// concatenates the three): each phase of the step runs the same device function as the separate
// kernel it replaces, over the same virtual blocks, so the step computes the same bits as
// `small_gemm=gemv, attn_decode=mma-bf16` launched kernel by kernel.
//
// Why: at batch 1 a decode step is ~7 kernels per layer, each reading its weights at memory
// bandwidth for a few microseconds and then draining; launch latency, ramp-up and tail of each
// (about 5 us per GEMV kernel on an H200, measured in docs/benchmarks.md) add up to a third of the
// step. Here the blocks stay resident for the whole step and meet at grid-wide barriers between
// phases; every GEMV phase issues its first weight loads before the barrier that opens it, so the
// memory system is busy while the previous phase drains.
//
// Phases per layer, a barrier before each: RMSNorm + q/k/v GEMV | RoPE + KV write + mma decode
// attention (split-K) + split merge | o GEMV + residual | RMSNorm + gate/up + SiLU·up | down GEMV
// + residual; then RMSNorm + head GEMV. Embedding and the token pick stay separate kernels before
// and after.
//
// Launch (host rule, cuda/mod.rs): grid = multiprocessors x resident blocks per multiprocessor
// (the occupancy query, so every block is resident at once: the barriers would deadlock
// otherwise), block MK_THREADS, dynamic shared memory DA_SMEM_BYTES. Requirements: one sequence,
// one token; head_dim 64 or 128; f32 KV storage; the mma kernel's shape rules. `bar` points at
// two zeroed u32 words, left zeroed-and-advanced by every launch (a sense-reversing barrier);
// `done` at kv_heads zeroed words, left zeroed.

#define MK_THREADS (32 * GEMV_WARPS)
// Blocks per multiprocessor the register budget is sized for (2: 128 registers, some spills;
// 1: no spills, half the warps). A tuning knob (cuda/tune.rs: TAPEDECK_NVRTC_DEFINES).
#ifndef MK_MIN_BLOCKS
#define MK_MIN_BLOCKS 2
#endif

// Per layer, the device pointers of the step (host: cuda/mod.rs `MkLayer`, same order).
struct MkLayer {
    const bf16_t* wq;
    const float* bq;
    const bf16_t* wk;
    const float* bk;
    const bf16_t* wv;
    const float* bv;
    const bf16_t* wo;
    const float* bo;
    const bf16_t* wg;
    const float* bg;
    const bf16_t* wu;
    const float* bu;
    const bf16_t* wd;
    const float* bd;
    const float* attn_norm;
    const float* mlp_norm;
    void* k_pool;  // f32, or bf16 bits for decode_step_bf16kv (a kv_dtype=bf16 pool)
    void* v_pool;
};

// The step's buffers and shapes, passed by value (host: cuda/mod.rs `MkParams`, same order:
// 8-byte fields first, so there is no padding to agree on).
struct MkParams {
    float* x;  // residual stream (hidden)
    float* q;
    float* k;
    float* v;
    float* att;    // attention output (heads * head_dim)
    bf16_t* act;   // SiLU·up (intermediate), the down projection's input
    float* logits; // (vocab)
    const MkLayer* layers;
    unsigned* bar;
    const bf16_t* head_w;
    const float* head_b;
    const float* final_norm;
    const float* inv_freq;
    const int* pos;
    const int* slots;
    const int* tables;
    const int* ctx;
    float* partial_out;
    float* partial_ml;
    float* q_scr;    // rotated queries per split (max_splits * heads * head_dim)
    unsigned* done;  // per KV head: splits finished (zero between layers)
    int n_layers, hidden, inter, heads, kv_heads, head_dim, vocab, block_size;
    int max_blocks, split_len, max_splits, kv_mode;
    int splits_qkv, splits_o, splits_down, splits_head;
    float eps, scale;
};

// Every block of the grid arrives before any leaves; what any block wrote before is visible to
// every block after (release by the arriving fence, acquire by the leaving load). bar[0] counts
// arrivals and is reset by the last one, which then advances the generation bar[1] that the
// others wait on: nothing needs resetting between launches.
__device__ __forceinline__ void grid_sync(unsigned* bar) {
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned gen = ld_acquire_u32(bar + 1);
        __threadfence();
        if (atomicAdd(bar, 1u) == gridDim.x - 1) {
            atomicExch(bar, 0u);
            __threadfence();
            atomicAdd(bar + 1, 1u);
        } else {
            while (ld_acquire_u32(bar + 1) == gen) {
            }
        }
        __threadfence();
    }
    __syncthreads();
}

// Up to three matrices that share one input (gemv_kernel's w0..w2).
struct MkMats {
    const bf16_t* w[3];
    const float* b[3];
    float* y[3];
    int out[3];
};

// Which matrix and row a warp's feature index falls in (as gemv_kernel resolves it).
struct MkRow {
    const bf16_t* w;
    const float* b;
    float* y;
    int out, row;
    bool live;
};

__device__ __forceinline__ MkRow mk_row(const MkMats& m, int row, bool in_grid) {
    MkRow r = {m.w[0], m.b[0], m.y[0], m.out[0], row, false};
    if (r.row >= m.out[0]) {
        r.row -= m.out[0], r.w = m.w[1], r.b = m.b[1], r.y = m.y[1], r.out = m.out[1];
        if (r.row >= m.out[1]) r.row -= m.out[1], r.w = m.w[2], r.b = m.b[2], r.y = m.y[2], r.out = m.out[2];
    }
    r.live = in_grid && r.row < r.out;
    return r;
}

// One virtual block of a GEMV phase (n = 1): the dot products of its warps' rows from their
// fetched chunks `pre`, the split slices summed in slice order, the epilogue. Every thread of the
// block calls it (the slice sums meet at __syncthreads).
__device__ __forceinline__ void mk_gemv_vb(const MkRow& r, const bf16_t* wr, const uint4 pre[GEMV_PRE],
                                           const void* x, int x_f32, int in, int k0, int len, int splits,
                                           int add) {
    __shared__ float slice_sums[GEMV_WARPS];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, part = warp % splits;
    float acc[1] = {0.0f};
    if (r.live) {
        if (x_f32)
            gemv_row<1, true>(wr, pre, x, in, k0, len, lane, acc);
        else
            gemv_row<1, false>(wr, pre, x, in, k0, len, lane, acc);
    }
    if (splits > 1) {
        if (lane == 0) slice_sums[warp] = acc[0];
        __syncthreads();
        if (part == 0) {
            for (int s = 1; s < splits; s++) acc[0] += slice_sums[warp + s];
        }
        __syncthreads();
    }
    if (part == 0 && r.live) gemv_store<1>(acc, r.b, r.y, r.out, r.row, add, lane);
}

// Virtual blocks of a GEMV phase whose weight rows each warp keeps in flight (2: double
// buffering, MK_DEPTH * 32 registers of chunks). A tuning knob (cuda/tune.rs:
// TAPEDECK_NVRTC_DEFINES): deeper rings want MK_MIN_BLOCKS=1 for the registers.
#ifndef MK_DEPTH
#define MK_DEPTH 2
#endif

// One GEMV phase, n = 1: what gemv_bf16_1 computes with these arguments, its virtual block vb
// taken by block vb % gridDim.x. A ring of MK_DEPTH buffers: the rows of a block's next
// MK_DEPTH - 1 virtual blocks are in flight while it computes the current one, and the first
// MK_DEPTH are requested before the barrier that opens the phase (`wait`; the previous phase's
// output is the input). The fused RMSNorm (norm_w) is computed once per block.
__device__ __forceinline__ void mk_gemv(const MkMats& m, const void* x, int x_f32, const float* norm_w, float eps,
                                        int in, int splits, int add, unsigned* bar, bool wait) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int per = GEMV_WARPS / splits;
    const int total = m.out[0] + m.out[1] + m.out[2];
    const int nvb = (total + per - 1) / per;
    const int len = in / splits, k0 = (warp % splits) * len;
    const int step = gridDim.x;
    // Resolves virtual block vb's row for this warp and requests its chunks into `buf`.
    auto fetch = [&](int vb, MkRow& r, const bf16_t*& wr, uint4 (&buf)[GEMV_PRE]) {
        r = mk_row(m, vb * per + warp / splits, vb < nvb);
        wr = r.w + (r.live ? (size_t)r.row * in + k0 : 0);
        gemv_prefetch(wr, len, lane, r.live, buf);
    };
    int vb = blockIdx.x;
    MkRow r[MK_DEPTH];
    const bf16_t* wr[MK_DEPTH];
    uint4 buf[MK_DEPTH][GEMV_PRE];
#pragma unroll
    for (int d = 0; d < MK_DEPTH; d++) fetch(vb + d * step, r[d], wr[d], buf[d]);
    if (wait) grid_sync(bar);
    if (vb >= nvb) return;  // uniform over the block
    if (norm_w) {
        x = gemv_norm_prologue<1>((const float*)x, norm_w, eps, in);
        x_f32 = 0;
    }
    for (bool done = false; !done;) {
        // A fixed trip count with no exit inside, so it unrolls: every buffer index is then a
        // constant and the ring stays in registers.
#pragma unroll
        for (int d = 0; d < MK_DEPTH; d++) {
            if (!done) {
                mk_gemv_vb(r[d], wr[d], buf[d], x, x_f32, in, k0, len, splits, add);
                fetch(vb + MK_DEPTH * step, r[d], wr[d], buf[d]);
                vb += step;
                done = vb >= nvb;
            }
        }
    }
}

// Virtual blocks of the gate/up phase whose gate and up rows each warp keeps (1: the current
// one's, with the next one's gate requested while the current up product runs; MK_SWIGLU_DEPTH *
// 64 registers of chunks). A tuning knob like MK_DEPTH.
#ifndef MK_SWIGLU_DEPTH
#define MK_SWIGLU_DEPTH 1
#endif

// The gate/up phase, n = 1: what gemv_bf16_swiglu_1 computes (input: the residual stream
// normalized with the layer's MLP norm). A ring of MK_SWIGLU_DEPTH virtual blocks' rows: the gate
// row MK_SWIGLU_DEPTH blocks ahead is requested as soon as the current gate product is done, its
// up row after the up product, so 2 * MK_SWIGLU_DEPTH rows per warp stay in flight.
__device__ __forceinline__ void mk_swiglu(const MkLayer& L, const float* x, float eps, int in, bf16_t* out,
                                          int inter, unsigned* bar) {
    constexpr int D = MK_SWIGLU_DEPTH;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int nvb = (inter + GEMV_WARPS - 1) / GEMV_WARPS;
    const int step = gridDim.x;
    int vb = blockIdx.x;
    // Virtual block v's row for this warp: its row index and weight offset, or not live.
    auto locate = [&](int v, int& row, bool& live, size_t& at) {
        row = v * GEMV_WARPS + warp;
        live = v < nvb && row < inter;
        at = live ? (size_t)row * in : 0;
    };
    int row[D];
    bool live[D];
    size_t at[D];
    uint4 pre_g[D][GEMV_PRE], pre_u[D][GEMV_PRE];
#pragma unroll
    for (int d = 0; d < D; d++) {
        locate(vb + d * step, row[d], live[d], at[d]);
        gemv_prefetch(L.wg + at[d], in, lane, live[d], pre_g[d]);
        gemv_prefetch(L.wu + at[d], in, lane, live[d], pre_u[d]);
    }
    grid_sync(bar);
    if (vb >= nvb) return;
    const bf16_t* xs = gemv_norm_prologue<1>(x, L.mlp_norm, eps, in);
    for (bool done = false; !done;) {
        // A fixed trip count with no exit inside, so it unrolls and the ring stays in registers.
#pragma unroll
        for (int d = 0; d < D; d++) {
            if (!done) {
                int nrow;
                bool nlive;
                size_t nat;
                locate(vb + D * step, nrow, nlive, nat);
                float g[1] = {0.0f}, u[1] = {0.0f};
                if (live[d]) gemv_row<1, false>(L.wg + at[d], pre_g[d], xs, in, 0, in, lane, g);
                gemv_prefetch(L.wg + nat, in, lane, nlive, pre_g[d]);
                if (live[d]) gemv_row<1, false>(L.wu + at[d], pre_u[d], xs, in, 0, in, lane, u);
                gemv_prefetch(L.wu + nat, in, lane, nlive, pre_u[d]);
                if (live[d]) swiglu_store<1>(g, u, L.bg, L.bu, out, inter, row[d], lane);
                row[d] = nrow, live[d] = nlive, at[d] = nat;
                vb += step;
                done = vb >= nvb;
            }
        }
    }
}

// RoPE + KV write, decode attention and the split merge of one layer, in one phase. Work item
// (kvh, split) for the splits that hold context: its block rotates the group's queries into its
// own copy (q_scr[split]; the same arithmetic as rope_kv_write, so the same bits), the last split
// also rotates and stores the new token's key and value (no other split reads that position),
// then threads 0..127 run the mma kernel's block. The item that finishes a KV head's splits last
// (a counter per KV head, reset by it) merges them, as decode_attn_combine would.
template <int D, typename KV>
__device__ __forceinline__ void mk_attention(const MkParams& p, const MkLayer& L, unsigned char* smem) {
    KV* k_pool = static_cast<KV*>(L.k_pool);
    KV* v_pool = static_cast<KV*>(L.v_pool);
    grid_sync(p.bar);
    const int group = p.heads / p.kv_heads;
    const int len = p.ctx[0];
    const int ns = min((len + p.split_len - 1) / p.split_len, p.max_splits);
    for (int it = blockIdx.x; it < p.kv_heads * ns; it += gridDim.x) {
        const int kvh = it % p.kv_heads, split = it / p.kv_heads;
        float* qs = p.q_scr + (size_t)split * p.heads * D;
        for (int j = 0; j < group; j++)
            rope_kv_head(p.q, qs, p.k, p.v, k_pool, v_pool, (float*)0, (float*)0, p.pos, p.inv_freq, p.slots, p.heads, p.kv_heads,
                         D, p.kv_mode, 0, kvh * group + j);
        if (split == ns - 1)
            rope_kv_head(p.q, qs, p.k, p.v, k_pool, v_pool, (float*)0, (float*)0, p.pos, p.inv_freq, p.slots, p.heads, p.kv_heads,
                         D, p.kv_mode, 0, p.heads + kvh);
        __threadfence();  // the new key and value reach L2 before the cp.async tile loads read them
        __syncthreads();
        if (threadIdx.x < DA_THREADS)
            da::mma_impl<KV, D, true>(p.att, qs, k_pool, v_pool, p.tables, p.ctx, p.partial_out,
                                         p.partial_ml, p.max_blocks, p.heads, p.kv_heads, p.block_size,
                                         p.split_len, p.max_splits, p.scale, smem, kvh, 0, split);
        __syncthreads();
        if (ns > 1)
            merge_if_last_split<DA_COMBINE_THREADS>(p.done + kvh, ns, p.att, p.partial_out, p.partial_ml, p.ctx,
                                                    p.heads, D, p.split_len, p.max_splits, kvh * group, group, 0,
                                                    (float*)0);
    }
}

// The barrier alone, `iters` times: what one costs on this GPU (cuda::check::grid_barrier).
extern "C" __global__ void grid_sync_bench(unsigned* bar, int iters) {
    TD_SCOPE("grid_sync_bench");
    for (int i = 0; i < iters; i++) grid_sync(bar);
}

// Which phases run (bits: 1 q/k/v, 2 attention, 4 o, 8 gate/up, 16 down, 32 head); a skipped
// phase keeps its barrier. Only for timing the phases on a GPU by difference (the step's numbers
// are wrong with any bit clear): a tuning knob like MK_MIN_BLOCKS.
#ifndef MK_PHASES
#define MK_PHASES 63
#endif
#define MK_RUNS(bit) ((MK_PHASES) & (bit))

// The step over a pool of KV elements (f32, or bf16 bits): decode_step / decode_step_bf16kv.
template <typename KV>
__device__ __forceinline__ void decode_step_impl(const MkParams& p, unsigned char* mk_smem) {
    const int q_dim = p.heads * p.head_dim, kv_dim = p.kv_heads * p.head_dim;
    for (int l = 0; l < p.n_layers; l++) {
        const MkLayer& L = p.layers[l];
        MkMats qkv = {{L.wq, L.wk, L.wv}, {L.bq, L.bk, L.bv}, {p.q, p.k, p.v}, {q_dim, kv_dim, kv_dim}};
        // The first phase needs no barrier: the embedding kernel before this one has finished.
        if (MK_RUNS(1))
            mk_gemv(qkv, p.x, 0, L.attn_norm, p.eps, p.hidden, p.splits_qkv, 0, p.bar, l > 0);
        else if (l > 0)
            grid_sync(p.bar);
        if (!MK_RUNS(2))
            grid_sync(p.bar);
        else if (p.head_dim == 64)
            mk_attention<64, KV>(p, L, mk_smem);
        else
            mk_attention<128, KV>(p, L, mk_smem);
        MkMats o = {{L.wo, 0, 0}, {L.bo, 0, 0}, {p.x, 0, 0}, {p.hidden, 0, 0}};
        if (MK_RUNS(4))
            mk_gemv(o, p.att, 1, 0, 0.0f, q_dim, p.splits_o, 1, p.bar, true);
        else
            grid_sync(p.bar);
        if (MK_RUNS(8))
            mk_swiglu(L, p.x, p.eps, p.hidden, p.act, p.inter, p.bar);
        else
            grid_sync(p.bar);
        MkMats down = {{L.wd, 0, 0}, {L.bd, 0, 0}, {p.x, 0, 0}, {p.hidden, 0, 0}};
        if (MK_RUNS(16))
            mk_gemv(down, p.act, 0, 0, 0.0f, p.inter, p.splits_down, 1, p.bar, true);
        else
            grid_sync(p.bar);
    }
    MkMats head = {{p.head_w, 0, 0}, {p.head_b, 0, 0}, {p.logits, 0, 0}, {p.vocab, 0, 0}};
    if (MK_RUNS(32))
        mk_gemv(head, p.x, 0, p.final_norm, p.eps, p.hidden, p.splits_head, 0, p.bar, true);
    else
        grid_sync(p.bar);
}

extern "C" __global__ void __launch_bounds__(MK_THREADS, MK_MIN_BLOCKS) decode_step(MkParams p) {
    TD_SCOPE("decode_step");
    extern __shared__ __align__(16) unsigned char mk_smem[];
    decode_step_impl<float>(p, mk_smem);
}
extern "C" __global__ void __launch_bounds__(MK_THREADS, MK_MIN_BLOCKS) decode_step_bf16kv(MkParams p) {
    TD_SCOPE("decode_step_bf16kv");
    extern __shared__ __align__(16) unsigned char mk_smem[];
    decode_step_impl<bf16_t>(p, mk_smem);
}
