#!/usr/bin/env bash
# Session 11's device call: packed GPU KV pools (bf16 bits, FP8 codes + scales) never ran on a GPU.
# Priority order with a time guard (the call limit is ~580 s).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
. bench/cuda/gpu_env.sh
export TAPEDECK_KERNEL_CACHE=/tmp/kc TAPEDECK_FIXTURES=$PWD/fixtures/models
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
ok() { [ $SECONDS -lt $1 ]; }
timeout 200 .device/test-cuda packed_kv_pools --test-threads=1 --nocapture > $OUT/packed.log 2>&1; echo "packed test exit $? at ${SECONDS}s"
grep -E "test result|panicked|storage|capacity|identical|worst|rel" $OUT/packed.log | cut -c1-220 | head -30
ok 330 && { timeout 150 .device/test-cuda megakernel fused --test-threads=1 > $OUT/mk-fused.log 2>&1; echo "megakernel+fused exit $? at ${SECONDS}s"; grep -E "^test |test result|panicked" $OUT/mk-fused.log | cut -c1-200 | head; }
B=matmul=bf16,attn_decode=mma-bf16,small_gemm=gemv,pdl=on,cuda_graphs=on
ok 420 && REPS=1 bash bench/cuda/sweep.sh "X=1 $B" "X=1 $B,kv_dtype=bf16" "TAPEDECK_KV_STORAGE=f32 $B,kv_dtype=bf16" \
  "X=1 $B,kv_dtype=fp8-e4m3" "X=1 $B,fuse=on" "X=1 $B,kv_dtype=bf16,fuse=on" | tee $OUT/sweep512.md
ok 470 && { timeout 100 .device/test-cuda --test-threads=1 --skip packed_kv_pools --skip megakernel --skip fused > $OUT/rest.log 2>&1; echo "rest of suite exit $? at ${SECONDS}s"; grep -E "^test |test result|panicked" $OUT/rest.log | cut -c1-160 | head -30; }
echo "done at ${SECONDS}s"
