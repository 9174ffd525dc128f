#!/usr/bin/env bash
# Twentieth session, call 3 (~4.5 min): DA_COMBINE_FAST=1 is now the default. (1) One layer traced
# with the fastest set (where the attention and its combine now stand). (2) The whole GPU suite.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
. bench/cuda/gpu_env.sh > /dev/null
export TAPEDECK_KERNEL_CACHE=/tmp/kc TAPEDECK_FIXTURES=$PWD/fixtures/models
nvidia-smi --query-gpu=name --format=csv,noheader
B=matmul=bf16,attn_decode=mma-bf16,small_gemm=gemv,pdl=on,cuda_graphs=on,fuse=on,kv_dtype=bf16
bash bench/cuda/trace_step.sh fast X=1 "$B" --layer 3 2>&1 | tail -12
echo "at ${SECONDS}s"
ONLY_TESTS=1 TEST_TIMEOUT=220 bash bench/cuda/run_engine_tests.sh $OUT/tests > $OUT/tests.log 2>&1
echo "tests exit $? at ${SECONDS}s"
grep -E "^test result|panicked|FAILED" $OUT/tests.log | head
rm -rf $OUT/tests/kernel-cache
