// decode_attn_bench.cu -- correctness and performance harness for kernels/decode_attention_mma.cu.
//
//   nvcc -O3 -arch=sm_90 -std=c++17 -o decode_attn_bench bench/cuda/decode_attn_bench.cu -ldl
//   ./decode_attn_bench [--ptx decode_attention_mma.compute_90.ptx] [--perf-out perf.tsv]
//                       [--quick] [--waves N] [--min-split N] [--no-perf] [--no-sweep]
//
// Sections: device info and a read-only bandwidth ceiling; correctness of the mma kernels (and of
// the SIMT f32 reference kernel below) against a float64 CPU reference on fresh random inputs;
// the same correctness cases through the NVRTC-compiled PTX when --ptx is given (loaded with the
// driver API, as the Rust backend does); a performance table (Llama-3.2-1B heads) and split_len
// sweeps. bench/cuda/run_decode_attn.sh runs all of it plus PyTorch SDPA and prints the table.
#include <cuda.h>  // types only: the driver API is reached through dlopen("libcuda.so.1")
#include <cuda_runtime.h>
#include <dlfcn.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "../../kernels/decode_attention_mma.cu"

#define CK(x)                                                                                     \
  do {                                                                                            \
    cudaError_t e_ = (x);                                                                         \
    if (e_ != cudaSuccess) {                                                                      \
      std::fprintf(stderr, "CUDA error %s at %s:%d: %s\n", cudaGetErrorString(e_), __FILE__, __LINE__, #x); \
      std::exit(1);                                                                               \
    }                                                                                             \
  } while (0)

// ---------------------------------------------------------------------------------------------
// host helpers
static inline uint16_t f2bf_host(float f) {  // RNE, NaN kept quiet
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}
static inline float bf2f_host(uint16_t b) {
  uint32_t u = (uint32_t)b << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

struct Rng {  // splitmix64 + Box-Muller; seeded from std::random_device: fresh inputs every run
  uint64_t s;
  explicit Rng(uint64_t seed) : s(seed) {}
  uint64_t next() {
    uint64_t z = (s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  double uni() { return ((next() >> 11) + 0.5) * (1.0 / 9007199254740992.0); }
  float normal() {
    double u1 = uni(), u2 = uni();
    return (float)(std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2));
  }
};

static int g_nsm = 132;
static int g_ctas_per_sm = 3;   // resident mma CTAs per SM (set from the occupancy API: 3 on an H200)
static int g_waves = 5;         // split rule, large batch: about this many waves of resident CTAs
static int g_min_split = 256;   // split rule: never fewer positions per split
static int g_fails = 0;

// The host-side rule (mirrored in docs/cuda_decode_attention.md), set from the split_len sweeps
// of the first H200 run (bench/cuda/results/run1_*): a small batch does best with about two
// long CTAs per SM (not one full wave of short ones: the per-CTA start-up and the combine kernel
// cost more than the extra warps gain), a large batch with about five waves of resident CTAs.
// Splits are a multiple of 64 positions (16 per warp) and at least g_min_split.
static void choose_split(int num_seqs, int num_kv_heads, int max_len, int* split_len, int* max_splits) {
  const long long slots = (long long)g_ctas_per_sm * g_nsm;
  const long long base = (long long)num_seqs * num_kv_heads;
  long long splits = base >= slots ? (g_waves * slots + base - 1) / base : (2LL * g_nsm) / base;
  if (splits < 1) splits = 1;
  long long sl = (max_len + splits - 1) / splits;
  sl = (sl + 63) / 64 * 64;
  if (sl < g_min_split) sl = g_min_split;
  *split_len = (int)sl;
  long long ms = (max_len + sl - 1) / sl;
  *max_splits = (int)(ms < 1 ? 1 : ms);
}

// ---------------------------------------------------------------------------------------------
// device helpers: random fill, SIMT f32 reference, read bandwidth
__device__ __forceinline__ uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
__device__ __forceinline__ float dev_normal(uint64_t seed, size_t i) {
  uint64_t a = mix64(seed + 0x9e3779b97f4a7c15ull * (2 * i + 1));
  uint64_t b = mix64(seed ^ (0x632be59bd9b4e019ull * (2 * i + 2)));
  float u1 = ((a >> 40) + 0.5f) * (1.0f / 16777216.0f);
  float u2 = ((b >> 40) + 0.5f) * (1.0f / 16777216.0f);
  return sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2);
}
__global__ void fill_normal_bf16(unsigned short* p, size_t n, uint64_t seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
    p[i] = (unsigned short)(da::pack_bf16x2_rne(dev_normal(seed, i), 0.f) & 0xffffu);
}
__global__ void fill_normal_f32(float* p, size_t n, uint64_t seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
    p[i] = dev_normal(seed, i);
}
__global__ void fill_f32(float* p, size_t n, float v) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) p[i] = v;
}

template <typename T>
__device__ __forceinline__ float ldf(const T* p);
template <>
__device__ __forceinline__ float ldf<unsigned short>(const unsigned short* p) { return da::bf16_bits_to_f32(*p); }
template <>
__device__ __forceinline__ float ldf<float>(const float* p) { return *p; }
template <typename T>
__device__ __forceinline__ void ld8(const T* p, float* f);
template <>
__device__ __forceinline__ void ld8<unsigned short>(const unsigned short* p, float* f) {
  uint4 u = *reinterpret_cast<const uint4*>(p);
  unsigned w[4] = {u.x, u.y, u.z, u.w};
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __uint_as_float(w[i] << 16);
    f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}
template <>
__device__ __forceinline__ void ld8<float>(const float* p, float* f) {
  float4 a = reinterpret_cast<const float4*>(p)[0], b = reinterpret_cast<const float4*>(p)[1];
  f[0] = a.x; f[1] = a.y; f[2] = a.z; f[3] = a.w; f[4] = b.x; f[5] = b.y; f[6] = b.z; f[7] = b.w;
}

// SIMT f32 reference: f32 q, K/V as stored (bf16 widened exactly, or f32), expf, f32 throughout.
// grid (num_heads, num_seqs, max_splits), block 128. One lane per position for Q.K (chunks of 32
// positions per warp), lanes over head_dim for P.V. With one split it writes out[]; otherwise
// unnormalised partials that ref_combine merges (independent of the mma combine kernel).
template <typename T, int D>
__global__ void __launch_bounds__(128) ref_decode_simt(float* out, float* rm, float* rl, float* ro, const float* q,
                                                       const T* kp, const T* vp, const int* bt, const int* lens,
                                                       int mbps, int nh, int nkv, int bs, int split_len,
                                                       int max_splits, float scale) {
  const int h = blockIdx.x, seq = blockIdx.y, sp = blockIdx.z, tid = threadIdx.x;
  const int len = lens[seq];
  const size_t sh = (size_t)seq * nh + h;
  if (len <= 0) {
    if (sp == 0)
      for (int d = tid; d < D; d += 128) out[sh * D + d] = 0.f;
    return;
  }
  const int start = sp * split_len;
  if (start >= len) return;
  const int end = min(len, start + split_len);
  const int ns = (len + split_len - 1) / split_len;
  const int kvh = h / (nh / nkv);
  __shared__ float qs[D];
  __shared__ float wm[4], wl[4];
  __shared__ float wo[4][D];
  for (int d = tid; d < D; d += 128) qs[d] = q[sh * D + d];
  __syncthreads();
  const int warp = tid >> 5, lane = tid & 31;
  const float NEG = -INFINITY;
  float m = NEG, l = 0.f, o[D / 32];
  for (int i = 0; i < D / 32; ++i) o[i] = 0.f;
  for (int base = start + warp * 32; base < end; base += 128) {
    const int pos = base + lane;
    const bool ok = pos < end;
    float s = NEG;
    long long row = 0;
    if (ok) {
      const int blk = pos / bs;
      const int phys = bt[(size_t)seq * mbps + blk];
      row = (((long long)phys * bs + (pos - blk * bs)) * nkv + kvh) * D;
      float acc = 0.f;
      for (int d0 = 0; d0 < D; d0 += 8) {
        float f[8];
        ld8<T>(kp + row + d0, f);
        for (int e = 0; e < 8; ++e) acc = fmaf(qs[d0 + e], f[e], acc);
      }
      s = acc * scale;
    }
    float mc = s;
    for (int x = 16; x > 0; x >>= 1) mc = fmaxf(mc, __shfl_xor_sync(0xffffffffu, mc, x));
    const float mn = fmaxf(m, mc);
    const float alpha = expf(m - mn);
    const float p = ok ? expf(s - mn) : 0.f;
    float ps = p;
    for (int x = 16; x > 0; x >>= 1) ps += __shfl_xor_sync(0xffffffffu, ps, x);
    l = l * alpha + ps;
    for (int i = 0; i < D / 32; ++i) o[i] *= alpha;
    const int cnt = min(32, end - base);
    for (int j = 0; j < cnt; ++j) {
      const float pj = __shfl_sync(0xffffffffu, p, j);
      const long long rj = __shfl_sync(0xffffffffu, row, j);
      for (int i = 0; i < D / 32; ++i) o[i] = fmaf(pj, ldf<T>(vp + rj + lane + 32 * i), o[i]);
    }
    m = mn;
  }
  if (lane == 0) {
    wm[warp] = m;
    wl[warp] = l;
  }
  for (int i = 0; i < D / 32; ++i) wo[warp][lane + 32 * i] = o[i];
  __syncthreads();
  for (int d = tid; d < D; d += 128) {
    float M = NEG;
    for (int w = 0; w < 4; ++w) M = fmaxf(M, wm[w]);
    float O = 0.f, L = 0.f;
    for (int w = 0; w < 4; ++w) {
      const float e = expf(wm[w] - M);
      O += e * wo[w][d];
      L += e * wl[w];
    }
    if (ns == 1) {
      out[sh * D + d] = O / L;
    } else {
      const size_t ps = sh * max_splits + sp;
      ro[ps * D + d] = O;
      if (d == 0) {
        rm[ps] = M;
        rl[ps] = L;
      }
    }
  }
}

__global__ void ref_combine(float* out, const float* rm, const float* rl, const float* ro, const int* lens, int nh,
                            int D, int split_len, int max_splits) {
  const int h = blockIdx.x, seq = blockIdx.y, d = threadIdx.x;
  const int len = lens[seq];
  if (len <= 0 || d >= D) return;
  const int ns = min((len + split_len - 1) / split_len, max_splits);
  if (ns <= 1) return;
  const size_t sh = (size_t)seq * nh + h;
  float M = -INFINITY;
  for (int s = 0; s < ns; ++s) M = fmaxf(M, rm[sh * max_splits + s]);
  float O = 0.f, L = 0.f;
  for (int s = 0; s < ns; ++s) {
    const float e = expf(rm[sh * max_splits + s] - M);
    O += e * ro[(sh * max_splits + s) * D + d];
    L += e * rl[sh * max_splits + s];
  }
  out[sh * D + d] = O / L;
}

__global__ void read_bw_kernel(const uint4* p, size_t n, unsigned* sink) {
  unsigned acc = 0;
  const size_t stride = (size_t)gridDim.x * blockDim.x;
  size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
  for (; i + 3 * stride < n; i += 4 * stride) {
    uint4 a = p[i], b = p[i + stride], c = p[i + 2 * stride], d = p[i + 3 * stride];
    acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w ^ c.x ^ c.y ^ c.z ^ c.w ^ d.x ^ d.y ^ d.z ^ d.w;
  }
  for (; i < n; i += stride) acc ^= p[i].x ^ p[i].y ^ p[i].z ^ p[i].w;
  if (acc == 0x9e3779b9u) sink[0] = acc;
}

// ---------------------------------------------------------------------------------------------
// kernel sets: the nvcc-compiled entry points, or the NVRTC PTX loaded through the driver API
typedef CUresult (*PFN_ModLoad)(CUmodule*, const void*);
typedef CUresult (*PFN_GetFn)(CUfunction*, CUmodule, const char*);
typedef CUresult (*PFN_SetAttr)(CUfunction, CUfunction_attribute, int);
typedef CUresult (*PFN_GetAttr)(int*, CUfunction_attribute, CUfunction);
typedef CUresult (*PFN_Launch)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                               CUstream, void**, void**);
static PFN_ModLoad p_modload;
static PFN_GetFn p_getfn;
static PFN_SetAttr p_setattr;
static PFN_GetAttr p_getattr;
static PFN_Launch p_launch;

struct Kern {
  const void* rt = nullptr;
  CUfunction drv = nullptr;
};
struct KernelSet {
  const char* name;
  Kern mma_bf16, mma_f32, combine;
};

static void launch(const Kern& k, dim3 g, dim3 b, size_t smem, cudaStream_t s, void** args) {
  if (k.rt) {
    CK(cudaLaunchKernel(k.rt, g, b, args, smem, s));
  } else {
    CUresult r = p_launch(k.drv, g.x, g.y, g.z, b.x, b.y, b.z, (unsigned)smem, (CUstream)s, args, nullptr);
    if (r != CUDA_SUCCESS) {
      std::fprintf(stderr, "cuLaunchKernel failed: %d\n", (int)r);
      std::exit(1);
    }
  }
}

static KernelSet runtime_set() {
  KernelSet ks;
  ks.name = "nvcc";
  ks.mma_bf16.rt = (const void*)decode_attn_mma_bf16kv;
  ks.mma_f32.rt = (const void*)decode_attn_mma_f32kv;
  ks.combine.rt = (const void*)decode_attn_combine;
  CK(cudaFuncSetAttribute(ks.mma_bf16.rt, cudaFuncAttributeMaxDynamicSharedMemorySize, DA_SMEM_BYTES));
  CK(cudaFuncSetAttribute(ks.mma_f32.rt, cudaFuncAttributeMaxDynamicSharedMemorySize, DA_SMEM_BYTES));
  cudaFuncAttributes fa;
  const char* names[3] = {"decode_attn_mma_bf16kv", "decode_attn_mma_f32kv", "decode_attn_combine"};
  const void* fns[3] = {ks.mma_bf16.rt, ks.mma_f32.rt, ks.combine.rt};
  for (int i = 0; i < 3; ++i) {
    CK(cudaFuncGetAttributes(&fa, fns[i]));
    std::printf("nvcc %-24s regs %3d  local %zu B  static smem %zu B\n", names[i], fa.numRegs, fa.localSizeBytes,
                fa.sharedSizeBytes);
  }
  int occ = 0;
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, ks.mma_bf16.rt, DA_THREADS, DA_SMEM_BYTES));
  std::printf("occupancy: %d blocks/SM of %d threads with %d B dynamic smem\n", occ, DA_THREADS, DA_SMEM_BYTES);
  if (occ > 0) g_ctas_per_sm = occ;
  return ks;
}

static bool driver_set(const char* ptx_path, KernelSet* out) {
  void* h = dlopen("libcuda.so.1", RTLD_NOW);
  if (!h) {
    std::printf("dlopen libcuda.so.1 failed\n");
    return false;
  }
  p_modload = (PFN_ModLoad)dlsym(h, "cuModuleLoadData");
  p_getfn = (PFN_GetFn)dlsym(h, "cuModuleGetFunction");
  p_setattr = (PFN_SetAttr)dlsym(h, "cuFuncSetAttribute");
  p_getattr = (PFN_GetAttr)dlsym(h, "cuFuncGetAttribute");
  p_launch = (PFN_Launch)dlsym(h, "cuLaunchKernel");
  if (!p_modload || !p_getfn || !p_setattr || !p_getattr || !p_launch) {
    std::printf("dlsym failed\n");
    return false;
  }
  std::ifstream f(ptx_path);
  if (!f) {
    std::printf("cannot read %s\n", ptx_path);
    return false;
  }
  std::string ptx((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  CK(cudaFree(0));  // make the runtime's primary context current for the driver calls
  CUmodule mod;
  CUresult r = p_modload(&mod, ptx.c_str());
  if (r != CUDA_SUCCESS) {
    std::printf("cuModuleLoadData(%s) failed: %d\n", ptx_path, (int)r);
    return false;
  }
  out->name = "nvrtc";
  const char* names[3] = {"decode_attn_mma_bf16kv", "decode_attn_mma_f32kv", "decode_attn_combine"};
  Kern* ks[3] = {&out->mma_bf16, &out->mma_f32, &out->combine};
  for (int i = 0; i < 3; ++i) {
    if (p_getfn(&ks[i]->drv, mod, names[i]) != CUDA_SUCCESS) {
      std::printf("cuModuleGetFunction %s failed\n", names[i]);
      return false;
    }
    int regs = 0, local = 0;
    p_getattr(&regs, CU_FUNC_ATTRIBUTE_NUM_REGS, ks[i]->drv);
    p_getattr(&local, CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES, ks[i]->drv);
    std::printf("nvrtc %-24s regs %3d  local %d B\n", names[i], regs, local);
  }
  for (int i = 0; i < 2; ++i)
    if (p_setattr(ks[i]->drv, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, DA_SMEM_BYTES) != CUDA_SUCCESS) {
      std::printf("cuFuncSetAttribute failed\n");
      return false;
    }
  return true;
}

struct DecodeArgs {
  float* out;
  const float* q;
  const void* k;
  const void* v;
  const int* bt;
  const int* lens;
  float* pout;
  float* pml;
  int mbps, nh, nkv, bs, D, split_len, max_splits;
  float scale;
  int num_seqs;
  bool f32kv;
};

static void launch_decode(const KernelSet& ks, DecodeArgs a, cudaStream_t s) {
  unsigned* done = nullptr;  // no in-kernel merge: the combine kernel follows
  const float* no_scales = nullptr;  // k_scale, v_scale: FP8 pools only
  void* args[] = {&a.out, &a.q, &a.k, &a.v, &a.bt, &a.lens, &a.pout, &a.pml,
                  &a.mbps, &a.nh, &a.nkv, &a.bs, &a.D, &a.split_len, &a.max_splits, &a.scale, &done,
                  &no_scales, &no_scales};
  launch(a.f32kv ? ks.mma_f32 : ks.mma_bf16, dim3(a.nkv, a.num_seqs, a.max_splits), dim3(DA_THREADS),
         DA_SMEM_BYTES, s, args);
  void* cargs[] = {&a.out, &a.pout, &a.pml, &a.lens, &a.nh, &a.D, &a.split_len, &a.max_splits};
  launch(ks.combine, dim3(a.nh, a.num_seqs), dim3(DA_COMBINE_THREADS), 0, s, cargs);
}

struct RefWs {
  float *rm = nullptr, *rl = nullptr, *ro = nullptr;
};
static void launch_ref(DecodeArgs a, RefWs w, cudaStream_t s) {
  dim3 g(a.nh, a.num_seqs, a.max_splits);
#define REFL(T, DD)                                                                                          \
  ref_decode_simt<T, DD><<<g, 128, 0, s>>>(a.out, w.rm, w.rl, w.ro, a.q, (const T*)a.k, (const T*)a.v, a.bt, \
                                           a.lens, a.mbps, a.nh, a.nkv, a.bs, a.split_len, a.max_splits, a.scale)
  if (a.f32kv) {
    if (a.D == 64) REFL(float, 64); else REFL(float, 128);
  } else {
    if (a.D == 64) REFL(unsigned short, 64); else REFL(unsigned short, 128);
  }
#undef REFL
  CK(cudaGetLastError());
  if (a.max_splits > 1) {
    ref_combine<<<dim3(a.nh, a.num_seqs), a.D, 0, s>>>(a.out, w.rm, w.rl, w.ro, a.lens, a.nh, a.D, a.split_len,
                                                       a.max_splits);
    CK(cudaGetLastError());
  }
}

static void poison(float* p, size_t n) {
  if (!n) return;
  fill_f32<<<1024, 256>>>(p, n, NAN);
  CK(cudaGetLastError());
}

// ---------------------------------------------------------------------------------------------
// correctness
struct Case {
  const char* name;
  int nh, nkv, D, bs;
  bool f32kv;
  std::vector<int> lens;
};

static double rel_err(const std::vector<float>& out, const std::vector<double>& ref, size_t* nans) {
  double num = 0, den = 0;
  *nans = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (!std::isfinite(out[i])) {
      ++*nans;
      continue;
    }
    const double d = (double)out[i] - ref[i];
    num += d * d;
    den += ref[i] * ref[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

static void run_case(const std::vector<KernelSet>& sets, const Case& c, Rng& rng) {
  const int nseq = (int)c.lens.size();
  const int nh = c.nh, nkv = c.nkv, D = c.D, bs = c.bs;
  const float scale = 1.0f / std::sqrt((float)D);
  int max_len = 0, mbps = 1;
  long long used = 0;
  for (int L : c.lens) {
    max_len = std::max(max_len, L);
    mbps = std::max(mbps, (L + bs - 1) / bs);
    used += (L + bs - 1) / bs;
  }
  mbps += 2;  // spare columns, filled with -1: never read
  const long long nblocks = used + 5;  // 5 blocks nobody owns, all NaN
  std::vector<int> perm(nblocks);
  for (long long i = 0; i < nblocks; ++i) perm[i] = (int)i;
  for (long long i = nblocks - 1; i > 0; --i) std::swap(perm[i], perm[rng.next() % (i + 1)]);
  std::vector<int> bt((size_t)nseq * mbps, -1);
  long long next = 0;
  for (int s = 0; s < nseq; ++s)
    for (int b = 0; b < (c.lens[s] + bs - 1) / bs; ++b) bt[(size_t)s * mbps + b] = perm[next++];

  const size_t pool = (size_t)nblocks * bs * nkv * D;
  std::vector<float> K(pool, NAN), V(pool, NAN);  // every row outside a context stays NaN
  for (int s = 0; s < nseq; ++s)
    for (int p = 0; p < c.lens[s]; ++p) {
      const int phys = bt[(size_t)s * mbps + p / bs];
      for (int h = 0; h < nkv; ++h)
        for (int d = 0; d < D; ++d) {
          const size_t i = (((size_t)phys * bs + p % bs) * nkv + h) * D + d;
          float k = rng.normal(), v = rng.normal();
          if (!c.f32kv) {
            k = bf2f_host(f2bf_host(k));
            v = bf2f_host(f2bf_host(v));
          }
          K[i] = k;
          V[i] = v;
        }
    }
  std::vector<float> Q((size_t)nseq * nh * D);
  for (auto& x : Q) x = rng.normal();

  // float64 reference
  const int group = nh / nkv;
  std::vector<double> ref((size_t)nseq * nh * D, 0.0);
  std::vector<double> sc;
  for (int s = 0; s < nseq; ++s)
    for (int h = 0; h < nh; ++h) {
      const int L = c.lens[s], kvh = h / group;
      if (L == 0) continue;
      sc.assign(L, 0.0);
      double mx = -1e300;
      const float* qh = &Q[((size_t)s * nh + h) * D];
      for (int p = 0; p < L; ++p) {
        const size_t row = (((size_t)bt[(size_t)s * mbps + p / bs] * bs + p % bs) * nkv + kvh) * D;
        double acc = 0;
        for (int d = 0; d < D; ++d) acc += (double)qh[d] * (double)K[row + d];
        sc[p] = acc * (double)scale;
        mx = std::max(mx, sc[p]);
      }
      double sum = 0;
      std::vector<double> o(D, 0.0);
      for (int p = 0; p < L; ++p) {
        const double w = std::exp(sc[p] - mx);
        sum += w;
        const size_t row = (((size_t)bt[(size_t)s * mbps + p / bs] * bs + p % bs) * nkv + kvh) * D;
        for (int d = 0; d < D; ++d) o[d] += w * (double)V[row + d];
      }
      for (int d = 0; d < D; ++d) ref[((size_t)s * nh + h) * D + d] = o[d] / sum;
    }

  // device buffers
  const size_t es = c.f32kv ? 4 : 2;
  void *dK, *dV;
  CK(cudaMalloc(&dK, pool * es));
  CK(cudaMalloc(&dV, pool * es));
  if (c.f32kv) {
    CK(cudaMemcpy(dK, K.data(), pool * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dV, V.data(), pool * 4, cudaMemcpyHostToDevice));
  } else {
    std::vector<uint16_t> hb(pool);
    for (size_t i = 0; i < pool; ++i) hb[i] = f2bf_host(K[i]);
    CK(cudaMemcpy(dK, hb.data(), pool * 2, cudaMemcpyHostToDevice));
    for (size_t i = 0; i < pool; ++i) hb[i] = f2bf_host(V[i]);
    CK(cudaMemcpy(dV, hb.data(), pool * 2, cudaMemcpyHostToDevice));
  }
  float *dq, *dout;
  int *dbt, *dlens;
  const size_t nout = (size_t)nseq * nh * D;
  CK(cudaMalloc(&dq, Q.size() * 4));
  CK(cudaMalloc(&dout, nout * 4));
  CK(cudaMalloc(&dbt, bt.size() * 4));
  CK(cudaMalloc(&dlens, nseq * 4));
  CK(cudaMemcpy(dq, Q.data(), Q.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dbt, bt.data(), bt.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dlens, c.lens.data(), nseq * 4, cudaMemcpyHostToDevice));

  int rule_sl, rule_ms;
  choose_split(nseq, nkv, max_len, &rule_sl, &rule_ms);
  const int one_sl = std::max(16, (max_len + 15) / 16 * 16);
  struct Sp {
    const char* what;
    int sl;
  };
  const Sp sps[3] = {{"rule", rule_sl}, {"sl=16", 16}, {"1 split", one_sl}};
  std::vector<float> hout(nout);

  auto check = [&](const char* impl, const char* what, int sl, int ms, double bound) {
    CK(cudaMemcpy(hout.data(), dout, nout * 4, cudaMemcpyDeviceToHost));
    size_t nans = 0;
    const double e = rel_err(hout, ref, &nans);
    const bool ok = nans == 0 && e <= bound;
    if (!ok) ++g_fails;
    std::printf("%-34s %-12s %-7s split_len %6d splits %5d  rel_err %.3e  nan %zu  %s\n", c.name, impl, what, sl, ms,
                e, nans, ok ? "PASS" : "FAIL");
  };

  for (const Sp& sp : sps) {
    const int sl = sp.sl, ms = std::max(1, (max_len + sl - 1) / sl);
    float *pout, *pml;
    CK(cudaMalloc(&pout, nout * ms * 4));
    CK(cudaMalloc(&pml, (size_t)nseq * nh * ms * 2 * 4));
    DecodeArgs a{dout, dq, dK, dV, dbt, dlens, pout, pml, mbps, nh, nkv, bs, D, sl, ms, scale, nseq, c.f32kv};
    for (const KernelSet& ks : sets) {
      poison(dout, nout);
      poison(pout, nout * ms);
      poison(pml, (size_t)nseq * nh * ms * 2);
      launch_decode(ks, a, 0);
      CK(cudaGetLastError());
      CK(cudaDeviceSynchronize());
      std::string impl = std::string("mma-") + ks.name;
      check(impl.c_str(), sp.what, sl, ms, 1e-2);
    }
    if (sp.sl != 16) {  // the SIMT f32 reference, split and unsplit
      RefWs w;
      CK(cudaMalloc(&w.rm, (size_t)nseq * nh * ms * 4));
      CK(cudaMalloc(&w.rl, (size_t)nseq * nh * ms * 4));
      CK(cudaMalloc(&w.ro, nout * ms * 4));
      poison(dout, nout);
      launch_ref(a, w, 0);
      CK(cudaDeviceSynchronize());
      check("simt-f32-ref", sp.what, sl, ms, 1e-5);
      CK(cudaFree(w.rm));
      CK(cudaFree(w.rl));
      CK(cudaFree(w.ro));
    }
    CK(cudaFree(pout));
    CK(cudaFree(pml));
  }
  CK(cudaFree(dK));
  CK(cudaFree(dV));
  CK(cudaFree(dq));
  CK(cudaFree(dout));
  CK(cudaFree(dbt));
  CK(cudaFree(dlens));
}

// ---------------------------------------------------------------------------------------------
// performance
struct Timing {
  double graph_us = 0, eager_us = 0;
};

template <class F>
static Timing time_fn(F fn, int R, double est_us) {
  // One sample = `inner` back-to-back calls cycling through all R input sets (so the L2 cannot
  // hold them between uses); median over samples, per call. Both through a CUDA graph (launch
  // gaps removed) and eagerly.
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const int inner = std::max(R, 4);
  int samples = (int)std::min(60.0, std::max(5.0, 150000.0 / (est_us * inner)));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  for (int i = 0; i < 3; ++i) fn(i % R, s);
  CK(cudaStreamSynchronize(s));
  Timing t;
  std::vector<float> v;
  for (int smp = 0; smp < samples; ++smp) {
    CK(cudaEventRecord(e0, s));
    for (int i = 0; i < inner; ++i) fn(i % R, s);
    CK(cudaEventRecord(e1, s));
    CK(cudaEventSynchronize(e1));
    float ms;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    v.push_back(ms * 1000.f / inner);
  }
  std::sort(v.begin(), v.end());
  t.eager_us = v[v.size() / 2];
  cudaGraph_t g;
  cudaGraphExec_t ge;
  CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < inner; ++i) fn(i % R, s);
  CK(cudaStreamEndCapture(s, &g));
  CK(cudaGraphInstantiate(&ge, g, 0));
  CK(cudaGraphLaunch(ge, s));
  CK(cudaStreamSynchronize(s));
  v.clear();
  for (int smp = 0; smp < samples; ++smp) {
    CK(cudaEventRecord(e0, s));
    CK(cudaGraphLaunch(ge, s));
    CK(cudaEventRecord(e1, s));
    CK(cudaEventSynchronize(e1));
    float ms;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    v.push_back(ms * 1000.f / inner);
  }
  std::sort(v.begin(), v.end());
  t.graph_us = v[v.size() / 2];
  CK(cudaGraphExecDestroy(ge));
  CK(cudaGraphDestroy(g));
  CK(cudaEventDestroy(e0));
  CK(cudaEventDestroy(e1));
  CK(cudaStreamDestroy(s));
  CK(cudaGetLastError());
  return t;
}

static FILE* g_tsv = nullptr;

struct PerfSetup {
  int nseq, ctx, R, mbps, nh = 32, nkv = 8, D = 64, bs = 16;
  bool f32kv;
  size_t pool;
  void *K = nullptr, *V = nullptr;
  float *q = nullptr, *out = nullptr, *out2 = nullptr;
  int *bt = nullptr, *lens = nullptr;
  double kv_bytes;  // K+V bytes one call reads
};

static PerfSetup perf_setup(int nseq, int ctx, bool f32kv, uint64_t seed) {
  PerfSetup P;
  P.nseq = nseq;
  P.ctx = ctx;
  P.f32kv = f32kv;
  const size_t es = f32kv ? 4 : 2;
  P.kv_bytes = (double)nseq * ctx * P.nkv * P.D * es * 2;
  P.R = (int)std::min(64.0, std::max(1.0, std::ceil(512e6 / P.kv_bytes)));
  P.mbps = ctx / P.bs;
  const long long nblocks = (long long)P.R * nseq * P.mbps;
  P.pool = (size_t)nblocks * P.bs * P.nkv * P.D;
  CK(cudaMalloc(&P.K, P.pool * es));
  CK(cudaMalloc(&P.V, P.pool * es));
  if (f32kv) {
    fill_normal_f32<<<4096, 256>>>((float*)P.K, P.pool, seed);
    fill_normal_f32<<<4096, 256>>>((float*)P.V, P.pool, seed ^ 0x5555);
  } else {
    fill_normal_bf16<<<4096, 256>>>((unsigned short*)P.K, P.pool, seed);
    fill_normal_bf16<<<4096, 256>>>((unsigned short*)P.V, P.pool, seed ^ 0x5555);
  }
  CK(cudaGetLastError());
  const size_t nq = (size_t)nseq * P.nh * P.D;
  CK(cudaMalloc(&P.q, nq * P.R * 4));
  fill_normal_f32<<<256, 256>>>(P.q, nq * P.R, seed ^ 0x7777);
  CK(cudaMalloc(&P.out, nq * 4));
  CK(cudaMalloc(&P.out2, nq * 4));
  Rng rng(seed);
  std::vector<int> perm(nblocks);
  for (long long i = 0; i < nblocks; ++i) perm[i] = (int)i;
  for (long long i = nblocks - 1; i > 0; --i) std::swap(perm[i], perm[rng.next() % (i + 1)]);
  CK(cudaMalloc(&P.bt, perm.size() * 4));
  CK(cudaMemcpy(P.bt, perm.data(), perm.size() * 4, cudaMemcpyHostToDevice));
  std::vector<int> lens(nseq, ctx);
  CK(cudaMalloc(&P.lens, nseq * 4));
  CK(cudaMemcpy(P.lens, lens.data(), nseq * 4, cudaMemcpyHostToDevice));
  CK(cudaDeviceSynchronize());
  return P;
}
static void perf_free(PerfSetup& P) {
  CK(cudaFree(P.K));
  CK(cudaFree(P.V));
  CK(cudaFree(P.q));
  CK(cudaFree(P.out));
  CK(cudaFree(P.out2));
  CK(cudaFree(P.bt));
  CK(cudaFree(P.lens));
}

static DecodeArgs perf_args(const PerfSetup& P, int r, float* out, float* pout, float* pml, int sl, int ms) {
  const size_t es = P.f32kv ? 4 : 2;
  (void)es;
  DecodeArgs a{out, P.q + (size_t)r * P.nseq * P.nh * P.D, P.K, P.V, P.bt + (size_t)r * P.nseq * P.mbps, P.lens,
               pout, pml, P.mbps, P.nh, P.nkv, P.bs, P.D, sl, ms, 1.0f / std::sqrt((float)P.D), P.nseq, P.f32kv};
  return a;
}

static double rel_err_dev(const float* a, const float* b, size_t n) {
  std::vector<float> x(n), y(n);
  CK(cudaMemcpy(x.data(), a, n * 4, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(y.data(), b, n * 4, cudaMemcpyDeviceToHost));
  double num = 0, den = 0;
  for (size_t i = 0; i < n; ++i) {
    if (!std::isfinite(x[i]) || !std::isfinite(y[i])) return INFINITY;
    num += ((double)x[i] - y[i]) * ((double)x[i] - y[i]);
    den += (double)y[i] * y[i];
  }
  return std::sqrt(num / den);
}

static void emit(const char* impl, const PerfSetup& P, int sl, int ms, const Timing& t, const char* note) {
  const double gbps = P.kv_bytes / (t.graph_us * 1e3);
  std::printf("PERF %-14s kv=%-4s batch %3d ctx %6d  split_len %6d splits %4d  graph %9.2f us  eager %9.2f us  "
              "%7.1f GB/s %s\n",
              impl, P.f32kv ? "f32" : "bf16", P.nseq, P.ctx, sl, ms, t.graph_us, t.eager_us, gbps, note);
  if (g_tsv)
    std::fprintf(g_tsv, "%s\t%s\t%d\t%d\t%d\t%d\t%.3f\t%.3f\t%.1f\t%s\n", impl, P.f32kv ? "f32" : "bf16", P.nseq,
                 P.ctx, sl, ms, t.graph_us, t.eager_us, gbps, note);
}

static void perf_case(const KernelSet& ks, int nseq, int ctx, bool f32kv, bool with_ref,
                      const std::vector<int>& sweep, uint64_t seed) {
  PerfSetup P = perf_setup(nseq, ctx, f32kv, seed);
  int rule_sl, rule_ms;
  choose_split(nseq, P.nkv, ctx, &rule_sl, &rule_ms);
  std::vector<int> sls = {rule_sl};
  for (int s : sweep)
    if (s != rule_sl && s <= ctx) sls.push_back(s);
  const size_t nq = (size_t)nseq * P.nh * P.D;
  const double est = P.kv_bytes / 3e6 + 5;  // us at ~3 TB/s
  for (size_t i = 0; i < sls.size(); ++i) {
    const int sl = sls[i], ms = (ctx + sl - 1) / sl;
    float *pout, *pml;
    CK(cudaMalloc(&pout, nq * ms * 4));
    CK(cudaMalloc(&pml, nq / P.D * ms * 2 * 4));
    Timing t = time_fn([&](int r, cudaStream_t s) { launch_decode(ks, perf_args(P, r, P.out, pout, pml, sl, ms), s); },
                       P.R, est);
    std::string impl = std::string("mma-") + ks.name;
    emit(impl.c_str(), P, sl, ms, t, i == 0 ? "rule" : "sweep");
    if (i == 0 && with_ref) {
      // correctness of this very configuration against the SIMT f32 reference (input set 0)
      RefWs w;
      CK(cudaMalloc(&w.rm, nq / P.D * ms * 4));
      CK(cudaMalloc(&w.rl, nq / P.D * ms * 4));
      CK(cudaMalloc(&w.ro, nq * ms * 4));
      poison(P.out, nq);
      poison(P.out2, nq);
      launch_decode(ks, perf_args(P, 0, P.out, pout, pml, sl, ms), 0);
      launch_ref(perf_args(P, 0, P.out2, pout, pml, sl, ms), w, 0);
      CK(cudaDeviceSynchronize());
      const double e = rel_err_dev(P.out, P.out2, nq);
      const bool ok = e <= 1e-2;
      if (!ok) ++g_fails;
      std::printf("CHECK mma vs simt-f32-ref batch %d ctx %d kv %s: rel_err %.3e %s\n", nseq, ctx,
                  f32kv ? "f32" : "bf16", e, ok ? "PASS" : "FAIL");
      Timing tr = time_fn([&](int r, cudaStream_t s) { launch_ref(perf_args(P, r, P.out2, pout, pml, sl, ms), w, s); },
                          P.R, est * 8);
      emit("simt-f32-ref", P, sl, ms, tr, "rule");
      CK(cudaFree(w.rm));
      CK(cudaFree(w.rl));
      CK(cudaFree(w.ro));
    }
    CK(cudaFree(pout));
    CK(cudaFree(pml));
  }
  perf_free(P);
}

static void read_bandwidth() {
  const size_t bytes = 4ull << 30;
  uint4* p;
  unsigned* sink;
  CK(cudaMalloc(&p, bytes));
  CK(cudaMalloc(&sink, 4));
  CK(cudaMemset(p, 1, bytes));
  const size_t n = bytes / 16;
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  std::vector<float> v;
  for (int i = 0; i < 12; ++i) {
    CK(cudaEventRecord(e0));
    read_bw_kernel<<<g_nsm * 8, 256>>>(p, n, sink);
    CK(cudaEventRecord(e1));
    CK(cudaEventSynchronize(e1));
    float ms;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    if (i >= 2) v.push_back(ms);
  }
  CK(cudaGetLastError());
  std::sort(v.begin(), v.end());
  std::printf("read-only bandwidth ceiling: %.0f GB/s (4 GiB read, median of 10)\n", bytes / (v[v.size() / 2] * 1e6));
  if (g_tsv) std::fprintf(g_tsv, "readbw\t-\t0\t0\t0\t0\t%.3f\t0\t%.1f\t-\n", v[v.size() / 2] * 1e3,
                          bytes / (v[v.size() / 2] * 1e6));
  CK(cudaFree(p));
  CK(cudaFree(sink));
}

int main(int argc, char** argv) {
  const char* ptx = nullptr;
  const char* tsv = nullptr;
  bool quick = false, perf = true, sweep = true;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--ptx" && i + 1 < argc) ptx = argv[++i];
    else if (a == "--perf-out" && i + 1 < argc) tsv = argv[++i];
    else if (a == "--quick") quick = true;
    else if (a == "--no-perf") perf = false;
    else if (a == "--no-sweep") sweep = false;
    else if (a == "--waves" && i + 1 < argc) g_waves = std::atoi(argv[++i]);
    else if (a == "--min-split" && i + 1 < argc) g_min_split = std::atoi(argv[++i]);
    else {
      std::fprintf(stderr, "unknown argument %s\n", a.c_str());
      return 2;
    }
  }
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  g_nsm = prop.multiProcessorCount;
  int clk = 0, memclk = 0;
  cudaDeviceGetAttribute(&clk, cudaDevAttrClockRate, 0);
  cudaDeviceGetAttribute(&memclk, cudaDevAttrMemoryClockRate, 0);
  std::printf("GPU %s  sm_%d%d  %d SMs  L2 %d MB  smem/block opt-in %zu KB  clock %d MHz  mem clock %d MHz\n",
              prop.name, prop.major, prop.minor, g_nsm, prop.l2CacheSize >> 20, prop.sharedMemPerBlockOptin >> 10,
              clk / 1000, memclk / 1000);
  if (tsv) g_tsv = std::fopen(tsv, "w");

  std::vector<KernelSet> sets;
  sets.push_back(runtime_set());
  std::printf("split rule: small batch ~2 CTAs per SM; large batch (>= %d x %d resident CTAs) ~%d waves; "
              "split_len >= %d, multiple of 64\n", g_ctas_per_sm, g_nsm, g_waves, g_min_split);
  KernelSet drv;
  if (ptx) {
    if (driver_set(ptx, &drv)) {
      sets.push_back(drv);
    } else {
      std::printf("FAIL: could not load the NVRTC PTX %s\n", ptx);
      ++g_fails;
    }
  }
  std::random_device rd;
  const uint64_t seed = ((uint64_t)rd() << 32) ^ rd();
  std::printf("seed %llu\n", (unsigned long long)seed);
  Rng rng(seed);

  // ---------------- correctness
  std::vector<Case> cases = {
      {"L1B 32/8 d64 bs16 bf16 ragged", 32, 8, 64, 16, false, {1, 15, 16, 17, 100, 1000, 2049, 4099}},
      {"L1B 32/8 d64 bs16 f32 ragged", 32, 8, 64, 16, true, {1, 15, 16, 17, 100, 1000, 2049, 4099}},
      {"8/2 d128 bs16 bf16 ragged", 8, 2, 128, 16, false, {3, 33, 500, 3001}},
      {"8/2 d128 bs16 f32 ragged", 8, 2, 128, 16, true, {3, 33, 500, 3001}},
      {"32/8 d128 bs32 bf16", 32, 8, 128, 32, false, {31, 777, 2500}},
      {"28/4 (g7) d64 bs128 f32", 28, 4, 64, 128, true, {129, 1000, 1}},
      {"16/1 (g16) d128 bs64 bf16", 16, 1, 128, 64, false, {65, 4000}},
      {"4/4 (g1) d64 bs16 bf16 +len0", 4, 4, 64, 16, false, {0, 50, 300}},
      {"L1B 32/8 d64 bs16 bf16 b1 32767", 32, 8, 64, 16, false, {32767}},
  };
  if (quick) cases.resize(4);
  for (const Case& c : cases) run_case(sets, c, rng);
  std::printf("correctness: %d failures\n", g_fails);

  // ---------------- performance
  if (perf) {
    read_bandwidth();
    const int ctxs[4] = {1024, 4096, 16384, 32768};
    const int batches[3] = {1, 8, 64};
    for (int ctx : ctxs)
      for (int b : batches) perf_case(sets[0], b, ctx, false, true, {}, rng.next());
    for (int b : batches) perf_case(sets[0], b, 32768, true, true, {}, rng.next());
    if (sweep) {  // around the rule's choice at the goal points
      perf_case(sets[0], 1, 32768, false, false, {512, 704, 2048, 4096}, rng.next());
      perf_case(sets[0], 8, 32768, false, false, {2048, 4096, 16384}, rng.next());
      perf_case(sets[0], 64, 32768, false, false, {4096, 10944, 16384}, rng.next());
      perf_case(sets[0], 1, 4096, false, false, {128, 512}, rng.next());
    }
    if (sets.size() > 1) {  // the NVRTC build (driver JIT of compute_90 PTX) at the goal points
      perf_case(sets[1], 1, 32768, false, false, {}, rng.next());
      perf_case(sets[1], 64, 32768, false, false, {}, rng.next());
    }
  }
  if (g_tsv) std::fclose(g_tsv);
  std::printf("decode_attn_bench: %d failures\n", g_fails);
  return g_fails ? 1 : 0;
}
