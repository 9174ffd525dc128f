#!/usr/bin/env bash
# Session 15, call 2: L2 prefetch of the next GEMVs' weights during the attention
# (TAPEDECK_L2_PREFETCH) in the batch-1 decode step, a trace with it, and the llama-1b GPU tests
# with it on (it must change no value).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
. bench/cuda/gpu_env.sh > /dev/null
export TAPEDECK_KERNEL_CACHE=/tmp/kc TAPEDECK_FIXTURES=$PWD/fixtures/models
nvidia-smi --query-gpu=name --format=csv,noheader
B=matmul=bf16,attn_decode=mma-bf16,small_gemm=gemv,pdl=on,cuda_graphs=on,fuse=on,kv_dtype=bf16
P=TAPEDECK_L2_PREFETCH
REPS=2 bash bench/cuda/sweep.sh "X=1 $B" "$P=mlp:24,o $B" "$P=mlp:40 $B" "$P=mlp:24,o,down:16,next,first $B" \
  "$P=mlp:24,o+TAPEDECK_NVRTC_DEFINES=L2_PREFETCH_EVICT_LAST=1 $B" | tee $OUT/sweep512.md
echo "at ${SECONDS}s"
bash bench/cuda/trace_step.sh pf "$P=mlp:24,o" "$B" --layer 3 --bytes @0=12.6 --bytes @4=8.4 \
  --bytes gemv_bf16_swiglu_1=67.1 --bytes gemv_bf16_1/1024=33.6
echo "at ${SECONDS}s"
TAPEDECK_L2_PREFETCH=mlp:24,o,down:16,next,first timeout 150 .device/test-cuda --test-threads=1 cuda_llama_1b > $OUT/tests.log 2>&1
echo "tests exit $? at ${SECONDS}s"
grep -E "^test |test result|panicked" $OUT/tests.log | cut -c1-200 | head
echo "done at ${SECONDS}s"
