#!/usr/bin/env bash
# Session 17, call 2: the run-ahead decode (generate enqueues step k+1 before reading step k's
# token; embed_tokens reads it from the pick buffer on the device). First the CUDA tests (the
# new bit-identity test among them), then the A/B against TAPEDECK_RUN_AHEAD=off, the llama-1b
# bench, and a kernel trace of the default for the per-kernel table.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
. bench/cuda/gpu_env.sh > /dev/null
export TAPEDECK_KERNEL_CACHE=/tmp/kc TAPEDECK_FIXTURES=$PWD/fixtures/models
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 120 .device/test-cuda running_ahead --nocapture 2>&1 | grep -E "running ahead|panicked|test result|SKIPPED" | tee $OUT/ahead-test.log
echo "at ${SECONDS}s"
B=matmul=bf16,attn_decode=mma-bf16,small_gemm=gemv,pdl=on,cuda_graphs=on,fuse=on,kv_dtype=bf16
REPS=2 bash bench/cuda/sweep.sh "TAPEDECK_RUN_AHEAD=off $B" "X=1 $B" | tee $OUT/sweep512.md
echo "at ${SECONDS}s"
mapfile -t ta < <(toggle_args "$B")
timeout 200 .device/tapedeck bench engine --device cuda --model llama-1b "${ta[@]}" --prompt-len 512 \
  --gen 64 --concurrency 1,16,64 --turns 0 --kv-budget-mib 8192 2>&1 | tee $OUT/bench-llama-1b.log | tail -9
echo "at ${SECONDS}s"
bash bench/cuda/trace_step.sh now X=1 "$B" --layer 3 --bytes @0=12.6 --bytes @4=8.4 \
  --bytes gemv_bf16_swiglu_1=67.1 --bytes gemv_bf16_1/1024=33.6 2>&1 | tail -30
echo "at ${SECONDS}s"
ONLY_TESTS=1 TEST_TIMEOUT=240 bash bench/cuda/run_engine_tests.sh $OUT/tests > $OUT/tests.log 2>&1
echo "tests exit $? at ${SECONDS}s"
grep -E "^test result|panicked|FAILED" $OUT/tests.log | head
rm -rf $OUT/tests/kernel-cache
