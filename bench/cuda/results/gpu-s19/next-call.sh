#!/usr/bin/env bash
# For the twentieth session's first device call (~3 min, after `bash bench/cuda/build_for_device.sh`;
# copy to .device/call.sh, carry [".device"]): `bench engine` concurrency rounds with the requests of a
# round queued as one arrival (EngineHandle::submit_all): call 1 saw c=16 at 6871 tok/s with a
# 23 ms TTFT p50 and 18 ms ITL p99 (8717, 4.3 and 2.6 in the eighteenth session); the unmeasured
# round before each level is now as long as the measured one (graphs for every block-table bucket
# the contexts grow through are captured before timing). Then the
# megakernel and run-ahead tests (ld_acquire_u32 moved into engine.cu), the GEMV reference test
# (compares TAPEDECK_GEMV_FEATURES=2, two down features a warp, bit for bit), and batch-1 decode
# with and without two features a warp (the down projection keeps 8 KB in flight a warp).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
. bench/cuda/gpu_env.sh > /dev/null
export TAPEDECK_KERNEL_CACHE=/tmp/kc TAPEDECK_FIXTURES=$PWD/fixtures/models
nvidia-smi --query-gpu=name --format=csv,noheader
B=matmul=bf16,attn_decode=mma-bf16,small_gemm=gemv,pdl=on,cuda_graphs=on,fuse=on,kv_dtype=bf16
mapfile -t ta < <(toggle_args "$B")
timeout 150 .device/tapedeck bench engine --device cuda --model llama-1b "${ta[@]}" --prompt-len 512 \
  --gen 64 --concurrency 1,16,64,16 --turns 0 --kv-budget-mib 8192 2>&1 | tee $OUT/bench-llama-1b.log | tail -9
echo "at ${SECONDS}s"
timeout 150 .device/test-cuda megakernel running_ahead gemv_kernel --test-threads=1 --nocapture > $OUT/tests.log 2>&1
echo "tests exit $? at ${SECONDS}s"
grep -E "^test |test result|panicked" $OUT/tests.log | head
REPS=3 bash bench/cuda/sweep.sh "X=1 $B" "TAPEDECK_GEMV_FEATURES=2 $B" | tee $OUT/sweep.md
echo "done at ${SECONDS}s"
