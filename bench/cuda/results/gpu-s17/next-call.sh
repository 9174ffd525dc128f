#!/usr/bin/env bash
# For the eighteenth session's first device call (~6 min after `bash bench/cuda/build_for_device.sh`;
# copy to .device/call.sh, carry [".device"]). (1) The cluster merge of the mma decode kernel's
# splits (TAPEDECK_MMA_MERGE=cluster, written without a GPU in the seventeenth session): its bit
# tests, then the A/B against the combine kernel at 512 tokens (2-8 splits: clusters apply) and
# 4096 (more than 8 splits at 128 a split: falls back to the combine kernel, so expect no
# change). (2) Nsight Compute on the MLP GEMVs, the biggest lever left toward 80% of roofline:
# whether DRAM or issue stalls limit gate/up (2.35 TB/s) and down (2.07 TB/s).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
. bench/cuda/gpu_env.sh > /dev/null
export TAPEDECK_KERNEL_CACHE=/tmp/kc TAPEDECK_FIXTURES=$PWD/fixtures/models
nvidia-smi --query-gpu=name --format=csv,noheader
TAPEDECK_MMA_MERGE=cluster timeout 240 .device/test-cuda megakernel graphs_replay mma_bf16_decode running_ahead \
  --test-threads=1 --nocapture 2>&1 | grep -E "cluster-merged|identical|running ahead|panicked|test result|SKIPPED" \
  | tail -30 | tee $OUT/cluster-tests.log
echo "at ${SECONDS}s"
B=matmul=bf16,attn_decode=mma-bf16,small_gemm=gemv,pdl=on,cuda_graphs=on,fuse=on,kv_dtype=bf16
C=TAPEDECK_MMA_MERGE=cluster
REPS=2 bash bench/cuda/sweep.sh "X=1 $B" "$C $B" "$C+TAPEDECK_NVRTC_DEFINES=DA_TRIGGER_AFTER_MERGE=1 $B" \
  | tee $OUT/sweep512.md
PROMPT=4096 REPS=1 bash bench/cuda/sweep.sh "X=1 $B" "$C $B" | tee $OUT/sweep4096.md
echo "at ${SECONDS}s"
if command -v ncu > /dev/null; then
  mapfile -t ta < <(toggle_args "${B/cuda_graphs=on,/}")
  timeout 200 ncu --clock-control none --kernel-name regex:'gemv_bf16_(swiglu_)?1' --launch-skip 600 \
    --launch-count 6 --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
    --section Occupancy .device/tapedeck bench engine --device cuda --model llama-1b "${ta[@]}" \
    --prompt-len 512 --gen 32 --concurrency 0 --turns 0 > $OUT/ncu-mlp.txt 2>&1
  grep -E "gemv_bf16|Grid Size|Registers Per|DRAM Throughput|Memory Throughput|Duration|Achieved Occupancy|Stall|Warp Cycles Per Issued" \
    $OUT/ncu-mlp.txt | head -60
fi
echo "done at ${SECONDS}s"
