#!/usr/bin/env bash
# Session 15, call 2 trimmed to the device time left (~3 min): the L2 prefetch
# (TAPEDECK_L2_PREFETCH) against none in the batch-1 decode step, then the llama-1b GPU-vs-CPU
# test with every prefetch on (it must change no value).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
. bench/cuda/gpu_env.sh > /dev/null
export TAPEDECK_KERNEL_CACHE=/tmp/kc TAPEDECK_FIXTURES=$PWD/fixtures/models
nvidia-smi --query-gpu=name --format=csv,noheader
B=matmul=bf16,attn_decode=mma-bf16,small_gemm=gemv,pdl=on,cuda_graphs=on,fuse=on,kv_dtype=bf16
P=TAPEDECK_L2_PREFETCH
GEN=48 REPS=2 bash bench/cuda/sweep.sh "X=1 $B" "$P=mlp:24,o $B" "$P=mlp:24,o,down:16,next,first $B" | tee $OUT/sweep512.md
echo "at ${SECONDS}s"
TAPEDECK_L2_PREFETCH=mlp:24,o,down:16,next,first timeout 80 .device/test-cuda --test-threads=1 cuda_llama_1b > $OUT/tests.log 2>&1
echo "tests exit $? at ${SECONDS}s"
grep -E "^test |test result|panicked" $OUT/tests.log | cut -c1-200 | head
