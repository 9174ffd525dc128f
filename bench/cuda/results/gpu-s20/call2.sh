#!/usr/bin/env bash
# Twentieth session, call 2 (~5 min): DA_COMBINE_FAST=1 (the combine kernel reads the context
# length before its PDL wait and every split's (m, l, O) in one round of loads) with and without
# DA_KV_EARLY=1, under pdl=all and under pdl=on with only the attention launched early
# (TAPEDECK_PDL_ATTN=on). (1) Bits: mma kernel against the CPU, graphs/pdl=all against pdl off, packed
# pools. (2) Batch-1 decode, 3 interleaved runs. (3) One layer traced with both under pdl=all.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
. bench/cuda/gpu_env.sh > /dev/null
export TAPEDECK_KERNEL_CACHE=/tmp/kc TAPEDECK_FIXTURES=$PWD/fixtures/models
nvidia-smi --query-gpu=name --format=csv,noheader
D=TAPEDECK_NVRTC_DEFINES
TAPEDECK_NVRTC_DEFINES=DA_KV_EARLY=1,DA_COMBINE_FAST=1 timeout 220 .device/test-cuda mma_bf16_decode graphs_replay \
  packed_kv --test-threads=1 --nocapture > $OUT/test-fast.log 2>&1
echo "tests exit $? at ${SECONDS}s"; grep -E "^test |test result|panicked|identical to" $OUT/test-fast.log | head -20
B=matmul=bf16,attn_decode=mma-bf16,small_gemm=gemv,pdl=on,cuda_graphs=on,fuse=on,kv_dtype=bf16
A=${B/pdl=on/pdl=all}
REPS=3 bash bench/cuda/sweep.sh "X=1 $B" "$D=DA_COMBINE_FAST=1 $B" "$D=DA_KV_EARLY=1 $A" \
  "$D=DA_KV_EARLY=1,DA_COMBINE_FAST=1 $A" "TAPEDECK_PDL_ATTN=on+$D=DA_KV_EARLY=1,DA_COMBINE_FAST=1 $B" \
  | tee $OUT/sweep.md
echo "at ${SECONDS}s"
bash bench/cuda/trace_step.sh early-fast "$D=DA_KV_EARLY=1,DA_COMBINE_FAST=1" "$A" --layer 3 2>&1 | tail -12
echo "done at ${SECONDS}s"
