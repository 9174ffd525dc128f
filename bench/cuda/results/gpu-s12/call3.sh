#!/usr/bin/env bash
# Session 12, third call: the fused-kernel identity test under the new fuse=on default (rope,head)
# and with every fusion on; fuse=on against the plain fastest set; GEMV_MIN_BLOCKS=3 (80 registers
# for the gate/up kernel, three blocks per SM instead of two).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
. bench/cuda/gpu_env.sh > /dev/null
export TAPEDECK_KERNEL_CACHE=/tmp/kc TAPEDECK_FIXTURES=$PWD/fixtures/models
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 100 .device/test-cuda fused_decode --test-threads=1 --nocapture > $OUT/fused-default.log 2>&1
echo "fused test, default fusions: exit $? at ${SECONDS}s"
grep -E "fuse=on:|test result|panicked" $OUT/fused-default.log | cut -c1-200 | head -14
TAPEDECK_FUSE=rope,merge,head timeout 100 .device/test-cuda fused_decode --test-threads=1 --nocapture > $OUT/fused-all.log 2>&1
echo "fused test, rope,merge,head: exit $? at ${SECONDS}s"
grep -E "fuse=on:|test result|panicked" $OUT/fused-all.log | cut -c1-200 | head -14
B=matmul=bf16,attn_decode=mma-bf16,small_gemm=gemv,pdl=on,cuda_graphs=on
REPS=2 bash bench/cuda/sweep.sh "X=1 $B" "X=1 $B,fuse=on" "TAPEDECK_NVRTC_DEFINES=GEMV_MIN_BLOCKS=3 $B,fuse=on" \
  "X=1 $B,fuse=on,kv_dtype=bf16" | tee $OUT/sweep512.md
echo "done at ${SECONDS}s"
