#!/usr/bin/env bash
# Eighteenth session, call 4 (~4 min; binaries of call 1). Call 2 ran the mma decode kernel with
# one split per KV head at 512 tokens (TAPEDECK_MMA_SPLIT_MIN=4096): no combine kernel, but the
# o GEMV after it then spent 6.6 µs after its wait instead of 3.2, since the attention blocks
# release their PDL dependents only after their KV reads (DA_TRIGGER_LATE=1) and 8 long blocks
# release late: the o GEMV launched late and fetched its weights late. Here the same with the
# release at the kernel's start (DA_TRIGGER_LATE=0), and with two splits.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
. bench/cuda/gpu_env.sh > /dev/null
export TAPEDECK_KERNEL_CACHE=/tmp/kc TAPEDECK_FIXTURES=$PWD/fixtures/models
nvidia-smi --query-gpu=name --format=csv,noheader
B=matmul=bf16,attn_decode=mma-bf16,small_gemm=gemv,pdl=on,cuda_graphs=on,fuse=on,kv_dtype=bf16
S=TAPEDECK_MMA_SPLIT_MIN
E=TAPEDECK_NVRTC_DEFINES=DA_TRIGGER_LATE=0
REPS=2 bash bench/cuda/sweep.sh "X=1 $B" "$E $B" "$S=4096+$E $B" "$S=512+$E $B" "$S=256+$E $B" | tee $OUT/sweep512.md
PROMPT=1024 REPS=1 bash bench/cuda/sweep.sh "X=1 $B" "$E $B" "$S=4096+$E $B" "$S=512+$E $B" | tail -4 | tee $OUT/sweep1024.md
echo "at ${SECONDS}s"
L="--layer 3 --bytes @0=12.6 --bytes @4=8.4 --bytes gemv_bf16_swiglu_1=67.1 --bytes gemv_bf16_1/1024=33.6"
bash bench/cuda/trace_step.sh nosplit-early "$S=4096+$E" "$B" $L 2>&1 | tail -12
bash bench/cuda/trace_step.sh early "$E" "$B" $L 2>&1 | tail -12
rm -f $OUT/*.csv.gz
echo "done at ${SECONDS}s"
