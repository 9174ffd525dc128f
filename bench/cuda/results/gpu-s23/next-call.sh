#!/usr/bin/env bash
# For the twenty-fourth session's first device call (~8 min; after `bash
# bench/cuda/build_for_device.sh`, copy to .device/call.sh, carry [".device"], timeout ~560).
# (1) The GEMV test alone: the twenty-third session's first call crashed in it (the streaming GEMV
#     read an f32 input staged in shared memory as bf16 as if it were f32; fixed after the call,
#     not yet run on a GPU). (2) Knobs that lost before the GEMV input went through shared memory
#     (twenty-second session), again beside it: down on two warps a row (GEMV_SLICE=4096, 852
#     against 876 then), 4-warp GEMV blocks (851 against 867), the attention launched early with
#     PDL (PDL_ATTN=on, level then). (3) The GPU suite, each test in a process of its own
#     (run_each), with the fused merge both ways.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
. bench/cuda/gpu_env.sh > /dev/null
export TAPEDECK_KERNEL_CACHE=/tmp/kc TAPEDECK_FIXTURES=$PWD/fixtures/models
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
timeout 90 .device/test-cuda cuda_gemv_kernel --test-threads=1 --nocapture > $OUT/test-gemv.log 2>&1
echo "gemv test exit $? at ${SECONDS}s"
grep -E "^test result|panicked|FAILED" $OUT/test-gemv.log | head -5
B=matmul=bf16,attn_decode=mma-bf16,small_gemm=gemv,pdl=on,cuda_graphs=on,fuse=on,kv_dtype=bf16
REPS=2 bash bench/cuda/sweep.sh "X=1 $B" "TAPEDECK_GEMV_SLICE=4096 $B" "TAPEDECK_GEMV_BLOCK=4 $B" \
  "TAPEDECK_PDL_ATTN=on $B" > $OUT/sweep.md 2>&1
cut -d'|' -f2,4,5 $OUT/sweep.md
echo "at ${SECONDS}s"
ONLY_TESTS=1 TEST_TIMEOUT=120 bash bench/cuda/run_engine_tests.sh $OUT/tests > $OUT/tests.log 2>&1
echo "tests exit $? at ${SECONDS}s"
grep -E "^test .*(ok|FAILED)$|^test result|panicked" $OUT/tests.log | grep -vE "result: ok" | head -40
rm -rf $OUT/tests/kernel-cache
