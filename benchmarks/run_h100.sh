#!/usr/bin/env bash
# One GPU. SUITE=default: gpu-marked tests, layer benchmarks at the four shapes, model benchmarks (bf16-true with fp32
# main params). SUITE=optimizer: the optimizer's gpu tests, the memory table of the optimizer options (qwen3-30b-a3b,
# 4 layers) and qwen3-30b-a3b with 8 layers trained with half the optimizer state offloaded (issue 17).
# Usage (repo root): OUT=outdir [SUITE=optimizer] [ACC8=64] bash benchmarks/run_h100.sh
set -uo pipefail
OUT=${OUT:-/tmp/lmoe_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
SUITE=${SUITE:-default}
model() {  # name, then bench_model.py arguments
  local name=$1; shift
  python3 benchmarks/bench_model.py "$@" --out "$OUT/m.json" 2>>"$OUT/errors.log" >/dev/null
  python3 - "$OUT/m.json" "$name" <<'PY' | tee -a "$OUT/models.jsonl"
import json, sys
r = json.load(open(sys.argv[1]))["records"][0]
print(json.dumps({"run": sys.argv[2], **{k: r.get(k) for k in [
    "preset", "num_layers", "params", "precision", "fp32_main_params", "strategy", "micro_batch_size",
    "accumulate_grad_batches", "devices", "tokens_per_sec", "tflops_per_gpu", "mfu", "step_time_s",
    "optimizer_step_ms_median", "device_bytes_per_param", "host_bytes_per_param", "predicted_static_gib",
    "predicted_host_gib", "static_mem_gib", "peak_mem_gib", "peak_mem_reserved_gib", "loss_first", "loss_last",
    "error"]}}))
PY
  rm -f "$OUT/m.json"
}
if [ "$SUITE" = optimizer ]; then  # PART=a: tests and the 4-layer table; PART=b: the 8-layer runs
  if [ "${PART:-ab}" != b ]; then
    python3 -m pytest tests/test_gpu_optimizer.py tests/test_gpu.py -q -p no:cacheprovider -s 2>&1 \
      | tee "$OUT/gpu_tests.log" | grep -E "passed|failed|error|host share|saved" | tail -12
    Q4="--preset qwen3-30b-a3b --batch 2 --accumulate 2 --steps 5 --warmup-steps 2"
    model q4_plain $Q4
    model q4_dist $Q4 --distributed-optimizer
    model q4_bf16_moments $Q4 --distributed-optimizer --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16
    model q4_offload_half $Q4 --distributed-optimizer --offload 0.5
    model q4_offload_all $Q4 --distributed-optimizer --offload 1.0
  fi
  if [ "${PART:-ab}" != a ]; then
    Q8="--preset qwen3-30b-a3b --layers 8 --batch 1 --distributed-optimizer"
    model q8_offload_all_short $Q8 --accumulate 2 --steps 3 --warmup-steps 1 --offload 1.0
    model q8_offload_half $Q8 --accumulate "${ACC8:-64}" --steps 3 --warmup-steps 1 --offload "${OFF8:-0.5}"
  fi
  exit 0
fi
python3 -m pytest tests/test_gpu.py tests/test_gpu_optimizer.py tests/modules/test_triton_permute.py -q \
  -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -2
python3 benchmarks/bench_layer.py --out "$OUT/layer.json" 2>>"$OUT/errors.log" >/dev/null
python3 - "$OUT/layer.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["records"]:
    print(r["shape"], "layer", round(r["layer"]["tflops"]), "bare", round(r["bare"]["tflops"]), "ratio",
          round(r["ratio_layer_over_bare"], 3), "split_ms", {k: round(v, 2) for k, v in r.get("split_ms", {}).items()})
PY
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
