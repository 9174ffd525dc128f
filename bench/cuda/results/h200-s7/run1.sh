#!/usr/bin/env bash
# Session 7, first call: megakernel test alone (short timeout), other tests, llama-1b batch-1 variants.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
. bench/cuda/gpu_env.sh
export TAPEDECK_KERNEL_CACHE=/tmp/kc TAPEDECK_FIXTURES=$PWD/fixtures/models
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader
echo "== megakernel test"
timeout 120 .device/test-cuda megakernel --test-threads=1 --nocapture > $OUT/mk.log 2>&1; echo "exit $?"
grep -vE "^\s*$" $OUT/mk.log | tail -25 | cut -c1-400
echo "== megakernel test, MK_MIN_BLOCKS=1"
TAPEDECK_NVRTC_DEFINES=MK_MIN_BLOCKS=1 timeout 120 .device/test-cuda megakernel --test-threads=1 --nocapture > $OUT/mk1.log 2>&1; echo "exit $?"
grep -E "test result|panicked" $OUT/mk1.log | head -5
echo "== other tests"
timeout 240 .device/test-cuda --skip megakernel --skip llama_1b --test-threads=1 > $OUT/tests.log 2>&1; echo "exit $?"
grep -E "^test |test result|panicked" $OUT/tests.log | head -40
td=.device/tapedeck
B=matmul=bf16,attn_decode=mma-bf16,small_gemm=gemv
bench() { # env-prefix toggles
  local args=(); local IFS=,; for p in $2; do args+=(--toggle "$p"); done; unset IFS
  echo "== llama-1b batch 1: $1 $2"
  env $1 timeout 150 $td bench engine --device cuda --model llama-1b "${args[@]}" --prompt-len 512 --gen 64 \
    --concurrency 1 --turns 0 --kv-budget-mib 8192 > $OUT/bench.tmp 2>&1; echo "exit $?"
  cat $OUT/bench.tmp >> $OUT/bench.log
  grep -vE "^\s*$" $OUT/bench.tmp | grep -iE "decode|megakernel|barrier|error|panick|conc" | cut -c1-200 | head -12
}
bench X=1 $B,pdl=on,cuda_graphs=on
bench X=1 $B,pdl=all,cuda_graphs=on
bench X=1 $B,megakernel=on,cuda_graphs=on
bench TAPEDECK_NVRTC_DEFINES=MK_MIN_BLOCKS=1 $B,megakernel=on,cuda_graphs=on
bench X=1 $B,megakernel=on
bench TAPEDECK_MMA_SPLIT_MIN=64 $B,pdl=all,cuda_graphs=on
rm -f $OUT/bench.tmp
