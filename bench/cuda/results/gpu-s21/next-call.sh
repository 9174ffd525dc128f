#!/usr/bin/env bash
# For the twenty-second session's first device call (~6.5 min; after `bash
# bench/cuda/build_for_device.sh`, copy to .device/call.sh, carry [".device"], timeout ~480).
# (1) TAPEDECK_GEMV_X_SMEM=on (written after the twenty-first session's last call, never run on a
# GPU; bit-identical on the host, ci/gemv_stream_host_check.py): the plain GEMVs (o and down in a
# decode step) copy their as-given input into shared memory once a block instead of every warp
# reading all of it. The trace of gpu-s21/call3 has the o GEMV 3.5 µs after its PDL wait with its
# weights already in registers: its 2048 warps ask the L2 for 8 KB of f32 each (16 MB) at the same
# moment, if the L1 does not merge their misses. Also beside GEMV1_MIN_BLOCKS=4 (the staging costs
# the one-row GEMV 8 registers: 80, three blocks an SM). (2) One layer traced with it (compare the
# o GEMV's "after wait" and down's span with gpu-s21/call3/blocks-oldregs.md). (3) The whole test
# executable with the knob on (every GEMV launch stages then).
# Print as you go: a call killed by its timeout returns only what is under $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
. bench/cuda/gpu_env.sh > /dev/null
export TAPEDECK_KERNEL_CACHE=/tmp/kc TAPEDECK_FIXTURES=$PWD/fixtures/models
nvidia-smi --query-gpu=name --format=csv,noheader
B=matmul=bf16,attn_decode=mma-bf16,small_gemm=gemv,pdl=on,cuda_graphs=on,fuse=on,kv_dtype=bf16
X=TAPEDECK_GEMV_X_SMEM=on
REPS=3 bash bench/cuda/sweep.sh "X=1 $B" "$X $B" "$X+TAPEDECK_NVRTC_DEFINES=GEMV1_MIN_BLOCKS=4 $B" \
  > $OUT/sweep-xsmem.md 2>&1
cut -d'|' -f2,4,5 $OUT/sweep-xsmem.md
echo "at ${SECONDS}s"
bash bench/cuda/trace_step.sh xsmem "$X" "$B" --layer 3 2>&1 | tail -10
echo "at ${SECONDS}s"
TAPEDECK_GEMV_X_SMEM=on timeout 220 .device/test-cuda --test-threads=1 --nocapture > $OUT/test-xsmem.log 2>&1
echo "tests exit $? at ${SECONDS}s"
grep -E "^test result|panicked|FAILED" $OUT/test-xsmem.log | head
