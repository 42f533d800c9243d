#!/usr/bin/env bash
# Four GPUs (issue 8): the four folded layouts' bf16 parity and the PP parity over NCCL, then model throughput with a
# per-rank time breakdown (compute / exposed communication / idle, from 2 profiled steps after the timed ones).
# Usage (repo root): OUT=outdir PART=a|b bash benchmarks/run_h200x4_breakdown.sh
#   PART=a: parity; qwen3-30b-a3b (4 layers) on 1 GPU, DP4/EP4, TP2·DP2/EP4, PP2·DP2/EP2, PP2·TP2/EP2
#   PART=b: bf16 parity; mixtral-8x7b (2 layers; 4 for PP) on 1 GPU, DP4/EP4, PP2·DP2/EP2; the qwen3 runs of a but
#           PP2·TP2; mixtral TP2·DP2/EP4 (most important first, for a short lease)
# Records and profile tables go to $WORK (default /tmp/lmoe_work), packed into $OUT/profiles.tgz at the end.
set -uo pipefail
OUT=${OUT:-/tmp/lmoe_out}; mkdir -p "$OUT"
WORK=${WORK:-/tmp/lmoe_work}; mkdir -p "$WORK"
PART=${PART:-a}
export PYTHONUNBUFFERED=1
nvidia-smi -L
model() {  # name, then bench_model.py arguments (give --accumulate / --microbatches explicitly)
  local name=$1; shift
  timeout 170 python3 benchmarks/bench_model.py "$@" --steps 8 --warmup-steps 3 --out "$WORK/$name.json" \
    --profile "$WORK/profile_$name.txt" 2>>"$OUT/errors.log" >/dev/null
  tar czf "$OUT/profiles.tgz" -C "$WORK" .
  python3 benchmarks/record_line.py "$WORK/$name.json" "$name" --kernel-ms | tee -a "$OUT/models.jsonl"
}
Q="--preset qwen3-30b-a3b"
M="--preset mixtral-8x7b"
if [ "$PART" = a ]; then
  LMOE_PARITY_ACCELERATOR=gpu timeout 200 python3 -m pytest tests/parallel/test_bf16_layouts_parity.py -q -s \
    -p no:cacheprovider 2>&1 | tee "$OUT/parity_bf16_nccl.log" | grep -E "rank[0-9]:|passed|failed"
  LMOE_PARITY_ACCELERATOR=gpu timeout 200 python3 -m pytest tests/parallel/test_pp_parity.py -q -s \
    -p no:cacheprovider 2>&1 | tee "$OUT/parity_pp_nccl.log" | grep -E "rank[0-9]:|passed|failed"
  model qwen3_1gpu $Q --devices 1 --batch 2 --accumulate 4
  model qwen3_dp4_ep4 $Q --devices 4 --ep 4 --batch 2 --accumulate 4
  model qwen3_pp2dp2_ep2 $Q --devices 4 --pp 2 --ep 2 --batch 8 --microbatches 4 --accumulate 1
  model qwen3_tp2dp2_ep4 $Q --devices 4 --tp 2 --ep 4 --batch 4 --accumulate 4
  model qwen3_pp2tp2_ep2 $Q --devices 4 --pp 2 --tp 2 --ep 2 --batch 16 --microbatches 8 --accumulate 1
elif [ "$PART" = b ]; then
  LMOE_PARITY_ACCELERATOR=gpu timeout 200 python3 -m pytest tests/parallel/test_bf16_layouts_parity.py -q -s \
    -p no:cacheprovider 2>&1 | tee "$OUT/parity_bf16_nccl.log" | grep -E "rank[0-9]:|passed|failed"
  model mixtral_1gpu $M --devices 1 --batch 1 --accumulate 4
  model mixtral_dp4_ep4 $M --devices 4 --ep 4 --batch 1 --accumulate 4
  model mixtral_l4_pp2dp2_ep2 $M --layers 4 --devices 4 --pp 2 --ep 2 --batch 4 --microbatches 4 --accumulate 1
  model qwen3_1gpu $Q --devices 1 --batch 2 --accumulate 4
  model qwen3_dp4_ep4 $Q --devices 4 --ep 4 --batch 2 --accumulate 4
  model qwen3_pp2dp2_ep2 $Q --devices 4 --pp 2 --ep 2 --batch 8 --microbatches 4 --accumulate 1
  model qwen3_tp2dp2_ep4 $Q --devices 4 --tp 2 --ep 4 --batch 4 --accumulate 4
  model mixtral_tp2dp2_ep4 $M --devices 4 --tp 2 --ep 4 --batch 2 --accumulate 4
else
  model mixtral_1gpu $M --devices 1 --batch 1 --accumulate 4
  model mixtral_dp4_ep4 $M --devices 4 --ep 4 --batch 1 --accumulate 4
  model mixtral_l4_pp2dp2_ep2 $M --layers 4 --devices 4 --pp 2 --ep 2 --batch 4 --microbatches 4 --accumulate 1
  model mixtral_tp2dp2_ep4 $M --devices 4 --tp 2 --ep 4 --batch 2 --accumulate 4
  model qwen3_tp2cp2_ep2etp2 $Q --devices 4 --tp 2 --cp 2 --ep 2 --etp 2 --batch 4 --accumulate 4
fi
