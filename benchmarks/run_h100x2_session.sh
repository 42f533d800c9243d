#!/usr/bin/env bash
# Two H100s (fourth session of 2026-11-25). One GPU: the GPU tests never run since the wgrad kernel's review changes
# and issue 18's q/k-norm recompute (test_gpu_activations), the kernel against grouped_mm + add, and issue 18's
# recompute rows and per-layer breakdown for qwen3 (4 layers, 2 x 4096). Two GPUs: issue 19's FP8 token dispatch
# (bench_ep --fp8-dispatch, EP2) at the qwen3 and mixtral shapes. Usage (repo root): OUT=dir bash THIS
set -uo pipefail
OUT=${OUT:-/tmp/lmoe_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
for f in tests/modules/test_triton_grouped_wgrad.py tests/test_gpu_wgrad_fusion.py tests/test_gpu_activations.py; do
  timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu "$f" -s >> "$OUT/tests.log" 2>&1
  echo "$f: $(tail -1 "$OUT/tests.log")"
done
grep -E "^(E   |FAILED)|held after" "$OUT/tests.log" | cut -c1-300 | head -30
timeout 150 python3 benchmarks/bench_recompute.py --preset qwen3-30b-a3b --layers 4 --seq 4096 --batch 2 --steps 6 --warmup 2 \
  --settings "none;recompute layernorm;recompute moe_act;recompute moe_act+layernorm;recompute moe_act+layernorm, offload expert_fc1" \
  > "$OUT/recompute.json" 2>>"$OUT/err.log"
python3 - "$OUT/recompute.json" <<'PY'
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except Exception as e:
    print("recompute: no result", e); raise SystemExit
print(json.dumps(d)[:3000])
PY
timeout 60 python3 benchmarks/activation_breakdown.py --preset qwen3-30b-a3b --seq 4096 --batch 2 \
  > "$OUT/kept_qwen3.json" 2>>"$OUT/err.log"
python3 -c "import json; d=json.load(open('$OUT/kept_qwen3.json')); print('layer_mib', d['layer_mib'], d['per_layer_mib'])" 2>&1 | tail -1
timeout 120 python3 benchmarks/bench_grouped_wgrad.py --out "$OUT/wgrad.json" 2>>"$OUT/err.log" | tail -c 1500
for s in qwen3 mixtral; do
  timeout 150 python3 benchmarks/bench_ep.py --ep 2 --shape $s --fp8-dispatch --iters 10 --out "$OUT/ep_$s.json" \
    2>>"$OUT/err.log" | tail -c 2500
done
tail -c 1500 "$OUT/err.log"
