#!/usr/bin/env bash
# One H100, issue 18 second pass: the GPU tests, the settings table rows with offload (bench_recompute.py now ends
# each micro-batch as the Trainer does), and the qwen3 8-layer micro-batch-4 fit. Usage: OUT=dir bash <this>
set -uo pipefail
OUT=${OUT:-/tmp/lmoe_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=.
DS='{"num_experts": 32, "first_k_dense": 1}'
OFF="none;offload expert_fc1;offload moe_act;offload core_attn;offload attn_norm+mlp_norm;recompute moe_act+layernorm, offload expert_fc1;recompute moe_act+layernorm+core_attn, offload expert_fc1"
timeout 150 python3 -m pytest -q -s -p no:cacheprovider tests/test_gpu_activations.py > "$OUT/act.log" 2>&1
timeout 120 python3 benchmarks/bench_recompute.py --preset qwen3-30b-a3b --layers 4 --seq 4096 --batch 2 \
  > "$OUT/table_qwen3_4096.json" 2>>"$OUT/err.log"
timeout 100 python3 benchmarks/bench_recompute.py --preset qwen3-30b-a3b --layers 4 --seq 16384 --settings "$OFF" \
  > "$OUT/table_qwen3_16384_off.json" 2>>"$OUT/err.log"
timeout 100 python3 benchmarks/bench_recompute.py --preset deepseek-v3 --layers 4 --seq 4096 --overrides "$DS" \
  --settings "$OFF" > "$OUT/table_ds_4096_off.json" 2>>"$OUT/err.log"
timeout 180 python3 benchmarks/bench_model.py --preset qwen3-30b-a3b --layers 8 --batch 4 --seq 4096 --steps 5 \
  --warmup-steps 2 --offload 0.5 --recompute moe_act,layernorm --offload-activations expert_fc1 \
  --out "$OUT/fit8.json" > "$OUT/fit8.log" 2>&1 || \
timeout 150 python3 benchmarks/bench_model.py --preset qwen3-30b-a3b --layers 8 --batch 4 --seq 4096 --steps 5 \
  --warmup-steps 2 --offload 0.75 --recompute moe_act,layernorm,core_attn --offload-activations expert_fc1 \
  --out "$OUT/fit8b.json" > "$OUT/fit8b.log" 2>&1
tail -3 "$OUT/act.log"; grep -h "bench_recompute\]" "$OUT/err.log" | cut -c1-200
tail -c 400 "$OUT/fit8.log"; tail -c 300 "$OUT/fit8b.log" 2>/dev/null
