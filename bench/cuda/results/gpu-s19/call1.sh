#!/usr/bin/env bash
# For the nineteenth session's first device call (~6 min after `bash bench/cuda/build_for_device.sh`;
# copy to .device/call.sh, carry [".device"]). (1) `bench engine` at concurrency 1/16/64 with the
# new `device busy` column: under ~95% at 16 or 64 means the host is in the batched step and
# the batched run-ahead (NOTES "First thing with device time", item 4) pays. (2) Prefill of 512
# and 8192 tokens with preset=gpu-fast: the prefill mma kernel spills less since the eighteenth
# session (bf16kv_hd64 52/68 -> 32/32 bytes on sm_90); on the H100 it was 114.2k / 131.3k tok/s
# (gpu-s18/call3). (3) The whole GPU suite (the prefill mma and scheduler run-ahead tests among them).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
. bench/cuda/gpu_env.sh > /dev/null
export TAPEDECK_KERNEL_CACHE=/tmp/kc TAPEDECK_FIXTURES=$PWD/fixtures/models
nvidia-smi --query-gpu=name --format=csv,noheader
B=matmul=bf16,attn_decode=mma-bf16,small_gemm=gemv,pdl=on,cuda_graphs=on,fuse=on,kv_dtype=bf16
mapfile -t ta < <(toggle_args "$B")
timeout 200 .device/tapedeck bench engine --device cuda --model llama-1b "${ta[@]}" --prompt-len 512 \
  --gen 64 --concurrency 1,16,64 --turns 0 --kv-budget-mib 8192 2>&1 | tee $OUT/bench-llama-1b.log | tail -10
echo "at ${SECONDS}s"
mapfile -t tp < <(toggle_args "preset=gpu-fast")
for rep in 1 2; do
  for p in 512 8192; do
    timeout 120 .device/tapedeck bench engine --device cuda --model llama-1b "${tp[@]}" --prompt-len $p \
      --gen 4 --concurrency 0 --turns 0 --kv-budget-mib 8192 2>&1 | grep -E "single sequence" | tee -a $OUT/prefill.log
  done
done
echo "at ${SECONDS}s"
ONLY_TESTS=1 TEST_TIMEOUT=240 bash bench/cuda/run_engine_tests.sh $OUT/tests > $OUT/tests.log 2>&1
echo "tests exit $? at ${SECONDS}s"
grep -E "^test result|panicked|FAILED" $OUT/tests.log | head
rm -rf $OUT/tests/kernel-cache
echo "done at ${SECONDS}s"
