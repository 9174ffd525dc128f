#!/usr/bin/env bash
# For the twenty-sixth session's first device call (~6.5 min; after `bash
# bench/cuda/build_for_device.sh`, copy to .device/call.sh, carry [".device"], timeout ~420).
# The twenty-fifth session's marks (docs/benchmarks.md, "Twenty-fifth session") show the DRAM
# nearly idle from the q/k/v GEMV's end to the combine's start (~5.7 µs a layer: the attention
# reads 1 MB), while the o GEMV's 8.4 MB and gate/up's first wave (17 MB) are both requested at
# the combine's start and share the bandwidth: o's input is ready only 5.4 µs after the combine.
# Knobs that already exist move those requests; none was timed with today's defaults:
#   GEMV_F32_TRIGGER_LATE=1  o lets gate/up launch only after its own wait (o's weights alone
#                            during the combine)
#   GEMV_F32_TRIGGER_LOADED=1  (new, untimed) o lets gate/up launch once all of o's blocks hold
#                            their weights, without waiting for the combine
#   TAPEDECK_PDL_ATTN=on     the attention and the combine launched early too (the combine, and so
#                            o, then launch once the attention's KV reads are done: o's weights
#                            stream during the attention's epilogue and the combine)
#   ... with DA_KV_EARLY=1   and the attention's cached KV staged before its wait
#   pdl=all                  every kernel launched early
# Then one layer traced with the best of them (edit W below after reading the sweep, or leave it).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
. bench/cuda/gpu_env.sh > /dev/null
export TAPEDECK_KERNEL_CACHE=/tmp/kc TAPEDECK_FIXTURES=$PWD/fixtures/models
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
B=matmul=bf16,attn_decode=mma-bf16,small_gemm=gemv,pdl=on,cuda_graphs=on,fuse=on,kv_dtype=bf16
A=matmul=bf16,attn_decode=mma-bf16,small_gemm=gemv,pdl=all,cuda_graphs=on,fuse=on,kv_dtype=bf16
D=TAPEDECK_NVRTC_DEFINES
REPS=2 bash bench/cuda/sweep.sh "X=1 $B" "$D=GEMV_F32_TRIGGER_LATE=1 $B" "$D=GEMV_F32_TRIGGER_LOADED=1 $B" \
  "TAPEDECK_PDL_ATTN=on $B" \
  "TAPEDECK_PDL_ATTN=on+$D=DA_KV_EARLY=1 $B" "X=1 $A" > $OUT/sweep.md 2>&1
cut -d'|' -f2,3,4,5 $OUT/sweep.md
echo "at ${SECONDS}s"
W=${W:-$D=GEMV_F32_TRIGGER_LATE=1}
for m in 1 0; do
  [ $SECONDS -lt 320 ] || break
  bash bench/cuda/trace_step.sh w$m "$W,TD_MARK_POINT=$m" "$B" --layer 3 2>&1 | tail -10
done
rm -f $OUT/*.csv.gz
echo "done at ${SECONDS}s"
