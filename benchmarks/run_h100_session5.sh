#!/usr/bin/env bash
# One H100 (fifth session of 2026-11-25). Part "first": the fixed-tile RoPE kernels' and the FP8 dispatch kernels'
# GPU tests, then where a step goes now (kernel tables of qwen3 4L, mixtral 2L and deepseek-v3 2L with every fusion).
# Part "optimizer": the fused AdamW + bf16 write-back (fused_optimizer_writeback): its tests, bench_optimizer.py, and
# the models with it against without it in the same call. Part "mla": the MLA RoPE fusion's tests (and the GPU tests
# that train with both new defaults), bench_rope / bench_optimizer, deepseek-v3 with and without rope_fusion.
# Usage (repo root): OUT=dir bash THIS PART
set -uo pipefail
OUT=${OUT:-/tmp/lmoe_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
MODEL_FIELDS="fused_optimizer_writeback"
. benchmarks/model_row.sh
DS="deepseek-v3 --layers 2 --vocab 32768 --batch 1 --accumulate 4 --first-k-dense 1 --experts 32"
case "${1:-first}" in
first)
  gpu_tests tests/modules/test_triton_rope.py tests/test_gpu_fp8_quant.py
  model qwen3 qwen3-30b-a3b --batch 2 --accumulate 2 --profile "$OUT/p_qwen3.txt"
  model mixtral mixtral-8x7b --batch 1 --accumulate 4 --profile "$OUT/p_mixtral.txt"
  model deepseek $DS --profile "$OUT/p_deepseek.txt" ;;
optimizer)
  gpu_tests tests/strategy/test_fused_adam.py tests/test_gpu_optimizer.py
  timeout 120 python3 benchmarks/bench_optimizer.py --out "$OUT/optimizer.json" 2>&1 >/dev/null | grep -v Warning
  model qwen3 qwen3-30b-a3b --batch 2 --accumulate 2
  model qwen3_unfused qwen3-30b-a3b --batch 2 --accumulate 2 --no-fused-optimizer
  model mixtral mixtral-8x7b --batch 1 --accumulate 4
  model mixtral_unfused mixtral-8x7b --batch 1 --accumulate 4 --no-fused-optimizer
  model deepseek $DS ;;
mla)
  gpu_tests tests/modules/test_triton_mla_rope.py tests/test_gpu_optimizer.py tests/test_gpu_document_mask.py tests/test_gpu.py
  timeout 90 python3 benchmarks/bench_rope.py --out "$OUT/rope.json" 2>&1 >/dev/null | grep -v Warning
  timeout 150 python3 benchmarks/bench_optimizer.py --out "$OUT/optimizer.json" 2>&1 >/dev/null | grep -v Warning
  MODEL_FIELDS="rope_fusion fused_optimizer_writeback"
  model deepseek $DS
  model deepseek_unfused_rope $DS --no-rope-fusion ;;
final)
  gpu_tests tests/test_gpu_activations.py tests/test_gpu_moe_overlap.py tests/test_gpu_fp8.py
  timeout 120 python3 benchmarks/probe_optimizer_repeat.py 2>&1 | grep REPEAT
  model qwen3 qwen3-30b-a3b --batch 2 --accumulate 2 --profile "$OUT/p_qwen3.txt"
  model qwen3_unfused qwen3-30b-a3b --batch 2 --accumulate 2 --no-fused-optimizer
  model qwen3_again qwen3-30b-a3b --batch 2 --accumulate 2
  model mixtral mixtral-8x7b --batch 1 --accumulate 4 ;;
sharded)
  gpu_tests tests/strategy/test_fused_adam.py tests/test_gpu_optimizer.py
  model qwen3 qwen3-30b-a3b --batch 2 --accumulate 2
  model qwen3_dist qwen3-30b-a3b --batch 2 --accumulate 2 --distributed-optimizer
  model qwen3_dist_unfused qwen3-30b-a3b --batch 2 --accumulate 2 --distributed-optimizer --no-fused-optimizer ;;
repeat)
  model qwen3 qwen3-30b-a3b --batch 2 --accumulate 2 --profile "$OUT/p_qwen3.txt"
  model mixtral mixtral-8x7b --batch 1 --accumulate 4
  model deepseek $DS ;;
esac
