#!/usr/bin/env bash
# Session 8, second call: which fusion costs what (TAPEDECK_FUSE), the mma kernel's late PDL
# trigger (DA_TRIGGER_LATE, default 1) with the in-kernel merge, bits of every fusion.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
. bench/cuda/gpu_env.sh
export TAPEDECK_KERNEL_CACHE=/tmp/kc TAPEDECK_FIXTURES=$PWD/fixtures/models
TAPEDECK_FUSE=rope,merge,head timeout 150 .device/test-cuda fused --test-threads=1 --nocapture > $OUT/fuse-test.log 2>&1; echo "fuse test (all three) exit $?"
grep -E "test result|panicked|identical: false" $OUT/fuse-test.log | cut -c1-220 | head -20
TAPEDECK_MMA_MERGE=in-kernel timeout 120 .device/test-cuda megakernel graphs --test-threads=1 > $OUT/ik-tests.log 2>&1; echo "in-kernel merge tests exit $?"
grep -E "test result|panicked" $OUT/ik-tests.log | cut -c1-200
B=matmul=bf16,attn_decode=mma-bf16,small_gemm=gemv,pdl=on,cuda_graphs=on
REPS=2 bash bench/cuda/sweep.sh "X=1 $B" "TAPEDECK_FUSE=rope $B,fuse=on" "TAPEDECK_FUSE=rope,merge $B,fuse=on" \
  "TAPEDECK_FUSE=rope,head $B,fuse=on" "TAPEDECK_MMA_MERGE=in-kernel $B" \
  "TAPEDECK_FUSE=rope+TAPEDECK_MMA_MERGE=in-kernel $B,fuse=on" \
  "TAPEDECK_FUSE=rope+TAPEDECK_MMA_MERGE=in-kernel+TAPEDECK_NVRTC_DEFINES=DA_TRIGGER_LATE=0 $B,fuse=on" | tee $OUT/sweep.md
