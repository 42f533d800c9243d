#!/usr/bin/env bash
# Two GPUs: parity over NCCL (the 2-rank cases), the EP=2 layer benchmark, and EP=2 model weak scaling.
# Usage (repo root): OUT=outdir bash benchmarks/run_h200x2.sh
set -uo pipefail
OUT=${OUT:-/tmp/lmoe_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi -L
LMOE_PARITY_ACCELERATOR=gpu python3 -m pytest tests/parallel/test_ep_parity.py -q -s -p no:cacheprovider \
  2>&1 | tee "$OUT/parity_nccl.log" | grep -E "rank0:|passed|failed"
for run in qwen3:alltoall qwen3:alltoall_dedup mixtral:alltoall mixtral:alltoall_dedup; do
  s=${run%%:*}; d=${run##*:}
  python3 benchmarks/bench_ep.py --ep 2 --shape $s --dispatcher $d --out "$OUT/ep.json" 2>>"$OUT/errors.log" >/dev/null
  python3 - "$OUT/ep.json" $d <<'PY' | tee -a "$OUT/ep.txt"
import json, sys
d = json.load(open(sys.argv[1]))
for r in d["ranks"]:
    print(d["shape"], sys.argv[2], "rank", r["rank"],
          {k: {m: round(v, 3) for m, v in r[k].items()} for k in ("ep1", "ep2")})
PY
done
rm -f "$OUT/ep.json"
for dev in 1 2; do
  python3 benchmarks/bench_model.py --preset qwen3-30b-a3b --accumulate 4 --steps 12 --warmup-steps 4 \
    --devices $dev --ep $dev --out "$OUT/m.json" 2>>"$OUT/errors.log" >/dev/null
  python3 - "$OUT/m.json" <<'PY' | tee -a "$OUT/models.jsonl"
import json, sys
r = json.load(open(sys.argv[1]))["records"][0]
print(json.dumps({k: r.get(k) for k in ["preset", "devices", "strategy", "precision", "fp32_main_params",
                                        "tokens_per_sec", "tflops_per_gpu", "mfu", "peak_mem_gib", "error"]}))
PY
  rm -f "$OUT/m.json"
done
