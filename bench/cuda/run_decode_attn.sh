#!/usr/bin/env bash
# Build and run the decode-attention checks and benchmarks in one go on a CUDA machine:
#   bash bench/cuda/run_decode_attn.sh [extra decode_attn_bench args]
# Needs nvcc (CUDA 12.8+ for compute_120) and python3 with torch. Logs go to $OUT (the device
# tool's output folder) or bench/cuda/out/.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
LOGS=${OUT:-$HERE/out}
BUILD=${BUILD:-/tmp/decode_attn_build}
mkdir -p "$LOGS" "$BUILD"
export PATH=$PATH:/usr/local/cuda/bin
export LD_LIBRARY_PATH=${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}/usr/local/cuda/lib64
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv || true
nvcc --version | tail -2

# Build in the background while SDPA runs on the GPU (the builds use only the CPU).
( nvcc -O3 -arch=sm_90 -std=c++17 -lineinfo -Xptxas -v -o "$BUILD/decode_attn_bench" \
    "$HERE/decode_attn_bench.cu" -ldl > "$BUILD/build.log" 2>&1; echo $? > "$BUILD/build.rc" ) &
( nvcc -O2 -o "$BUILD/nvrtc_check" "$HERE/nvrtc_check.cpp" -lnvrtc > "$BUILD/nvrtc_build.log" 2>&1;
  echo $? > "$BUILD/nvrtc_build.rc" ) &

if [ -n "${SDPA_TSV:-}" ]; then  # reuse an earlier SDPA measurement (same GPU kind)
  echo "== PyTorch SDPA: reusing $SDPA_TSV"; cp "$SDPA_TSV" "$LOGS/sdpa.tsv"
else
  echo "== PyTorch SDPA"
  timeout 200 python3 "$HERE/sdpa_bench.py" > "$LOGS/sdpa.tsv" 2> "$LOGS/sdpa.log"
  echo "sdpa rc $?"; cat "$LOGS/sdpa.log"
fi
wait

echo "== build"
grep -E "error|warning" "$BUILD/build.log" | head -20
grep -A2 -E "Compiling entry function '(decode_attn|_Z15ref)" "$BUILD/build.log" | grep -E "Compiling|registers|spill" | sed 's/ptxas info    : //'
echo "harness build rc $(cat "$BUILD/build.rc"), nvrtc_check build rc $(cat "$BUILD/nvrtc_build.rc")"
cp "$BUILD/build.log" "$LOGS/build.log"
[ "$(cat "$BUILD/build.rc")" = 0 ] || { cat "$BUILD/build.log" | head -60; exit 1; }

echo "== NVRTC compile check (compute_90, compute_120)"
"$BUILD/nvrtc_check" "$ROOT/kernels/decode_attention_mma.cu" "$BUILD" compute_90 compute_120 2>&1 | tee "$LOGS/nvrtc.log"
for a in 90 120; do
  [ -f "$BUILD/decode_attention_mma.compute_$a.ptx" ] && ptxas -arch=sm_$a -v "$BUILD/decode_attention_mma.compute_$a.ptx" \
    -o "$BUILD/da_sm$a.cubin" 2>&1 | grep -E "Compiling|registers|spill|error" | sed 's/ptxas info    : //'
done
if command -v cuobjdump > /dev/null; then
  echo "SASS of decode_attn_mma_bf16kv (nvcc build):" \
    "$(cuobjdump -sass -fun decode_attn_mma_bf16kv "$BUILD/decode_attn_bench" 2>/dev/null | grep -cE 'HMMA') HMMA," \
    "$(cuobjdump -sass -fun decode_attn_mma_bf16kv "$BUILD/decode_attn_bench" 2>/dev/null | grep -cE 'LDSM') LDSM," \
    "$(cuobjdump -sass -fun decode_attn_mma_bf16kv "$BUILD/decode_attn_bench" 2>/dev/null | grep -cE 'LDGSTS') LDGSTS," \
    "$(cuobjdump -sass -fun decode_attn_mma_bf16kv "$BUILD/decode_attn_bench" 2>/dev/null | grep -cE 'LDL|STL') LDL/STL"
fi

echo "== decode_attn_bench"
PTXARG=()
[ -f "$BUILD/decode_attention_mma.compute_90.ptx" ] && PTXARG=(--ptx "$BUILD/decode_attention_mma.compute_90.ptx")
timeout ${BENCH_TIMEOUT:-300} "$BUILD/decode_attn_bench" "${PTXARG[@]}" --perf-out "$LOGS/perf.tsv" "$@" 2>&1 | tee "$LOGS/bench.log"
RC=${PIPESTATUS[0]}

echo "== table"
python3 "$HERE/report.py" "$LOGS/perf.tsv" "$LOGS/sdpa.tsv" | tee "$LOGS/table.md"
echo "decode_attn_bench rc $RC"
exit $RC
