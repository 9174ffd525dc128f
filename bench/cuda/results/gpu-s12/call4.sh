#!/usr/bin/env bash
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
. bench/cuda/gpu_env.sh > /dev/null
export TAPEDECK_FIXTURES=$PWD/fixtures/models
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 150 .device/test-cuda fused_decode --test-threads=1 --nocapture 2>&1 | grep -E "fuse=on|test result|panicked" | cut -c1-160
