#!/usr/bin/env bash
# Eighteenth session, call 2 (~4 min; binaries of call 1): does the mma decode kernel's split-K
# pay at short contexts? At 512 tokens the attention (64 blocks, 3.3 µs each) and its combine
# kernel (4.8 µs after it) take 9.8 µs a layer for 1 MB of KV: one split per KV head runs no
# combine at all. TAPEDECK_MMA_SPLIT_MIN=4096 gives one split up to 4096 positions, 512 gives
# one or two. Then the layer traced both ways.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
. bench/cuda/gpu_env.sh > /dev/null
export TAPEDECK_KERNEL_CACHE=/tmp/kc TAPEDECK_FIXTURES=$PWD/fixtures/models
nvidia-smi --query-gpu=name --format=csv,noheader
B=matmul=bf16,attn_decode=mma-bf16,small_gemm=gemv,pdl=on,cuda_graphs=on,fuse=on,kv_dtype=bf16
S=TAPEDECK_MMA_SPLIT_MIN
REPS=2 bash bench/cuda/sweep.sh "X=1 $B" "$S=512 $B" "$S=4096 $B" "TAPEDECK_NVRTC_DEFINES=GEMV_MIN_BLOCKS=3 $B" | tee $OUT/sweep512.md
for p in 1024 2048 4096; do
  PROMPT=$p REPS=1 bash bench/cuda/sweep.sh "X=1 $B" "$S=$p $B" "$S=4096 $B" | tail -3 | tee $OUT/sweep$p.md
done
echo "at ${SECONDS}s"
L="--layer 3 --bytes @0=12.6 --bytes @4=8.4 --bytes gemv_bf16_swiglu_1=67.1 --bytes gemv_bf16_1/1024=33.6"
bash bench/cuda/trace_step.sh base X=1 "$B" $L 2>&1 | tail -12
bash bench/cuda/trace_step.sh nosplit $S=4096 "$B" $L 2>&1 | tail -12
echo "done at ${SECONDS}s"
