#!/usr/bin/env bash
# Twenty-third session, second call (~4 min): the GPU test executable after the fix for the crash
# call 1 found (the streaming GEMV, TAPEDECK_GEMV_STREAM's kernel, read an f32 input staged in
# shared memory as bf16 bits as if it were still f32: an out-of-bounds shared-memory read, first
# hit by cuda_gemv_kernel_matches_a_float64_reference's 2048x8192 one-row f32 case). The GEMV test
# first, then the rest.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
. bench/cuda/gpu_env.sh > /dev/null
export TAPEDECK_KERNEL_CACHE=/tmp/kc TAPEDECK_FIXTURES=$PWD/fixtures/models
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
timeout 60 .device/test-cuda cuda_gemv_kernel --test-threads=1 --nocapture > $OUT/test-gemv.log 2>&1
echo "gemv test exit $? at ${SECONDS}s"
grep -E "^test result|panicked|FAILED|streaming" $OUT/test-gemv.log | head
timeout 185 .device/test-cuda --skip cuda_gemv_kernel --test-threads=1 --nocapture > $OUT/test-rest.log 2>&1
echo "tests exit $? at ${SECONDS}s"
grep -E "^test |^test result|panicked|FAILED" $OUT/test-rest.log | head -30
