#!/usr/bin/env bash
# Twenty-eighth session, call 2: PRE_SPLIT_PER_SM (only a launch's first blocks per SM split
# their weight requests around the PDL wait; later blocks request whole rows up front) against
# the defaults, alone and with the plain GEMVs / gate/up / q/k/v split further.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
. bench/cuda/gpu_env.sh > /dev/null
export TAPEDECK_KERNEL_CACHE=/tmp/kc TAPEDECK_FIXTURES=$PWD/fixtures/models
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
B=matmul=bf16,attn_decode=mma-bf16,small_gemm=gemv,pdl=on,cuda_graphs=on,fuse=on,kv_dtype=bf16
D=TAPEDECK_NVRTC_DEFINES
REPS=${REPS:-1} timeout ${LIMIT:-380} bash bench/cuda/sweep.sh "X=1 $B" "$D=PRE_SPLIT_PER_SM=2 $B" \
  "$D=PRE_SPLIT_PER_SM=3,GEMV_PRE_EARLY=6 $B" "$D=PRE_SPLIT_PER_SM=3 $B" \
  "$D=PRE_SPLIT_PER_SM=3,SWIGLU_PRE_EARLY=2,QKV_PRE_EARLY=4 $B" > $OUT/sweep.md 2>&1
cut -d'|' -f2,4,5 $OUT/sweep.md
echo "at ${SECONDS}s"
