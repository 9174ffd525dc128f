#!/usr/bin/env bash
# For the twenty-second session's first device call (~8 min; after `bash
# bench/cuda/build_for_device.sh`, copy to .device/call.sh, carry [".device"], timeout ~540).
# Two GEMV knobs written after the twenty-first session's last call, bit-identical on the host
# (ci/gemv_stream_host_check.py), never run on a GPU:
# - TAPEDECK_GEMV_X_SMEM=on: the plain GEMVs (o, down, the head) copy an as-given input into
#   shared memory once a block instead of every warp reading all of it. The o GEMV spends 3.5 µs
#   after its PDL wait with its weights already in registers (gpu-s21/call3): its 2048 warps ask
#   the L2 for 8 KB of f32 each (16 MB) at the same moment, if the L1 does not merge the misses.
# - TAPEDECK_GEMV_ASYNC=8|16: the plain GEMVs stage their weights in shared memory by cp.async
#   instead of registers (one-row GEMV 71 -> 60 registers). Down ran 3.2 µs faster a layer at
#   four blocks an SM (128 KB in flight) but then blocked the next q/k/v (gpu-s21/call3); 16 with
#   TAPEDECK_GEMV_SLICE=4096 gives down two warps a row with 8 KB each in flight before the wait,
#   at two blocks an SM, leaving registers for q/k/v beside it.
# - TAPEDECK_SWIGLU_ASYNC=on: gate/up stages its two rows a warp the same way (96 -> 54 registers),
#   so down's blocks fit beside gate/up's last wave; shared memory then decides how many gate/up
#   blocks an SM holds (three at 68 KB: 192 KB in flight instead of 128).
# Then one layer traced with the async stage, and the whole test executable with all three on.
# Print as you go: a call killed by its timeout returns only what is under $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
. bench/cuda/gpu_env.sh > /dev/null
export TAPEDECK_KERNEL_CACHE=/tmp/kc TAPEDECK_FIXTURES=$PWD/fixtures/models
nvidia-smi --query-gpu=name --format=csv,noheader
B=matmul=bf16,attn_decode=mma-bf16,small_gemm=gemv,pdl=on,cuda_graphs=on,fuse=on,kv_dtype=bf16
X=TAPEDECK_GEMV_X_SMEM=on
A=TAPEDECK_GEMV_ASYNC
S=TAPEDECK_SWIGLU_ASYNC=on
REPS=2 bash bench/cuda/sweep.sh "X=1 $B" "$X $B" "$A=8 $B" "$A=16+TAPEDECK_GEMV_SLICE=4096 $B" \
  "$S $B" "$S+$A=16+TAPEDECK_GEMV_SLICE=4096 $B" > $OUT/sweep-gemv.md 2>&1
cut -d'|' -f2,4,5 $OUT/sweep-gemv.md
echo "at ${SECONDS}s"
bash bench/cuda/trace_step.sh async16 "$A=16+TAPEDECK_GEMV_SLICE=4096" "$B" --layer 3 2>&1 | tail -10
echo "at ${SECONDS}s"
TAPEDECK_GEMV_ASYNC=16 TAPEDECK_GEMV_X_SMEM=on TAPEDECK_SWIGLU_ASYNC=on timeout 170 .device/test-cuda --test-threads=1 \
  --nocapture > $OUT/test-gemv-knobs.log 2>&1
echo "tests exit $? at ${SECONDS}s"
grep -E "^test result|panicked|FAILED" $OUT/test-gemv-knobs.log | head
