#!/usr/bin/env bash
# Session 16, call 3 (call 2 with pieces spread over blocks first): the L2 prefetch kernel (TAPEDECK_L2_PREFETCH) on 12 blocks lasted as long
# as its transfer (16-26 µs) and the attention waited for it (620 tok/s against 829). Here its
# pieces are spread over more blocks (blocks:N), so each SM's copy engine issues fewer.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
. bench/cuda/gpu_env.sh > /dev/null
export TAPEDECK_KERNEL_CACHE=/tmp/kc TAPEDECK_FIXTURES=$PWD/fixtures/models
nvidia-smi --query-gpu=name --format=csv,noheader
B=matmul=bf16,attn_decode=mma-bf16,small_gemm=gemv,pdl=on,cuda_graphs=on,fuse=on,kv_dtype=bf16
P=TAPEDECK_L2_PREFETCH
REPS=1 bash bench/cuda/sweep.sh "X=1 $B" "$P=o,blocks:132 $B" "$P=mlp:24,o,blocks:132 $B" "$P=mlp:24,o,blocks:264 $B" \
  "$P=mlp:24,o,blocks:264+TAPEDECK_NVRTC_DEFINES=L2_PREFETCH_PIECE=4096 $B" "$P=mlp:8,blocks:132 $B" \
  "X=1 $B" | tee $OUT/sweep512.md
echo "at ${SECONDS}s"
bash bench/cuda/trace_step.sh pf "$P=mlp:24,o,blocks:264" "$B" --layer 3 --bytes @0=12.6 --bytes @4=8.4 \
  --bytes gemv_bf16_swiglu_1=67.1 --bytes gemv_bf16_1/1024=33.6
echo "done at ${SECONDS}s"
