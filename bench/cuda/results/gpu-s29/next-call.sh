#!/usr/bin/env bash
# For the thirtieth session's first device call, written in the twenty-ninth (not run there: its
# machine starts failed). ~6 min (SHORT=1: ~3 min, the defaults against all three on only);
# after `bash bench/cuda/build_for_device.sh`, copy to .device/call.sh, carry [".device"].
# The step's fixed costs around the layers (the twenty-fifth session's trace: ~5 µs from the
# step's start to the first GEMV's input, 12 µs from the head's end to the step's end):
# TAPEDECK_PDL_PICKS=on launches the picks with PDL under pdl=on; PICK_FAST=1 takes the picks'
# warp maxima by redux.sync and pick_finish's logits from the candidates' keys;
# TAPEDECK_EMBED_FUSED=on drops embed_tokens (the first q/k/v launch gathers the row).
# (1) `generate` with all three on against the defaults, byte for byte with logits; (2) two runs
# a configuration, interleaved; (3) the tests that cover them, all on (until TESTS_END seconds).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
. bench/cuda/gpu_env.sh > /dev/null
export TAPEDECK_KERNEL_CACHE=/tmp/kc TAPEDECK_FIXTURES=$PWD/fixtures/models
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
B=matmul=bf16,attn_decode=mma-bf16,small_gemm=gemv,pdl=on,cuda_graphs=on,fuse=on,kv_dtype=bf16
D=TAPEDECK_NVRTC_DEFINES
ALL=(TAPEDECK_PDL_PICKS=on TAPEDECK_EMBED_FUSED=on $D=PICK_FAST=1)
mapfile -t args < <(toggle_args "$B")
P="The history of the river town begins with a ferry, a mill and a quarrel over tolls."
gen() { timeout "$1" .device/tapedeck generate --device cuda --model llama-1b --raw --prompt "$P" \
  --max-tokens 48 --logits "${args[@]}"; }
gen 150 > $OUT/gen-def.txt 2> $OUT/gen-def.err; echo "default rc $?"
env "${ALL[@]}" bash -c "$(declare -f gen); $(declare -p args P); gen 60" > $OUT/gen-all.txt 2> $OUT/gen-all.err
echo "all on rc $?"
if [ -s $OUT/gen-def.txt ] && cmp $OUT/gen-def.txt $OUT/gen-all.txt; then echo "generate: same output"
else echo "generate: DIFFERENT or failed"; tail -3 $OUT/gen-all.err; fi
echo "at ${SECONDS}s"
A=$(IFS=+; echo "${ALL[*]}")
if [ -n "${SHORT:-}" ]; then
  REPS=2 timeout ${LIMIT:-120} bash bench/cuda/sweep.sh "X=1 $B" "$A $B" > $OUT/sweep.md 2>&1
else
  REPS=${REPS:-2} timeout ${LIMIT:-260} bash bench/cuda/sweep.sh "X=1 $B" "TAPEDECK_PDL_PICKS=on $B" \
    "$D=PICK_FAST=1 $B" "TAPEDECK_EMBED_FUSED=on $B" "$A $B" > $OUT/sweep.md 2>&1
fi
cut -d'|' -f2,4,5,8 $OUT/sweep.md
echo "at ${SECONDS}s"
for t in cuda_picks_tokens cuda_graphs_replay cuda_running_ahead cuda_matches_cpu_on_both \
    cuda_fused_decode_kernels cuda_scheduler_invariance; do
  [ $SECONDS -lt ${TESTS_END:-400} ] || break
  env "${ALL[@]}" timeout 90 .device/test-cuda $t --nocapture > $OUT/test-$t.log 2>&1
  echo "$t exit $? at ${SECONDS}s: $(grep -E '^test result' $OUT/test-$t.log)"
done
grep -hE "panicked|FAILED" $OUT/test-*.log | head
