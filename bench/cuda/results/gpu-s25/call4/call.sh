#!/usr/bin/env bash
# Session 25, call 4: DA_INDEX_EARLY is now on by default. (1) One interleaved sweep: the new
# defaults (X=1), DA_INDEX_EARLY off, the twenty-fourth session's defaults (all four knobs off),
# and a define that changes no kernel (a control: does setting TAPEDECK_NVRTC_DEFINES alone move
# the figure?). (2) The GPU tests that run the mma decode kernel's other paths (the persistent
# decode step, the fused decode kernels) and the whole suite as far as the time allows.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
. bench/cuda/gpu_env.sh > /dev/null
export TAPEDECK_KERNEL_CACHE=/tmp/kc TAPEDECK_FIXTURES=$PWD/fixtures/models
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
B=matmul=bf16,attn_decode=mma-bf16,small_gemm=gemv,pdl=on,cuda_graphs=on,fuse=on,kv_dtype=bf16
D=TAPEDECK_NVRTC_DEFINES
REPS=2 bash bench/cuda/sweep.sh "X=1 $B" "$D=DA_INDEX_EARLY=0 $B" \
  "$D=NORM_PREFETCH=0,QKV_INDEX_EARLY=0,GEMV_ADD_EARLY=0,DA_INDEX_EARLY=0 $B" "$D=TD_UNUSED_CONTROL=1 $B" \
  > $OUT/sweep.md 2>&1
cut -d'|' -f2,4,5 $OUT/sweep.md
echo "at ${SECONDS}s"
for t in megakernel fused_decode mma_bf16_decode graphs_replay packed_kv running_ahead; do
  [ $SECONDS -lt 400 ] || break
  run_each .device/test-cuda 100 $t > $OUT/test-$t.log 2>&1; echo "$t exit $? at ${SECONDS}s"
done
grep -hE "panicked|FAILED|identical" $OUT/test-*.log | head -20
