#!/usr/bin/env bash
# Written in session 11 for the next device call (its last call could not start: too little device
# time left). Copy to .device/ after `bash bench/cuda/build_for_device.sh`, run it with the device
# tool (carry .device, timeout ~560). About 7 minutes; prints everything that matters to stdout.
#  1. packed KV pools on the GPU, bit for bit against an f32 pool, now with the FP8 tensor-core
#     decode kernel (decode_attn_mma_fp8kv, never run) and fuse=on (the Args overflow fixed in
#     348b562 crashed it); the fused and megakernel tests with FP8 pools;
#  2. decode tok/s per KV storage (f32 / bf16 / fp8 pools, and TAPEDECK_KV_STORAGE=f32);
#  3. session 8's leftovers: kernel timelines of the default set and of fuse=on, and which fusion
#     costs what (bench/cuda/results/h200-s8/next-call.sh explains them).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
. bench/cuda/gpu_env.sh > /dev/null
export TAPEDECK_KERNEL_CACHE=/tmp/kc TAPEDECK_FIXTURES=$PWD/fixtures/models
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 200 .device/test-cuda packed_kv_pools fused megakernel --test-threads=1 --nocapture > $OUT/tests.log 2>&1
echo "packed+fused+megakernel exit $? at ${SECONDS}s"
grep -E "^test |test result|panicked|identical|persistent" $OUT/tests.log | cut -c1-180 | head -80
B=matmul=bf16,attn_decode=mma-bf16,small_gemm=gemv,pdl=on,cuda_graphs=on
REPS=2 bash bench/cuda/sweep.sh "X=1 $B" "X=1 $B,kv_dtype=bf16" "X=1 $B,kv_dtype=fp8-e4m3" \
  "TAPEDECK_KV_STORAGE=f32 $B,kv_dtype=bf16" "X=1 $B,fuse=on" "X=1 $B,kv_dtype=bf16,fuse=on" \
  "TAPEDECK_FUSE=rope $B,fuse=on" "TAPEDECK_FUSE=rope,head $B,fuse=on" | tee $OUT/sweep512.md
PROMPT=4096 REPS=1 bash bench/cuda/sweep.sh "X=1 $B" "X=1 $B,kv_dtype=bf16" "X=1 $B,kv_dtype=fp8-e4m3" | tee $OUT/sweep4096.md
mapfile -t args < <(toggle_args "$B")
for name in default fuse; do
  extra=(); [ $name = fuse ] && extra=(--toggle fuse=on)
  TAPEDECK_TRACE=/tmp/trace-$name.csv timeout 150 .device/tapedeck bench engine --device cuda --model llama-1b \
    "${args[@]}" "${extra[@]}" --prompt-len 512 --gen 64 --concurrency 0 --turns 0 > $OUT/trace-$name-bench.log 2>&1
  grep -E "trace:|decode step" $OUT/trace-$name-bench.log
  python3 bench/cuda/trace_summary.py /tmp/trace-$name.csv > $OUT/trace-$name.md 2>&1; head -40 $OUT/trace-$name.md
done
[ $SECONDS -lt 420 ] && { timeout 130 .device/test-cuda --test-threads=1 --skip packed_kv_pools --skip fused --skip megakernel > $OUT/rest.log 2>&1
  echo "rest of suite exit $? at ${SECONDS}s"; grep -E "^test |test result|panicked" $OUT/rest.log | cut -c1-160; }
echo "done at ${SECONDS}s"
