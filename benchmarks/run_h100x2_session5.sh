#!/usr/bin/env bash
# Two GPUs (fifth session of 2026-11-25): issue 19's FP8 token dispatch with the Triton pack/unpack kernels
# (bench_ep --fp8-dispatch, EP2) at the qwen3 and mixtral shapes; on one of them the sharded-optimizer GPU test with
# its new tolerance and qwen3 4L with and without the fused optimizer step. Usage (repo root): OUT=dir bash THIS
set -uo pipefail
OUT=${OUT:-/tmp/lmoe_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
nvidia-smi --query-gpu=name --format=csv,noheader | head -2
for s in qwen3 mixtral; do
  timeout 150 python3 benchmarks/bench_ep.py --ep 2 --shape $s --fp8-dispatch --iters 10 --out "$OUT/ep_$s.json" \
    2>>"$OUT/err.log" | tail -c 1200
done
CUDA_VISIBLE_DEVICES=0 timeout 120 python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/test_gpu_optimizer.py \
  -k "sharded_optimizer_matches_plain and dist" > "$OUT/tests.log" 2>&1
grep -E "steps, worst|passed|failed" "$OUT/tests.log" | tail -6
MODEL_FIELDS="fused_optimizer_writeback"
. benchmarks/model_row.sh
export CUDA_VISIBLE_DEVICES=0
model qwen3 qwen3-30b-a3b --batch 2 --accumulate 2
model qwen3_unfused qwen3-30b-a3b --batch 2 --accumulate 2 --no-fused-optimizer
tail -c 800 "$OUT/err.log"
