#!/usr/bin/env bash
# Compiles every CUDA kernel with NVRTC for compute_80 / compute_90 / compute_120 and assembles the
# PTX with ptxas for sm_80 / sm_90 / sm_120, on a machine with no GPU (CI): the kernels are built at
# run time on the user's GPU, so a kernel that does not compile would otherwise surface only there.
# NVRTC and ptxas come from NVIDIA's PyPI wheels (CUDA 13.0, the device machine's toolkit), cached
# in $TAPEDECK_CUDA_WHEELS (default ~/.cache/tapedeck/cuda-wheels). Needs: python3 with pip, cargo.
set -euo pipefail
cd "$(dirname "$0")/.."
version=13.0.88
cache="${TAPEDECK_CUDA_WHEELS:-$HOME/.cache/tapedeck/cuda-wheels}/$version"
if [ ! -x "$cache/nvidia/cu13/bin/ptxas" ] || [ ! -e "$cache/nvidia/cu13/lib/libnvrtc.so.13" ]; then
  mkdir -p "$cache/wheels"
  pip=(python3 -m pip)
  if ! python3 -m pip --version > /dev/null 2>&1; then
    # No pip next to the system python: a throwaway venv has one.
    python3 -m venv "$cache/venv"
    pip=("$cache/venv/bin/python" -m pip)
  fi
  "${pip[@]}" download --quiet --disable-pip-version-check --no-deps \
    "nvidia-cuda-nvrtc==$version" "nvidia-cuda-nvcc==$version" -d "$cache/wheels"
  for w in "$cache"/wheels/*.whl; do
    python3 -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])' "$w" "$cache"
  done
  chmod +x "$cache/nvidia/cu13/bin/ptxas"
  rm -rf "$cache/wheels" "$cache/venv"
fi
LD_LIBRARY_PATH="$cache/nvidia/cu13/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
TAPEDECK_PTXAS="$cache/nvidia/cu13/bin/ptxas" TAPEDECK_REQUIRE_NVRTC=1 \
  cargo test -p tapedeck-engine --test cuda nvrtc_compiles -- --nocapture 2>&1
