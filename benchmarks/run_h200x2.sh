#!/usr/bin/env bash
# Two GPUs: parity over NCCL (the 2-rank cases), the EP=2 layer benchmark, and EP=2 model weak scaling.
# Usage (repo root): OUT=outdir bash benchmarks/run_h200x2.sh
set -uo pipefail
OUT=${OUT:-/tmp/lmoe_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi -L
LMOE_PARITY_ACCELERATOR=gpu python3 -m pytest tests/parallel/test_ep_parity.py -q -s -p no:cacheprovider \
  2>&1 | tee "$OUT/parity_nccl.log" | grep -E "rank0:|passed|failed"
for s in qwen3 mixtral; do
  python3 benchmarks/bench_ep.py --ep 2 --shape $s --out "$OUT/ep_$s.json" 2>"$OUT/ep_$s.err" >/dev/null
  python3 - "$OUT/ep_$s.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for r in d["ranks"]:
    print(d["shape"], "rank", r["rank"], {k: {m: round(v, 3) for m, v in r[k].items()} for k in ("ep1", "ep2")})
PY
done
for dev in 1 2; do
  python3 benchmarks/bench_model.py --preset qwen3-30b-a3b --accumulate 4 --steps 12 --warmup-steps 4 \
    --devices $dev --ep $dev --out "$OUT/model_qwen3_d$dev.json" 2>"$OUT/model_qwen3_d$dev.err" >/dev/null
  python3 - "$OUT/model_qwen3_d$dev.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))["records"][0]
print({k: r.get(k) for k in ["preset", "devices", "strategy", "tokens_per_sec", "tflops_per_gpu", "mfu",
                             "peak_mem_gib", "error"]})
PY
done
