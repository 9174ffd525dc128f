#!/usr/bin/env bash
# Session 25, call 3: DA_INDEX_EARLY (the mma decode kernel's q and block-table loads, and the
# combine's partials, issued alongside the context length instead of after it; the same bits).
# (1) Sweep against the defaults, interleaved. (2) End to end bit identity: llama-1b greedy with
# per-token logits, knob off and on. (3) The decode-attention GPU tests with it on. (4) Traces
# with TD_MARK_POINT=1 and 2 (input ready, dot products summed) to split each kernel's time after
# its wait.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
. bench/cuda/gpu_env.sh > /dev/null
export TAPEDECK_KERNEL_CACHE=/tmp/kc TAPEDECK_FIXTURES=$PWD/fixtures/models
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
B=matmul=bf16,attn_decode=mma-bf16,small_gemm=gemv,pdl=on,cuda_graphs=on,fuse=on,kv_dtype=bf16
D=TAPEDECK_NVRTC_DEFINES
REPS=2 bash bench/cuda/sweep.sh "X=1 $B" "$D=DA_INDEX_EARLY=1 $B" > $OUT/sweep.md 2>&1
cut -d'|' -f2,4,5 $OUT/sweep.md
echo "at ${SECONDS}s"
P=$(python3 -c "import random; random.seed(5); print(' '.join(random.choice(['alpha','river','stone','cloud','seven','lamp','green','north']) for _ in range(700)))")
mapfile -t ta < <(toggle_args "$B")
for v in 0 1; do
  env $D=DA_INDEX_EARLY=$v timeout 100 .device/tapedeck generate --device cuda --model llama-1b --raw \
    --prompt "$P" --max-tokens 48 --logits "${ta[@]}" > $OUT/gen-$v.txt 2> $OUT/gen-$v.err
  echo "generate $v exit $? lines $(wc -l < $OUT/gen-$v.txt)"
done
cmp $OUT/gen-0.txt $OUT/gen-1.txt && echo "generate: DA_INDEX_EARLY=1 output IDENTICAL to 0"
tail -2 $OUT/gen-1.txt | cut -c1-200; tail -2 $OUT/gen-1.err
echo "at ${SECONDS}s"
export $D=DA_INDEX_EARLY=1
run_each .device/test-cuda 120 mma_bf16_decode > $OUT/test-early.log 2>&1; echo "mma test exit $?"
run_each .device/test-cuda 120 graphs_replay > $OUT/test-early-graphs.log 2>&1; echo "graphs test exit $?"
run_each .device/test-cuda 120 packed_kv_pools > $OUT/test-early-packed.log 2>&1; echo "packed test exit $?"
grep -hE "panicked|FAILED|test result" $OUT/test-early*.log | head
echo "at ${SECONDS}s"
unset $D
for m in 1 2; do
  [ $SECONDS -lt 330 ] || break
  bash bench/cuda/trace_step.sh mark$m "$D=DA_INDEX_EARLY=1,TD_MARK_POINT=$m" "$B" --layer 3 2>&1 | tail -10
  echo "at ${SECONDS}s"
done
[ $SECONDS -lt 330 ] && bash bench/cuda/trace_step.sh mark0 "$D=DA_INDEX_EARLY=1" "$B" --layer 3 2>&1 | tail -10
rm -f $OUT/*.csv.gz
echo "done at ${SECONDS}s"
