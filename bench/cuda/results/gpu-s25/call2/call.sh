#!/usr/bin/env bash
# Session 25, call 2: the three latency knobs are now on by default (call 1: 914 -> 935 tok/s).
# (1) One layer traced with the new defaults. (2) The whole GPU suite with them, each test in a
# process of its own, as far as the time allows.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
. bench/cuda/gpu_env.sh > /dev/null
export TAPEDECK_KERNEL_CACHE=/tmp/kc TAPEDECK_FIXTURES=$PWD/fixtures/models
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
B=matmul=bf16,attn_decode=mma-bf16,small_gemm=gemv,pdl=on,cuda_graphs=on,fuse=on,kv_dtype=bf16
bash bench/cuda/trace_step.sh def "X=1" "$B" --layer 3 2>&1 | tail -12
rm -f $OUT/*.csv.gz
echo "at ${SECONDS}s"
ONLY_TESTS=1 TEST_TIMEOUT=150 timeout $((440-SECONDS)) bash bench/cuda/run_engine_tests.sh $OUT/tests > $OUT/tests.log 2>&1
echo "tests exit $? at ${SECONDS}s"
grep -E "^test .*(ok|FAILED)$|^test result|panicked|^== " $OUT/tests.log | grep -vE "result: ok" | head -60
rm -rf $OUT/tests/kernel-cache
