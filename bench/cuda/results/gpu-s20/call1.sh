#!/usr/bin/env bash
# Twentieth session, call 1 (~6 min; after `bash bench/cuda/build_for_device.sh`, copy to
# .device/call.sh, carry [".device"]). (1) Bits: the GEMV reference test (two down features a
# warp, TAPEDECK_GEMV_FEATURES=2, against one), and with DA_KV_EARLY=1 (the mma decode kernel
# stages its cached KV tiles before its PDL wait) the mma kernel against the CPU, graphs/pdl=all
# against pdl off, and the megakernel. (2) Batch-1 decode: default, two features, pdl=all, pdl=all
# with early KV, both. (3) `bench engine` concurrency rounds queued as one arrival (submit_all).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
. bench/cuda/gpu_env.sh > /dev/null
export TAPEDECK_KERNEL_CACHE=/tmp/kc TAPEDECK_FIXTURES=$PWD/fixtures/models
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 100 .device/test-cuda gemv_kernel --test-threads=1 --nocapture > $OUT/test-gemv.log 2>&1
echo "gemv test exit $? at ${SECONDS}s"; grep -E "two features|panicked|test result" $OUT/test-gemv.log | head -4
TAPEDECK_NVRTC_DEFINES=DA_KV_EARLY=1 timeout 200 .device/test-cuda mma_bf16_decode graphs_replay megakernel \
  --test-threads=1 --nocapture > $OUT/test-early.log 2>&1
echo "early-KV tests exit $? at ${SECONDS}s"; grep -E "^test |test result|panicked|identical to" $OUT/test-early.log | head -20
B=matmul=bf16,attn_decode=mma-bf16,small_gemm=gemv,pdl=on,cuda_graphs=on,fuse=on,kv_dtype=bf16
A=${B/pdl=on/pdl=all}
E=TAPEDECK_NVRTC_DEFINES=DA_KV_EARLY=1
F=TAPEDECK_GEMV_FEATURES=2
REPS=3 bash bench/cuda/sweep.sh "X=1 $B" "$F $B" "X=1 $A" "$E $A" "$E+$F $A" | tee $OUT/sweep.md
echo "at ${SECONDS}s"
mapfile -t ta < <(toggle_args "$B")
timeout 150 .device/tapedeck bench engine --device cuda --model llama-1b "${ta[@]}" --prompt-len 512 \
  --gen 64 --concurrency 1,16,64,16 --turns 0 --kv-budget-mib 8192 2>&1 | tee $OUT/bench-llama-1b.log | tail -9
echo "done at ${SECONDS}s"
