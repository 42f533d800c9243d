#!/usr/bin/env bash
# One GPU: gpu-marked tests, layer benchmarks at the four shapes, model benchmarks for both presets.
# Usage (repo root): OUT=outdir bash benchmarks/run_h100.sh
set -uo pipefail
OUT=${OUT:-/tmp/lmoe_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pytest tests/test_gpu.py tests/modules/test_triton_permute.py -q -p no:cacheprovider 2>&1 \
  | tee "$OUT/gpu_tests.log" | tail -2
python3 benchmarks/bench_layer.py --out "$OUT/layer.json" 2>"$OUT/layer.err" >/dev/null
python3 - "$OUT/layer.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["records"]:
    print(r["shape"], "layer", round(r["layer"]["tflops"]), "bare", round(r["bare"]["tflops"]), "ratio",
          round(r["ratio_layer_over_bare"], 3), "split_ms", {k: round(v, 2) for k, v in r.get("split_ms", {}).items()})
PY
for p in mixtral-8x7b qwen3-30b-a3b; do
  python3 benchmarks/bench_model.py --preset $p --accumulate 4 --steps 12 --warmup-steps 4 \
    --out "$OUT/model_$p.json" 2>"$OUT/model_$p.err" >/dev/null
  python3 - "$OUT/model_$p.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))["records"][0]
print({k: r.get(k) for k in ["preset", "num_layers", "micro_batch_size", "accumulate_grad_batches", "tokens_per_sec",
                             "tflops_per_gpu", "mfu", "peak_mem_gib", "error"]})
PY
done
