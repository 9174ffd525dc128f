#!/usr/bin/env bash
# Session 13, call 1: the CUDA test suite (pick/top-k/SIMT kernels rewritten host-only in s12),
# the fastest set vs the SIMT reference / decode_topk / FP8 on SIMT, a trace of the fastest set.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
. bench/cuda/gpu_env.sh > /dev/null
export TAPEDECK_KERNEL_CACHE=/tmp/kc TAPEDECK_FIXTURES=$PWD/fixtures/models
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 280 .device/test-cuda --test-threads=1 > $OUT/tests.log 2>&1
echo "suite exit $? at ${SECONDS}s"
grep -E "^test |test result|panicked" $OUT/tests.log | cut -c1-170 | grep -v " ok$" | head -40
grep -cE "^test .* ok$" $OUT/tests.log
B=matmul=bf16,attn_decode=mma-bf16,small_gemm=gemv,pdl=on,cuda_graphs=on,fuse=on,kv_dtype=bf16
S=matmul=bf16,small_gemm=gemv,pdl=on,cuda_graphs=on
REPS=2 bash bench/cuda/sweep.sh "X=1 $B" "X=1 $S,attn_decode=simt-f32" "X=1 $S,attn_decode=simt-f32,kv_dtype=fp8-e4m3" \
  "X=1 $S,decode_topk=64" "X=1 $S,attn_decode=mma-bf16,kv_dtype=fp8-e4m3" | tee $OUT/sweep512.md
echo "at ${SECONDS}s"
mapfile -t args < <(toggle_args "$B")
TAPEDECK_TRACE=/tmp/trace.csv timeout 100 .device/tapedeck bench engine --device cuda --model llama-1b \
  "${args[@]}" --prompt-len 512 --gen 64 --concurrency 0 --turns 0 > $OUT/trace-bench.log 2>&1
grep -E "trace:|decode step" $OUT/trace-bench.log
python3 bench/cuda/trace_summary.py /tmp/trace.csv > $OUT/trace.md 2>&1; head -60 $OUT/trace.md
echo "done at ${SECONDS}s"
