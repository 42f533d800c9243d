#!/usr/bin/env bash
# One H100, issue 19 (ninth session of 2026-11-26). Parts, in the order given (default: all four):
#   tests    the FP8 GPU tests (tests/test_gpu_fp8.py, test_gpu_fp8_cache.py, test_gpu_fp8_quant.py) and the CUDA
#            graphs against eager, bf16 and FP8 (tests/test_gpu.py -k cuda_graphs)
#   wgrad    the persistent wgrad's configs at bench_model's micro-batch shapes (bench_fp8_wgrad.py --shapes
#            mixtral-b1,qwen3-b2)
#   mixtral  mixtral-8x7b 2 layers (1 x 4 micro-batches) in bf16, FP8 rowwise, and FP8 rowwise with the attention
#            projections in bf16 (--fp8-exclude '*attn*'), one after the other
#   qwen3    qwen3-30b-a3b 4 layers (2 x 2 micro-batches), the same three ways
# Usage (repo root): OUT=dir bash benchmarks/run_h100_fp8_model_shapes.sh [tests] [wgrad] [mixtral] [qwen3]
set -uo pipefail
set -f  # the exclude pattern below is a glob for FP8Training, not for the shell
OUT=${OUT:-/tmp/lmoe_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
models() {  # NAME PRESET FLAGS: the three precisions
  local name=$1 preset=$2 flags=$3 v n f
  for v in "bf16:" "fp8:--fp8 rowwise" "fp8_noattn:--fp8 rowwise --fp8-exclude *attn*"; do
    n=${v%%:*}; f=${v#*:}
    timeout -k 10 110 python3 benchmarks/bench_model.py --preset "$preset" $flags --steps 5 --warmup-steps 2 $f \
      --out /tmp/m.json > "$OUT/${name}_$n.log" 2>&1
    echo "$name $n rc=$?"
    python3 benchmarks/record_line.py /tmp/m.json "${name}_$n" \
      --keys tflops_per_gpu,tokens_per_sec,step_time_median_s,optimizer_step_ms_median,peak_mem_gib,error
    rm -f /tmp/m.json
  done
  pkill -9 -f benchmarks/bench_model.py
}
for p in ${@:-tests wgrad mixtral qwen3}; do case "$p" in
tests)
  timeout -k 10 240 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_fp8.py tests/test_gpu_fp8_cache.py \
    tests/test_gpu_fp8_quant.py > "$OUT/tests.log" 2>&1
  tail -1 "$OUT/tests.log"; grep -E "^(E   |FAILED)" "$OUT/tests.log" | cut -c1-300 | head -10
  timeout -k 10 240 python3 -m pytest -q -s -p no:cacheprovider tests/test_gpu.py -k cuda_graphs > "$OUT/graphs.log" 2>&1
  tail -1 "$OUT/graphs.log"; grep -E "^(E   |FAILED)|max \|loss diff" "$OUT/graphs.log" | cut -c1-300 | head -10 ;;
wgrad)
  WGRAD_SHAPES=mixtral-b1,qwen3-b2 WGRAD_S=200 OUT=$OUT bash benchmarks/run_h100_fp8_persistent.sh wgrad 2>&1 \
    | grep -v "^GPU" ;;
mixtral) models mx mixtral-8x7b "--batch 1 --accumulate 4" ;;
qwen3) models q3 qwen3-30b-a3b "--batch 2 --accumulate 2" ;;
esac; done
true
