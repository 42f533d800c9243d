#!/usr/bin/env bash
# One H100, issue 21 and the GPU checks of this session: the fused router / permute tests and benchmark, the MoE
# layer against its bare block with the fused kernels and without (one run each, same machine), then the activation
# memory tests (issue 18) and the shared-expert overlap test.
# Usage (repo root): OUT=outdir bash benchmarks/run_h100_fused.sh
set -uo pipefail
OUT=${OUT:-/tmp/lmoe_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi -L
timeout 170 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_fused.py tests/modules/test_triton_permute.py \
  tests/test_gpu.py tests/test_gpu_moe_overlap.py > "$OUT/gpu_fused.log" 2>&1
grep -E "passed|failed|Error" "$OUT/gpu_fused.log" | cut -c1-300 | tail -15
timeout 60 python3 benchmarks/bench_router.py --out "$OUT/bench_router.json" > /dev/null 2>>"$OUT/errors.log"
python3 - "$OUT/bench_router.json" <<'PY'
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except Exception as e:
    print("bench_router: no result", e); raise SystemExit
print(json.dumps(d)[:1500])
PY
for mode in fused unfused; do
  flag=$([ $mode = unfused ] && echo --unfused)
  timeout 100 python3 benchmarks/bench_layer.py --shapes qwen3,olmoe,mixtral --split-iters 1 $flag \
    --out "$OUT/layer_$mode.json" > /dev/null 2>>"$OUT/errors.log"
  python3 - "$OUT/layer_$mode.json" $mode <<'PY'
import json, sys
try:
    recs = json.load(open(sys.argv[1]))["records"]
except Exception as e:
    print(sys.argv[2], "no result", e); raise SystemExit
for r in recs:
    if "error" in r:
        print(sys.argv[2], r); continue
    print(sys.argv[2], r["shape"], "layer ms", round(r["layer"]["median_ms"], 3), "layer/bare",
          round(r["ratio_layer_over_bare"], 3), "split", {k: round(v, 3) for k, v in r.get("split_ms", {}).items()})
PY
done
timeout 150 python3 -m pytest -q -s -p no:cacheprovider tests/test_gpu_activations.py > "$OUT/gpu_act.log" 2>&1
grep -E "held after|passed|failed|Error" "$OUT/gpu_act.log" | cut -c1-300 | tail -12
