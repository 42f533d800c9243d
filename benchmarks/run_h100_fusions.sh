#!/usr/bin/env bash
# One H100 (fourth session of 2026-11-25): the fused RoPE (+ q/k norms) and the fused cross-entropy.
# Part "tests": their kernel tests and the GPU tests that run whole models (graphs, recompute/offload, packed
# documents, the merged schedule, FP8), then the two kernel benchmarks. Part "models": the RoPE tests and benchmark
# again, issue 18's recompute rows for
# qwen3 (4 layers, 2 x 4096) and qwen3 4 layers (2 x 2) / mixtral 2 layers (1 x 4) with both fusions, without the loss
# fusion and without either, in the same call. Usage (repo root): OUT=dir bash THIS PART
set -uo pipefail
OUT=${OUT:-/tmp/lmoe_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
MODEL_FIELDS="rope_fusion cross_entropy_fusion"
. benchmarks/model_row.sh
case "${1:-tests}" in
tests)
  for f in tests/modules/test_triton_rope.py tests/modules/test_triton_cross_entropy.py tests/test_gpu.py \
           tests/test_gpu_activations.py tests/test_gpu_document_mask.py tests/test_gpu_moe_overlap.py \
           tests/test_gpu_fp8.py; do
    timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu "$f" >> "$OUT/tests.log" 2>&1
    echo "$f: $(tail -1 "$OUT/tests.log")"
  done
  grep -E "^(E   |FAILED)" "$OUT/tests.log" | cut -c1-300 | head -20
  timeout 90 python3 benchmarks/bench_rope.py --out "$OUT/rope.json" 2>&1 >/dev/null | grep -v Warning
  timeout 90 python3 benchmarks/bench_cross_entropy.py --out "$OUT/ce.json" 2>&1 >/dev/null | grep -v Warning ;;
models)
  timeout 100 python3 -m pytest -q -p no:cacheprovider -m gpu tests/modules/test_triton_rope.py > "$OUT/tests.log" 2>&1
  echo "rope tests: $(tail -1 "$OUT/tests.log")"; grep -E "^(E   |FAILED)" "$OUT/tests.log" | cut -c1-300 | head
  timeout 90 python3 benchmarks/bench_rope.py --out "$OUT/rope.json" 2>&1 >/dev/null | grep -v Warning
  timeout 150 python3 benchmarks/bench_recompute.py --preset qwen3-30b-a3b --layers 4 --seq 4096 --batch 2 --steps 6 \
    --warmup 2 --settings "none;recompute layernorm;recompute moe_act;recompute moe_act+layernorm;recompute moe_act+layernorm, offload expert_fc1" \
    > "$OUT/recompute.json" 2>>"$OUT/err.log"
  python3 -c "import json; d=json.load(open('$OUT/recompute.json')); print({k: (round(v['ms'], 2), v['time_ratio'], round(v['saved_gib'], 3), v['saved_share']) for k, v in d['settings'].items()})" 2>&1 | tail -1
  model qwen3 qwen3-30b-a3b --batch 2 --accumulate 2
  model qwen3_rope qwen3-30b-a3b --batch 2 --accumulate 2 --no-cross-entropy-fusion
  model qwen3_none qwen3-30b-a3b --batch 2 --accumulate 2 --no-cross-entropy-fusion --no-rope-fusion
  model mixtral mixtral-8x7b --batch 1 --accumulate 4
  model mixtral_none mixtral-8x7b --batch 1 --accumulate 4 --no-cross-entropy-fusion --no-rope-fusion ;;
tuned)  # the autotuned RoPE kernels: their tests, where the time goes, and the two models with both fusions
  timeout 100 python3 -m pytest -q -p no:cacheprovider -m gpu tests/modules/test_triton_rope.py > "$OUT/tests.log" 2>&1
  echo "rope tests: $(tail -1 "$OUT/tests.log")"; grep -E "^(E   |FAILED)" "$OUT/tests.log" | cut -c1-300 | head
  timeout 120 python3 benchmarks/bench_rope.py --out "$OUT/rope.json" 2>&1 >/dev/null | grep -v Warning
  python3 -c "import json; [print(r['shape'], r['kernels_us_fused']) for r in json.load(open('$OUT/rope.json'))['records']]"
  model qwen3 qwen3-30b-a3b --batch 2 --accumulate 2
  model mixtral mixtral-8x7b --batch 1 --accumulate 4 ;;
esac
