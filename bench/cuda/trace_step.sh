#!/usr/bin/env bash
# Traces a llama-1b batch-1 decode (512-token prompt, 64 generated) with the kernel tracer and
# prints the step summary and one layer block by block, on the GPU machine:
#
#   bash bench/cuda/trace_step.sh NAME "KNOB=V+KNOB2=V2" TOGGLES [trace_blocks.py options...]
#
# NAME names the files written under $OUT (trace-NAME.md, blocks-NAME.md, the bench log); the
# knobs are '+'-separated environment assignments (X=1 for none), as in sweep.sh. The options
# after the toggles go to trace_blocks.py (default: --layer 3).
set -uo pipefail
. "$(dirname "$0")/gpu_env.sh" > /dev/null
export TAPEDECK_KERNEL_CACHE=${TAPEDECK_KERNEL_CACHE:-/tmp/tapedeck-kernel-cache}
name=$1 knobs=$2 toggles=$3
shift 3
out=${OUT:-/tmp/out}
mkdir -p "$out"
mapfile -t args < <(toggle_args "$toggles")
IFS=+ read -ra kv <<< "$knobs"
env "${kv[@]}" TAPEDECK_TRACE="/tmp/trace-$name.csv" timeout 100 "${BIN:-.device/tapedeck}" bench engine \
  --device cuda --model "${MODEL:-llama-1b}" "${args[@]}" --prompt-len "${PROMPT:-512}" --gen 64 \
  --concurrency 0 --turns 0 > "$out/trace-$name-bench.log" 2>&1
grep -E "decode step" "$out/trace-$name-bench.log"
python3 "$(dirname "$0")/trace_summary.py" "/tmp/trace-$name.csv" > "$out/trace-$name.md" 2>&1
gzip -c "/tmp/trace-$name.csv" > "$out/trace-$name.csv.gz"
head -1 "$out/trace-$name.md"
grep -E "pick_|embed_" "$out/trace-$name.md" | head -4
[ $# -gt 0 ] || set -- --layer 3
python3 "$(dirname "$0")/trace_blocks.py" "/tmp/trace-$name.csv" "$@" | tee "$out/blocks-$name.md"
