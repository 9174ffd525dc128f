#!/usr/bin/env bash
# For the twenty-third session's first device call (~5 min; after `bash
# bench/cuda/build_for_device.sh`, copy to .device/call.sh, carry [".device"], timeout ~420). Written
# for the twenty-second session's second call, which could not start (budget spent on refused starts).
# TAPEDECK_GEMV_X_SMEM is on by default since call1 (911 against 876 tok/s). (1) The o GEMV
# merging the attention splits itself (TAPEDECK_FUSE=rope,merge,head) with the new staged merge
# (every split copied to shared memory by cp.async in one round, 76 registers; the register merge,
# TAPEDECK_MERGE_STAGED=off, has 126 and measured 801 against 852 in the seventeenth session)
# against the default; (2) the fused-kernel test with the merge on (bit for bit); (3) the whole
# GPU test executable with the new default; (4) one layer traced with the staged merge.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
. bench/cuda/gpu_env.sh > /dev/null
export TAPEDECK_KERNEL_CACHE=/tmp/kc TAPEDECK_FIXTURES=$PWD/fixtures/models
nvidia-smi --query-gpu=name --format=csv,noheader
B=matmul=bf16,attn_decode=mma-bf16,small_gemm=gemv,pdl=on,cuda_graphs=on,fuse=on,kv_dtype=bf16
F=TAPEDECK_FUSE=rope,merge,head
REPS=1 bash bench/cuda/sweep.sh "X=1 $B" "$F $B" "$F+TAPEDECK_MERGE_STAGED=off $B" "$F $B" "X=1 $B" \
  > $OUT/sweep-merge.md 2>&1
cut -d'|' -f2,4,5 $OUT/sweep-merge.md
echo "at ${SECONDS}s"
TAPEDECK_FUSE=rope,merge,head timeout 60 .device/test-cuda fused_decode --test-threads=1 --nocapture \
  > $OUT/test-merge.log 2>&1
echo "merge test exit $? at ${SECONDS}s"
grep -E "^test result|panicked|FAILED|identical: false" $OUT/test-merge.log | head
grep -E "with the merge" $OUT/test-merge.log | head -3
timeout 200 .device/test-cuda --test-threads=1 --nocapture > $OUT/test-default.log 2>&1
echo "tests exit $? at ${SECONDS}s"
grep -E "^test result|panicked|FAILED" $OUT/test-default.log | head
bash bench/cuda/trace_step.sh merge "$F" "$B" --layer 3 2>&1 | tail -10
echo "at ${SECONDS}s"
rm -f $OUT/*.csv.gz
