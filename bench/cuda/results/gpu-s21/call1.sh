#!/usr/bin/env bash
# For the twenty-first session's first device call (~7 min; after `bash
# bench/cuda/build_for_device.sh`, copy to .device/call.sh, carry [".device"]).
# (1) One shared-memory carveout for every kernel (TAPEDECK_SMEM_CARVEOUT, written after the
# twentieth session's last call): an SM holds blocks of one carveout at a time, so if the GEMVs
# (a few KB of shared memory) and the mma attention (64 KB a block) get different ones from the
# driver, each kernel's blocks wait for SMs to drain of the previous kernel's, PDL or not. That
# would explain why launching the attention early gained nothing (twentieth session). With it,
# early KV staging (DA_KV_EARLY=1 + TAPEDECK_PDL_ATTN=on) may pay again. Also pdl=all with the
# attention triggering at its start (DA_TRIGGER_LATE=0): the o GEMV then launches, and fetches
# its weights, during the attention, when the memory is otherwise idle (~3.3 µs a layer); and
# the same with the o GEMV triggering gate/up only after its own wait (GEMV_F32_TRIGGER_LATE=1),
# so gate/up's 17 MB first wave does not crowd the attention's KV reads, under pdl=all and
# under pdl=on with only the attention launched early (TAPEDECK_PDL_ATTN=on).
# (2) One layer traced, default and carveout 100: trace_blocks.py's last column counts the
# blocks that started beside a block of the kernel before on the same SM.
# next-call-2.sh has the rest (bench engine, split floor, the whole suite).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
. bench/cuda/gpu_env.sh > /dev/null
export TAPEDECK_KERNEL_CACHE=/tmp/kc TAPEDECK_FIXTURES=$PWD/fixtures/models
nvidia-smi --query-gpu=name --format=csv,noheader
B=matmul=bf16,attn_decode=mma-bf16,small_gemm=gemv,pdl=on,cuda_graphs=on,fuse=on,kv_dtype=bf16
C=TAPEDECK_SMEM_CARVEOUT
E=TAPEDECK_PDL_ATTN=on+TAPEDECK_NVRTC_DEFINES=DA_KV_EARLY=1
A=${B/pdl=on/pdl=all}
L=TAPEDECK_NVRTC_DEFINES=DA_TRIGGER_LATE=0
O=$L,GEMV_F32_TRIGGER_LATE=1
G=TAPEDECK_NVRTC_DEFINES=GEMV1_MIN_BLOCKS=4
REPS=2 bash bench/cuda/sweep.sh "X=1 $B" "$G $B" "$C=100 $B" "$C=50 $B" "TAPEDECK_NVRTC_DEFINES=SWIGLU1_MAXNREG=88 $B" "$G,SWIGLU1_MAXNREG=88 $B" "$C=100+$G $B" "$C=100+$E $B" "$E $B" "$L $A" "$C=100+$L $A" \
  "$O $A" "TAPEDECK_PDL_ATTN=on+$O $B" | tee $OUT/sweep-carveout.md
echo "at ${SECONDS}s"
bash bench/cuda/trace_step.sh fast X=1 "$B" --layer 3 2>&1 | tail -12
bash bench/cuda/trace_step.sh carve100 "$C=100" "$B" --layer 3 2>&1 | tail -12
echo "at ${SECONDS}s"
