#!/usr/bin/env bash
# Session 7, fourth call: the mma kernel merging its own splits (default) under every test; the
# old combine path's graphs test; llama-1b batch 1 with each merge and GEMV slice; bench gemv.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
. bench/cuda/gpu_env.sh
export TAPEDECK_KERNEL_CACHE=/tmp/kc TAPEDECK_FIXTURES=$PWD/fixtures/models
echo "== all tests (in-kernel merge)"
timeout 200 .device/test-cuda --test-threads=1 --nocapture > $OUT/tests.log 2>&1; echo "exit $?"
grep -E "^test |test result|panicked|megakernel:|identical to" $OUT/tests.log | cut -c1-160 | head -40
echo "== merge in the combine kernel: graphs + numerics tests"
TAPEDECK_MMA_MERGE=kernel timeout 120 .device/test-cuda cuda_graphs cuda_matches --test-threads=1 > $OUT/tests-k.log 2>&1; echo "exit $?"
grep -E "test result|panicked" $OUT/tests-k.log
td=.device/tapedeck
B=matmul=bf16,attn_decode=mma-bf16,small_gemm=gemv,pdl=on,cuda_graphs=on
bench() {
  local args=(); local IFS=,; for p in $2; do args+=(--toggle "$p"); done; unset IFS
  env $1 timeout 100 $td bench engine --device cuda --model llama-1b "${args[@]}" --prompt-len 512 --gen 64 \
    --concurrency 0 --turns 0 --kv-budget-mib 8192 > $OUT/bench.tmp 2>&1
  cat $OUT/bench.tmp >> $OUT/bench.log
  echo "$1 $2: $(grep -oE 'decode [0-9.]+ tokens/s' $OUT/bench.tmp) | $(grep -oE 'decode step: .*' $OUT/bench.tmp)"
}
for rep in 1 2; do
  bench TAPEDECK_MMA_MERGE=kernel $B
  bench TAPEDECK_MMA_MERGE=in-kernel $B
done
bench TAPEDECK_GEMV_SLICE=1024 $B
bench TAPEDECK_GEMV_SLICE=512 $B
bench X=1 ${B/pdl=on,/}
bench X=1 ${B/pdl=on/pdl=all}
for sl in 2048 1024; do
  echo "== bench gemv, slice $sl"
  TAPEDECK_GEMV_SLICE=$sl timeout 60 $td bench gemv --device cuda 2>&1 | grep -E " 1 |rows:" | cut -c1-120
done
rm -f $OUT/bench.tmp
