#!/usr/bin/env bash
# Eight GPUs (issue 9): the source's folding example in bf16 parity over NCCL (TP2·CP2·DP2 / EP8 and TP2·DP4 /
# ETP1·EP8), then weak scaling 1 -> 2 -> 4 -> 8 GPUs with the same work per GPU (tokens and experts per GPU), with a
# per-rank time breakdown. Usage (repo root): OUT=outdir bash benchmarks/run_h200x8.sh
#   qwen3-30b-a3b, 4 layers, 128 experts (EP = GPUs): micro-batch 2 x accumulation 4 per GPU
#   deepseek-v3, 2 layers (1 dense + 1 MoE; MLA, shared expert, group-limited sigmoid routing), 32 experts per GPU
#   (EP = GPUs, so 256 on 8 GPUs as in the full model): micro-batch 1 x accumulation 4 per GPU
set -uo pipefail
OUT=${OUT:-/tmp/lmoe_out}; mkdir -p "$OUT"
WORK=${WORK:-/tmp/lmoe_work}; mkdir -p "$WORK"
export PYTHONUNBUFFERED=1
nvidia-smi -L
model() {  # name, then bench_model.py arguments
  local name=$1; shift
  timeout 150 python3 benchmarks/bench_model.py "$@" --steps 6 --warmup-steps 2 --out "$WORK/$name.json" \
    --profile "$WORK/profile_$name.txt" 2>>"$OUT/errors.log" >/dev/null
  tar czf "$OUT/profiles.tgz" -C "$WORK" .
  python3 - "$WORK/$name.json" "$name" <<'PY' | tee -a "$OUT/models.jsonl"
import json, sys
try:
    r = json.load(open(sys.argv[1]))["records"][0]
except Exception as e:  # noqa: BLE001
    r = {"error": f"no record: {e}"}
keys = ["preset", "num_layers", "num_experts", "devices", "micro_batch_size", "accumulate_grad_batches",
        "tokens_per_step", "tokens_per_sec", "tflops_per_gpu", "mfu", "peak_mem_gib", "step_time_median_s", "error"]
out = {"run": sys.argv[2], **{k: r.get(k) for k in keys}}
out["breakdown"] = [{k: (round(v, 3) if isinstance(v, float) else v) for k, v in b.items() if k != "kernel_ms"}
                    for b in r.get("time_breakdown_per_rank") or []]
print(json.dumps(out))
PY
}
LMOE_PARITY_ACCELERATOR=gpu timeout 150 python3 -m pytest tests/parallel/test_eight_rank_parity.py -q -s \
  -p no:cacheprovider 2>&1 | tee "$OUT/parity_eight_nccl.log" | grep -E "rank[0-9]:|passed|failed"
Q="--preset qwen3-30b-a3b --layers 4 --vocab 32768 --batch 2 --accumulate 4"
for n in 1 2 4 8; do model qwen3_g$n $Q --devices $n --ep $n; done
D="--preset deepseek-v3 --layers 2 --vocab 32768 --batch 1 --accumulate 4 --first-k-dense 1"
for n in 1 2 4 8; do model deepseek_g$n $D --experts $((32 * n)) --devices $n --ep $n; done
