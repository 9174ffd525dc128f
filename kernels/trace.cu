// trace.cu -- an optional per-block timeline of the kernels, prepended to every kernel module by
// engine/src/cuda/kernels.rs. Nsight Systems is not always at hand (the device machine has none),
// and what a decode step loses between kernels (launch gaps, programmatic-dependent-launch overlap,
// the tail of one grid against the head of the next) shows only on a timeline.
//
// Off unless compiled with TD_TRACE=1 (TAPEDECK_TRACE=path, engine/src/cuda/tune.rs): then every
// traced kernel's block 0..n records, from its thread 0, when it started, when its PDL wait
// returned (if it waited) and when thread 0 finished, with its SM, block and grid size, into one
// buffer shared by all modules (the host sets td_events in each module; cuda/trace.rs). One atomic
// per block: the timeline is slightly perturbed, not rearranged.
//
// Event layout, 4 words: start ns (%globaltimer); (end - start) << 32 | (waited - start, or
// 0xffffffff for none); kernel id (FNV-1a of its name) << 32 | SM; block << 32 | blocks in grid.
// Word 0 of the buffer counts events (it may exceed td_capacity: the rest were dropped).

#ifndef TD_TRACE
#define TD_TRACE 0
#endif

// The FNV-1a hash of a kernel name: its id in the trace (cuda/trace.rs hashes the entry point
// names the same way to name them back).
constexpr unsigned int td_hash(const char* s) {
    unsigned int h = 2166136261u;
    while (*s) h = (h ^ (unsigned char)*s++) * 16777619u;
    return h;
}

#if TD_TRACE
__device__ unsigned long long* td_events;
__device__ unsigned long long td_capacity;
__shared__ unsigned long long td_wait_at;

__device__ __forceinline__ unsigned long long td_now() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

__device__ __forceinline__ bool td_leader() {
    return threadIdx.x == 0 && threadIdx.y == 0 && threadIdx.z == 0;
}

// Lives for the kernel's body: records the block's event when thread 0 leaves it.
struct TdScope {
    unsigned long long t0;
    unsigned int kid;
    __device__ explicit TdScope(unsigned int k) : t0(0), kid(k) {
        if (td_leader()) {
            t0 = td_now();
            td_wait_at = 0;
        }
    }
    __device__ ~TdScope() {
        unsigned long long* ev = td_events;
        if (!td_leader() || !ev) return;
        unsigned long long t1 = td_now();
        unsigned long long i = atomicAdd(ev, 1ull);
        if (i >= td_capacity) return;
        unsigned int sm;
        asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
        unsigned long long waited = td_wait_at ? td_wait_at - t0 : 0xffffffffull;
        unsigned long long block = blockIdx.x + (unsigned long long)gridDim.x * (blockIdx.y + (unsigned long long)gridDim.y * blockIdx.z);
        unsigned long long blocks = (unsigned long long)gridDim.x * gridDim.y * gridDim.z;
        unsigned long long* e = ev + 1 + 4 * i;
        e[0] = t0;
        e[1] = ((t1 - t0) << 32) | (waited & 0xffffffffull);
        e[2] = ((unsigned long long)kid << 32) | sm;
        e[3] = (block << 32) | blocks;
    }
};
#define TD_SCOPE(name)                                  \
    constexpr unsigned int td_kernel_id_ = td_hash(name); \
    TdScope td_scope_(td_kernel_id_)
// TD_MARK_POINT=k (a kernel macro, through TAPEDECK_NVRTC_DEFINES) records the moment thread 0
// passes TD_MARK(k) in the "waited" field instead of the PDL wait's return: the kernels mark
// 1 where their input is ready (a GEMV's prologue done, the attention's first KV tile arrived,
// the combine's partials loaded) and 2 where their dot products are summed (just before the
// stores), so that traces taken with 0, 1 and 2 split a block's time after its wait into
// prologue, arithmetic and epilogue. Kernels without the mark then show no wait.
#ifndef TD_MARK_POINT
#define TD_MARK_POINT 0
#endif
#define TD_WAITED()                                                   \
    do {                                                              \
        if (TD_MARK_POINT == 0 && td_leader()) td_wait_at = td_now(); \
    } while (0)
#define TD_MARK(k)                                                      \
    do {                                                                \
        if (TD_MARK_POINT == (k) && td_leader()) td_wait_at = td_now(); \
    } while (0)
#else
#define TD_SCOPE(name)
#define TD_WAITED()
#define TD_MARK(k)
#endif
