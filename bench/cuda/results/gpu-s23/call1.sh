#!/usr/bin/env bash
# Twenty-third session, first device call (~8 min; after `bash bench/cuda/build_for_device.sh`,
# copy to .device/call.sh, carry [".device"], timeout ~560). One call does what the twenty-second
# session's next-call.sh and the twentieth's next-call-2.sh would have done in two, since
# machine starts fail more often than not:
# (1) the o GEMV merging the attention splits itself (TAPEDECK_FUSE=rope,merge,head) with the
#     staged merge (default) and the register merge (TAPEDECK_MERGE_STAGED=off), against the
#     default (combine kernel), interleaved;
# (2) the whole GPU test executable under the winner of (1) (with the merge on, it checks the
#     fused path bit for bit against the unfused one);
# (3) one layer traced under the winner (the GEMV input in shared memory has not been traced);
# (4) `bench engine` at concurrency 1/16/64 for the docs' table.
# Print as you go: a call killed by its timeout returns only what is under $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
. bench/cuda/gpu_env.sh > /dev/null
export TAPEDECK_KERNEL_CACHE=/tmp/kc TAPEDECK_FIXTURES=$PWD/fixtures/models
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
B=matmul=bf16,attn_decode=mma-bf16,small_gemm=gemv,pdl=on,cuda_graphs=on,fuse=on,kv_dtype=bf16
F=TAPEDECK_FUSE=rope,merge,head
REPS=1 bash bench/cuda/sweep.sh "X=1 $B" "$F $B" "$F+TAPEDECK_MERGE_STAGED=off $B" "$F $B" "X=1 $B" \
  > $OUT/sweep-merge.md 2>&1
cut -d'|' -f2,4,5 $OUT/sweep-merge.md
echo "at ${SECONDS}s"
# Mean tok/s of the default rows and of the staged-merge rows.
base=$(awk -F'|' '$2 ~ /^ X=1 $/ {s+=$4; n++} END {if (n) printf "%.1f", s/n}' $OUT/sweep-merge.md)
staged=$(awk -F'|' '$2 ~ /^ TAPEDECK_FUSE=rope,merge,head $/ {s+=$4; n++} END {if (n) printf "%.1f", s/n}' $OUT/sweep-merge.md)
echo "default $base, staged merge $staged"
W=X=1
if awk -v a="$base" -v b="$staged" 'BEGIN {exit !(b > a * 1.002)}'; then W=$F; fi
echo "winner: $W" | tee $OUT/winner.txt
IFS=+ read -ra wkv <<< "$W"
env "${wkv[@]}" timeout 220 .device/test-cuda --test-threads=1 --nocapture > $OUT/test-winner.log 2>&1
echo "tests exit $? at ${SECONDS}s"
grep -E "^test result|panicked|FAILED" $OUT/test-winner.log | head
bash bench/cuda/trace_step.sh winner "$W" "$B" --layer 3 2>&1 | tail -12
echo "at ${SECONDS}s"
rm -f $OUT/*.csv.gz
mapfile -t ta < <(toggle_args "$B")
env "${wkv[@]}" timeout 150 .device/tapedeck bench engine --device cuda --model llama-1b "${ta[@]}" \
  --prompt-len 512 --gen 64 --concurrency 1,16,64 --turns 0 --kv-budget-mib 8192 2>&1 \
  | tee $OUT/bench-llama-1b.log | tail -12
echo "at ${SECONDS}s"
