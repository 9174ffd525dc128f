#!/usr/bin/env bash
# Session 12, second call: the L2 prefetch of the next weights (TAPEDECK_L2_PREFETCH) for
# correctness (the fused and packed-pool bit tests with it on) and speed, against fuse=on's new
# default (rope,head) and the in-kernel split merge with DA_TRIGGER_LATE=1 (never measured).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
. bench/cuda/gpu_env.sh > /dev/null
export TAPEDECK_KERNEL_CACHE=/tmp/kc TAPEDECK_FIXTURES=$PWD/fixtures/models
nvidia-smi --query-gpu=name --format=csv,noheader
TAPEDECK_L2_PREFETCH=16 timeout 150 .device/test-cuda packed_kv_pools fused --test-threads=1 --nocapture > $OUT/tests.log 2>&1
echo "packed+fused with L2 prefetch 16 MB: exit $? at ${SECONDS}s"
grep -E "^test |test result|panicked|identical: false|identical false" $OUT/tests.log | cut -c1-200 | head -20
grep -c "identical: true\|identical true" $OUT/tests.log
B=matmul=bf16,attn_decode=mma-bf16,small_gemm=gemv,pdl=on,cuda_graphs=on
F=$B,fuse=on
REPS=2 bash bench/cuda/sweep.sh "X=1 $B" "X=1 $F" "TAPEDECK_L2_PREFETCH=8 $F" "TAPEDECK_L2_PREFETCH=16 $F" \
  "TAPEDECK_L2_PREFETCH=24 $F" "TAPEDECK_L2_PREFETCH=32 $F" "TAPEDECK_L2_PREFETCH=16+TAPEDECK_NVRTC_DEFINES=L2_PF_LATE=1 $F" \
  "TAPEDECK_MMA_MERGE=in-kernel $F" "TAPEDECK_MMA_MERGE=in-kernel+TAPEDECK_L2_PREFETCH=24 $F" \
  "TAPEDECK_L2_PREFETCH=24 $B" | tee $OUT/sweep512.md
echo "at ${SECONDS}s"
PROMPT=4096 REPS=1 bash bench/cuda/sweep.sh "X=1 $F" "TAPEDECK_L2_PREFETCH=16 $F" "X=1 $F,kv_dtype=bf16" \
  "TAPEDECK_L2_PREFETCH=16 $F,kv_dtype=bf16" | tee $OUT/sweep4096.md
echo "at ${SECONDS}s"
mapfile -t args < <(toggle_args "$F")
TAPEDECK_L2_PREFETCH=16 TAPEDECK_TRACE=/tmp/trace-pf.csv timeout 100 .device/tapedeck bench engine --device cuda --model llama-1b \
  "${args[@]}" --prompt-len 512 --gen 64 --concurrency 0 --turns 0 > $OUT/trace-pf-bench.log 2>&1
grep -E "trace:|decode step|roofline" $OUT/trace-pf-bench.log
python3 bench/cuda/trace_summary.py /tmp/trace-pf.csv > $OUT/trace-pf.md 2>&1; sed -n 1,16p $OUT/trace-pf.md; tail -14 $OUT/trace-pf.md
echo "done at ${SECONDS}s"
