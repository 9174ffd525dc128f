#!/usr/bin/env bash
# Nineteenth session, call 3 (~4 min): the MLP dataflow grid without its ticket and finish
# atomics (blockIdx order; counters cleared by their last user), down warps on two features.
# (1) Bit identity (slices 2048 with rope,head,mlp; 256 with head,mlp). (2) Default against
# +mlp (2 down features a warp, 1, lag 2), interleaved 2x. (3) One layer traced with +mlp.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
. bench/cuda/gpu_env.sh > /dev/null
export TAPEDECK_KERNEL_CACHE=/tmp/kc TAPEDECK_FIXTURES=$PWD/fixtures/models
nvidia-smi --query-gpu=name --format=csv,noheader
for run in rope,head,mlp:2048 head,mlp:256; do
  TAPEDECK_FUSE=${run%%:*} TAPEDECK_GEMV_SLICE=${run#*:} timeout 150 .device/test-cuda fused_decode \
    --test-threads=1 --nocapture > $OUT/test-mlp-${run#*:}.log 2>&1
  echo "fused_decode $run: exit $?"
  grep -E "MLP as one grid|panicked|test result" $OUT/test-mlp-${run#*:}.log | head -4
done
echo "at ${SECONDS}s"
B=matmul=bf16,attn_decode=mma-bf16,small_gemm=gemv,pdl=on,cuda_graphs=on,fuse=on,kv_dtype=bf16
F=TAPEDECK_FUSE=rope,head,mlp
D=TAPEDECK_NVRTC_DEFINES
REPS=2 bash bench/cuda/sweep.sh "X=1 $B" "$F $B" "$F+TAPEDECK_MLP_DROWS=1 $B" "$F+$D=MLP_FLOW_LAG=2 $B" | tee $OUT/sweep.md
echo "at ${SECONDS}s"
bash bench/cuda/trace_step.sh mlp "$F" "$B" --layer 3 2>&1 | tail -10
echo "done at ${SECONDS}s"
