#!/usr/bin/env bash
# One H100, the session's last checks: the record_stream probe, the GPU tests of activations / training / fused
# kernels, what a layer keeps after the attention-layout change, three table rows, the router profile and a qwen3
# model step. Usage (repo root): OUT=dir bash benchmarks/run_h100_final.sh
set -uo pipefail
OUT=${OUT:-/tmp/lmoe_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=.
python3 benchmarks/probe_record_stream.py > "$OUT/probe.log" 2>&1
timeout 120 python3 -m pytest -q -s -p no:cacheprovider tests/test_gpu_activations.py > "$OUT/act.log" 2>&1
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py > "$OUT/gpu.log" 2>&1
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_fused.py -x --tb=short > "$OUT/fused.log" 2>&1
python3 benchmarks/activation_breakdown.py --preset qwen3-30b-a3b --seq 4096 --batch 2 > "$OUT/kept_qwen3.json" 2>>"$OUT/err.log"
timeout 90 python3 benchmarks/bench_recompute.py --preset qwen3-30b-a3b --layers 4 --seq 4096 --batch 2 \
  --settings "none;recompute moe_act+layernorm;offload expert_fc1;offload core_attn" > "$OUT/table.json" 2>>"$OUT/err.log"
for s in qwen3 deepseek-v3; do timeout 60 python3 benchmarks/profile_router.py --shape $s > "$OUT/router_$s.json" 2>>"$OUT/err.log"; done
timeout 150 python3 benchmarks/bench_model.py --preset qwen3-30b-a3b --batch 2 --accumulate 2 --steps 6 \
  --warmup-steps 2 --out "$OUT/qwen3.json" > "$OUT/qwen3.log" 2>&1
cat "$OUT/probe.log"; tail -2 "$OUT/act.log"; tail -2 "$OUT/gpu.log"; tail -2 "$OUT/fused.log"
grep -h "bench_recompute\]" "$OUT/err.log" | cut -c1-200; grep -E '"(router_ms|gemm)' "$OUT"/router_*.json
python3 -c "import json; r=json.load(open('$OUT/qwen3.json'))['records'][0]; print({k: r.get(k) for k in ('tokens_per_sec','mfu','peak_mem_gib')})"
