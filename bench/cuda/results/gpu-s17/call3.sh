#!/usr/bin/env bash
# Session 17, call 3: the mma kernel's own split merge (TAPEDECK_MMA_MERGE=in-kernel) with every
# head of the group merged at once (combine_group_fast: all loads issued before use) instead of
# head after head. First the bit tests with the knob on (the megakernel test compares it with the
# persistent kernel's 256-thread combine), then the A/B, then traces of both for the table.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
. bench/cuda/gpu_env.sh > /dev/null
export TAPEDECK_KERNEL_CACHE=/tmp/kc TAPEDECK_FIXTURES=$PWD/fixtures/models
nvidia-smi --query-gpu=name --format=csv,noheader
TAPEDECK_MMA_MERGE=in-kernel timeout 200 .device/test-cuda megakernel graphs_replay mma_bf16_decode \
  --nocapture 2>&1 | grep -E "identical|graphs vs eager|panicked|test result|SKIPPED|mismatch" | tail -25 | tee $OUT/merge-tests.log
echo "at ${SECONDS}s"
B=matmul=bf16,attn_decode=mma-bf16,small_gemm=gemv,pdl=on,cuda_graphs=on,fuse=on,kv_dtype=bf16
REPS=3 bash bench/cuda/sweep.sh "X=1 $B" "TAPEDECK_MMA_MERGE=in-kernel $B" | tee $OUT/sweep512.md
echo "at ${SECONDS}s"
PROMPT=4096 REPS=1 bash bench/cuda/sweep.sh "X=1 $B" "TAPEDECK_MMA_MERGE=in-kernel $B" | tee $OUT/sweep4096.md
echo "at ${SECONDS}s"
L="--layer 3 --bytes @0=12.6 --bytes @4=8.4 --bytes gemv_bf16_swiglu_1=67.1 --bytes gemv_bf16_1/1024=33.6"
bash bench/cuda/trace_step.sh base X=1 "$B" $L 2>&1 | tail -14
bash bench/cuda/trace_step.sh merge TAPEDECK_MMA_MERGE=in-kernel "$B" $L 2>&1 | tail -14
echo "done at ${SECONDS}s"
