#!/usr/bin/env bash
# For the seventeenth session's first device call (~3 min): what the sixteenth session's host
# changes did, all untimed on a GPU so far. generate now reserves its cache before prefill (no
# mid-decode growth: a device copy and a fresh graph capture per request), and `bench engine`
# times single-sequence decode from the second token. Expect decode tok/s near the scheduler's
# concurrency-1 ITL (1.15 ms p50 = ~870 tok/s in call 4, against 804 single-sequence), and the
# host split's `launch` and `outside` well under call 4's 23-36 µs each. Then the CUDA tests, which
# have not run since `cuda/mod.rs` was split into modules (moves only; ~3 min).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
. bench/cuda/gpu_env.sh > /dev/null
export TAPEDECK_KERNEL_CACHE=/tmp/kc TAPEDECK_FIXTURES=$PWD/fixtures/models
nvidia-smi --query-gpu=name --format=csv,noheader
B=matmul=bf16,attn_decode=mma-bf16,small_gemm=gemv,pdl=on,cuda_graphs=on,fuse=on,kv_dtype=bf16
REPS=2 bash bench/cuda/sweep.sh "X=1 $B" "TAPEDECK_HOST_COPIES=pinned $B" "X=1 preset=gpu-fast" \
  | tee $OUT/sweep512.md
echo "at ${SECONDS}s"
mapfile -t ta < <(toggle_args "$B")
timeout 200 .device/tapedeck bench engine --device cuda --model llama-1b "${ta[@]}" --prompt-len 512 \
  --gen 64 --concurrency 1,16,64 --turns 0 --kv-budget-mib 8192 2>&1 | tee $OUT/bench-llama-1b.log | tail -9
echo "done at ${SECONDS}s"
ONLY_TESTS=1 TEST_TIMEOUT=240 bash bench/cuda/run_engine_tests.sh $OUT/tests > $OUT/tests.log 2>&1
echo "tests exit $? at ${SECONDS}s"
grep -E "^test result|panicked|FAILED" $OUT/tests.log | head
rm -rf $OUT/tests/kernel-cache
