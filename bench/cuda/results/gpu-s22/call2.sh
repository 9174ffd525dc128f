#!/usr/bin/env bash
# The twenty-second session's second device call (~5 min; after `bash
# bench/cuda/build_for_device.sh`, copied to .device/call.sh, carry [".device"]).
# TAPEDECK_GEMV_X_SMEM is on by default since call1 (911 against 876 tok/s): (1) the whole GPU test
# executable with the new default; (2) the default against =off; (3) one layer traced.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
. bench/cuda/gpu_env.sh > /dev/null
export TAPEDECK_KERNEL_CACHE=/tmp/kc TAPEDECK_FIXTURES=$PWD/fixtures/models
nvidia-smi --query-gpu=name --format=csv,noheader
B=matmul=bf16,attn_decode=mma-bf16,small_gemm=gemv,pdl=on,cuda_graphs=on,fuse=on,kv_dtype=bf16
timeout 230 .device/test-cuda --test-threads=1 --nocapture > $OUT/test-default.log 2>&1
echo "tests exit $? at ${SECONDS}s"
grep -E "^test result|panicked|FAILED" $OUT/test-default.log | head
REPS=1 bash bench/cuda/sweep.sh "X=1 $B" "TAPEDECK_GEMV_X_SMEM=off $B" > $OUT/sweep-xsmem.md 2>&1
cut -d'|' -f2,4,5 $OUT/sweep-xsmem.md
echo "at ${SECONDS}s"
bash bench/cuda/trace_step.sh xsmem "X=1" "$B" --layer 3 2>&1 | tail -10
echo "at ${SECONDS}s"
rm -f $OUT/*.csv.gz
