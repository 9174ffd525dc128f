#!/usr/bin/env bash
# Session 16, call 4: page-locked host copies (TAPEDECK_HOST_COPIES=pinned) against the pageable
# default, with the host's time per decode step split (prepare / launch / wait / read / outside
# the backend); then the CUDA tests, replay A/B and benches with pinned copies on (the whole
# run_engine_tests.sh had not run since the twelfth session), llama-1b on the fastest set only.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
. bench/cuda/gpu_env.sh > /dev/null
export TAPEDECK_KERNEL_CACHE=/tmp/kc TAPEDECK_FIXTURES=$PWD/fixtures/models
nvidia-smi --query-gpu=name --format=csv,noheader
B=matmul=bf16,attn_decode=mma-bf16,small_gemm=gemv,pdl=on,cuda_graphs=on,fuse=on,kv_dtype=bf16
REPS=2 bash bench/cuda/sweep.sh "X=1 $B" "TAPEDECK_HOST_COPIES=pinned $B" | tee $OUT/sweep512.md
echo "at ${SECONDS}s"
TAPEDECK_HOST_COPIES=pinned LLAMA1B_TOGGLES=$B EXTRAS=0 TEST_TIMEOUT=200 timeout 420 \
  bash bench/cuda/run_engine_tests.sh $OUT/tests > $OUT/engine-tests.log 2>&1
echo "engine tests exit $? at ${SECONDS}s"
grep -E "^test result|panicked|FAILED|^baseline|exit [0-9]|tokens/s|llama-1b.*rel|^== " $OUT/engine-tests.log | cut -c1-220 | head -90
rm -rf $OUT/tests/kernel-cache
