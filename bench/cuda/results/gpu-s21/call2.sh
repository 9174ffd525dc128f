#!/usr/bin/env bash
# Twenty-first session, second call (~6.5 min): (1) the register caps made default after call 1
# (SWIGLU1_MAXNREG=88, GEMV1_MIN_BLOCKS=4) against the compiler's choice, the q/k/v cap
# QKV1_MAXNREG=96, the smallest shared-memory carveout (call 1: 100 and 50 cost 7-9%), and the
# split floor 128 beside the fast combine; (2) the whole GPU suite with the new defaults.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
. bench/cuda/gpu_env.sh > /dev/null
export TAPEDECK_KERNEL_CACHE=/tmp/kc TAPEDECK_FIXTURES=$PWD/fixtures/models
nvidia-smi --query-gpu=name --format=csv,noheader
B=matmul=bf16,attn_decode=mma-bf16,small_gemm=gemv,pdl=on,cuda_graphs=on,fuse=on,kv_dtype=bf16
D=TAPEDECK_NVRTC_DEFINES
REPS=2 bash bench/cuda/sweep.sh "X=1 $B" "$D=SWIGLU1_MAXNREG=0,GEMV1_MIN_BLOCKS=1 $B" "$D=QKV1_MAXNREG=96 $B" \
  "TAPEDECK_SMEM_CARVEOUT=0 $B" "TAPEDECK_MMA_SPLIT_MIN=128 $B" > $OUT/sweep.md 2>&1
cut -d'|' -f2,4,5 $OUT/sweep.md
echo "at ${SECONDS}s"
ONLY_TESTS=1 TEST_TIMEOUT=200 bash bench/cuda/run_engine_tests.sh $OUT/tests > $OUT/tests.log 2>&1
echo "tests exit $? at ${SECONDS}s"
grep -E "^test result|panicked|FAILED" $OUT/tests.log | head
rm -rf $OUT/tests/kernel-cache
