#!/usr/bin/env bash
# Session 7, fifth call: the final state's tests (combine kernel by default), and the megakernel
# identity with the in-kernel merge under a 64-position split floor.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
. bench/cuda/gpu_env.sh
export TAPEDECK_KERNEL_CACHE=/tmp/kc TAPEDECK_FIXTURES=$PWD/fixtures/models
timeout 150 .device/test-cuda --test-threads=1 --nocapture > $OUT/tests.log 2>&1; echo "exit $?"
grep -E "^test |test result|panicked|topk|flips" $OUT/tests.log | cut -c1-160 | head -30
TAPEDECK_MMA_MERGE=in-kernel TAPEDECK_MMA_SPLIT_MIN=64 timeout 90 .device/test-cuda megakernel cuda_graphs --test-threads=1 --nocapture > $OUT/tests-ik.log 2>&1; echo "exit $?"
grep -E "test result|panicked|identical" $OUT/tests-ik.log | cut -c1-160 | head -20
