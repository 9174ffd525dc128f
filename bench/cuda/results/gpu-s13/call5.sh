#!/usr/bin/env bash
# Session 13, call 5: the peer on the same card as the two-row-tile kernel: SDPA, then our spans.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
. bench/cuda/gpu_env.sh > /dev/null
export TAPEDECK_KERNEL_CACHE=/tmp/kc TAPEDECK_FIXTURES=$PWD/fixtures/models
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 60 python3 bench/cuda/sdpa_prefill.py 8192 16384 2>&1 | grep -E "^SDPA|^torch"
for L in 8192 16384; do
  mapfile -t ta < <(toggle_args "matmul=bf16,kv_dtype=bf16,attn_prefill=mma-bf16")
  rm -f /tmp/tr.csv
  TAPEDECK_TRACE=/tmp/tr.csv timeout 60 .device/tapedeck bench engine --device cuda --model llama-1b "${ta[@]}" \
    --prompt-len $L --gen 2 --concurrency 0 --turns 0 --kv-budget-mib 16384 > $OUT/t$L.log 2>&1
  python3 bench/cuda/prefill_kernel_spans.py /tmp/tr.csv --tokens $L
  echo "at ${SECONDS}s"
done
