#!/usr/bin/env bash
# One H100: long packed rows through the Trainer (issue 22's one-GPU part): qwen3-30b-a3b shrunk to 2 layers and a 32k
# vocabulary, one row per micro-batch, causal rows against packed documents (FlexAttention's document mask), up to
# 128k tokens with full recompute. One JSON line per run in $OUT/long.jsonl.
# Usage (repo root): OUT=dir bash benchmarks/run_h100_long.sh
set -uo pipefail
OUT=${OUT:-/tmp/lmoe_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=.
B="--preset qwen3-30b-a3b --layers 2 --vocab 32768 --batch 1 --accumulate 1 --steps 6 --warmup-steps 2"
run() {  # name, seconds, extra flags
  local name=$1 t=$2; shift 2
  timeout "$t" python3 benchmarks/bench_model.py $B "$@" --out "$OUT/$name.json" > /dev/null 2>> "$OUT/long.err"
  python3 - "$OUT/$name.json" "$name" <<'PY' | tee -a "$OUT/long.jsonl"
import json, sys
try:
    r = json.load(open(sys.argv[1]))["records"][0]
except Exception as e:
    r = {"error": f"no record: {e}"}
print(json.dumps({"run": sys.argv[2], **{k: r.get(k) for k in ("seq_length", "pack_documents", "recompute",
      "tokens_per_sec", "step_time_median_s", "peak_mem_gib", "peak_mem_reserved_gib", "loss_first", "loss_last",
      "error")}}))
PY
}
run causal_32k 120 --seq 32768
run packed_32k 120 --seq 32768 --pack-documents
run causal_64k 150 --seq 65536
run packed_64k 150 --seq 65536 --pack-documents
run packed_128k_recompute 200 --seq 131072 --pack-documents --recompute full
grep -iE "error|out of memory" "$OUT/long.err" | grep -v Warning | tail -4 | cut -c1-300
