#!/usr/bin/env bash
# Twenty-fourth session's device call (~5.5 min; after `bash bench/cuda/build_for_device.sh`,
# copy to .device/call.sh, carry [".device"], timeout ~360).
# (1) The GEMV test alone: the twenty-third session's call crashed in it (the streaming GEMV read
#     an f32 input staged in shared memory as bf16 as if it were f32; fixed after that call).
# (2) Three latency knobs written in the twenty-fourth session, all the same bits by construction
#     and off by default: the RMSNorm weights fetched before the PDL wait (NORM_PREFETCH=1 into
#     L1, 2 into L2), the q/k/v GEMV's positions, rotary frequencies and cache slots read before
#     it (QKV_INDEX_EARLY=1), the o and down GEMVs' residual loaded beside the input's prologue
#     (GEMV_ADD_EARLY=1): all on against none (twice, interleaved), then each alone.
# (3) One layer traced with all three on (trace_blocks.py's last column: when the early blocks'
#     waits are released after the kernel before ends).
# (4) Knobs that lost before the GEMV input went through shared memory, once each beside it.
# (5) The GPU suite, each test in a process of its own, as far as the time allows.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
. bench/cuda/gpu_env.sh > /dev/null
export TAPEDECK_KERNEL_CACHE=/tmp/kc TAPEDECK_FIXTURES=$PWD/fixtures/models
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
timeout 90 .device/test-cuda cuda_gemv_kernel --test-threads=1 --nocapture > $OUT/test-gemv.log 2>&1
echo "gemv test exit $? at ${SECONDS}s"
grep -E "^test result|panicked|FAILED" $OUT/test-gemv.log | head -5
B=matmul=bf16,attn_decode=mma-bf16,small_gemm=gemv,pdl=on,cuda_graphs=on,fuse=on,kv_dtype=bf16
D=TAPEDECK_NVRTC_DEFINES
A=NORM_PREFETCH=1,QKV_INDEX_EARLY=1,GEMV_ADD_EARLY=1
REPS=2 bash bench/cuda/sweep.sh "X=1 $B" "$D=$A $B" > $OUT/sweep-new.md 2>&1
cut -d'|' -f2,4,5 $OUT/sweep-new.md
echo "at ${SECONDS}s"
REPS=1 bash bench/cuda/sweep.sh "$D=NORM_PREFETCH=1 $B" "$D=QKV_INDEX_EARLY=1 $B" "$D=GEMV_ADD_EARLY=1 $B" \
  "$D=NORM_PREFETCH=2,QKV_INDEX_EARLY=1,GEMV_ADD_EARLY=1 $B" "X=1 $B" > $OUT/sweep-each.md 2>&1
cut -d'|' -f2,4,5 $OUT/sweep-each.md
echo "at ${SECONDS}s"
# One layer with the three knobs on; trace_blocks.py's last column says when each boundary's
# early blocks' PDL waits are released (compare gpu-s23/call1/trace-winner.md for the defaults).
bash bench/cuda/trace_step.sh new "$D=$A" "$B" --layer 3 2>&1 | tail -9
rm -f $OUT/*.csv.gz
echo "at ${SECONDS}s"
REPS=1 bash bench/cuda/sweep.sh "TAPEDECK_PDL_ATTN=on $B" "TAPEDECK_GEMV_STREAM=2 $B" \
  "TAPEDECK_GEMV_SLICE=4096 $B" "X=1 $B" > $OUT/sweep-old.md 2>&1
cut -d'|' -f2,4,5 $OUT/sweep-old.md
echo "at ${SECONDS}s"
ONLY_TESTS=1 TEST_TIMEOUT=120 timeout $((330-SECONDS)) bash bench/cuda/run_engine_tests.sh $OUT/tests > $OUT/tests.log 2>&1
echo "tests exit $? at ${SECONDS}s"
grep -E "^test .*(ok|FAILED)$|^test result|panicked" $OUT/tests.log | grep -vE "result: ok" | head -40
rm -rf $OUT/tests/kernel-cache
