#!/usr/bin/env bash
# Session 13, call 4: the tensor-core prefill kernel with two row tiles per warp at head_dim 64
# (128 rows a block): its test, then its spans from a kernel timeline (compare call 3: one row tile).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
. bench/cuda/gpu_env.sh > /dev/null
export TAPEDECK_KERNEL_CACHE=/tmp/kc TAPEDECK_FIXTURES=$PWD/fixtures/models
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 150 .device/test-cuda cuda_mma_bf16_prefill --test-threads=1 --nocapture > $OUT/tests.log 2>&1
echo "test exit $? at ${SECONDS}s"
grep -E "test result|panicked|mma prefill" $OUT/tests.log | cut -c1-200
for L in 2048 8192 16384; do
  t="matmul=bf16,kv_dtype=bf16,attn_prefill=mma-bf16"
  mapfile -t ta < <(toggle_args "$t")
  rm -f /tmp/tr.csv
  TAPEDECK_TRACE=/tmp/tr.csv timeout 100 .device/tapedeck bench engine --device cuda --model llama-1b "${ta[@]}" \
    --prompt-len $L --gen 2 --concurrency 0 --turns 0 --kv-budget-mib 16384 > $OUT/t$L.log 2>&1
  python3 bench/cuda/prefill_kernel_spans.py /tmp/tr.csv --tokens $L
  timeout 100 .device/tapedeck bench engine --device cuda --model llama-1b "${ta[@]}" \
    --prompt-len $L --gen 2 --concurrency 0 --turns 0 --kv-budget-mib 16384 > $OUT/p$L.log 2>&1
  echo "$L [$t] untraced: $(grep -oE 'prefill [0-9.]+ tokens/s' $OUT/p$L.log)"
  echo "at ${SECONDS}s"
done
