#!/usr/bin/env bash
# Session 13, call 3: the prefill attention kernels alone (spans from a kernel timeline) against
# PyTorch's SDPA on the same shapes (llama-1b: 32/8 heads of 64, one causal prompt).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
. bench/cuda/gpu_env.sh > /dev/null
export TAPEDECK_KERNEL_CACHE=/tmp/kc TAPEDECK_FIXTURES=$PWD/fixtures/models
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 90 python3 bench/cuda/sdpa_prefill.py 2048 8192 16384 2>&1 | tee $OUT/sdpa.log | grep -v Warning
for L in 2048 8192 16384; do
  for t in "matmul=bf16,kv_dtype=bf16" "matmul=bf16,kv_dtype=bf16,attn_prefill=mma-bf16"; do
    mapfile -t ta < <(toggle_args "$t")
    rm -f /tmp/tr.csv
    TAPEDECK_TRACE=/tmp/tr.csv timeout 150 .device/tapedeck bench engine --device cuda --model llama-1b "${ta[@]}" \
      --prompt-len $L --gen 2 --concurrency 0 --turns 0 --kv-budget-mib 16384 > $OUT/t$L.log 2>&1
    echo "$L [$t]: $(grep -oE 'prefill [0-9.]+ tokens/s' $OUT/t$L.log)"
    python3 bench/cuda/prefill_kernel_spans.py /tmp/tr.csv --tokens $L
  done
  echo "at ${SECONDS}s"
done
