#!/usr/bin/env python3
"""Registers, spills and shared memory of every kernel entry point, without a GPU.

Compiles a kernel module the way engine/src/cuda/kernels.rs does (the same sources concatenated,
the same NVRTC options) with NVRTC through ctypes, assembles the PTX with ptxas -v for one
architecture, and prints one row per entry point. Register pressure and spills decide a kernel's
occupancy and often its speed, and this shows them before any device time is spent.

    python3 bench/cuda/ptxas_report.py                       # every module, sm_90
    python3 bench/cuda/ptxas_report.py prefill_mma --arch sm_120 --filter hd64
    python3 bench/cuda/ptxas_report.py engine -D GEMV_BLOCK_WARPS=4 --filter gemv

Needs NVRTC and ptxas: `bash ci/kernels_check.sh` fetches them (NVIDIA's PyPI wheels) into
~/.cache/tapedeck/cuda-wheels/<version>/nvidia/cu13 (or set TAPEDECK_CUDA_WHEELS as it does).
"""
import argparse
import ctypes
import glob
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Module name -> its sources under kernels/, in kernels.rs order.
MODULES = {
    "engine": ["trace.cu", "engine.cu"],
    "prefill": ["trace.cu", "prefill_attention.cu"],
    "prefill_mma": ["trace.cu", "decode_attention_mma.cu", "prefill_attention_mma.cu"],
    "decode_mma": ["trace.cu", "decode_attention_mma.cu"],
    "decode_step": ["trace.cu", "engine.cu", "decode_attention_mma.cu", "decode_step.cu"],
    "fused": ["trace.cu", "engine.cu", "decode_attention_mma.cu", "decode_fused.cu"],
}


def toolkit():
    """The cu13 folder of the wheels ci/kernels_check.sh unpacked."""
    base = os.environ.get("TAPEDECK_CUDA_WHEELS", os.path.expanduser("~/.cache/tapedeck/cuda-wheels"))
    found = sorted(glob.glob(os.path.join(base, "*", "nvidia", "cu13")))
    if not found:
        sys.exit(f"no NVRTC/ptxas under {base}: run `bash ci/kernels_check.sh` once")
    return found[-1]


def ptx_of(nvrtc, code, name, arch, defines):
    """NVRTC's PTX for `code`, with kernels.rs's options."""
    prog = ctypes.c_void_p()
    check = lambda r, what: r == 0 or sys.exit(f"NVRTC {what} failed ({r})")
    check(nvrtc.nvrtcCreateProgram(ctypes.byref(prog), code.encode(), name.encode(), 0, None, None), "create")
    opts = [
        f"--gpu-architecture=compute_{arch.removeprefix('sm_')}",
        "--fmad=true",
        "--prec-div=true",
        "--prec-sqrt=true",
        "--ftz=false",
        "-default-device",
        "--std=c++17",
    ] + [f"-D{d}" for d in defines]
    arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
    r = nvrtc.nvrtcCompileProgram(prog, len(opts), arr)
    if r != 0:
        size = ctypes.c_size_t()
        nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        nvrtc.nvrtcGetProgramLog(prog, log)
        sys.exit(f"{name}: NVRTC compile failed\n{log.value.decode(errors='replace')}")
    size = ctypes.c_size_t()
    check(nvrtc.nvrtcGetPTXSize(prog, ctypes.byref(size)), "PTX size")
    ptx = ctypes.create_string_buffer(size.value)
    check(nvrtc.nvrtcGetPTX(prog, ptx), "PTX")
    nvrtc.nvrtcDestroyProgram(ctypes.byref(prog))
    return ptx.value.decode()


def report(ptxas, ptx, arch):
    """(entry, registers, spill stores, spill loads, static smem bytes) per entry point."""
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    try:
        out = subprocess.run(
            [ptxas, f"-arch={arch}", "-v", f.name, "-o", os.devnull],
            capture_output=True, text=True, check=True,
        ).stderr
    finally:
        os.unlink(f.name)
    rows, entry, spills = [], None, (0, 0)
    for line in out.splitlines():
        m = re.search(r"Compiling entry function '(\w+)'", line)
        if m:
            entry, spills = m.group(1), (0, 0)
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and entry:
            spills = (int(m.group(1)), int(m.group(2)))
        m = re.search(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?", line)
        if m and entry:
            rows.append((entry, int(m.group(1)), *spills, int(m.group(2) or 0)))
            entry = None
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("modules", nargs="*", choices=[[]] + list(MODULES), help="modules (default: all)")
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("-D", dest="defines", action="append", default=[], help="NAME=VALUE, as TAPEDECK_NVRTC_DEFINES")
    ap.add_argument("--filter", default="", help="only entry points matching this regex")
    a = ap.parse_args()
    cu = toolkit()
    # NVRTC opens its builtins library by name: load it first, so that name is already resolved.
    lib = lambda stem: sorted(glob.glob(os.path.join(cu, "lib", stem + ".so*")))[0]
    ctypes.CDLL(lib("libnvrtc-builtins"), mode=ctypes.RTLD_GLOBAL)
    nvrtc = ctypes.CDLL(lib("libnvrtc"))
    ptxas = os.path.join(cu, "bin", "ptxas")
    print(f"| module | entry point | registers | spill stores / loads (bytes) | static smem |")
    print("|---|---|---|---|---|")
    for mod in a.modules or MODULES:
        code = "".join(open(os.path.join(ROOT, "kernels", s)).read() for s in MODULES[mod])
        rows = report(ptxas, ptx_of(nvrtc, code, MODULES[mod][-1], a.arch, a.defines), a.arch)
        for entry, regs, st, ld, smem in sorted(rows):
            if re.search(a.filter, entry):
                flag = " **spills**" if st or ld else ""
                print(f"| {mod} | {entry} | {regs} | {st} / {ld}{flag} | {smem} |")


if __name__ == "__main__":
    main()
