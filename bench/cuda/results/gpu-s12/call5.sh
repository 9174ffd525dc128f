#!/usr/bin/env bash
# Session 12, last call: the RMSNorm loops with batched loads (NORM_UNROLL=8) against the old
# one-stride loops (NORM_UNROLL=1), and the fused/megakernel bit tests on the new loops.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
. bench/cuda/gpu_env.sh > /dev/null
export TAPEDECK_KERNEL_CACHE=/tmp/kc TAPEDECK_FIXTURES=$PWD/fixtures/models
nvidia-smi --query-gpu=name --format=csv,noheader
B=matmul=bf16,attn_decode=mma-bf16,small_gemm=gemv,pdl=on,cuda_graphs=on,fuse=on,kv_dtype=bf16
REPS=2 bash bench/cuda/sweep.sh "TAPEDECK_NVRTC_DEFINES=NORM_UNROLL=1 $B" "X=1 $B" | tee $OUT/sweep512.md
echo "at ${SECONDS}s"
timeout 60 .device/test-cuda fused_decode megakernel --test-threads=1 --nocapture > $OUT/tests.log 2>&1
echo "fused + megakernel tests: exit $? at ${SECONDS}s"
grep -E "test result|panicked|identical: false" $OUT/tests.log | head
