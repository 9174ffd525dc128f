#!/usr/bin/env bash
# Session 14, call 2 (trimmed for the device time left): the streaming GEMV kernels
# (TAPEDECK_GEMV_STREAM) against the default ones in the decode step, bench gemv, their bit tests.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
. bench/cuda/gpu_env.sh > /dev/null
export TAPEDECK_KERNEL_CACHE=/tmp/kc TAPEDECK_FIXTURES=$PWD/fixtures/models
nvidia-smi --query-gpu=name --format=csv,noheader
B=matmul=bf16,attn_decode=mma-bf16,small_gemm=gemv,pdl=on,cuda_graphs=on,fuse=on,kv_dtype=bf16
GEN=48 REPS=2 bash bench/cuda/sweep.sh "X=1 $B" "TAPEDECK_GEMV_STREAM=2 $B" "TAPEDECK_GEMV_STREAM=1 $B" | tee $OUT/sweep512.md
echo "at ${SECONDS}s"
timeout 60 .device/tapedeck bench gemv --device cuda --rows 1 --reps 100 2>&1 | tee $OUT/bench-gemv.txt | tail -9
echo "at ${SECONDS}s"
timeout 60 .device/test-cuda --test-threads=1 cuda_gemv cuda_fused_gate > $OUT/tests.log 2>&1
echo "tests exit $? at ${SECONDS}s"
grep -E "test result|panicked|differs" $OUT/tests.log | head
