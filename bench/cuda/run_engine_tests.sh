#!/usr/bin/env bash
# Runs tapedeck's CUDA tests and GPU figures on a GPU machine, from executables built elsewhere
# (the device machine has no Rust toolchain). Build them here first:
#
#   bash bench/cuda/build_for_device.sh      # -> .device/ (stripped test binaries + tapedeck)
#
# then, on the GPU machine, from the repository root:
#
#   bash bench/cuda/run_engine_tests.sh [OUT_DIR]      # ONLY_1B=1: only the llama-1b figures;
#                                                      # ONLY_TESTS=1: only the tests;
#                                                      # ONLY_AB=1: only generate + replay A/B
#                                                      # LLAMA1B_CONC=1,16: concurrency levels
#                                                      # EXTRAS=0: skip 8k prefill, serve and
#                                                      #   transformers in the llama-1b part
#
# The CUDA libraries are found by bench/cuda/gpu_env.sh.
set -uo pipefail
out="${1:-${OUT:-/tmp/tapedeck-gpu}}"
mkdir -p "$out"
bin=.device

. bench/cuda/gpu_env.sh
echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv || true
export TAPEDECK_KERNEL_CACHE="$out/kernel-cache"
export TAPEDECK_FIXTURES="$PWD/fixtures/models"

status=0
[ "${ONLY_1B:-0}" = 1 ] || [ "${ONLY_AB:-0}" = 1 ] || for t in "$bin"/test-*; do
  [ -x "$t" ] || continue
  echo "== $t"
  # Test executables find the fixtures through TAPEDECK_FIXTURES (the build machine's
  # CARGO_MANIFEST_DIR is baked in and does not exist here).
  # A hung kernel (e.g. a PDL wait that never returns) must not eat the whole device call, and a
  # crashed one must not fail the tests after it: each test runs alone, under TEST_TIMEOUT.
  if ! run_each "$t" "${TEST_TIMEOUT:-300}" 2>&1 | tee "$out/$(basename "$t").log"; then
    status=1
  fi
  # fuse=on leaves the split merge in the o GEMV out by default (it measured slower): its bit
  # identity is checked with every fusion on, merging in registers and staged in shared memory.
  for staged in off on; do
    if ! TAPEDECK_FUSE=rope,merge,head TAPEDECK_MERGE_STAGED=$staged timeout 120 "$t" fused_decode \
        --test-threads=1 --nocapture 2>&1 | tee "$out/$(basename "$t")-fuse-all-staged-$staged.log"; then
      status=1
    fi
  done
  # The MLP as one dataflow grid (TAPEDECK_FUSE=...,mlp), with the separate down GEMV's slices
  # (2 and 4 on the test shapes) and with 8 (TAPEDECK_GEMV_SLICE=256 applies to both paths; not
  # with rope, whose q/k/v kernel keeps one warp a feature while the plain GEMV splits at 256).
  for run in rope,head,mlp:2048 head,mlp:256; do
    if ! TAPEDECK_FUSE=${run%%:*} TAPEDECK_GEMV_SLICE=${run#*:} timeout 120 "$t" fused_decode \
        --test-threads=1 --nocapture 2>&1 | tee "$out/$(basename "$t")-fuse-mlp-${run#*:}.log"; then
      status=1
    fi
  done
  # The splits merged in their thread block cluster (TAPEDECK_MMA_MERGE=cluster): the megakernel
  # test compares that path with the persistent kernel's merge bit for bit.
  if ! TAPEDECK_MMA_MERGE=cluster timeout 200 "$t" megakernel graphs_replay mma_bf16_decode running_ahead \
      --test-threads=1 --nocapture 2>&1 | tee "$out/$(basename "$t")-cluster-merge.log"; then
    status=1
  fi
done

if [ -x "$bin/tapedeck" ] && [ "${ONLY_TESTS:-0}" != 1 ]; then
  td="$bin/tapedeck"
  [ "${ONLY_1B:-0}" = 1 ] || for dev in cpu cuda; do
    echo "== tapedeck generate --device $dev (greedy: the same text on both)"
    "$td" generate --device $dev --prompt "hello there" --max-tokens 16 2>&1 | tail -2
  done
  # A streamed chat completion from `tapedeck serve --device cuda --model $1`.
  serve_check() {
    echo "== tapedeck serve --device cuda --model $1: a streamed chat completion"
    "$td" serve --device cuda --model "$1" --served-model-name m --listen 127.0.0.1:8399 --db "$out/serve.db" \
      > "$out/serve.log" 2>&1 &
    local spid=$!
    for _ in $(seq 120); do curl -sf 127.0.0.1:8399/v1/models > /dev/null && break; sleep 0.5; done
    curl -sN 127.0.0.1:8399/v1/chat/completions -H 'content-type: application/json' \
      -d '{"model":"m","stream":true,"max_tokens":12,"messages":[{"role":"user","content":"hi"}]}' \
      | tail -5 | cut -c1-300
    kill $spid; wait $spid 2>/dev/null
    tail -2 "$out/serve.log"
  }
  [ "${ONLY_1B:-0}" = 1 ] || {
    echo "== replay A/B on the GPU (ci/compare.sh: engine:tiny-qwen2 on cuda, baseline | candidate toggles)"
    for pair in "|cuda_graphs=on" "|cuda_graphs=on,attn_decode=mma-bf16" "|decode_topk=16" \
      "matmul=bf16|matmul=bf16,small_gemm=gemv" \
      "matmul=bf16|matmul=bf16,small_gemm=gemv,pdl=on,cuda_graphs=on" \
      "matmul=bf16|matmul=bf16,attn_decode=mma-bf16,small_gemm=gemv,pdl=all,cuda_graphs=on" \
      "matmul=bf16,attn_decode=mma-bf16,small_gemm=gemv|matmul=bf16,attn_decode=mma-bf16,small_gemm=gemv,megakernel=on,cuda_graphs=on" \
      "|kv_dtype=bf16" "matmul=bf16|matmul=bf16,kv_dtype=fp8-e4m3"; do
      base=${pair%%|*} cand=${pair#*|}
      timeout 120 bash ci/compare.sh --base-bin "$td" --cand-bin "$td" \
        --base "engine:tiny-qwen2?device=cuda${base:+,$base}" --cand "engine:tiny-qwen2?device=cuda,$cand" \
        --out "$out/compare-${cand//[=,]/_}" > "$out/compare.log" 2>&1
      echo "baseline ${base:-default}, candidate $cand: exit $? (0 pass, 1 fail)"; tail -3 "$out/compare.log"
    done
    [ "${ONLY_AB:-0}" = 1 ] && exit $status
    serve_check tiny-qwen2
  }
  [ "${ONLY_1B:-0}" = 1 ] || for t in "" "cuda_graphs=on"; do
    mapfile -t ta < <(toggle_args "$t")
    timeout 240 "$td" bench engine --device cuda --model tiny-qwen2 --model llama-120m \
      "${ta[@]}" --concurrency 1,16,64 --turns 10 2>&1 | tee -a "$out/bench-engine-cuda.log"
  done
  # LLAMA1B_TOGGLES="a=b,c=d e=f": other toggle sets (space-separated).
  if [ -n "${LLAMA1B_TOGGLES:-}" ]; then
    read -ra sets <<< "$LLAMA1B_TOGGLES"
  else
    sets=("" "matmul=bf16,attn_decode=mma-bf16" "matmul=bf16,attn_decode=mma-bf16,cuda_graphs=on"
      "matmul=bf16,attn_decode=mma-bf16,small_gemm=gemv"
      "matmul=bf16,attn_decode=mma-bf16,small_gemm=gemv,cuda_graphs=on"
      "matmul=bf16,attn_decode=mma-bf16,small_gemm=gemv,pdl=on"
      "matmul=bf16,attn_decode=mma-bf16,small_gemm=gemv,pdl=on,cuda_graphs=on"
      "matmul=bf16,attn_decode=mma-bf16,small_gemm=gemv,pdl=on,cuda_graphs=on,fuse=on"
      "matmul=bf16,attn_decode=mma-bf16,small_gemm=gemv,pdl=all,cuda_graphs=on"
      "matmul=bf16,attn_decode=mma-bf16,small_gemm=gemv,megakernel=on,cuda_graphs=on")
  fi
  echo "== bf16 GEMV kernels vs cuBLAS on Llama-3.2-1B's linear layers"
  timeout 240 "$td" bench gemv --device cuda 2>&1 | tee "$out/bench-gemv.log"
  for t in "${sets[@]}"; do
    echo "== llama-1b on cuda, toggles: ${t:-default}"
    mapfile -t ta < <(toggle_args "$t")
    timeout ${LLAMA1B_TIMEOUT:-240} "$td" bench engine --device cuda --model llama-1b \
      "${ta[@]}" --prompt-len 512 --gen 64 \
      --concurrency "${LLAMA1B_CONC:-1,16,64}" --turns 0 --kv-budget-mib 8192 2>&1 | tee -a "$out/bench-llama-1b.log"
  done
  [ "${EXTRAS:-1}" = 1 ] && {
  echo "== llama-1b prefill at 8k tokens (bf16 GEMMs, tiled f32 attention, then tensor-core attention)"
  for pf in simt-f32 mma-bf16; do
    timeout 240 "$td" bench engine --device cuda --model llama-1b --toggle matmul=bf16 \
      --toggle attn_prefill=$pf --prompt-len 8192 --gen 4 --concurrency 1 --turns 0 \
      --kv-budget-mib 8192 2>&1 | tee -a "$out/bench-llama-1b.log"
  done
  serve_check "$HOME/.cache/tapedeck/bench/llama-1b"
  }
  # PROFILE=1: where a batch-1 decode step's time goes, per kernel (Nsight Compute's duration of
  # each of 400 consecutive eager launches in the middle of decoding; clocks left alone).
  if [ "${PROFILE:-0}" = 1 ] && command -v ncu > /dev/null; then
    echo "== ncu: llama-1b batch-1 decode, kernels by total time (${PROFILE_TOGGLES:=matmul=bf16,attn_decode=mma-bf16,small_gemm=gemv,pdl=on})"
    mapfile -t ta < <(toggle_args "$PROFILE_TOGGLES")
    timeout 300 ncu --clock-control none --metrics gpu__time_duration.sum --csv \
      --launch-skip 3000 --launch-count 400 \
      "$td" bench engine --device cuda --model llama-1b "${ta[@]}" --prompt-len 64 --gen 64 \
      --concurrency 0 --turns 0 > "$out/ncu.csv" 2> "$out/ncu.log"
    python3 bench/cuda/kernel_table.py < "$out/ncu.csv" | tee "$out/ncu-kernels.txt"
  elif [ "${PROFILE:-0}" = 1 ]; then
    echo "PROFILE=1: no ncu on this machine"
  fi
  # TIMELINE=1: an Nsight Systems trace of batch-1 decode with CUDA graphs traced per node: each
  # kernel's duration and the gap (or PDL overlap) before it, in the real graph launch.
  if [ "${TIMELINE:-0}" = 1 ] && command -v nsys > /dev/null; then
    for tt in ${TIMELINE_TOGGLES:-matmul=bf16,attn_decode=mma-bf16,small_gemm=gemv,pdl=on,cuda_graphs=on}; do
      echo "== nsys timeline: llama-1b batch-1 decode ($tt)"
      mapfile -t ta < <(toggle_args "$tt")
      tag=$(echo "$tt" | md5sum | cut -c1-6)
      timeout 240 nsys profile --cuda-graph-trace=node --trace=cuda -o "$out/tl-$tag" -f true \
        "$td" bench engine --device cuda --model llama-1b "${ta[@]}" --prompt-len 512 --gen 64 \
        --concurrency 0 --turns 0 > "$out/tl-$tag.log" 2>&1
      nsys stats --report cuda_gpu_trace --format csv -o "$out/tl-$tag" "$out/tl-$tag.nsys-rep" > /dev/null 2>&1
      python3 bench/cuda/timeline.py < "$out/tl-${tag}_cuda_gpu_trace.csv" | tee "$out/timeline-$tag.txt"
    done
  elif [ "${TIMELINE:-0}" = 1 ]; then
    echo "TIMELINE=1: no nsys on this machine"
  fi
  echo "== llama-1b: CUDA logits against the CPU engine"
  TAPEDECK_LLAMA1B="$HOME/.cache/tapedeck/bench/llama-1b" timeout 300 "$bin/test-cuda" \
    cuda_llama_1b --nocapture 2>&1 | grep -E "llama-1b|test result|panicked" | tee -a "$out/test-cuda-llama-1b.log"
  [ "${EXTRAS:-1}" = 1 ] && {
  echo "== transformers on the same llama-1b weights"
  timeout 240 python3 bench/cuda/hf_decode.py "$HOME/.cache/tapedeck/bench/llama-1b" 512 64 2>&1 \
    | grep -v Warning | tail -3 | tee -a "$out/bench-llama-1b.log"
  }
fi
exit $status
