#!/usr/bin/env bash
# One GPU. SUITE=default: gpu-marked tests, layer benchmarks at the four shapes, model benchmarks (bf16-true with fp32
# main params). SUITE=optimizer: the optimizer's gpu tests, the memory table of the optimizer options (qwen3-30b-a3b,
# 4 layers) and qwen3-30b-a3b with 8 layers trained with half the optimizer state offloaded (issue 17).
# SUITE=fp8: FP8 gpu tests, the layer table in FP8 against bf16, mixtral (2 layers) and qwen3 (4 layers) in FP8, and
# the convergence comparison (issue 19).
# Usage (repo root): OUT=outdir [SUITE=optimizer|fp8] [PART=a|b] [ACC8=64] bash benchmarks/run_h100.sh
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
if [ "$SUITE" = fp8 ]; then  # issue 19. PART=a: gpu tests and the layer table; PART=b: models and convergence
  if [ "${PART:-ab}" != b ]; then
    timeout "${TEST_S:-330}" python3 -m pytest ${TESTS:-tests/test_gpu_fp8.py} -q -p no:cacheprovider --durations=8 \
      2>&1 | tee "$OUT/gpu_tests.log" | grep -E "passed|failed|Error|error|s call" | tail -25
    timeout 300 python3 benchmarks/bench_layer.py --shapes mixtral,qwen3,olmoe --split-iters 1 \
      --precision bf16,fp8-rowwise,fp8-tensorwise,fp8-tensorwise-hybrid --out "$OUT/layer_fp8.json" \
      2>>"$OUT/errors.log" >/dev/null
    python3 - "$OUT/layer_fp8.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["records"]:
    if "error" in r:
        print(r); continue
    print(r["shape"], "bf16 layer", round(r["layer"]["tflops"]), "block", round(r["bare"]["tflops"]),
          {p: (round(v["layer_speedup"], 3), round(v["bare_speedup"], 3)) for p, v in r.get("fp8", {}).items()})
PY
  fi
  if [ "${PART:-ab}" != a ]; then
    M2="--preset mixtral-8x7b --layers 2 --batch 1 --accumulate 4 --steps 8 --warmup-steps 3"
    Q4="--preset qwen3-30b-a3b --batch 2 --accumulate 2 --steps 8 --warmup-steps 3"
    for r in ${RECIPES:-bf16 rowwise tensorwise}; do
      extra=""; [ "$r" != bf16 ] && extra="--fp8 $r --fp8-format e4m3"
      model "mixtral2_$r" $M2 $extra
      model "qwen3_4_$r" $Q4 $extra
    done
    timeout "${CONV_S:-360}" python3 benchmarks/fp8_convergence.py --steps "${CONV_STEPS:-500}" \
      --out "$OUT/convergence.json" 2>>"$OUT/errors.log" | python3 -c "
import json, sys; r = json.load(sys.stdin)
print({k: (round(v['final_loss'], 4), round(100 * v['vs_bf16'], 2)) for k, v in r['runs'].items()})"
  fi
  exit 0
fi
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
