#!/usr/bin/env bash
# A/B sweep of batch-1 decode on the GPU machine: each configuration is a '+'-separated list of
# environment assignments (tuning knobs of engine/src/cuda/tune.rs, or X=1 for none), a space, and
# a comma-separated toggle set; every
# configuration runs REPS times, interleaved (so drift between calls spreads over all of them),
# and the script prints one markdown row per run (the last column: the run's seconds, engine start
# and kernel compiles included). No rebuild: the knobs are read at run time.
#
#   bash bench/cuda/sweep.sh "X=1 matmul=bf16,small_gemm=gemv,pdl=on,cuda_graphs=on" \
#     "TAPEDECK_MMA_SPLIT_MIN=64+TAPEDECK_NVRTC_DEFINES=MK_MIN_BLOCKS=1 matmul=bf16,small_gemm=gemv,pdl=on"
#
# Knobs: MODEL (llama-1b), PROMPT (512), GEN (64), REPS (2), BIN (.device/tapedeck).
set -uo pipefail
. "$(dirname "$0")/gpu_env.sh" > /dev/null
export TAPEDECK_KERNEL_CACHE=${TAPEDECK_KERNEL_CACHE:-/tmp/tapedeck-kernel-cache}
bin=${BIN:-.device/tapedeck}
log=$(mktemp)
echo "| knobs | toggles | decode tok/s | device µs per step | wall µs per step | host µs: prepare / launch / wait / read / outside | run s |"
echo "|---|---|---|---|---|---|---|"
for rep in $(seq "${REPS:-2}"); do
  for cfg in "$@"; do
    knobs=${cfg%% *} toggles=${cfg#* }
    mapfile -t args < <(toggle_args "$toggles")
    IFS=+ read -ra kv <<< "$knobs"
    start=$SECONDS
    env "${kv[@]}" timeout 120 "$bin" bench engine --device cuda --model "${MODEL:-llama-1b}" \
      "${args[@]}" --prompt-len "${PROMPT:-512}" --gen "${GEN:-64}" --concurrency 0 --turns 0 \
      --kv-budget-mib 8192 > "$log" 2>&1
    tok=$(grep -oE 'decode [0-9.]+ tokens/s' "$log" | grep -oE '[0-9.]+' | head -1)
    dev=$(grep -oE '[0-9.]+ µs on the device' "$log" | grep -oE '^[0-9.]+' | head -1)
    wall=$(grep -oE 'decode step: [0-9.]+ µs wall' "$log" | grep -oE '[0-9.]+' | head -1)
    host=$(grep -oE 'host per decode step: .*' "$log" | grep -oE '[0-9.]+ µs' | grep -oE '[0-9.]+' | paste -sd/ | sed 's|/| / |g')
    echo "| $knobs | $toggles | ${tok:-failed} | ${dev:--} | ${wall:--} | ${host:--} | $((SECONDS - start)) |"
    [ -n "$tok" ] || tail -3 "$log" | sed 's/^/    /'
  done
done
rm -f "$log"
