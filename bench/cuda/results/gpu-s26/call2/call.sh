#!/usr/bin/env bash
# Session 26, call 2 (~9.5 min). Call 1 found TAPEDECK_PDL_ATTN=on with DA_KV_EARLY=1 the only
# faster knob (938 against 930 tok/s); both are now the default. (1) Sweep: the old defaults, the
# new ones, and the attention's trigger moved to the start (DA_TRIGGER_LATE=0) or to just after
# its first KV tiles are requested (=2, new). (2) The whole GPU suite with the new defaults.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
. bench/cuda/gpu_env.sh > /dev/null
export TAPEDECK_KERNEL_CACHE=/tmp/kc TAPEDECK_FIXTURES=$PWD/fixtures/models
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
B=matmul=bf16,attn_decode=mma-bf16,small_gemm=gemv,pdl=on,cuda_graphs=on,fuse=on,kv_dtype=bf16
D=TAPEDECK_NVRTC_DEFINES
REPS=2 bash bench/cuda/sweep.sh "TAPEDECK_PDL_ATTN=off+$D=DA_KV_EARLY=0 $B" "X=1 $B" \
  "$D=DA_TRIGGER_LATE=2 $B" "$D=DA_TRIGGER_LATE=0 $B" > $OUT/sweep.md 2>&1
cut -d'|' -f2,4,5 $OUT/sweep.md
echo "at ${SECONDS}s"
ONLY_TESTS=1 TEST_TIMEOUT=150 timeout $((560-SECONDS)) bash bench/cuda/run_engine_tests.sh $OUT/tests > $OUT/tests.log 2>&1
echo "tests exit $? at ${SECONDS}s"
grep -E "^test .*(ok|FAILED)$|^test result|panicked|^== " $OUT/tests.log | grep -vE "result: ok" | head -60
rm -rf $OUT/tests/kernel-cache
