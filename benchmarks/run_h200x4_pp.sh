#!/usr/bin/env bash
# Four GPUs, pipeline layouts: PP parity over NCCL, and PP-folded model throughput and measured bubbles against one
# GPU of the same machine. Usage (repo root): OUT=outdir PART=a|b bash benchmarks/run_h200x4_pp.sh
#   PART=a: PP parity (2 and 4 GPUs); qwen3-30b-a3b (4 layers) 1 GPU, PP2·DP2/EP2, PP2·TP2/EP2; 8 layers on PP4
#           with 1F1B and interleaved 1F1B (bubble)
#   PART=c: parity, then the runs of a and b in order of importance (for a short lease)
#   PART=b: mixtral-8x7b (2 layers) 1 GPU, PP2·DP2/EP2, PP2·TP2/EP2; a kernel profile of qwen3 PP2·DP2/EP2
set -uo pipefail
OUT=${OUT:-/tmp/lmoe_out}; mkdir -p "$OUT"
PART=${PART:-a}
export PYTHONUNBUFFERED=1
nvidia-smi -L
model() {  # name, then bench_model.py arguments (give --accumulate / --microbatches explicitly)
  local name=$1; shift
  python3 benchmarks/bench_model.py "$@" --steps 8 --warmup-steps 3 --out "$OUT/m.json" 2>>"$OUT/errors.log" >/dev/null
  python3 - "$OUT/m.json" "$name" <<'PY' | tee -a "$OUT/models.jsonl"
import json, sys
r = json.load(open(sys.argv[1]))["records"][0]
keys = ["preset", "num_layers", "devices", "strategy", "micro_batch_size", "tokens_per_step", "tokens_per_sec",
        "tflops_per_gpu", "mfu", "peak_mem_gib", "step_time_median_s", "pipeline", "error"]
print(json.dumps({"run": sys.argv[2], **{k: r.get(k) for k in keys}}))
PY
  rm -f "$OUT/m.json"
}
Q="--preset qwen3-30b-a3b"
M="--preset mixtral-8x7b"
if [ "$PART" = c ]; then  # the most important runs first, for a short lease
  LMOE_PARITY_ACCELERATOR=gpu python3 -m pytest tests/parallel/test_pp_parity.py -q -s -p no:cacheprovider \
    2>&1 | tee "$OUT/parity_pp_nccl.log" | grep -E "rank[0-9]:|passed|failed"
  model qwen3_1gpu $Q --devices 1 --batch 2 --accumulate 4
  model qwen3_pp2dp2_ep2 $Q --devices 4 --pp 2 --ep 2 --batch 8 --microbatches 4
  model qwen3_l8_pp4_1f1b_m8 $Q --layers 8 --devices 4 --pp 4 --batch 16 --microbatches 8
  model qwen3_l8_pp4_vpp2_m8 $Q --layers 8 --devices 4 --pp 4 --vpp 2 --batch 16 --microbatches 8
  model mixtral_1gpu $M --devices 1 --batch 1 --accumulate 4
  model mixtral_pp2dp2_ep2 $M --devices 4 --pp 2 --ep 2 --batch 4 --microbatches 4
  model qwen3_pp2tp2_ep2 $Q --devices 4 --pp 2 --tp 2 --ep 2 --batch 16 --microbatches 8
elif [ "$PART" = a ]; then
  LMOE_PARITY_ACCELERATOR=gpu python3 -m pytest tests/parallel/test_pp_parity.py -q -s -p no:cacheprovider \
    2>&1 | tee "$OUT/parity_pp_nccl.log" | grep -E "rank[0-9]:|passed|failed"
  model qwen3_1gpu $Q --devices 1 --batch 2 --accumulate 4
  model qwen3_pp2dp2_ep2 $Q --devices 4 --pp 2 --ep 2 --batch 8 --microbatches 4
  model qwen3_pp2tp2_ep2 $Q --devices 4 --pp 2 --tp 2 --ep 2 --batch 16 --microbatches 8
  model qwen3_l8_pp4_1f1b_m8 $Q --layers 8 --devices 4 --pp 4 --batch 16 --microbatches 8
  model qwen3_l8_pp4_vpp2_m8 $Q --layers 8 --devices 4 --pp 4 --vpp 2 --batch 16 --microbatches 8
else
  model mixtral_1gpu $M --devices 1 --batch 1 --accumulate 4
  model mixtral_pp2dp2_ep2 $M --devices 4 --pp 2 --ep 2 --batch 4 --microbatches 4
  model mixtral_pp2tp2_ep2 $M --devices 4 --pp 2 --tp 2 --ep 2 --batch 8 --microbatches 8
  model qwen3_pp2dp2_ep2_profiled $Q --devices 4 --pp 2 --ep 2 --batch 8 --microbatches 4 --profile "$OUT/profile_qwen3_pp2dp2.txt"
fi
