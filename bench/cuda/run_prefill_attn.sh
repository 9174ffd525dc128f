#!/usr/bin/env bash
# Build and run the prefill-attention checks and benchmarks on a CUDA machine:
#   bash bench/cuda/run_prefill_attn.sh [extra prefill_attn_bench args, e.g. --no-perf]
# Needs nvcc (CUDA 12.8+ for compute_120). The whole log goes to run.log (and the compiler's to
# build.log) in $OUT (the device tool's output folder) or bench/cuda/out/.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
LOGS=${OUT:-$HERE/out}
BUILD=${BUILD:-/tmp/prefill_attn_build}
mkdir -p "$LOGS" "$BUILD"
export PATH=$PATH:/usr/local/cuda/bin
export LD_LIBRARY_PATH=${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}/usr/local/cuda/lib64
main() {
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv || true
nvcc --version | tail -2

echo "== build (sm_90 harness)"
nvcc -O3 -arch=sm_90 -std=c++17 -lineinfo -Xptxas -v -Xcompiler -pthread -o "$BUILD/prefill_attn_bench" \
  "$HERE/prefill_attn_bench.cu" -lnvrtc -ldl > "$BUILD/build.log" 2>&1
BRC=$?
cp "$BUILD/build.log" "$LOGS/build.log"
grep -E "error|warning" "$BUILD/build.log" | head -20
grep -A2 -E "Compiling entry function '(prefill_attention|_Z12pa_hd64|_Z17pa_hd64|_ZN3ref9attention)" "$BUILD/build.log" |
  grep -E "Compiling|registers|spill" | sed 's/ptxas info    : //'
echo "harness build rc $BRC"
[ "$BRC" = 0 ] || { head -60 "$BUILD/build.log"; return 1; }
if command -v cuobjdump > /dev/null; then
  for f in prefill_attention_hd64 prefill_attention_hd128; do
    S=$(cuobjdump -sass -fun $f "$BUILD/prefill_attn_bench" 2>/dev/null)
    echo "SASS $f: $(grep -c 'FFMA' <<< "$S") FFMA, $(grep -c 'LDS.128' <<< "$S") LDS.128," \
      "$(grep -c 'LDGSTS' <<< "$S") LDGSTS, $(grep -cE 'LDL|STL' <<< "$S") LDL/STL"
  done
fi

echo "== nvcc --ptx for compute_120 and compute_80 (the kernel file alone), ptxas for sm_120 / sm_80"
for a in 120 80; do
  nvcc --ptx -arch=compute_$a -o "$BUILD/prefill_attention.compute_$a.ptx" "$ROOT/kernels/prefill_attention.cu"
  echo "compute_$a ptx rc $?"
  ptxas -arch=sm_$a -v "$BUILD/prefill_attention.compute_$a.ptx" -o "$BUILD/pa_sm$a.cubin" 2>&1 |
    grep -E "Compiling|registers|spill|error" | sed 's/ptxas info    : //'
done

echo "== prefill_attn_bench"
timeout ${BENCH_TIMEOUT:-400} "$BUILD/prefill_attn_bench" --src "$ROOT/kernels/prefill_attention.cu" "$@" 2>&1
RC=$?
echo "prefill_attn_bench rc $RC"
return $RC
}
main "$@" 2>&1 | tee "$LOGS/run.log"
exit "${PIPESTATUS[0]}"
