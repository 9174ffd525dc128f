#!/usr/bin/env bash
# Session 25, call 5 (the budget's last ~300 s): the GPU tests that run the split attention with
# several sequences and the CPU comparison, with DA_INDEX_EARLY on by default; then one layer
# traced with the final defaults if time is left.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
. bench/cuda/gpu_env.sh > /dev/null
export TAPEDECK_KERNEL_CACHE=/tmp/kc TAPEDECK_FIXTURES=$PWD/fixtures/models
for t in batched_segments scheduler_invariance matches_cpu_on_both toggles_move; do
  run_each .device/test-cuda 60 $t > $OUT/test-$t.log 2>&1; echo "$t exit $? at ${SECONDS}s"
done
grep -hE "panicked|FAILED|test result" $OUT/test-*.log | head -8
B=matmul=bf16,attn_decode=mma-bf16,small_gemm=gemv,pdl=on,cuda_graphs=on,fuse=on,kv_dtype=bf16
[ $SECONDS -lt 90 ] && bash bench/cuda/trace_step.sh final "X=1" "$B" --layer 3 2>&1 | tail -11
rm -f $OUT/*.csv.gz
echo "done at ${SECONDS}s"
