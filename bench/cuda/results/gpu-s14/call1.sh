#!/usr/bin/env bash
# Session 14, call 1: where a decode layer's time goes (block-level trace), the attention path
# without the combine launch (one split: TAPEDECK_MMA_SPLIT_MIN), pdl=all, L2 evict-first weights;
# then the whole CUDA suite.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
. bench/cuda/gpu_env.sh > /dev/null
export TAPEDECK_KERNEL_CACHE=/tmp/kc TAPEDECK_FIXTURES=$PWD/fixtures/models
nvidia-smi --query-gpu=name --format=csv,noheader
B=matmul=bf16,attn_decode=mma-bf16,small_gemm=gemv,pdl=on,cuda_graphs=on,fuse=on,kv_dtype=bf16
BA=${B/pdl=on/pdl=all}
E=TAPEDECK_NVRTC_DEFINES=GEMV_L2_EVICT_FIRST=1
S1=TAPEDECK_MMA_SPLIT_MIN=1024
REPS=2 bash bench/cuda/sweep.sh "X=1 $B" "X=1 $BA" "$S1 $B" "$S1 $BA" "TAPEDECK_MMA_SPLIT_MIN=256 $B" \
  "$E $B" "$E+$S1 $BA" | tee $OUT/sweep512.md
echo "at ${SECONDS}s"
PROMPT=4096 REPS=2 bash bench/cuda/sweep.sh "X=1 $B" "$S1 $B" "TAPEDECK_MMA_SPLIT_MIN=512 $B" "$E $B" | tee $OUT/sweep4096.md
echo "at ${SECONDS}s"
trace() {  # name knobs toggles
  mapfile -t args < <(toggle_args "$3")
  env $2 TAPEDECK_TRACE=/tmp/trace-$1.csv timeout 100 .device/tapedeck bench engine --device cuda --model llama-1b \
    "${args[@]}" --prompt-len 512 --gen 64 --concurrency 0 --turns 0 > $OUT/trace-$1-bench.log 2>&1
  grep -E "decode step" $OUT/trace-$1-bench.log
  python3 bench/cuda/trace_summary.py /tmp/trace-$1.csv > $OUT/trace-$1.md 2>&1; head -12 $OUT/trace-$1.md
  python3 bench/cuda/trace_blocks.py /tmp/trace-$1.csv --layer 3 --bytes gemv_bf16_swiglu_1=67.1 \
    --bytes gemv_bf16_1/1024=33.6 --bytes gemv_bf16_1/256=8.4 --bytes gemv_bf16_qkv_rope_bf16kv_1=12.6 \
    | tee $OUT/blocks-$1.md
  # the head GEMV's blocks, for a bandwidth reference
  python3 bench/cuda/trace_blocks.py /tmp/trace-$1.csv --layer 16 --bytes gemv_bf16_1/16032=525.3 | tail -8
}
trace default X=1 "$B"
trace split1-all "$S1" "$BA"
trace evict "$E" "$B"
echo "at ${SECONDS}s"
timeout 280 .device/test-cuda --test-threads=1 > $OUT/tests.log 2>&1
echo "suite exit $? at ${SECONDS}s"
grep -E "^test |test result|panicked" $OUT/tests.log | cut -c1-170 | grep -v " ok$" | head -40
grep -cE "^test .* ok$" $OUT/tests.log
echo "done at ${SECONDS}s"
