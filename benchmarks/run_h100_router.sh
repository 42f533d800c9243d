#!/usr/bin/env bash
# One H100: the activation-memory GPU tests, the router GPU tests (fused cases incl. router_dtype bf16, the bf16 GEMM
# against its emulation), and the MoE layer against the bare expert block with router_dtype fp32 and bf16 in the same
# call. Usage (repo root): OUT=dir bash benchmarks/run_h100_router.sh
set -uo pipefail
OUT=${OUT:-/tmp/lmoe_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=.
timeout 100 python3 -m pytest -q -s -p no:cacheprovider tests/test_gpu_activations.py -k "memory or lean" \
  > "$OUT/act.log" 2>&1
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_fused.py -k "router" --tb=short > "$OUT/router.log" 2>&1
for d in fp32 bf16; do
  timeout 200 python3 benchmarks/bench_layer.py --shapes qwen3,olmoe,mixtral,deepseek-v3-ep8 --router-dtype $d \
    --out "$OUT/layer_$d.json" > /dev/null 2> "$OUT/layer_$d.log"
done
grep -E "held after" "$OUT/act.log"; tail -2 "$OUT/act.log"; tail -2 "$OUT/router.log"
grep -h "ratio" "$OUT"/layer_*.log | cut -c1-160
