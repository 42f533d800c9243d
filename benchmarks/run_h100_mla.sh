#!/usr/bin/env bash
# One H100: the GPU training tests, what a deepseek-v3 (MLA) layer keeps after the layout change, and the deepseek-v3
# settings table again at 4096 (all settings) and at 16384 (offload rows). Usage: OUT=dir bash <this>
set -uo pipefail
OUT=${OUT:-/tmp/lmoe_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=.
DS='{"num_experts": 32, "first_k_dense": 1}'
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_gpu_activations.py -k "not memory" \
  > "$OUT/gpu.log" 2>&1
python3 benchmarks/activation_breakdown.py --preset deepseek-v3 --seq 4096 --overrides "$DS" > "$OUT/kept_ds.json" 2>>"$OUT/err.log"
timeout 150 python3 benchmarks/bench_recompute.py --preset deepseek-v3 --layers 4 --seq 4096 --overrides "$DS" \
  > "$OUT/table_ds_4096.json" 2>>"$OUT/err.log"
timeout 200 python3 benchmarks/bench_recompute.py --preset deepseek-v3 --layers 4 --seq 16384 --overrides "$DS" \
  --settings "none;offload expert_fc1;offload moe_act;offload core_attn;recompute moe_act+layernorm, offload expert_fc1;recompute mla_up_proj" \
  > "$OUT/table_ds_16384.json" 2>>"$OUT/err.log"
tail -2 "$OUT/gpu.log"; grep -h "bench_recompute\]" "$OUT/err.log" | cut -c1-200
python3 -c "import json; d=json.load(open('$OUT/kept_ds.json')); print(d['layer_mib'], {k: v['mib'] for k, v in list(d['modules'].items())[:6]})"
