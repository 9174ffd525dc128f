#!/usr/bin/env bash
# Session 8, first call: fuse=on bit identity; the persistent GEMV grid (TAPEDECK_GEMV_GRID) against
# the default, same greedy tokens and logprobs; the megakernel's deeper rings (bits); a sweep; the
# whole suite.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
. bench/cuda/gpu_env.sh
export TAPEDECK_KERNEL_CACHE=/tmp/kc TAPEDECK_FIXTURES=$PWD/fixtures/models
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
timeout 150 .device/test-cuda fused --test-threads=1 --nocapture > $OUT/fuse-test.log 2>&1; echo "fuse test exit $?"
grep -E "test result|panicked|identical|fused" $OUT/fuse-test.log | cut -c1-220 | head -40
G="--device cuda --model tiny-qwen2 --prompt hello --max-tokens 48 --logits --toggle matmul=bf16 --toggle small_gemm=gemv --toggle pdl=on"
for k in 0 1 2; do
  TAPEDECK_GEMV_GRID=$k timeout 60 .device/tapedeck generate $G > $OUT/gen-grid$k.txt 2>&1
  TAPEDECK_GEMV_GRID=$k timeout 60 .device/tapedeck generate $G --toggle fuse=on > $OUT/gen-grid$k-fuse.txt 2>&1
done
for f in $OUT/gen-grid*.txt; do echo "$(md5sum < $f | cut -c1-12) $(wc -l < $f) $(basename $f)"; done
head -5 $OUT/gen-grid0.txt
TAPEDECK_GEMV_GRID=1 timeout 150 .device/test-cuda fused gemv graphs --test-threads=1 --nocapture > $OUT/grid1-tests.log 2>&1; echo "grid1 tests exit $?"
grep -E "test result|panicked" $OUT/grid1-tests.log | cut -c1-200
TAPEDECK_NVRTC_DEFINES=MK_DEPTH=3,MK_SWIGLU_DEPTH=2,MK_MIN_BLOCKS=1 timeout 120 .device/test-cuda megakernel --nocapture > $OUT/mk-depth.log 2>&1; echo "mk depth exit $?"
grep -E "test result|panicked|identical" $OUT/mk-depth.log | cut -c1-200
B=matmul=bf16,attn_decode=mma-bf16,small_gemm=gemv
REPS=2 bash bench/cuda/sweep.sh "X=1 $B,pdl=on,cuda_graphs=on" "X=1 $B,pdl=on,cuda_graphs=on,fuse=on" \
  "X=1 $B,pdl=all,cuda_graphs=on,fuse=on" \
  "TAPEDECK_GEMV_GRID=1 $B,pdl=on,cuda_graphs=on,fuse=on" "TAPEDECK_GEMV_GRID=2 $B,pdl=on,cuda_graphs=on,fuse=on" \
  "TAPEDECK_NVRTC_DEFINES=MK_MIN_BLOCKS=1 $B,megakernel=on,cuda_graphs=on" \
  "TAPEDECK_NVRTC_DEFINES=MK_DEPTH=3,MK_MIN_BLOCKS=1 $B,megakernel=on,cuda_graphs=on" \
  "TAPEDECK_NVRTC_DEFINES=MK_DEPTH=3,MK_SWIGLU_DEPTH=2,MK_MIN_BLOCKS=1 $B,megakernel=on,cuda_graphs=on" | tee $OUT/sweep.md
timeout 240 .device/test-cuda --test-threads=1 > $OUT/tests.log 2>&1; echo "all tests exit $?"
grep -E "^test |test result|panicked" $OUT/tests.log | cut -c1-160 | head -30
