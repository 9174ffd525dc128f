#!/usr/bin/env bash
# Eighteenth session, call 5 (short: the session's last device minutes): the scheduler's
# run-ahead for a lone sequence on the GPU. Its bit test, then bench engine at concurrency 1/16.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
. bench/cuda/gpu_env.sh > /dev/null
export TAPEDECK_KERNEL_CACHE=/tmp/kc TAPEDECK_FIXTURES=$PWD/fixtures/models
timeout 70 .device/test-cuda running_ahead --nocapture 2>&1 | grep -E "running ahead|panicked|test result|SKIPPED" | tee $OUT/ahead-test.log
echo "at ${SECONDS}s"
B=matmul=bf16,attn_decode=mma-bf16,small_gemm=gemv,pdl=on,cuda_graphs=on,fuse=on,kv_dtype=bf16
mapfile -t ta < <(toggle_args "$B")
timeout 50 .device/tapedeck bench engine --device cuda --model llama-1b "${ta[@]}" --prompt-len 512 \
  --gen 64 --concurrency 1,16 --turns 0 --kv-budget-mib 8192 2>&1 | tee $OUT/bench.log | tail -6
echo "done at ${SECONDS}s"
