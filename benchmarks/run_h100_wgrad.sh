#!/usr/bin/env bash
# One H100, issue 21: the experts' wgrad GEMM accumulating into the fp32 main grads (triton_grouped_wgrad.py).
# Part "tests": the kernel and the GPU tests that run main grads; the kernel against grouped_mm + add; qwen3 4 layers
# with the experts fused (default) and without (--no-expert-wgrad-fusion). Part "models": mixtral 2 layers and
# deepseek-v3 2 layers (32 experts, vocab 32768) both ways; parts "mixtral" and "deepseek" run one each. Usage (repo root): OUT=dir bash benchmarks/run_h100_wgrad.sh PART
set -uo pipefail
OUT=${OUT:-/tmp/lmoe_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
MODEL_FIELDS="wgrad_fusion" KEEP_JSON=1
. benchmarks/model_row.sh
case "${1:-tests}" in
tests)
  for f in tests/modules/test_triton_grouped_wgrad.py tests/test_gpu_wgrad_fusion.py tests/test_gpu.py \
           tests/test_gpu_activations.py tests/test_gpu_moe_overlap.py; do
    timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu "$f" >> "$OUT/tests.log" 2>&1
    echo "$f: $(tail -1 "$OUT/tests.log")"
  done
  grep -E "^(E   |FAILED)" "$OUT/tests.log" | cut -c1-300 | head -20
  timeout 120 python3 benchmarks/bench_grouped_wgrad.py --out "$OUT/wgrad.json" 2>&1 >/dev/null | grep -v Warning
  model qwen3 qwen3-30b-a3b --batch 2 --accumulate 2
  model qwen3_dense qwen3-30b-a3b --batch 2 --accumulate 2 --no-expert-wgrad-fusion ;;
models|mixtral|deepseek)
  [ "$1" = deepseek ] || model mixtral mixtral-8x7b --batch 1 --accumulate 4
  [ "$1" = deepseek ] || model mixtral_dense mixtral-8x7b --batch 1 --accumulate 4 --no-expert-wgrad-fusion
  [ "$1" = mixtral ] && exit 0
  model deepseek deepseek-v3 --layers 2 --vocab 32768 --first-k-dense 1 --experts 32 --batch 1 --accumulate 4
  model deepseek_dense deepseek-v3 --layers 2 --vocab 32768 --first-k-dense 1 --experts 32 --batch 1 --accumulate 4 \
    --no-expert-wgrad-fusion ;;
esac
