#!/usr/bin/env bash
# For the twenty-first session's second device call (~6 min; as next-call.sh). (1) `bench engine`
# at concurrency 1/16/64 with the per-level host split (`host per forward pass`: what keeps the
# device 86% busy at 64?). (2) The split floor beside the fast combine (DA_COMBINE_FAST=1, default
# since the twentieth session; =0 is the old combine). (3) The whole GPU suite.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
. bench/cuda/gpu_env.sh > /dev/null
export TAPEDECK_KERNEL_CACHE=/tmp/kc TAPEDECK_FIXTURES=$PWD/fixtures/models
nvidia-smi --query-gpu=name --format=csv,noheader
B=matmul=bf16,attn_decode=mma-bf16,small_gemm=gemv,pdl=on,cuda_graphs=on,fuse=on,kv_dtype=bf16
mapfile -t ta < <(toggle_args "$B")
timeout 150 .device/tapedeck bench engine --device cuda --model llama-1b "${ta[@]}" --prompt-len 512 \
  --gen 64 --concurrency 1,16,64 --turns 0 --kv-budget-mib 8192 2>&1 | tee $OUT/bench-llama-1b.log | tail -12
echo "at ${SECONDS}s"
REPS=2 bash bench/cuda/sweep.sh "X=1 $B" "TAPEDECK_MMA_SPLIT_MIN=256 $B" "TAPEDECK_MMA_SPLIT_MIN=512 $B" \
  "TAPEDECK_MMA_SPLIT_MIN=1024 $B" "TAPEDECK_SMEM_CARVEOUT=100+TAPEDECK_MMA_SPLIT_MIN=1024 $B" \
  "TAPEDECK_NVRTC_DEFINES=DA_COMBINE_FAST=0 $B" | tee $OUT/sweep-split.md
echo "at ${SECONDS}s"
ONLY_TESTS=1 TEST_TIMEOUT=220 bash bench/cuda/run_engine_tests.sh $OUT/tests > $OUT/tests.log 2>&1
echo "tests exit $? at ${SECONDS}s"
grep -E "^test result|panicked|FAILED" $OUT/tests.log | head
rm -rf $OUT/tests/kernel-cache
