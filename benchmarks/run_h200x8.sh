#!/usr/bin/env bash
# Eight GPUs (issue 9): the source's folding example in bf16 parity over NCCL (TP2·CP2·DP2 / EP8 and TP2·DP4 /
# ETP1·EP8), then weak scaling 1 -> 2 -> 4 -> 8 GPUs with the same work per GPU (tokens and experts per GPU), with a
# per-rank time breakdown. Usage (repo root): OUT=outdir bash benchmarks/run_h200x8.sh
#   PARITY=0 skips the parity tests; RUNS="deepseek_g8 qwen3_g8" runs only the named model runs (any that fit the
#   machine: on 4 GPUs, RUNS="qwen3_g1 qwen3_g2 qwen3_g4 ...")
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
  if [ -n "${RUNS:-}" ] && [[ " $RUNS " != *" $name "* ]]; then return; fi
  timeout 150 python3 benchmarks/bench_model.py "$@" --steps 6 --warmup-steps 2 --out "$WORK/$name.json" \
    --profile "$WORK/profile_$name.txt" 2>>"$OUT/errors.log" >/dev/null
  tar czf "$OUT/profiles.tgz" -C "$WORK" .
  python3 benchmarks/record_line.py "$WORK/$name.json" "$name" | tee -a "$OUT/models.jsonl"
}
if [ "${PARITY:-1}" = 1 ]; then
  LMOE_PARITY_ACCELERATOR=gpu timeout 150 python3 -m pytest tests/parallel/test_eight_rank_parity.py -q -s \
    -p no:cacheprovider 2>&1 | tee "$OUT/parity_eight_nccl.log" | grep -E "rank[0-9]:|passed|failed"
fi
Q="--preset qwen3-30b-a3b --layers 4 --vocab 32768 --batch 2 --accumulate 4"
for n in 1 2 4 8; do model qwen3_g$n $Q --devices $n --ep $n; done
D="--preset deepseek-v3 --layers 2 --vocab 32768 --batch 1 --accumulate 4 --first-k-dense 1"
for n in 1 2 4 8; do model deepseek_g$n $D --experts $((32 * n)) --devices $n --ep $n; done
# qwen3 again with the deduplicating all-to-all (each token sent once per destination rank, as DeepEP does)
for n in 2 4 8; do model qwen3_dedup_g$n $Q --devices $n --ep $n --dispatcher alltoall_dedup; done
