#!/usr/bin/env bash
# Eighteenth session, first device call (~8 min after `bash bench/cuda/build_for_device.sh`; copy
# to .device/call.sh, carry [".device"]). (1) The cluster merge of the mma decode kernel's splits
# (TAPEDECK_MMA_MERGE=cluster, written without a GPU in the seventeenth session): bit tests.
# (2) 4-warp GEMV blocks (TAPEDECK_GEMV_BLOCK=4, new): bit tests. (3) A/B of both at 512 tokens
# and the cluster merge at 4096 (more than 8 splits: falls back, expect no change). (4) Nsight
# Compute on the MLP GEMVs, 8- and 4-warp blocks: DRAM or issue stalls?
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
. bench/cuda/gpu_env.sh > /dev/null
export TAPEDECK_KERNEL_CACHE=/tmp/kc TAPEDECK_FIXTURES=$PWD/fixtures/models
nvidia-smi --query-gpu=name --format=csv,noheader
TAPEDECK_MMA_MERGE=cluster timeout 150 .device/test-cuda megakernel graphs_replay mma_bf16_decode running_ahead \
  --test-threads=1 --nocapture 2>&1 | grep -E "cluster-merged|identical|running ahead|panicked|test result|SKIPPED" \
  | tail -30 | tee $OUT/cluster-tests.log
echo "at ${SECONDS}s"
TAPEDECK_GEMV_BLOCK=4 timeout 200 .device/test-cuda gemv_kernel fused_gate_up megakernel fused_decode graphs_replay \
  --test-threads=1 --nocapture 2>&1 | grep -E "identical|rel|panicked|test result|SKIPPED" \
  | tail -40 | tee $OUT/block4-tests.log
echo "at ${SECONDS}s"
B=matmul=bf16,attn_decode=mma-bf16,small_gemm=gemv,pdl=on,cuda_graphs=on,fuse=on,kv_dtype=bf16
C=TAPEDECK_MMA_MERGE=cluster
G=TAPEDECK_GEMV_BLOCK=4
REPS=2 bash bench/cuda/sweep.sh "X=1 $B" "$C $B" "$G $B" "$C+$G $B" | tee $OUT/sweep512.md
PROMPT=4096 REPS=1 bash bench/cuda/sweep.sh "X=1 $B" "$C $B" | tee $OUT/sweep4096.md
echo "at ${SECONDS}s"
if command -v ncu > /dev/null; then
  mapfile -t ta < <(toggle_args "${B/cuda_graphs=on,/}")
  for g in 8 4; do
    TAPEDECK_GEMV_BLOCK=$g timeout 150 ncu --clock-control none --kernel-name regex:'gemv_bf16_(swiglu_)?1' --launch-skip 600 \
      --launch-count 4 --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
      --section Occupancy --section LaunchStats .device/tapedeck bench engine --device cuda --model llama-1b "${ta[@]}" \
      --prompt-len 512 --gen 32 --concurrency 0 --turns 0 > $OUT/ncu-mlp-block$g.txt 2>&1
    echo "== block $g"
    grep -E "gemv_bf16|Grid Size|Block Size|Registers Per|DRAM Throughput|Memory Throughput|Duration|Achieved Occupancy|Theoretical Occupancy|Stall|Warp Cycles Per Issued" \
      $OUT/ncu-mlp-block$g.txt | head -50
  done
fi
echo "done at ${SECONDS}s"
