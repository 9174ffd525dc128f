#!/usr/bin/env bash
# Session 7, second call: the fp8 test fix, megakernel phase costs by leaving one out, split floor
# sweep on the separate kernels, ncu per-kernel times of the separate path.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
. bench/cuda/gpu_env.sh
export TAPEDECK_KERNEL_CACHE=/tmp/kc TAPEDECK_FIXTURES=$PWD/fixtures/models
echo "== numeric toggles test"
timeout 120 .device/test-cuda cuda_matches_cpu --test-threads=1 --nocapture > $OUT/tests.log 2>&1; echo "exit $?"
grep -E "kv_dtype|test result|panicked" $OUT/tests.log | head -12
td=.device/tapedeck
B=matmul=bf16,attn_decode=mma-bf16,small_gemm=gemv
bench() { # env-assignment toggles
  local args=(); local IFS=,; for p in $2; do args+=(--toggle "$p"); done; unset IFS
  env $1 timeout 100 $td bench engine --device cuda --model llama-1b "${args[@]}" --prompt-len 512 --gen 64 \
    --concurrency 0 --turns 0 --kv-budget-mib 8192 > $OUT/bench.tmp 2>&1
  cat $OUT/bench.tmp >> $OUT/bench.log
  echo "$1 $2: $(grep -oE 'decode [0-9.]+ tokens/s' $OUT/bench.tmp) | $(grep -oE 'decode step: .*' $OUT/bench.tmp)"
}
for ph in 63 0 62 61 59 55 47 31; do
  bench "TAPEDECK_NVRTC_DEFINES=MK_MIN_BLOCKS=1,MK_PHASES=$ph" $B,megakernel=on,cuda_graphs=on
done
bench "TAPEDECK_NVRTC_DEFINES=MK_MIN_BLOCKS=1,MK_PHASES=63" $B,megakernel=on,cuda_graphs=on
for sm in 256 128 64; do bench TAPEDECK_MMA_SPLIT_MIN=$sm $B,pdl=on,cuda_graphs=on; done
echo "== ncu, separate kernels, pdl=on eager"
mapfile -t ta < <(IFS=,; for p in $B,pdl=on; do printf -- '--toggle\n%s\n' "$p"; done)
timeout 200 ncu --clock-control none --metrics gpu__time_duration.sum --csv --launch-skip 3000 --launch-count 400 \
  $td bench engine --device cuda --model llama-1b "${ta[@]}" --prompt-len 512 --gen 64 --concurrency 0 --turns 0 \
  > $OUT/ncu.csv 2> $OUT/ncu.log; echo "ncu exit $?"
python3 bench/cuda/kernel_table.py < $OUT/ncu.csv | head -30
rm -f $OUT/bench.tmp
