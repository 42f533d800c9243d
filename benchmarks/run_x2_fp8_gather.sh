#!/usr/bin/env bash
# Two GPUs (session of 2026-11-26): the FP8 parameter all-gather (FP8Training(fp8_param_gather=True)).
#   part "checks": its GPU test and the FP8 GPU tests on GPU 0; the gather-on/off parity cases over NCCL; the gather
#                  alone against the bf16 all-gather (bench_param_gather.py).
#   part "models": bench_model on both GPUs (DP2, distributed optimizer, FP8 tensorwise with E4M3 gradients: the
#                  grouped kernels), with and without the FP8 gather, same call.
# Usage (repo root): OUT=dir bash THIS checks|models
set -uo pipefail
OUT=${OUT:-/tmp/lmoe_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
source benchmarks/model_row.sh
nvidia-smi --query-gpu=name --format=csv,noheader | head -2
case "${1:-checks}" in
kernels)  # after the Triton quantize/dequantize kernels: the GPU test and the gather alone again
  CUDA_VISIBLE_DEVICES=0 gpu_tests tests/test_gpu_fp8_param_gather.py
  timeout 200 python3 benchmarks/bench_param_gather.py --gpus 2 --shape mixtral,qwen3,deepseek_ep8 \
    --out "$OUT/gather.json" > /dev/null 2>"$OUT/gather_err.log" || tail -5 "$OUT/gather_err.log"
  python3 -c "
import json; [print({k: r[k] for k in ('shape', 'recipe', 'bf16_ms', 'fp8_wire_ms', 'fp8_ms', 'fp8_amax_ms',
 'fp8_dequant_ms', 'fp8_vs_bf16', 'wire_vs_bf16')}) for r in json.load(open('$OUT/gather.json'))['records']]"
  ;;
tiles)  # the whole-row tile shapes of triton_block_quant, at the mixtral shape
  timeout 300 python3 benchmarks/bench_param_gather.py --gpus 2 --shape mixtral --recipe tensorwise \
    --tiles 32x128x4,64x128x4,64x128x8,128x128x8,16x128x4,16x256x4,32x256x8 --out "$OUT/tiles.json" > /dev/null \
    2>"$OUT/tiles_err.log" || tail -5 "$OUT/tiles_err.log"
  python3 -c "
import json; [print({k: r[k] for k in ('tile', 'bf16_ms', 'fp8_ms', 'fp8_amax_ms', 'fp8_dequant_ms', 'fp8_vs_bf16')})
 for r in json.load(open('$OUT/tiles.json'))['records']]"
  ;;
checks)
  CUDA_VISIBLE_DEVICES=0 gpu_tests tests/test_gpu_fp8_param_gather.py tests/test_gpu_fp8.py tests/test_gpu_fp8_cache.py
  LMOE_PARITY_ACCELERATOR=gpu LMOE_PARITY_ONLY=dp2 timeout 240 python3 -m pytest -q -s -p no:cacheprovider \
    tests/parallel/test_fp8_param_gather.py > "$OUT/parity.log" 2>&1
  grep -E "rank0:|passed|failed|Error" "$OUT/parity.log" | cut -c1-300 | tail -8
  timeout 200 python3 benchmarks/bench_param_gather.py --gpus 2 --shape mixtral,qwen3,deepseek_ep8 \
    --out "$OUT/gather.json" > /dev/null 2>"$OUT/gather_err.log" || tail -5 "$OUT/gather_err.log"
  python3 -c "
import json; [print({k: r[k] for k in ('shape', 'recipe', 'bf16_ms', 'fp8_wire_ms', 'fp8_ms', 'fp8_vs_bf16',
 'wire_vs_bf16', 'bf16_bytes_per_rank', 'fp8_bytes_per_rank')}) for r in json.load(open('$OUT/gather.json'))['records']]"
  ;;
models)
  F8="--devices 2 --distributed-optimizer --fp8 tensorwise --fp8-format e4m3"
  model mixtral_fp8 mixtral-8x7b --batch 1 --accumulate 4 $F8
  model mixtral_fp8_gather mixtral-8x7b --batch 1 --accumulate 4 $F8 --fp8-param-gather
  model qwen3_fp8 qwen3-30b-a3b --batch 2 --accumulate 2 $F8
  model qwen3_fp8_gather qwen3-30b-a3b --batch 2 --accumulate 2 $F8 --fp8-param-gather
  ;;
esac
