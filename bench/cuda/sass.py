#!/usr/bin/env python3
"""The SASS of one kernel, as the engine would build it, on a machine with no GPU: the kernel files
concatenated in the engine's order (engine/src/cuda/kernels.rs), compiled by NVRTC with the
engine's options and your defines, assembled by ptxas and disassembled by nvdisasm, all from
NVIDIA's PyPI wheels (cached beside ci/kernels_check.sh's in $TAPEDECK_CUDA_WHEELS, default
~/.cache/tapedeck/cuda-wheels; fetched on first use).

Why: where a load is issued relative to the first instruction that waits for another is ptxas's
choice, not the source's order. The twenty-fifth session found ptxas moving a warp-uniform
context length into a uniform register (R2UR) right after its load, which stalled every load
behind it; only the SASS shows that. By default the script prints the memory, barrier, branch
and uniform-move instructions in order, with the register and spill counts.

    python3 bench/cuda/sass.py decode_attn_combine kernels/trace.cu kernels/decode_attention_mma.cu \\
        -D DA_INDEX_EARLY=1 [--arch 90] [--all] [--grep 'LDG|R2UR']
"""
import argparse
import ctypes
import os
import re
import subprocess
import sys
import tempfile
import zipfile

NVRTC_VERSION = "13.0.88"
NVDISASM_VERSION = "13.2.86"  # the oldest nvdisasm wheel on PyPI for CUDA 13
CACHE = os.path.join(
    os.environ.get("TAPEDECK_CUDA_WHEELS", os.path.expanduser("~/.cache/tapedeck/cuda-wheels")))
DEFAULT_PATTERN = r"LDG|STG|LDS|STS|LDGSTS|BAR|BRA|EXIT|R2UR|ACQBULK|DEPBAR|ATOM|RED\.|SHFL|MEMBAR|CCTL"


def fetch(version, packages, marker):
    """Unpacks the wheels of `packages` at `version` into the cache unless `marker` is there."""
    root = os.path.join(CACHE, version)
    if os.path.exists(os.path.join(root, marker)):
        return root
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                        "--disable-pip-version-check", "-d", tmp]
                       + [f"{p}=={version}" for p in packages], check=True)
        for w in os.listdir(tmp):
            zipfile.ZipFile(os.path.join(tmp, w)).extractall(root)
    for b in ("ptxas", "nvdisasm"):
        path = os.path.join(root, "nvidia/cu13/bin", b)
        if os.path.exists(path):
            os.chmod(path, 0o755)
    return root


def ptx(sources, arch, defines):
    """PTX of the concatenated sources, with the engine's NVRTC options."""
    root = fetch(NVRTC_VERSION, ["nvidia-cuda-nvrtc", "nvidia-cuda-nvcc"], "nvidia/cu13/bin/ptxas")
    libdir = os.path.join(root, "nvidia/cu13/lib")
    # NVRTC dlopens its builtins by soname; loaded first, they are found without LD_LIBRARY_PATH.
    for f in sorted(os.listdir(libdir)):
        if f.startswith("libnvrtc-builtins.so"):
            ctypes.CDLL(os.path.join(libdir, f), mode=ctypes.RTLD_GLOBAL)
    lib = ctypes.CDLL(os.path.join(libdir, "libnvrtc.so.13"))
    src = "\n".join(open(f).read() for f in sources).encode()
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), src, b"module.cu", 0, None, None) != 0:
        sys.exit("nvrtcCreateProgram failed")
    # As engine/src/cuda/kernels.rs `options`.
    opts = [f"--gpu-architecture=compute_{arch}", "--fmad=true", "--prec-div=true",
            "--prec-sqrt=true", "--ftz=false", "-default-device", "--std=c++17"]
    opts += [f"-D{d}" for d in defines]
    arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
    rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
    n = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
    log = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetProgramLog(prog, log)
    if rc != 0:
        sys.exit(f"NVRTC failed:\n{log.value.decode()}")
    lib.nvrtcGetPTXSize(prog, ctypes.byref(n))
    out = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetPTX(prog, out)
    return root, out.value


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("kernel", help="entry point (extern \"C\" name)")
    ap.add_argument("sources", nargs="+", help="kernel files, in the engine's order")
    ap.add_argument("-D", dest="defines", action="append", default=[], help="NAME=VALUE")
    ap.add_argument("--arch", default="90", help="90, 120, 80 (default 90)")
    ap.add_argument("--all", action="store_true", help="every instruction")
    ap.add_argument("--grep", default=DEFAULT_PATTERN, help="instructions to keep (regex)")
    args = ap.parse_args()
    root, text = ptx(args.sources, args.arch, args.defines)
    with tempfile.TemporaryDirectory() as tmp:
        ptx_path, cubin = os.path.join(tmp, "m.ptx"), os.path.join(tmp, "m.cubin")
        open(ptx_path, "wb").write(text)
        info = subprocess.run([os.path.join(root, "nvidia/cu13/bin/ptxas"), f"-arch=sm_{args.arch}",
                               "-v", ptx_path, "-o", cubin], capture_output=True, text=True)
        if info.returncode != 0:
            sys.exit(info.stderr)
        lines = info.stderr.splitlines()
        for i, line in enumerate(lines):
            if f"'{args.kernel}'" in line:
                print("\n".join(l.replace("ptxas info    : ", "").strip() for l in lines[i + 1:i + 4]))
                break
        else:
            sys.exit(f"no entry point {args.kernel!r} in the module")
        disasm_root = fetch(NVDISASM_VERSION, ["nvidia-cuda-nvdisasm"], "nvidia/cu13/bin/nvdisasm")
        sass = subprocess.run([os.path.join(disasm_root, "nvidia/cu13/bin/nvdisasm"), "-c", cubin],
                              capture_output=True, text=True, check=True).stdout
    start = sass.find(f".text.{args.kernel}:")
    body = sass[start:sass.find("//-----", start)]
    keep = re.compile(args.grep)
    for line in body.splitlines():
        m = re.search(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if m and (args.all or keep.search(m.group(2))):
            print(m.group(1), m.group(2))


if __name__ == "__main__":
    try:
        main()
    except BrokenPipeError:  # piped into head
        sys.stderr.close()
