// nvrtc_check: compile a kernel source with NVRTC for the given virtual architectures, the way
// the Rust backend does at run time, and write the PTX next to it.
//   nvrtc_check <source.cu> <out_dir> compute_90 compute_120 ...
// Checks: the compile succeeds with no #include available; the PTX has the three entry points,
// mma.sync m16n8k16 bf16, ldmatrix and cp.async; and no wgmma / tcgen05.
// Build: g++ -O2 nvrtc_check.cpp -I$CUDA/include -L$CUDA/lib64 -lnvrtc -o nvrtc_check
#include <nvrtc.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

static int fails = 0;
static void check(bool ok, const std::string& what) {
  std::printf("  [%s] %s\n", ok ? "ok" : "FAIL", what.c_str());
  if (!ok) ++fails;
}

int main(int argc, char** argv) {
  if (argc < 4) {
    std::fprintf(stderr, "usage: %s source.cu out_dir arch...\n", argv[0]);
    return 2;
  }
  std::ifstream f(argv[1]);
  if (!f) {
    std::fprintf(stderr, "cannot read %s\n", argv[1]);
    return 2;
  }
  std::stringstream ss;
  ss << f.rdbuf();
  const std::string src = ss.str();
  {
    bool inc = false;  // a preprocessor #include line (comments mentioning it are fine)
    std::istringstream ls(src);
    for (std::string line; std::getline(ls, line);) {
      size_t p = line.find_first_not_of(" \t");
      if (p != std::string::npos && line.compare(p, 1, "#") == 0 && line.find("include", p) != std::string::npos)
        inc = true;
    }
    check(!inc, "source has no #include line");
  }
  int major = 0, minor = 0;
  nvrtcVersion(&major, &minor);
  std::printf("NVRTC %d.%d\n", major, minor);

  for (int a = 3; a < argc; ++a) {
    const std::string arch = argv[a];
    for (int fast = 0; fast < 2; ++fast) {
      nvrtcProgram prog;
      nvrtcResult r = nvrtcCreateProgram(&prog, src.c_str(), "decode_attention_mma.cu", 0, nullptr, nullptr);
      if (r != NVRTC_SUCCESS) {
        std::printf("create: %s\n", nvrtcGetErrorString(r));
        return 1;
      }
      std::string archopt = "--gpu-architecture=" + arch;
      std::vector<const char*> opts = {archopt.c_str(), "-lineinfo"};
      if (fast) opts.push_back("--use_fast_math");
      r = nvrtcCompileProgram(prog, (int)opts.size(), opts.data());
      size_t logsz = 0;
      nvrtcGetProgramLogSize(prog, &logsz);
      std::string log(logsz, '\0');
      if (logsz) nvrtcGetProgramLog(prog, &log[0]);
      std::printf("%s%s: %s\n", arch.c_str(), fast ? " --use_fast_math" : "", nvrtcGetErrorString(r));
      if (logsz > 1) std::printf("log:\n%s\n", log.c_str());
      check(r == NVRTC_SUCCESS, "compile " + arch + (fast ? " fast-math" : ""));
      if (r != NVRTC_SUCCESS) {
        nvrtcDestroyProgram(&prog);
        continue;
      }
      size_t n = 0;
      nvrtcGetPTXSize(prog, &n);
      std::string ptx(n, '\0');
      nvrtcGetPTX(prog, &ptx[0]);
      nvrtcDestroyProgram(&prog);
      if (fast) continue;
      const char* entries[] = {".entry decode_attn_mma_bf16kv", ".entry decode_attn_mma_f32kv",
                               ".entry decode_attn_combine"};
      for (const char* e : entries) check(ptx.find(e) != std::string::npos, std::string("PTX has ") + e);
      check(ptx.find("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32") != std::string::npos,
            "PTX uses mma.sync m16n8k16 bf16");
      check(ptx.find("ldmatrix.sync.aligned") != std::string::npos, "PTX uses ldmatrix");
      check(ptx.find("cp.async") != std::string::npos, "PTX uses cp.async");
      check(ptx.find("wgmma") == std::string::npos, "PTX has no wgmma");
      check(ptx.find("tcgen05") == std::string::npos, "PTX has no tcgen05");
      const std::string path = std::string(argv[2]) + "/decode_attention_mma." + arch + ".ptx";
      std::ofstream o(path);
      o << ptx.c_str();
      std::printf("  wrote %s (%zu bytes)\n", path.c_str(), n);
    }
  }
  std::printf("nvrtc_check: %d failures\n", fails);
  return fails ? 1 : 0;
}
