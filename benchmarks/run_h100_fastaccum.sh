#!/usr/bin/env bash
# One H100, issue 19: FP8Training(fast_accum="all") -- fast accumulation in dgrad and wgrad too -- against the default
# ("fprop", as Transformer Engine does). Part "conv": the GPU FP8 tests while the convergence runs train side by side
# (one process each: bf16, fp8-rowwise, fp8-rowwise-fastall, fp8-delayed, fp8-blockwise; their speed is not measured),
# then the layer bench. Part "model": mixtral 2 layers and qwen3 4 layers, bf16 against both FP8 settings, and a
# kernel profile of the bf16 qwen3 step (issue 21). Usage (repo root): OUT=dir bash run_h100_fastaccum.sh PART
set -uo pipefail
OUT=${OUT:-/tmp/lmoe_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
case "${1:-conv}" in
conv)
  for r in ${RUNS:-bf16 fp8-rowwise fp8-rowwise-fastall fp8-delayed fp8-blockwise}; do
    timeout "${CONV_S:-400}" python3 benchmarks/fp8_convergence.py --runs "$r" --steps "${CONV_STEPS:-500}" \
      --out "$OUT/conv_$r.json" > /dev/null 2> "$OUT/conv_$r.err" &
  done
  timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_fp8.py tests/test_gpu_fp8_cache.py \
    tests/test_gpu_fp8_quant.py > "$OUT/tests.log" 2>&1
  echo "tests rc=$?: $(tail -1 "$OUT/tests.log")"; grep -E "^(E   |FAILED)" "$OUT/tests.log" | cut -c1-300 | head -20
  wait
  python3 - "$OUT" <<'PY'
import glob, json, sys
runs = {}
for f in sorted(glob.glob(f"{sys.argv[1]}/conv_*.json")):
    try:
        runs.update(json.load(open(f))["runs"])
    except Exception as e:
        print(f, "unreadable", e)
ref = runs.get("bf16", {}).get("final_loss")
for k, v in runs.items():
    print(f"{k}: final {v['final_loss']:.4f} steps {len(v['losses'])}" + (f" vs bf16 {100 * (v['final_loss'] / ref - 1):+.2f} %" if ref else ""))
json.dump({"runs": runs}, open(f"{sys.argv[1]}/conv_all.json", "w"))
PY
  tail -2 "$OUT"/conv_*.err | cut -c1-200
  timeout 150 python3 benchmarks/bench_layer.py --shapes qwen3,olmoe,mixtral \
    --precision bf16,fp8-rowwise,fp8-rowwise-fastall --split-iters 1 --iters 10 --warmup 3 \
    --out "$OUT/layer.json" > /dev/null 2> "$OUT/layer.err"
  echo "layer rc=$?"
  python3 - "$OUT" <<'PY'
import json, sys
for r in json.load(open(f"{sys.argv[1]}/layer.json"))["records"]:
    if "fp8" not in r:
        print(r.get("shape"), "error", r.get("error")); continue
    print(r["shape"], f"bf16 block {r['bare']['median_ms']:.3f} ms layer {r['layer']['median_ms']:.3f} ms",
          {k: (round(v["bare"]["median_ms"], 3), round(v["layer"]["median_ms"], 3), round(v["bare_speedup"], 3),
               round(v["layer_speedup"], 3)) for k, v in r["fp8"].items()})
PY
  ;;
model)
  for v in ${VARIANTS:-"mixtral_bf16:mixtral-8x7b:" "mixtral_fp8:mixtral-8x7b:--fp8 rowwise" \
           "mixtral_fp8all:mixtral-8x7b:--fp8 rowwise --fp8-fast-accum all" "qwen3_bf16:qwen3-30b-a3b:" \
           "qwen3_fp8all:qwen3-30b-a3b:--fp8 rowwise --fp8-fast-accum all"}; do
    name=${v%%:*}; rest=${v#*:}; preset=${rest%%:*}; flags=${rest#*:}
    if [ "$preset" = mixtral-8x7b ]; then shape="--batch 1 --accumulate 4"; else shape="--batch 2 --accumulate 2"; fi
    timeout 150 python3 benchmarks/bench_model.py --preset "$preset" $shape --steps 5 --warmup-steps 2 $flags \
      --out "$OUT/model_$name.json" > "$OUT/model_$name.log" 2>&1
    python3 -c "import json; r=json.load(open('$OUT/model_$name.json'))['records'][0]; print('$name', {k: r.get(k) for k in ('tokens_per_sec','tflops_per_gpu','mfu','peak_mem_gib')})" \
      2>/dev/null || { echo "$name failed"; tail -3 "$OUT/model_$name.log" | cut -c1-300; }
  done
  timeout 150 python3 benchmarks/bench_model.py --preset qwen3-30b-a3b --batch 2 --accumulate 2 --steps 4 \
    --warmup-steps 2 --profile "$OUT/profile_qwen3.txt" --out "$OUT/model_qwen3_prof.json" > "$OUT/prof.log" 2>&1
  echo "profile rc=$?"; head -45 "$OUT/profile_qwen3.txt" 2>/dev/null | cut -c1-200 ;;
esac
