#!/usr/bin/env bash
# Two GPUs, issue 20's overlap_moe_comm over NCCL: the 2-rank cases of tests/parallel/test_moe_overlap.py (overlap
# and plain twins: bitwise equal, and against the 1-process reference) and the side-stream GPU test, then qwen3-30b-a3b
# 4 layers in EP2 with 4 micro-batches per step, with and without --overlap-moe-comm, in the same call.
# Usage (repo root): OUT=outdir bash benchmarks/run_h200x2_overlap.sh
set -uo pipefail
OUT=${OUT:-/tmp/lmoe_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=.
LMOE_PARITY_ACCELERATOR=gpu LMOE_PARITY_TIMEOUT=120 timeout 240 python3 -m pytest tests/parallel/test_moe_overlap.py \
  tests/test_gpu_moe_overlap.py -q -s -p no:cacheprovider > "$OUT/overlap_parity.log" 2>&1
for o in plain overlap; do
  flag=$([ $o = overlap ] && echo --overlap-moe-comm)
  timeout 170 python3 benchmarks/bench_model.py --preset qwen3-30b-a3b --devices 2 --ep 2 --microbatches 4 \
    --batch 4 --steps 6 --warmup-steps 3 $flag --out "$OUT/ep2_$o.json" > "$OUT/ep2_$o.log" 2>&1
done
grep -E "rank[01]:|passed|failed|Error" "$OUT/overlap_parity.log" | cut -c1-200 | tail -20
for o in plain overlap; do python3 - "$OUT/ep2_$o.json" <<'PY'
import json, sys
try:
    r = json.load(open(sys.argv[1]))["records"][0]
except Exception as e:
    print(sys.argv[1], "missing", e); sys.exit()
print(sys.argv[1], {k: r.get(k) for k in ("tokens_per_sec", "tflops_per_gpu", "mfu", "peak_mem_gib")}, r.get("pipeline"))
PY
done
