// prefill_attn_bench.cu -- correctness and performance harness for kernels/prefill_attention.cu.
//
//   nvcc -O3 -arch=sm_90 -std=c++17 -Xcompiler -pthread -o prefill_attn_bench \
//       bench/cuda/prefill_attn_bench.cu -lnvrtc -ldl
//   ./prefill_attn_bench [--src kernels/prefill_attention.cu] [--no-perf]
//
// Sections: device info and the kernels' resources; the NVRTC build of the source with the
// engine's options (engine/src/cuda/kernels.rs) for compute_80, compute_90 and compute_120;
// correctness against a float64 CPU reference on fresh random inputs, through the nvcc build and
// the NVRTC compute_90 build (loaded with the driver API, as the Rust backend does), with
// engine.cu's `attention` beside them; a performance table (Llama-3.2-1B heads) against
// `attention`. bench/cuda/run_prefill_attn.sh builds and runs it.
#include <cuda.h>  // types only: the driver API is reached through dlopen("libcuda.so.1")
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <nvrtc.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "../../kernels/prefill_attention.cu"

#define CK(x)                                                                                     \
  do {                                                                                            \
    cudaError_t e_ = (x);                                                                         \
    if (e_ != cudaSuccess) {                                                                      \
      std::fprintf(stderr, "CUDA error %s at %s:%d: %s\n", cudaGetErrorString(e_), __FILE__, __LINE__, #x); \
      std::exit(1);                                                                               \
    }                                                                                             \
  } while (0)

// ---------------------------------------------------------------------------------------------
// The baseline: engine.cu's `attention` (the f32 SIMT kernel, one block per token and query
// head), copied as it is at commit 86ed26b rather than included, so that edits elsewhere in
// engine.cu cannot break this harness. Only the names of its helpers moved into a namespace.
namespace ref {
#define ATT_WARPS 4
#define MAX_DPL 8
__device__ __forceinline__ float round_bf16(float x) {
  unsigned int b = __float_as_uint(x);
  if ((b & 0x7fffffffu) > 0x7f800000u) return x;
  unsigned int r = (b + 0x7fffu + ((b >> 16) & 1u)) & 0xffff0000u;
  return __uint_as_float(r);
}
__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ size_t kv_offset(const int* table, int j, int bs, int kv_dim, int kvh, int hd) {
  return ((size_t)table[j / bs] * bs + j % bs) * kv_dim + (size_t)kvh * hd;
}
__global__ void attention(float* out, const float* q, const float* k_pool, const float* v_pool, const int* tables,
                          int max_blocks, const int* seg, const int* ctx, const int* hide, const int* rows,
                          const float* scores, int scores_stride, int heads, int kv_heads, int hd, int bs,
                          float scale, int bf16) {
  const float NEG_INF = __uint_as_float(0xff800000u);
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
#undef ATT_WARPS
#undef MAX_DPL
}  // namespace ref

// Variants of the hd-64 kernel for the performance table only: K/V tiles of 32 positions, and
// BN 64 without the 2-blocks-per-SM register cap.
#define PA_VARIANT(NAME, HD, BN, MINB)                                                                     \
  __global__ void __launch_bounds__(PA_THREADS, MINB)                                                      \
  NAME(float* out, const float* q, const float* k_pool, const float* v_pool, const float* k_scale,         \
       const float* v_scale, const int* tables,                                                            \
       int max_blocks, const int* seg, const int* ctx, const int* hide, const int* tiles, int heads,        \
       int kv_heads, int hd, int bs, float scale, int bf16) {                                              \
    extern __shared__ __align__(16) float pa_variant_smem[];                                               \
    pa::prefill<HD, BN>(out, q, k_pool, v_pool, k_scale, v_scale, tables, max_blocks, seg, ctx, hide, tiles, heads, kv_heads, \
                        hd, bs, scale, bf16, pa_variant_smem);                                             \
  }
PA_VARIANT(pa_hd64_bn32, 64, 32, 2)
PA_VARIANT(pa_hd64_bn64_1blk, 64, 64, 1)
#undef PA_VARIANT

// ---------------------------------------------------------------------------------------------
// host helpers
static inline float bf16_round_host(float f) {  // RNE, as pa::round_bf16
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return f;
  u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
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
  int below(int n) { return (int)(next() % (uint64_t)n); }
  float normal() {
    double u1 = uni(), u2 = uni();
    return (float)(std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2));
  }
};

static int g_fails = 0;

__device__ __forceinline__ uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
__global__ void fill_normal_f32(float* p, size_t n, uint64_t seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    uint64_t a = mix64(seed + 0x9e3779b97f4a7c15ull * (2 * i + 1));
    uint64_t b = mix64(seed ^ (0x632be59bd9b4e019ull * (2 * i + 2)));
    float u1 = ((a >> 40) + 0.5f) * (1.0f / 16777216.0f);
    float u2 = ((b >> 40) + 0.5f) * (1.0f / 16777216.0f);
    p[i] = sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2);
  }
}
__global__ void fill_f32(float* p, size_t n, float v) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) p[i] = v;
}
static void poison(float* p, size_t n) {
  fill_f32<<<1024, 256>>>(p, n, NAN);
  CK(cudaGetLastError());
}

// ---------------------------------------------------------------------------------------------
// kernels: nvcc-built (runtime API) or NVRTC-built (driver API)
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
  const char* name = "";
  const void* rt = nullptr;
  CUfunction drv = nullptr;
  int hd = 0, bn = 0;
  int smem() const { return PA_SMEM_BYTES(hd, bn); }
};

// The host side of the contract in prefill_attention.cu.
struct PaArgs {
  float* out;
  const float *q, *k, *v;
  const float *k_scale, *v_scale;  // FP8 pools only: null here (f32 pools)
  const int *tables;
  int max_blocks;
  const int *seg, *ctx, *hide, *tiles;
  int num_tiles, heads, kv_heads, hd, bs;
  float scale;
  int bf16;
};

static void launch_pa(const Kern& k, PaArgs a, cudaStream_t s) {
  void* args[] = {&a.out, &a.q,     &a.k,     &a.v,        &a.k_scale, &a.v_scale, &a.tables, &a.max_blocks, &a.seg, &a.ctx,
                  &a.hide, &a.tiles, &a.heads, &a.kv_heads, &a.hd,     &a.bs,         &a.scale, &a.bf16};
  const unsigned grid = (unsigned)(a.num_tiles * a.kv_heads);
  if (k.rt) {
    CK(cudaLaunchKernel(k.rt, dim3(grid), dim3(PA_THREADS), args, k.smem(), s));
  } else {
    CUresult r = p_launch(k.drv, grid, 1, 1, PA_THREADS, 1, 1, (unsigned)k.smem(), (CUstream)s, args, nullptr);
    if (r != CUDA_SUCCESS) {
      std::fprintf(stderr, "cuLaunchKernel failed: %d\n", (int)r);
      std::exit(1);
    }
  }
}

static void launch_attention(const PaArgs& a, int n, cudaStream_t s) {
  ref::attention<<<dim3(n, a.heads), 128, 0, s>>>(a.out, a.q, a.k, a.v, a.tables, a.max_blocks, a.seg, a.ctx, a.hide,
                                                  nullptr, nullptr, 0, a.heads, a.kv_heads, a.hd, a.bs, a.scale,
                                                  a.bf16);
  CK(cudaGetLastError());
}

static Kern rt_kern(const char* name, const void* fn, int hd, int bn) {
  Kern k;
  k.name = name;
  k.rt = fn;
  k.hd = hd;
  k.bn = bn;
  CK(cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, k.smem()));
  cudaFuncAttributes fa;
  CK(cudaFuncGetAttributes(&fa, fn));
  int occ = 0;
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, fn, PA_THREADS, k.smem()));
  std::printf("nvcc  %-26s regs %3d  local %3zu B  dynamic smem %6d B  blocks/SM %d\n", name, fa.numRegs,
              fa.localSizeBytes, k.smem(), occ);
  return k;
}

// Engine options (engine/src/cuda/kernels.rs `options`).
static bool nvrtc_compile(const std::string& src, const std::string& arch, std::string* ptx) {
  nvrtcProgram prog;
  if (nvrtcCreateProgram(&prog, src.c_str(), "prefill_attention.cu", 0, nullptr, nullptr) != NVRTC_SUCCESS) return false;
  const std::string a = "--gpu-architecture=" + arch;
  const char* opts[] = {a.c_str(), "--fmad=true", "--prec-div=true", "--prec-sqrt=true", "--ftz=false",
                        "-default-device", "--std=c++17"};
  nvrtcResult r = nvrtcCompileProgram(prog, 7, opts);
  size_t logsz = 0;
  nvrtcGetProgramLogSize(prog, &logsz);
  if (logsz > 1) {
    std::string log(logsz, '\0');
    nvrtcGetProgramLog(prog, &log[0]);
    std::printf("NVRTC %s log:\n%s\n", arch.c_str(), log.c_str());
  }
  if (r == NVRTC_SUCCESS) {
    size_t n = 0;
    nvrtcGetPTXSize(prog, &n);
    ptx->assign(n, '\0');
    nvrtcGetPTX(prog, &(*ptx)[0]);
  }
  nvrtcDestroyProgram(&prog);
  return r == NVRTC_SUCCESS;
}

static void check(bool ok, const std::string& what) {
  std::printf("  [%s] %s\n", ok ? "ok" : "FAIL", what.c_str());
  if (!ok) ++g_fails;
}

static const char* kEntries[3] = {"prefill_attention_hd32", "prefill_attention_hd64", "prefill_attention_hd128"};
static const int kHds[3] = {32, 64, 128};

// NVRTC builds for compute_80/90/120 with the checks of the portability test; returns the
// compute_90 entry points loaded through the driver API (empty on failure).
static std::vector<Kern> nvrtc_set(const char* src_path) {
  std::vector<Kern> ks;
  std::ifstream f(src_path);
  if (!f) {
    check(false, std::string("read ") + src_path);
    return ks;
  }
  std::stringstream ss;
  ss << f.rdbuf();
  const std::string src = ss.str();
  bool inc = false;
  std::istringstream ls(src);
  for (std::string line; std::getline(ls, line);) {
    size_t p = line.find_first_not_of(" \t");
    if (p != std::string::npos && line.compare(p, 1, "#") == 0 && line.find("include", p) != std::string::npos) inc = true;
  }
  check(!inc, "source has no #include line");
  int major = 0, minor = 0;
  nvrtcVersion(&major, &minor);
  std::printf("NVRTC %d.%d\n", major, minor);
  std::string ptx90;
  for (const char* arch : {"compute_80", "compute_90", "compute_120"}) {
    std::string ptx;
    const bool ok = nvrtc_compile(src, arch, &ptx);
    check(ok, std::string("NVRTC compile for ") + arch);
    if (!ok) continue;
    for (const char* e : kEntries) check(ptx.find(std::string(".entry ") + e) != std::string::npos,
                                         std::string(arch) + " PTX has " + e);
    check(ptx.find("cp.async") != std::string::npos, std::string(arch) + " PTX uses cp.async");
    check(ptx.find("wgmma") == std::string::npos && ptx.find("tcgen05") == std::string::npos,
          std::string(arch) + " PTX has no wgmma / tcgen05");
    if (std::string(arch) == "compute_90") ptx90 = ptx;
  }
  if (ptx90.empty()) return ks;
  void* h = dlopen("libcuda.so.1", RTLD_NOW);
  if (!h) {
    check(false, "dlopen libcuda.so.1");
    return ks;
  }
  p_modload = (PFN_ModLoad)dlsym(h, "cuModuleLoadData");
  p_getfn = (PFN_GetFn)dlsym(h, "cuModuleGetFunction");
  p_setattr = (PFN_SetAttr)dlsym(h, "cuFuncSetAttribute");
  p_getattr = (PFN_GetAttr)dlsym(h, "cuFuncGetAttribute");
  p_launch = (PFN_Launch)dlsym(h, "cuLaunchKernel");
  if (!p_modload || !p_getfn || !p_setattr || !p_getattr || !p_launch) {
    check(false, "dlsym of the driver API");
    return ks;
  }
  CK(cudaFree(0));  // make the runtime's primary context current for the driver calls
  CUmodule mod;
  if (p_modload(&mod, ptx90.c_str()) != CUDA_SUCCESS) {
    check(false, "cuModuleLoadData of the compute_90 PTX");
    return ks;
  }
  for (int i = 0; i < 3; ++i) {
    Kern k;
    k.name = kEntries[i];
    k.hd = kHds[i];
    k.bn = PA_BN(kHds[i]);
    if (p_getfn(&k.drv, mod, kEntries[i]) != CUDA_SUCCESS ||
        p_setattr(k.drv, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, k.smem()) != CUDA_SUCCESS) {
      check(false, std::string("load ") + kEntries[i]);
      ks.clear();
      return ks;
    }
    int regs = 0, local = 0;
    p_getattr(&regs, CU_FUNC_ATTRIBUTE_NUM_REGS, k.drv);
    p_getattr(&local, CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES, k.drv);
    std::printf("nvrtc %-26s regs %3d  local %3d B\n", kEntries[i], regs, local);
    ks.push_back(k);
  }
  return ks;
}

// ---------------------------------------------------------------------------------------------
// batches: segments with their chunk, block tables, per-token metadata, the tile list
struct Seg {
  int p0, len;  // this chunk is positions p0 .. p0+len-1; positions < p0 are already in the pool
};

// Tiles as the contract asks: every run of consecutive same-segment tokens split from its start
// into pieces of tile_tokens (or, with random_sizes, of random sizes 1..tile_tokens), longest
// context first.
static std::vector<int> build_tiles(const std::vector<int>& seg, const std::vector<int>& ctx, int tile_tokens,
                                    Rng* random_sizes) {
  struct T {
    int t0, count, end;
  };
  std::vector<T> ts;
  const int n = (int)seg.size();
  for (int t = 0; t < n;) {
    int run = 1;
    while (t + run < n && seg[t + run] == seg[t]) ++run;
    for (int i = 0; i < run;) {
      int c = std::min(tile_tokens, run - i);
      if (random_sizes) c = 1 + random_sizes->below(c);
      int end = 0;
      for (int k = 0; k < c; ++k) end = std::max(end, ctx[t + i + k]);
      ts.push_back({t + i, c, end});
      i += c;
    }
    t += run;
  }
  std::stable_sort(ts.begin(), ts.end(), [](const T& a, const T& b) { return a.end > b.end; });
  std::vector<int> out;
  for (const T& x : ts) {
    out.push_back(x.t0);
    out.push_back(x.count);
  }
  return out;
}

struct Case {
  const char* name;
  int heads, kv, hd, bs;
  std::vector<Seg> segs;
  int hide_pct;       // share of tokens (with ctx >= 2) given a hidden position
  bool random_tiles;  // tiles of random sizes instead of full ones
};

static double rel_err(const std::vector<float>& out, const std::vector<double>& ref, size_t* nans, size_t* worst) {
  double num = 0, den = 0, wd = -1;
  *nans = 0;
  *worst = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (!std::isfinite(out[i])) {
      ++*nans;
      continue;
    }
    const double d = std::fabs((double)out[i] - ref[i]);
    if (d > wd) {
      wd = d;
      *worst = i;
    }
    num += d * d;
    den += ref[i] * ref[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

static void run_case(const Case& c, int bf16, const std::vector<Kern>& rt, const std::vector<Kern>& drv, Rng& rng) {
  const int heads = c.heads, kv = c.kv, hd = c.hd, bs = c.bs, group = heads / kv;
  const int nseg = (int)c.segs.size();
  const float scale = 1.0f / std::sqrt((float)hd);
  int mbps = 1;
  long long used = 0;
  for (const Seg& s : c.segs) {
    const int nb = (s.p0 + s.len + bs - 1) / bs;
    mbps = std::max(mbps, nb);
    used += nb;
  }
  mbps += 2;                           // spare columns, -1: never read
  const long long nblocks = used + 5;  // 5 blocks nobody owns, all NaN
  std::vector<int> perm(nblocks);
  for (long long i = 0; i < nblocks; ++i) perm[i] = (int)i;
  for (long long i = nblocks - 1; i > 0; --i) std::swap(perm[i], perm[rng.next() % (i + 1)]);
  std::vector<int> tables((size_t)nseg * mbps, -1);
  long long next = 0;
  for (int s = 0; s < nseg; ++s)
    for (int b = 0; b < (c.segs[s].p0 + c.segs[s].len + bs - 1) / bs; ++b) tables[(size_t)s * mbps + b] = perm[next++];
  const size_t kv_dim = (size_t)kv * hd;
  const size_t pool = (size_t)nblocks * bs * kv_dim;
  std::vector<float> K(pool, NAN), V(pool, NAN);  // every row outside a context stays NaN
  auto row = [&](int s, int p) { return ((size_t)tables[(size_t)s * mbps + p / bs] * bs + p % bs) * kv_dim; };
  for (int s = 0; s < nseg; ++s)
    for (int p = 0; p < c.segs[s].p0 + c.segs[s].len; ++p)
      for (size_t i = 0; i < kv_dim; ++i) {
        K[row(s, p) + i] = rng.normal();
        V[row(s, p) + i] = rng.normal();
      }
  std::vector<int> seg, ctx, hide;
  for (int s = 0; s < nseg; ++s)
    for (int i = 0; i < c.segs[s].len; ++i) {
      const int pos = c.segs[s].p0 + i;
      seg.push_back(s);
      ctx.push_back(pos + 1);
      int h = -1;
      if (pos >= 1 && rng.below(100) < c.hide_pct) {
        const int kind = rng.below(3);  // the chunk boundary, the token itself, anywhere
        h = kind == 0 && c.segs[s].p0 > 0 ? c.segs[s].p0 - 1 : kind == 1 ? pos : rng.below(pos + 1);
      }
      hide.push_back(h);
    }
  const int n = (int)seg.size();
  std::vector<float> Q((size_t)n * heads * hd);
  for (float& x : Q) x = rng.normal();
  const std::vector<int> tiles = build_tiles(seg, ctx, PA_ROWS / group, c.random_tiles ? &rng : nullptr);
  const int num_tiles = (int)tiles.size() / 2;

  // float64 reference, with the CPU reference's roundings for bf16 (models/llama.rs attend_with):
  // q, k, v rounded; p = exp(s - max) over the unmasked positions, rounded; sum of unrounded p.
  // Rounding p to bf16 is discontinuous, so an f32 score that differs from the float64 one in its
  // last bits moves some p across a rounding boundary (one bf16 step, 2^-8 relative): against this
  // reference any f32 kernel shows such flips. With bf16 a second reference (ref32) therefore takes
  // the scores as the kernel computes them -- an f32 fma chain over d in order, times scale in
  // f32, p = expf(s - max) in f32 -- and then rounds and accumulates as the first one: it holds
  // the kernel to the same roundings, with only the summation order of l and of P V left to differ.
  std::vector<double> ref((size_t)n * heads * hd), ref32(bf16 ? ref.size() : 0);
  auto rb = [&](float x) { return bf16 ? bf16_round_host(x) : x; };
  auto work = [&](int t_begin, int t_end) {
    std::vector<double> sc, o(hd), o32(hd);
    std::vector<float> qr(hd), sc32;
    for (int t = t_begin; t < t_end; ++t)
      for (int h = 0; h < heads; ++h) {
        const int kvh = h / group, L = ctx[t];
        for (int d = 0; d < hd; ++d) qr[d] = rb(Q[((size_t)t * heads + h) * hd + d]);
        sc.assign(L, -INFINITY);
        sc32.assign(L, -INFINITY);
        double mx = -INFINITY;
        float mx32 = -INFINITY;
        for (int p = 0; p < L; ++p) {
          if (p == hide[t]) continue;
          const float* kr = &K[row(seg[t], p) + (size_t)kvh * hd];
          double acc = 0;
          float acc32 = 0.0f;
          for (int d = 0; d < hd; ++d) {
            acc += (double)qr[d] * (double)rb(kr[d]);
            acc32 = std::fmaf(qr[d], rb(kr[d]), acc32);
          }
          sc[p] = acc * (double)scale;
          sc32[p] = acc32 * scale;
          mx = std::max(mx, sc[p]);
          mx32 = std::max(mx32, sc32[p]);
        }
        double sum = 0, sum32 = 0;
        std::fill(o.begin(), o.end(), 0.0);
        std::fill(o32.begin(), o32.end(), 0.0);
        for (int p = 0; p < L; ++p) {
          if (p == hide[t]) continue;
          const float* vr = &V[row(seg[t], p) + (size_t)kvh * hd];
          const double w = std::exp(sc[p] - mx);
          sum += w;
          const double wr = bf16 ? (double)bf16_round_host((float)w) : w;
          for (int d = 0; d < hd; ++d) o[d] += wr * (double)rb(vr[d]);
          if (bf16) {
            const float w32 = std::exp(sc32[p] - mx32);
            sum32 += w32;
            const double wr32 = bf16_round_host(w32);
            for (int d = 0; d < hd; ++d) o32[d] += wr32 * (double)rb(vr[d]);
          }
        }
        for (int d = 0; d < hd; ++d) {
          ref[((size_t)t * heads + h) * hd + d] = o[d] / sum;
          if (bf16) ref32[((size_t)t * heads + h) * hd + d] = o32[d] / sum32;
        }
      }
  };
  {
    const int nt = std::max(1u, std::min(16u, std::thread::hardware_concurrency()));
    std::vector<std::thread> th;
    for (int i = 0; i < nt; ++i) th.emplace_back(work, (int)((long long)n * i / nt), (int)((long long)n * (i + 1) / nt));
    for (auto& x : th) x.join();
  }

  float *dq, *dk, *dv, *dout;
  int *dtab, *dseg, *dctx, *dhide, *dtiles;
  const size_t nout = (size_t)n * heads * hd;
  CK(cudaMalloc(&dq, nout * 4));
  CK(cudaMalloc(&dk, pool * 4));
  CK(cudaMalloc(&dv, pool * 4));
  CK(cudaMalloc(&dout, nout * 4));
  CK(cudaMalloc(&dtab, tables.size() * 4));
  CK(cudaMalloc(&dseg, n * 4));
  CK(cudaMalloc(&dctx, n * 4));
  CK(cudaMalloc(&dhide, n * 4));
  CK(cudaMalloc(&dtiles, tiles.size() * 4));
  CK(cudaMemcpy(dq, Q.data(), nout * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dk, K.data(), pool * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dv, V.data(), pool * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dtab, tables.data(), tables.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dseg, seg.data(), n * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dctx, ctx.data(), n * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dhide, hide.data(), n * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dtiles, tiles.data(), tiles.size() * 4, cudaMemcpyHostToDevice));
  PaArgs a{dout, dq, dk, dv, nullptr, nullptr, dtab, mbps, dseg, dctx, dhide, dtiles, num_tiles, heads, kv, hd, bs, scale, bf16};

  std::vector<float> hout(nout);
  int nhide = 0;
  for (int h : hide) nhide += h >= 0;
  // f32: held to 1e-5 against the float64 reference. bf16: against ref32, with the error against
  // the float64 reference printed beside it, held to 5e-5: the device's expf and the host's differ
  // in the last bit for some inputs, which still flips an occasional p by one bf16 step; the
  // expected relative L2 of that is about 2^-8 * sqrt(share of p flipped), ~1e-5 whatever the size
  // (measured on an H200: 2e-7 .. 1.9e-5 over the cases below). A wrong rounding shows as ~1e-3:
  // `attention`'s, against its running max, measures 1.1e-3 .. 1.9e-3 here.
  auto report = [&](const char* impl, bool counts) {
    CK(cudaMemcpy(hout.data(), dout, nout * 4, cudaMemcpyDeviceToHost));
    size_t nans = 0, worst = 0;
    const double e64 = rel_err(hout, ref, &nans, &worst);
    const double e = bf16 ? rel_err(hout, ref32, &nans, &worst) : e64;
    const bool ok = nans == 0 && e <= (bf16 ? 5e-5 : 1e-5);
    if (!ok && counts) ++g_fails;
    char vs64[64] = "";
    if (bf16) std::snprintf(vs64, sizeof vs64, "  (vs float64 scores %.3e)", e64);
    std::printf("CASE %-34s %-4s %-14s tokens %5d tiles %4d hidden %4d  rel_err %.3e%s  nan %zu  %s\n", c.name,
                bf16 ? "bf16" : "f32", impl, n, num_tiles, nhide, e, vs64, nans,
                ok ? "PASS" : counts ? "FAIL" : "(baseline, not counted)");
    if (!ok && counts) {  // where it went wrong, for the next run
      const std::vector<double>& r = bf16 ? ref32 : ref;
      const size_t t = worst / ((size_t)heads * hd), h = worst / hd % heads;
      int tile = -1;
      for (int i = 0; i < num_tiles; ++i)
        if ((int)t >= tiles[2 * i] && (int)t < tiles[2 * i] + tiles[2 * i + 1]) tile = i;
      std::printf("     worst: token %zu head %zu dim %zu got %.6g want %.6g; seg %d ctx %d hide %d; tile %d "
                  "(t0 %d count %d)\n",
                  t, h, worst % hd, hout[worst], r[worst], seg[t], ctx[t], hide[t], tile,
                  tile >= 0 ? tiles[2 * tile] : -1, tile >= 0 ? tiles[2 * tile + 1] : -1);
      size_t first_nan = 0;
      while (first_nan < nout && std::isfinite(hout[first_nan])) ++first_nan;
      if (first_nan < nout)
        std::printf("     first non-finite: token %zu head %zu\n", first_nan / ((size_t)heads * hd),
                    first_nan / hd % heads);
    }
  };
  const int ki = hd == 32 ? 0 : hd == 64 ? 1 : 2;
  poison(dout, nout);
  launch_pa(rt[ki], a, 0);
  CK(cudaGetLastError());
  CK(cudaDeviceSynchronize());
  report("prefill-nvcc", true);
  if (!drv.empty()) {
    poison(dout, nout);
    launch_pa(drv[ki], a, 0);
    CK(cudaDeviceSynchronize());
    report("prefill-nvrtc", true);
  }
  poison(dout, nout);
  launch_attention(a, n, 0);
  CK(cudaDeviceSynchronize());
  // The baseline's online softmax rounds p against a running max: with bf16 it is not held to 1e-5.
  report("attention", !bf16);

  for (void* p : {(void*)dq, (void*)dk, (void*)dv, (void*)dout, (void*)dtab, (void*)dseg, (void*)dctx, (void*)dhide,
                  (void*)dtiles})
    CK(cudaFree(p));
}

// ---------------------------------------------------------------------------------------------
// performance
template <class F>
static double time_us(F fn, double budget_us) {
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  fn();  // warm-up
  CK(cudaEventRecord(e0));
  fn();
  CK(cudaEventRecord(e1));
  CK(cudaEventSynchronize(e1));
  float ms;
  CK(cudaEventElapsedTime(&ms, e0, e1));
  const int reps = (int)std::max(3.0, std::min(30.0, budget_us / (ms * 1e3)));
  std::vector<float> v;
  for (int i = 0; i < reps; ++i) {
    CK(cudaEventRecord(e0));
    fn();
    CK(cudaEventRecord(e1));
    CK(cudaEventSynchronize(e1));
    CK(cudaEventElapsedTime(&ms, e0, e1));
    v.push_back(ms * 1e3f);
  }
  CK(cudaGetLastError());
  CK(cudaEventDestroy(e0));
  CK(cudaEventDestroy(e1));
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
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

struct PerfRow {
  std::string shape, impl;
  double us, tflops, speedup;
};
static std::vector<PerfRow> g_rows;

// nseq sequences of len tokens each, prefilled from position 0 in one batch.
static void perf_case(const char* shape, int nseq, int len, int heads, int kv, int hd, const std::vector<Kern>& kerns,
                      const Kern* nvrtc, uint64_t seed) {
  const int bs = 16, group = heads / kv, n = nseq * len, mbps = (len + bs - 1) / bs;
  const float scale = 1.0f / std::sqrt((float)hd);
  const size_t pool = (size_t)nseq * mbps * bs * kv * hd, nq = (size_t)n * heads * hd;
  float *q, *k, *v, *out, *out_ref;
  int *tab, *seg, *ctx, *hide, *tiles;
  CK(cudaMalloc(&q, nq * 4));
  CK(cudaMalloc(&out, nq * 4));
  CK(cudaMalloc(&out_ref, nq * 4));
  CK(cudaMalloc(&k, pool * 4));
  CK(cudaMalloc(&v, pool * 4));
  fill_normal_f32<<<4096, 256>>>(q, nq, seed);
  fill_normal_f32<<<4096, 256>>>(k, pool, seed ^ 0x5555);
  fill_normal_f32<<<4096, 256>>>(v, pool, seed ^ 0x7777);
  CK(cudaGetLastError());
  Rng rng(seed);
  std::vector<int> perm(nseq * mbps);
  for (int i = 0; i < (int)perm.size(); ++i) perm[i] = i;
  for (int i = (int)perm.size() - 1; i > 0; --i) std::swap(perm[i], perm[rng.next() % (i + 1)]);
  std::vector<int> hseg, hctx, hhide(n, -1);
  for (int s = 0; s < nseq; ++s)
    for (int i = 0; i < len; ++i) {
      hseg.push_back(s);
      hctx.push_back(i + 1);
    }
  const std::vector<int> htiles = build_tiles(hseg, hctx, PA_ROWS / group, nullptr);
  CK(cudaMalloc(&tab, perm.size() * 4));
  CK(cudaMalloc(&seg, n * 4));
  CK(cudaMalloc(&ctx, n * 4));
  CK(cudaMalloc(&hide, n * 4));
  CK(cudaMalloc(&tiles, htiles.size() * 4));
  CK(cudaMemcpy(tab, perm.data(), perm.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(seg, hseg.data(), n * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(ctx, hctx.data(), n * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(hide, hhide.data(), n * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(tiles, htiles.data(), htiles.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaDeviceSynchronize());
  PaArgs a{out, q, k, v, nullptr, nullptr, tab, mbps, seg, ctx, hide, tiles, (int)htiles.size() / 2, heads, kv, hd, bs, scale, 0};
  const double flops = 4.0 * nseq * ((double)len * len / 2) * heads * hd;

  PaArgs ar = a;
  ar.out = out_ref;
  poison(out_ref, nq);
  const double t_att = time_us([&] { launch_attention(ar, n, 0); }, 4e5);
  auto row = [&](const std::string& impl, double us) {
    g_rows.push_back({shape, impl, us, flops / (us * 1e-6) / 1e12, t_att / us});
    std::printf("PERF %-24s %-22s %10.1f us  %6.2f TFLOP/s  %6.1fx attention\n", shape, impl.c_str(), us,
                flops / (us * 1e-6) / 1e12, t_att / us);
  };
  row("attention f32", t_att);
  std::vector<const Kern*> all;
  for (const Kern& kk : kerns) all.push_back(&kk);
  if (nvrtc) all.push_back(nvrtc);
  for (const Kern* kk : all)
    for (int bf16 : {0, 1}) {
      if (bf16 && kk != &kerns[0]) continue;  // bf16 through the entry point only
      a.bf16 = bf16;
      poison(out, nq);
      launch_pa(*kk, a, 0);
      CK(cudaDeviceSynchronize());
      if (!bf16) {  // the same function as the baseline, on these inputs
        const double e = rel_err_dev(out, out_ref, nq);
        const bool ok = e <= 1e-5;
        if (!ok) ++g_fails;
        std::printf("CHECK %-24s %-22s vs attention f32: rel_err %.3e %s\n", shape, kk->name, e, ok ? "PASS" : "FAIL");
      }
      const double us = time_us([&] { launch_pa(*kk, a, 0); }, 2e5);
      row(std::string(kk->name) + (kk->drv ? " (nvrtc)" : "") + (bf16 ? " bf16" : " f32"), us);
    }
  for (void* p : {(void*)q, (void*)k, (void*)v, (void*)out, (void*)out_ref, (void*)tab, (void*)seg, (void*)ctx,
                  (void*)hide, (void*)tiles})
    CK(cudaFree(p));
}

int main(int argc, char** argv) {
  const char* src = "kernels/prefill_attention.cu";
  bool perf = true;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--src" && i + 1 < argc) src = argv[++i];
    else if (a == "--no-perf") perf = false;
    else {
      std::fprintf(stderr, "unknown argument %s\n", a.c_str());
      return 2;
    }
  }
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  int clk = 0;
  cudaDeviceGetAttribute(&clk, cudaDevAttrClockRate, 0);
  std::printf("GPU %s  sm_%d%d  %d SMs  L2 %d MB  smem/block opt-in %zu KB  smem/SM %zu KB  clock %d MHz\n", prop.name,
              prop.major, prop.minor, prop.multiProcessorCount, prop.l2CacheSize >> 20,
              prop.sharedMemPerBlockOptin >> 10, prop.sharedMemPerMultiprocessor >> 10, clk / 1000);

  std::vector<Kern> rt = {rt_kern(kEntries[0], (const void*)prefill_attention_hd32, 32, PA_BN(32)),
                          rt_kern(kEntries[1], (const void*)prefill_attention_hd64, 64, PA_BN(64)),
                          rt_kern(kEntries[2], (const void*)prefill_attention_hd128, 128, PA_BN(128))};
  const Kern v_bn32 = rt_kern("pa_hd64_bn32", (const void*)pa_hd64_bn32, 64, 32);
  const Kern v_1blk = rt_kern("pa_hd64_bn64_1blk", (const void*)pa_hd64_bn64_1blk, 64, 64);
  {
    cudaFuncAttributes fa;
    CK(cudaFuncGetAttributes(&fa, (const void*)ref::attention));
    std::printf("nvcc  %-26s regs %3d  local %3zu B\n", "attention (baseline)", fa.numRegs, fa.localSizeBytes);
  }
  std::printf("== NVRTC (engine options)\n");
  const std::vector<Kern> drv = nvrtc_set(src);

  std::random_device rd;
  const uint64_t seed = ((uint64_t)rd() << 32) ^ rd();
  std::printf("seed %llu\n", (unsigned long long)seed);
  Rng rng(seed);

  std::printf("== correctness (CPU reference, relative L2: f32 against float64, bound 1e-5; bf16 against the "
              "kernel-order f32 scores, bound 5e-5, float64 scores beside it)\n");
  const std::vector<Case> cases = {
      {"fixture 4/2 hd32 bs16 512", 4, 2, 32, 16, {{0, 512}}, 5, false},
      {"L1B 32/8 hd64 mixed+decode", 32, 8, 64, 16, {{0, 300}, {137, 200}, {1000, 1}, {33, 77}, {0, 1}}, 20, false},
      {"g1 8/8 hd128 bs16", 8, 8, 128, 16, {{0, 150}, {500, 129}, {77, 1}}, 20, false},
      {"g8 32/4 hd64 bs32", 32, 4, 64, 32, {{0, 260}, {700, 64}, {5, 3}}, 20, false},
      {"g8 16/2 hd128 bs16", 16, 2, 128, 16, {{0, 200}, {300, 90}}, 20, false},
      {"g8 8/1 hd32 bs8 random tiles", 8, 1, 32, 8, {{0, 130}, {61, 70}}, 20, true},
      {"g3 12/4 hd64 bs16 random tiles", 12, 4, 64, 16, {{0, 100}, {250, 50}, {9, 1}}, 20, true},
      {"g4 32/8 hd128 chunk at 1500", 32, 8, 128, 16, {{1500, 200}, {2000, 1}}, 10, false},
      {"L1B 32/8 hd64 bs16 1024", 32, 8, 64, 16, {{0, 1024}}, 2, false},
  };
  for (const Case& c : cases)
    for (int bf16 : {0, 1}) run_case(c, bf16, rt, drv, rng);
  std::printf("correctness: %d failures\n", g_fails);

  if (perf) {
    std::printf("== performance (median of event-timed launches; TFLOP/s = 4 n^2/2 heads hd / time)\n");
    const Kern* nv64 = drv.empty() ? nullptr : &drv[1];
    const std::vector<Kern> k64 = {rt[1], v_bn32, v_1blk};
    perf_case("fixture 4/2/32 n512", 1, 512, 4, 2, 32, {rt[0]}, nullptr, rng.next());
    perf_case("L1B 32/8/64 n1024", 1, 1024, 32, 8, 64, k64, nv64, rng.next());
    perf_case("L1B 32/8/64 n4096", 1, 4096, 32, 8, 64, k64, nv64, rng.next());
    perf_case("L1B 32/8/64 n8192", 1, 8192, 32, 8, 64, k64, nv64, rng.next());
    perf_case("L1B 32/8/64 2x4096", 2, 4096, 32, 8, 64, k64, nv64, rng.next());
    perf_case("32/8/128 n4096", 1, 4096, 32, 8, 128, {rt[2]}, nullptr, rng.next());

    std::printf("\n| shape | kernel | us | TFLOP/s | vs attention |\n|---|---|---:|---:|---:|\n");
    for (const PerfRow& r : g_rows)
      std::printf("| %s | %s | %.1f | %.2f | %.1fx |\n", r.shape.c_str(), r.impl.c_str(), r.us, r.tflops, r.speedup);
  }
  std::printf("prefill_attn_bench: %d failures\n", g_fails);
  return g_fails ? 1 : 0;
}
