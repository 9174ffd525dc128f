#!/usr/bin/env bash
# For the twenty-first session's first device call (~8 min; after `bash
# bench/cuda/build_for_device.sh`, copy to .device/call.sh, carry [".device"]).
# (1) One shared-memory carveout for every kernel (TAPEDECK_SMEM_CARVEOUT, written after the
# twentieth session's last call): an SM holds blocks of one carveout at a time, so if the GEMVs
# (a few KB of shared memory) and the mma attention (64 KB a block) get different ones from the
# driver, each kernel's blocks wait for SMs to drain of the previous kernel's, PDL or not. That
# would explain why launching the attention early gained nothing (twentieth session). With it,
# early KV staging (DA_KV_EARLY=1 + TAPEDECK_PDL_ATTN=on) may pay again. (2) One layer traced,
# default and carveout 100. (3) `bench engine` at concurrency 1/16/64 with the per-level host
# split. (4) The split floor beside the fast combine (DA_COMBINE_FAST=1, default since the
# twentieth session; =0 is the old combine). (5) The whole GPU suite.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
. bench/cuda/gpu_env.sh > /dev/null
export TAPEDECK_KERNEL_CACHE=/tmp/kc TAPEDECK_FIXTURES=$PWD/fixtures/models
nvidia-smi --query-gpu=name --format=csv,noheader
B=matmul=bf16,attn_decode=mma-bf16,small_gemm=gemv,pdl=on,cuda_graphs=on,fuse=on,kv_dtype=bf16
C=TAPEDECK_SMEM_CARVEOUT
E=TAPEDECK_PDL_ATTN=on+TAPEDECK_NVRTC_DEFINES=DA_KV_EARLY=1
REPS=2 bash bench/cuda/sweep.sh "X=1 $B" "$C=100 $B" "$C=50 $B" "$C=100+$E $B" "$E $B" | tee $OUT/sweep-carveout.md
echo "at ${SECONDS}s"
bash bench/cuda/trace_step.sh fast X=1 "$B" --layer 3 2>&1 | tail -12
bash bench/cuda/trace_step.sh carve100 "$C=100" "$B" --layer 3 2>&1 | tail -12
echo "at ${SECONDS}s"
mapfile -t ta < <(toggle_args "$B")
timeout 150 .device/tapedeck bench engine --device cuda --model llama-1b "${ta[@]}" --prompt-len 512 \
  --gen 64 --concurrency 1,16,64 --turns 0 --kv-budget-mib 8192 2>&1 | tee $OUT/bench-llama-1b.log | tail -12
echo "at ${SECONDS}s"
REPS=2 bash bench/cuda/sweep.sh "X=1 $B" "TAPEDECK_MMA_SPLIT_MIN=256 $B" "TAPEDECK_MMA_SPLIT_MIN=512 $B" \
  "TAPEDECK_NVRTC_DEFINES=DA_COMBINE_FAST=0 $B" | tee $OUT/sweep-split.md
echo "at ${SECONDS}s"
ONLY_TESTS=1 TEST_TIMEOUT=220 bash bench/cuda/run_engine_tests.sh $OUT/tests > $OUT/tests.log 2>&1
echo "tests exit $? at ${SECONDS}s"
grep -E "^test result|panicked|FAILED" $OUT/tests.log | head
rm -rf $OUT/tests/kernel-cache
