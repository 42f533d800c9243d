#!/usr/bin/env bash
# One H100, issue 18: the GPU tests of Recompute / ActivationOffload, what a layer keeps (activation_breakdown.py),
# the settings table (bench_recompute.py) for qwen3-30b-a3b and deepseek-v3 at sequence 4096 and 16384, and the
# qwen3 8-layer micro-batch-4 fit (bench_model.py). Usage (repo root): OUT=outdir bash benchmarks/run_h100_recompute.sh
set -uo pipefail
OUT=${OUT:-/tmp/lmoe_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=.
DS='{"num_experts": 32, "first_k_dense": 1}'  # deepseek-v3 at 4 layers: 32 experts fit one GPU; per token the same
timeout 170 python3 -m pytest -q -s -p no:cacheprovider tests/test_gpu_activations.py > "$OUT/act.log" 2>&1
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_fused.py -k dispatch_matches --tb=short \
  > "$OUT/fused.log" 2>&1
python3 benchmarks/activation_breakdown.py --preset qwen3-30b-a3b --seq 4096 --batch 2 > "$OUT/kept_qwen3.json" 2>>"$OUT/err.log"
python3 benchmarks/activation_breakdown.py --preset deepseek-v3 --seq 4096 --overrides "$DS" > "$OUT/kept_ds.json" 2>>"$OUT/err.log"
for cfg in "qwen3-30b-a3b 4096 2" "qwen3-30b-a3b 16384 1" "deepseek-v3 4096 1" "deepseek-v3 16384 1"; do
  set -- $cfg
  ov='{}'; [ "$1" = deepseek-v3 ] && ov=$DS
  timeout 200 python3 benchmarks/bench_recompute.py --preset $1 --layers 4 --seq $2 --batch $3 --overrides "$ov" \
    > "$OUT/table_$1_$2.json" 2>>"$OUT/err.log"
done
timeout 240 python3 benchmarks/bench_model.py --preset qwen3-30b-a3b --layers 8 --batch 4 --seq 4096 --steps 6 \
  --warmup-steps 2 --offload 0.5 --recompute moe_act,layernorm --offload-activations expert_fc1 \
  --out "$OUT/fit8.json" > "$OUT/fit8.log" 2>&1
tail -3 "$OUT/act.log"; tail -3 "$OUT/fused.log"; grep -h "bench_recompute\]" "$OUT/err.log" | cut -c1-230
tail -c 600 "$OUT/fit8.log"
