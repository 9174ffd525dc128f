#!/usr/bin/env bash
# Session 13, call 2: the tensor-core prefill kernel (attn_prefill=mma-bf16): its tests, then
# llama-1b prefill tok/s against the tiled SIMT kernel at 512 .. 16k tokens, then the llama-1b
# logits test (which now includes attn_prefill=mma-bf16).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
. bench/cuda/gpu_env.sh > /dev/null
export TAPEDECK_KERNEL_CACHE=/tmp/kc TAPEDECK_FIXTURES=$PWD/fixtures/models
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 200 .device/test-cuda cuda_mma_bf16_prefill nvrtc cuda_matches_cpu_on_both --test-threads=1 --nocapture > $OUT/tests.log 2>&1
echo "tests exit $? at ${SECONDS}s"
grep -E "^test |test result|panicked|mma prefill|attn_prefill|assert" $OUT/tests.log | cut -c1-200 | head -40
for L in 512 2048 8192 16384; do
  for t in "matmul=bf16,kv_dtype=bf16" "matmul=bf16,kv_dtype=bf16,attn_prefill=mma-bf16"; do
    mapfile -t ta < <(toggle_args "$t")
    timeout 120 .device/tapedeck bench engine --device cuda --model llama-1b "${ta[@]}" \
      --prompt-len $L --gen 4 --concurrency 0 --turns 0 --kv-budget-mib 16384 > $OUT/p$L.log 2>&1
    echo "$L [$t]: $(grep -oE 'prefill [0-9.]+ tokens/s' $OUT/p$L.log || tail -2 $OUT/p$L.log)"
  done
done
echo "at ${SECONDS}s"
TAPEDECK_LLAMA1B=$HOME/.cache/tapedeck/bench/llama-1b timeout $((540 - SECONDS)) .device/test-cuda cuda_llama_1b --nocapture > $OUT/llama.log 2>&1
echo "llama-1b test exit $? at ${SECONDS}s"
grep -E "llama-1b \[|test result|panicked" $OUT/llama.log | cut -c1-200
