#!/usr/bin/env bash
# Session 17, call 4: why the mma kernel's own merge (TAPEDECK_MMA_MERGE=in-kernel) is slower than
# the combine kernel: with the PDL trigger before the merge (default), at the start
# (DA_TRIGGER_LATE=0), or at exit (DA_TRIGGER_AFTER_MERGE=1).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
. bench/cuda/gpu_env.sh > /dev/null
export TAPEDECK_KERNEL_CACHE=/tmp/kc TAPEDECK_FIXTURES=$PWD/fixtures/models
nvidia-smi --query-gpu=name --format=csv,noheader
B=matmul=bf16,attn_decode=mma-bf16,small_gemm=gemv,pdl=on,cuda_graphs=on,fuse=on,kv_dtype=bf16
M=TAPEDECK_MMA_MERGE=in-kernel D=TAPEDECK_NVRTC_DEFINES
REPS=2 bash bench/cuda/sweep.sh "X=1 $B" "$M $B" "$M+$D=DA_TRIGGER_AFTER_MERGE=1 $B" "$M+$D=DA_TRIGGER_LATE=0 $B" \
  "X=1 ${B/pdl=on/pdl=all}" | tee $OUT/sweep512.md
echo "done at ${SECONDS}s"
