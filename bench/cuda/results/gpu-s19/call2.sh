#!/usr/bin/env bash
# Nineteenth session, call 2 (~6 min): the MLP as one dataflow grid (TAPEDECK_FUSE=...,mlp,
# mlp_flow_N in kernels/engine.cu). (1) Bit identity against the separate gate/up + down GEMVs
# (fused_decode test, slices 2048 and 256). (2) Batch-1 decode, default fusions against +mlp,
# with MLP_FLOW_LAG 0/1/2, interleaved 3x. (3) One layer traced both ways.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
. bench/cuda/gpu_env.sh > /dev/null
export TAPEDECK_KERNEL_CACHE=/tmp/kc TAPEDECK_FIXTURES=$PWD/fixtures/models
nvidia-smi --query-gpu=name --format=csv,noheader
for slice in 2048 256; do
  TAPEDECK_FUSE=rope,head,mlp TAPEDECK_GEMV_SLICE=$slice timeout 150 .device/test-cuda fused_decode \
    --test-threads=1 --nocapture > $OUT/test-mlp-$slice.log 2>&1
  echo "fused_decode mlp slice $slice: exit $?"
  grep -E "MLP as one grid|panicked|test result" $OUT/test-mlp-$slice.log | head -8
done
echo "at ${SECONDS}s"
B=matmul=bf16,attn_decode=mma-bf16,small_gemm=gemv,pdl=on,cuda_graphs=on,fuse=on,kv_dtype=bf16
F=TAPEDECK_FUSE=rope,head,mlp
D=TAPEDECK_NVRTC_DEFINES=MLP_FLOW_LAG
REPS=3 bash bench/cuda/sweep.sh "X=1 $B" "$F $B" "$F+$D=0 $B" "$F+$D=2 $B" | tee $OUT/sweep.md
echo "at ${SECONDS}s"
L="--layer 3"
bash bench/cuda/trace_step.sh base X=1 "$B" $L 2>&1 | tail -14
bash bench/cuda/trace_step.sh mlp "$F" "$B" $L 2>&1 | tail -14
echo "done at ${SECONDS}s"
