#!/usr/bin/env bash
# Session 17, call 5 (the last ~5 device minutes): run-time knobs never timed with the host out of
# the step: the combine folded into the o GEMV, a longer split floor, the down projection over 8
# warps a row (slice 1024) or 2 (slice 4096, new).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
. bench/cuda/gpu_env.sh > /dev/null
export TAPEDECK_KERNEL_CACHE=/tmp/kc TAPEDECK_FIXTURES=$PWD/fixtures/models
B=matmul=bf16,attn_decode=mma-bf16,small_gemm=gemv,pdl=on,cuda_graphs=on,fuse=on,kv_dtype=bf16
REPS=2 GEN=48 bash bench/cuda/sweep.sh "X=1 $B" "TAPEDECK_GEMV_SLICE=4096 $B" "TAPEDECK_FUSE=rope,merge,head $B" \
  "TAPEDECK_MMA_SPLIT_MIN=256 $B" "TAPEDECK_GEMV_SLICE=1024 $B" | tee $OUT/sweep512.md
