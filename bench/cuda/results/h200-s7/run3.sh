#!/usr/bin/env bash
# Session 7, third call: the whole device script with the new split floor (tests, A/B, serve,
# llama-1b sets, ncu per-kernel breakdown of the separate kernels).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
B=matmul=bf16,attn_decode=mma-bf16,small_gemm=gemv
PROFILE=1 PROFILE_TOGGLES=$B,pdl=on LLAMA1B_CONC=1,16,64 \
LLAMA1B_TOGGLES="$B,cuda_graphs=on $B,pdl=on,cuda_graphs=on $B,megakernel=on,cuda_graphs=on" \
  timeout 560 bash bench/cuda/run_engine_tests.sh /tmp/r > $OUT/run.log 2>&1; echo "exit $?"
cp /tmp/r/ncu-kernels.txt $OUT/ 2>/dev/null
grep -E "^test |test result|panicked|exit [01]|^baseline|tokens/s|megakernel:|decode step|^\s+(1|16|64)\s|kernel|gemv|lm_head|all 16|llama-1b|== " $OUT/run.log | cut -c1-200 | head -150
