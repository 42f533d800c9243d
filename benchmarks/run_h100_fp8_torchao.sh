#!/usr/bin/env bash
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:.
# One H100, issue 19: the experts' FP8 grouped GEMMs on torchao's rowwise MoE kernels
# (FP8Training(grouped_kernels="torchao"); torchao is not in the image: the line above installs the carried wheel).
#   1. tests/test_gpu_fp8_torchao.py: forward, dgrad and wgrad against torchao's recipe quantized by hand, our
#      emulation and bf16, at Qwen3-30B-A3B's expert shapes; a 3-step FP8Training run on a tiny bf16-true model;
#   2. bench_layer.py, bf16, fp8-rowwise (ours) and fp8-rowwise-torchao in one process: each shape's expert block and
#      MoE layer, and their speed-ups over bf16 (the torchao layer with expert_rows_align=16).
# Usage (repo root): OUT=outdir bash benchmarks/run_h100_fp8_torchao.sh   (about 5 minutes)
set -uo pipefail
OUT=${OUT:-/tmp/lmoe_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi -L
python3 -c "import torch, triton, torchao; print('torch', torch.__version__, 'triton', triton.__version__, 'torchao', torchao.__version__)" 2>&1 | tail -1

timeout 120 python3 -m pytest -q -rs -p no:cacheprovider tests/test_gpu_fp8_torchao.py > "$OUT/gpu_fp8_torchao.log" 2>&1
echo "tests exit $?"
grep -E "passed|failed|skipped|Error|errs|assert" "$OUT/gpu_fp8_torchao.log" | cut -c1-400 | tail -15

timeout 220 python3 benchmarks/bench_layer.py --shapes qwen3,olmoe,mixtral --precision bf16,fp8-rowwise,fp8-rowwise-torchao \
  --split-iters 1 --out "$OUT/layer_fp8_torchao.json" > /dev/null 2> "$OUT/bench_layer.log"
echo "bench_layer exit $?"
grep -E "^\[bench\]" "$OUT/bench_layer.log" | tail -12
python3 - "$OUT/layer_fp8_torchao.json" <<'PY'
import json, sys
try:
    recs = json.load(open(sys.argv[1]))["records"]
except Exception as e:
    print("bench_layer: no result", e); raise SystemExit
for r in recs:
    if "error" in r:
        print(r["shape"], r["error"]); continue
    print(f"{r['shape']}: bf16 block {r['bare']['median_ms']:.3f} ms, layer {r['layer']['median_ms']:.3f} ms")
    for p, f in r.get("fp8", {}).items():
        layer = (f"layer {f['layer']['median_ms']:.3f} ms = x{f['layer_speedup']:.2f}" if f["layer_speedup"]
                 else f"layer {f['layer']['error']}")
        print(f"  {p:22s} block {f['bare']['median_ms']:.3f} ms = x{f['bare_speedup']:.2f} of bf16, {layer}")
PY
