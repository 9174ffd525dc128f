set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
. bench/cuda/gpu_env.sh > /dev/null
export TAPEDECK_KERNEL_CACHE=/tmp/kc TAPEDECK_FIXTURES=$PWD/fixtures/models
nvidia-smi --query-gpu=name --format=csv,noheader
B=matmul=bf16,attn_decode=mma-bf16,small_gemm=gemv,pdl=on,cuda_graphs=on,fuse=on,kv_dtype=bf16
D=TAPEDECK_NVRTC_DEFINES
REPS=2 bash bench/cuda/sweep.sh "X=1 $B" "$D=SWIGLU_PRE_EARLY=4,QKV_PRE_EARLY=6 $B" "$D=SWIGLU_PRE_EARLY=3,QKV_PRE_EARLY=6 $B" "$D=SWIGLU_PRE_EARLY=4,QKV_PRE_EARLY=5 $B" > $OUT/sweep.md 2>&1
cat $OUT/sweep.md; cut -d'|' -f2,4,5 $OUT/sweep.md
