#!/usr/bin/env bash
# For the twenty-ninth session's first device call (after `bash bench/cuda/build_for_device.sh`,
# copy to .device/call.sh, carry [".device"], timeout ~540; LIMIT=seconds bounds the sweep,
# TESTS_LIMIT the tests after it).
# The twenty-eighth session (one H100 call) found every plain GEMV slower when it splits its
# weight requests around the PDL wait (down 6: 899, o 6: 920, head 6: 884 against 957 tok/s):
# only a launch's first wave starts before the kernel before has ended, the later waves only pay
# the split's extra round trip. It wrote PRE_SPLIT_PER_SM=N (split only in blocks below
# N x %nsmid; SASS unchanged at the default 0) and had no machine left to time it. It also made
# an engine start compile and load its kernel files side by side and skip the merging o GEMV's
# file (cuda/launch.rs load_modules): each sweep run cost ~70 s on a new define set, most of it
# compiling. First check that this works on the GPU (the first run's `bench engine` succeeds),
# then the per-run seconds in the table's last column tell what it saved.
# (1) Sweep, one run a configuration (~40-70 s each): the defaults; PRE_SPLIT_PER_SM 2 and 3;
#     the plain GEMVs at 6 with the split in the first 3 blocks per SM; gate/up 2 and q/k/v 4
#     the same way.
# (2) The GPU suite with the defaults in what time is left (it needs ~8 min alone: a second
#     call with SKIP_SWEEP=1 TESTS_LIMIT=560, timeout 600, finishes it).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
. bench/cuda/gpu_env.sh > /dev/null
export TAPEDECK_KERNEL_CACHE=/tmp/kc TAPEDECK_FIXTURES=$PWD/fixtures/models
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
B=matmul=bf16,attn_decode=mma-bf16,small_gemm=gemv,pdl=on,cuda_graphs=on,fuse=on,kv_dtype=bf16
D=TAPEDECK_NVRTC_DEFINES
if [ -z "${SKIP_SWEEP:-}" ]; then
  REPS=${REPS:-1} timeout ${LIMIT:-400} bash bench/cuda/sweep.sh "X=1 $B" "$D=PRE_SPLIT_PER_SM=2 $B" \
    "$D=PRE_SPLIT_PER_SM=3 $B" "$D=PRE_SPLIT_PER_SM=3,GEMV_PRE_EARLY=6 $B" \
    "$D=PRE_SPLIT_PER_SM=3,SWIGLU_PRE_EARLY=2,QKV_PRE_EARLY=4 $B" \
    "$D=PRE_SPLIT_PER_SM=2,GEMV_PRE_EARLY=6 $B" "X=1 $B" > $OUT/sweep.md 2>&1
  cut -d'|' -f2,4,5,8 $OUT/sweep.md
  echo "at ${SECONDS}s"
fi
ONLY_TESTS=1 TEST_TIMEOUT=150 timeout $((${TESTS_LIMIT:-520}-SECONDS)) bash bench/cuda/run_engine_tests.sh $OUT/tests > $OUT/tests.log 2>&1
echo "tests exit $? at ${SECONDS}s"
grep -E "^test .*(ok|FAILED)$|^test result|panicked|^== " $OUT/tests.log | grep -vE "result: ok" | head -60
rm -rf $OUT/tests/kernel-cache
