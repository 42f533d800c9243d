#!/usr/bin/env bash
# One GPU: gpu-marked tests, layer benchmarks at the four shapes, model benchmarks (bf16-true with fp32 main params).
# Usage (repo root): OUT=outdir bash benchmarks/run_h100.sh
set -uo pipefail
OUT=${OUT:-/tmp/lmoe_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pytest tests/test_gpu.py tests/modules/test_triton_permute.py -q -p no:cacheprovider 2>&1 \
  | tee "$OUT/gpu_tests.log" | tail -2
python3 benchmarks/bench_layer.py --out "$OUT/layer.json" 2>>"$OUT/errors.log" >/dev/null
python3 - "$OUT/layer.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["records"]:
    print(r["shape"], "layer", round(r["layer"]["tflops"]), "bare", round(r["bare"]["tflops"]), "ratio",
          round(r["ratio_layer_over_bare"], 3), "split_ms", {k: round(v, 2) for k, v in r.get("split_ms", {}).items()})
PY
model() {  # name, then bench_model.py arguments
  local name=$1; shift
  python3 benchmarks/bench_model.py "$@" --out "$OUT/m.json" 2>>"$OUT/errors.log" >/dev/null
  python3 - "$OUT/m.json" "$name" <<'PY' | tee -a "$OUT/models.jsonl"
import json, sys
r = json.load(open(sys.argv[1]))["records"][0]
print(json.dumps({"run": sys.argv[2], **{k: r.get(k) for k in [
    "preset", "num_layers", "precision", "fp32_main_params", "micro_batch_size", "accumulate_grad_batches",
    "devices", "tokens_per_sec", "tflops_per_gpu", "mfu", "peak_mem_gib", "step_time_s", "error"]}}))
PY
  rm -f "$OUT/m.json"
}
M=${MODELS:-all}
model mixtral_b1 --preset mixtral-8x7b --batch 1 --accumulate 4 --steps 12 --warmup-steps 4
model qwen3_b2 --preset qwen3-30b-a3b --batch 2 --accumulate 4 --steps 12 --warmup-steps 4
if [ "$M" = all ]; then
  model mixtral_b2 --preset mixtral-8x7b --batch 2 --accumulate 4 --steps 10 --warmup-steps 4
  model mixtral_b1_mixed --preset mixtral-8x7b --batch 1 --accumulate 4 --steps 10 --warmup-steps 4 \
    --precision bf16-mixed
  python3 benchmarks/bench_model.py --preset mixtral-8x7b --batch 1 --accumulate 4 --steps 8 --warmup-steps 4 \
    --profile "$OUT/profile_mixtral.txt" 2>>"$OUT/errors.log" >/dev/null
fi
