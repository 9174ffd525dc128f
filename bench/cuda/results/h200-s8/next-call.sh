#!/usr/bin/env bash
# Written in session 8 for the next device call (the second call of session 8 was refused: no
# machine was lent). Copy to .device/ after `bash bench/cuda/build_for_device.sh`, then run it with
# the device tool (carry .device). About 6 minutes.
#  1. the bits of every fusion (TAPEDECK_FUSE=rope,merge,head) and of the in-kernel merge with the
#     mma kernel's late PDL trigger (DA_TRIGGER_LATE, default 1, never run yet);
#  2. kernel timelines (TAPEDECK_TRACE) of the default fastest set and of fuse=on, summarised on the
#     machine (the CSV is ~150 MB) by bench/cuda/trace_summary.py;
#  3. which fusion costs what, and whether the late trigger rescues the in-kernel merge.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
. bench/cuda/gpu_env.sh
export TAPEDECK_KERNEL_CACHE=/tmp/kc TAPEDECK_FIXTURES=$PWD/fixtures/models
TAPEDECK_FUSE=rope,merge,head timeout 150 .device/test-cuda fused --test-threads=1 --nocapture > $OUT/fuse-test.log 2>&1; echo "fuse test (all three) exit $?"
grep -E "test result|panicked|identical: false" $OUT/fuse-test.log | cut -c1-220 | head -20
TAPEDECK_MMA_MERGE=in-kernel timeout 120 .device/test-cuda megakernel graphs --test-threads=1 > $OUT/ik-tests.log 2>&1; echo "in-kernel merge tests exit $?"
grep -E "test result|panicked" $OUT/ik-tests.log | cut -c1-200
B=matmul=bf16,attn_decode=mma-bf16,small_gemm=gemv,pdl=on,cuda_graphs=on
mapfile -t args < <(toggle_args "$B")
for name in default fuse; do
  extra=(); [ $name = fuse ] && extra=(--toggle fuse=on)
  TAPEDECK_TRACE=/tmp/trace-$name.csv timeout 150 .device/tapedeck bench engine --device cuda --model llama-1b \
    "${args[@]}" "${extra[@]}" --prompt-len 512 --gen 64 --concurrency 0 --turns 0 > $OUT/trace-$name-bench.log 2>&1
  grep -E "trace:|decode step" $OUT/trace-$name-bench.log
  python3 bench/cuda/trace_summary.py /tmp/trace-$name.csv > $OUT/trace-$name.md 2>&1; head -60 $OUT/trace-$name.md
done
REPS=2 bash bench/cuda/sweep.sh "X=1 $B" "TAPEDECK_FUSE=rope $B,fuse=on" "TAPEDECK_FUSE=rope,merge $B,fuse=on" \
  "TAPEDECK_FUSE=rope,head $B,fuse=on" "TAPEDECK_MMA_MERGE=in-kernel $B" \
  "TAPEDECK_FUSE=rope+TAPEDECK_MMA_MERGE=in-kernel $B,fuse=on" \
  "TAPEDECK_FUSE=rope+TAPEDECK_MMA_MERGE=in-kernel+TAPEDECK_NVRTC_DEFINES=DA_TRIGGER_LATE=0 $B,fuse=on" | tee $OUT/sweep.md
timeout 240 .device/test-cuda --test-threads=1 > $OUT/tests.log 2>&1; echo "all tests exit $?"
grep -E "^test |test result|panicked" $OUT/tests.log | cut -c1-160 | head -30
