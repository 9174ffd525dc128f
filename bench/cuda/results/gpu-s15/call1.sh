#!/usr/bin/env bash
# Session 15, call 1: the streaming GEMV kernels (TAPEDECK_GEMV_STREAM) against the default ones
# in the batch-1 decode step, their bit tests and the token-pick test (pick kernels on 2048-logit
# chunks now), bench gemv, then block-level traces of a step with and without them.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
. bench/cuda/gpu_env.sh > /dev/null
export TAPEDECK_KERNEL_CACHE=/tmp/kc TAPEDECK_FIXTURES=$PWD/fixtures/models
nvidia-smi --query-gpu=name --format=csv,noheader
B=matmul=bf16,attn_decode=mma-bf16,small_gemm=gemv,pdl=on,cuda_graphs=on,fuse=on,kv_dtype=bf16
D=TAPEDECK_NVRTC_DEFINES
REPS=2 bash bench/cuda/sweep.sh "X=1 $B" "TAPEDECK_GEMV_STREAM=2 $B" "TAPEDECK_GEMV_STREAM=1 $B" | tee $OUT/sweep512.md
echo "at ${SECONDS}s"
timeout 150 .device/test-cuda --test-threads=1 cuda_gemv cuda_fused_gate cuda_picks > $OUT/tests.log 2>&1
echo "tests exit $? at ${SECONDS}s"
grep -E "^test |test result|panicked|differs" $OUT/tests.log | cut -c1-200 | head -20
grep -E "^swiglu 8192x2048, 1 rows|^gemv out 2048 in 8192 n 1|^segment" $OUT/tests.log | head
timeout 90 .device/tapedeck bench gemv --device cuda --rows 1 --reps 100 2>&1 | tee $OUT/bench-gemv.txt | tail -12
echo "at ${SECONDS}s"
trace() {  # name knobs toggles
  mapfile -t args < <(toggle_args "$3")
  env $2 TAPEDECK_TRACE=/tmp/trace-$1.csv timeout 100 .device/tapedeck bench engine --device cuda --model llama-1b \
    "${args[@]}" --prompt-len 512 --gen 64 --concurrency 0 --turns 0 > $OUT/trace-$1-bench.log 2>&1
  grep -E "decode step" $OUT/trace-$1-bench.log
  python3 bench/cuda/trace_summary.py /tmp/trace-$1.csv > $OUT/trace-$1.md 2>&1
  head -1 $OUT/trace-$1.md; grep -E "pick_|embed" $OUT/trace-$1.md | head -4
  python3 bench/cuda/trace_blocks.py /tmp/trace-$1.csv --layer 3 --bytes gemv_stream_swiglu_1=67.1 \
    --bytes @5=33.6 --bytes @3=8.4 --bytes @0=12.6 | tee $OUT/blocks-$1.md
}
trace stream2 TAPEDECK_GEMV_STREAM=2 "$B"
trace default X=1 "$B"
echo "at ${SECONDS}s"
REPS=1 bash bench/cuda/sweep.sh "TAPEDECK_GEMV_STREAM=2+$D=GEMV_STREAM_DEPTH=2 $B" \
  "TAPEDECK_GEMV_STREAM=1+$D=GEMV_STREAM_DEPTH=5,GEMV_STREAM_MIN_BLOCKS=1 $B" | tee $OUT/sweep512-depth.md
echo "done at ${SECONDS}s"
