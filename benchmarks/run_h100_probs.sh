#!/usr/bin/env bash
# One H100: the weighted SwiGLU (ModelConfig.probs_in_experts) with the Triton SwiGLU, and overlap_moe_comm's side
# stream. Part "tests": the GPU tests; part "layer": bench_layer with the new default, with the combine weighting
# (--probs-in-combine), and with neither (the previous code); part "model": qwen3 4 layers both ways, what a layer
# keeps, and the moe_act+layernorm recompute share (issue 18). Usage (repo root): OUT=dir bash run_h100_probs.sh PART
set -uo pipefail
OUT=${OUT:-/tmp/lmoe_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=.
case "${1:-tests}" in
tests)
  for f in tests/test_gpu_moe_overlap.py tests/modules/test_triton_swiglu.py tests/test_gpu_fused.py tests/test_gpu.py \
           tests/test_gpu_activations.py tests/test_gpu_wgrad_fusion.py tests/test_gpu_fp8.py tests/test_gpu_fp8_cache.py \
           tests/test_gpu_fp8_quant.py; do
    timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu "$f" >> "$OUT/tests.log" 2>&1
    echo "$f: $(tail -1 "$OUT/tests.log")"
  done
  grep -E "^(E   |FAILED)" "$OUT/tests.log" | cut -c1-300 | head -30 ;;
layer)
  for v in ${VARIANTS:-"new:" "combine:--probs-in-combine" "old:--probs-in-combine --no-swiglu-fusion"}; do
    timeout 120 python3 benchmarks/bench_layer.py --shapes qwen3,olmoe,mixtral ${v#*:} --out "$OUT/layer_${v%%:*}.json" \
      > /dev/null 2> "$OUT/layer_${v%%:*}.err"; echo "${v%%:*}"; grep -E "ratio" "$OUT/layer_${v%%:*}.err"
  done ;;
model)
  for v in "new:" "old:--probs-in-combine --no-swiglu-fusion"; do
    timeout 150 python3 benchmarks/bench_model.py --preset qwen3-30b-a3b --batch 2 --accumulate 2 --steps 5 \
      --warmup-steps 2 ${v#*:} --out "$OUT/model_${v%%:*}.json" > "$OUT/model_${v%%:*}.log" 2>&1
    python3 -c "import json; r=json.load(open('$OUT/model_${v%%:*}.json'))['records'][0]; print('${v%%:*}', {k: r.get(k) for k in ('tokens_per_sec','mfu','peak_mem_gib')})"
  done
  for o in '{}' '{"probs_in_experts": false, "swiglu_fusion": false}'; do
    timeout 60 python3 benchmarks/activation_breakdown.py --preset qwen3-30b-a3b --seq 4096 --batch 2 --overrides "$o" \
      >> "$OUT/kept.json" 2>>"$OUT/err.log"
  done
  timeout 90 python3 benchmarks/bench_recompute.py --preset qwen3-30b-a3b --layers 4 --seq 4096 --batch 2 \
    --settings "none;recompute moe_act+layernorm" > "$OUT/recompute.json" 2>>"$OUT/err.log"
  grep -h "bench_recompute\]" "$OUT/err.log" | cut -c1-220; grep '"layer_mib"' "$OUT/kept.json" ;;
esac
