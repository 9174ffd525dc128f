#!/usr/bin/env bash
# For the twenty-seventh session's first device call (~8 min; after `bash
# bench/cuda/build_for_device.sh`, copy to .device/call.sh, carry [".device"], timeout ~500;
# LIMIT=seconds ends the tests sooner). The twenty-sixth session wrote GEMV_TMA (every GEMV's
# staged weights by bulk copies of the copy engine, sm_90+) and could not time it: its only
# later call's probe was broken (a `$D=...` prefix is not an assignment in bash, and the first
# `generate --model llama-1b` builds the model, >60 s).
# (0) GEMV_TMA: the same tokens and logits as the default build, and no hang, before it is
#     timed (the default run builds llama-1b into the cache first, hence its longer limit).
# (1) Sweep: the defaults; all staging by bulk copies (GEMV_TMA=1 with TAPEDECK_GEMV_ASYNC=8,
#     TAPEDECK_SWIGLU_ASYNC=on, TAPEDECK_QKV_ASYNC=on); the same staging by cp.async (control);
#     (s27) half of each row requested before the PDL wait, the rest after the input is ready,
#     in gate/up (SWIGLU_PRE_EARLY=4) and in all three GEMV kinds.
# (2) One layer traced with bulk copies and TD_MARK_POINT=1 (input ready): did the inputs come
#     sooner after the waits than the twenty-fifth session's 2-4 µs?
# (3) The rest of the GPU suite (the fused-decode variants and the cluster merge were cut in
#     the twenty-sixth session; its other 15 GPU tests passed with the new defaults on an H200).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
. bench/cuda/gpu_env.sh > /dev/null
export TAPEDECK_KERNEL_CACHE=/tmp/kc TAPEDECK_FIXTURES=$PWD/fixtures/models
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
B=matmul=bf16,attn_decode=mma-bf16,small_gemm=gemv,pdl=on,cuda_graphs=on,fuse=on,kv_dtype=bf16
D=TAPEDECK_NVRTC_DEFINES
S="TAPEDECK_GEMV_ASYNC=8+TAPEDECK_SWIGLU_ASYNC=on+TAPEDECK_QKV_ASYNC=on"
mapfile -t args < <(toggle_args "$B")
P="The history of the river town begins with a ferry, a mill and a quarrel over tolls."
gen() { timeout "$1" .device/tapedeck generate --device cuda --model llama-1b --raw --prompt "$P" \
  --max-tokens 48 --logits "${args[@]}"; }
gen 180 > $OUT/gen-def.txt 2> $OUT/gen-def.err; echo "default rc $?"
IFS=+ read -ra staged <<< "$S"
(for kv in "${staged[@]}" "$D=GEMV_TMA=1"; do export "$kv"; done; gen 60) > $OUT/gen-tma.txt 2> $OUT/gen-tma.err
echo "tma rc $?"
T=()
if [ -s $OUT/gen-def.txt ] && cmp $OUT/gen-def.txt $OUT/gen-tma.txt; then
  echo "GEMV_TMA: same output"; T=("$S+$D=GEMV_TMA=1 $B")
else echo "GEMV_TMA: DIFFERENT or failed"; tail -3 $OUT/gen-tma.err; fi
echo "at ${SECONDS}s"
H1="$D=SWIGLU_PRE_EARLY=4 $B"
H2="$D=SWIGLU_PRE_EARLY=4,GEMV_PRE_EARLY=4,QKV_PRE_EARLY=4 $B"
REPS=2 bash bench/cuda/sweep.sh "X=1 $B" "${T[@]}" "$H1" "$H2" "$S $B" > $OUT/sweep.md 2>&1
cut -d'|' -f2,4,5 $OUT/sweep.md
echo "at ${SECONDS}s"
if [ ${#T[@]} = 1 ]; then
  bash bench/cuda/trace_step.sh tma1 "$S+$D=GEMV_TMA=1,TD_MARK_POINT=1" "$B" --layer 3 2>&1 | tail -10
  rm -f $OUT/*.csv.gz
  echo "at ${SECONDS}s"
fi
ONLY_TESTS=1 TEST_TIMEOUT=150 timeout $((${LIMIT:-480}-SECONDS)) bash bench/cuda/run_engine_tests.sh $OUT/tests > $OUT/tests.log 2>&1
echo "tests exit $? at ${SECONDS}s"
grep -E "^test .*(ok|FAILED)$|^test result|panicked|^== " $OUT/tests.log | grep -vE "result: ok" | head -60
rm -rf $OUT/tests/kernel-cache
