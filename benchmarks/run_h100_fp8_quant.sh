#!/usr/bin/env bash
# One H100, issue 19: the rowwise FP8 quantization kernels (triton_fp8_quant.py) exact against the torch code, then
# the FP8 expert block and layer with the kernels off and on (LMOE_FP8_TRITON_QUANT=0/1, same machine), the ratios,
# and where the fused block's time goes.
# Usage (repo root): OUT=outdir bash benchmarks/run_h100_fp8_quant.sh
set -uo pipefail
OUT=${OUT:-/tmp/lmoe_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi -L
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_fp8_quant.py > "$OUT/gpu_fp8_quant.log" 2>&1
echo "test rc=$?"; grep -E "passed|failed|Error|assert" "$OUT/gpu_fp8_quant.log" | cut -c1-300 | tail -15
for q in 0 1; do
  LMOE_FP8_TRITON_QUANT=$q timeout 75 python3 benchmarks/bench_layer.py --shapes qwen3,mixtral \
    --precision bf16,fp8-rowwise --split-iters 1 --iters 10 --warmup 3 --out "$OUT/layer_quant$q.json" \
    > "$OUT/layer_quant$q.log" 2>&1
  echo "bench LMOE_FP8_TRITON_QUANT=$q rc=$?"
done
python3 - "$OUT" <<'PY'
import json, sys
recs = {}
for q in (0, 1):
    try:
        recs[q] = {r["shape"]: r for r in json.load(open(f"{sys.argv[1]}/layer_quant{q}.json"))["records"]}
    except Exception as e:
        print(f"quant={q}: no result", e)
if len(recs) == 2:
    for shape in recs[1]:
        a, b = recs[0].get(shape, {}), recs[1][shape]
        if "fp8" not in a or "fp8" not in b:
            print(shape, "error", a.get("error"), b.get("error"))
            continue
        fa, fb = a["fp8"]["fp8-rowwise"], b["fp8"]["fp8-rowwise"]
        ta, tb = fa["bare"]["median_ms"], fb["bare"]["median_ms"]
        la, lb = fa["layer"]["median_ms"], fb["layer"]["median_ms"]
        print(f"{shape}: bf16 block {b['bare']['median_ms']:.3f} ms | fp8 block torch-quant {ta:.3f} ms, "
              f"triton-quant {tb:.3f} ms (x{ta / tb:.2f}; over bf16 x{fa['bare_speedup']:.2f} -> "
              f"x{fb['bare_speedup']:.2f}) | fp8 layer {la:.3f} -> {lb:.3f} ms (x{la / lb:.2f}; over bf16 "
              f"x{fa['layer_speedup']:.2f} -> x{fb['layer_speedup']:.2f})")
PY
LMOE_FP8_TRITON_QUANT=1 timeout 60 python3 benchmarks/profile_fp8_block.py --shape qwen3 --precision fp8-rowwise \
  --top 14 --out "$OUT/profile_quant1.json" > /dev/null 2>"$OUT/profile_quant1.log"
echo "profile rc=$?"
python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(json.dumps(d['runs'], indent=1)[:3000])" \
  "$OUT/profile_quant1.json" 2>/dev/null || tail -5 "$OUT/profile_quant1.log"
