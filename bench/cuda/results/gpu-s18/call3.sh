#!/usr/bin/env bash
# Eighteenth session, call 3, on an H200 (the reference card; its figures in
# docs/benchmarks.md were from the twelfth session, before the run-ahead decode): batch-1 decode
# of the fastest set with run-ahead on and off, the scheduler at concurrency 1/16/64, prefill of
# 512 and 8192 tokens, transformers on the same weights, then the whole GPU test suite.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
. bench/cuda/gpu_env.sh > /dev/null
export TAPEDECK_KERNEL_CACHE=/tmp/kc TAPEDECK_FIXTURES=$PWD/fixtures/models
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
B=matmul=bf16,attn_decode=mma-bf16,small_gemm=gemv,pdl=on,cuda_graphs=on,fuse=on,kv_dtype=bf16
REPS=2 bash bench/cuda/sweep.sh "X=1 $B" "TAPEDECK_RUN_AHEAD=off $B" | tee $OUT/sweep512.md
PROMPT=4096 REPS=1 bash bench/cuda/sweep.sh "X=1 $B" | tail -1 | tee $OUT/sweep4096.md
echo "at ${SECONDS}s"
mapfile -t ta < <(toggle_args "$B")
timeout 200 .device/tapedeck bench engine --device cuda --model llama-1b "${ta[@]}" --prompt-len 512 \
  --gen 64 --concurrency 1,16,64 --turns 0 --kv-budget-mib 8192 2>&1 | tee $OUT/bench-llama-1b.log | tail -9
echo "at ${SECONDS}s"
mapfile -t tp < <(toggle_args "preset=gpu-fast")
for p in 512 8192; do
  timeout 120 .device/tapedeck bench engine --device cuda --model llama-1b "${tp[@]}" --prompt-len $p \
    --gen 4 --concurrency 0 --turns 0 --kv-budget-mib 8192 2>&1 | tee $OUT/prefill-$p.log | grep -iE "prefill" | head -3
done
echo "at ${SECONDS}s"
timeout 240 python3 bench/cuda/hf_decode.py "$HOME/.cache/tapedeck/bench/llama-1b" 512 64 2>&1 \
  | grep -v Warning | tail -4 | tee $OUT/hf.log
echo "at ${SECONDS}s"
ONLY_TESTS=1 TEST_TIMEOUT=240 bash bench/cuda/run_engine_tests.sh $OUT/tests > $OUT/tests.log 2>&1
echo "tests exit $? at ${SECONDS}s"
grep -E "^test result|panicked|FAILED" $OUT/tests.log | head
rm -rf $OUT/tests/kernel-cache
echo "done at ${SECONDS}s"
