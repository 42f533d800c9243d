#!/usr/bin/env bash
# Two GPUs, issue 20's pipeline p2p overlap over NCCL: the 2-rank PP parity cases with overlap_p2p_comm=True (and the
# synchronous twins), then qwen3-30b-a3b 4 layers in PP2 (1F1B, m = 8) with --overlap-p2p 0 and 1 in the same call.
# Usage (repo root): OUT=outdir bash benchmarks/run_h200x2_pp.sh
set -uo pipefail
OUT=${OUT:-/tmp/lmoe_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=.
LMOE_PARITY_ACCELERATOR=gpu LMOE_PARITY_TIMEOUT=120 LMOE_PARITY_ONLY='^pp2_(1f1b|interleaved|afab|uneven|bias|packed)' \
  timeout 200 python3 -m pytest tests/parallel/test_pp_parity.py -q -s -p no:cacheprovider > "$OUT/pp_parity.log" 2>&1
for o in 0 1; do
  timeout 150 python3 benchmarks/bench_model.py --preset qwen3-30b-a3b --devices 2 --pp 2 --microbatches 8 \
    --batch 1 --steps 6 --warmup-steps 3 --overlap-p2p $o --out "$OUT/pp2_overlap$o.json" > "$OUT/pp2_overlap$o.log" 2>&1
done
grep -E "rank[01]:|passed|failed|Error" "$OUT/pp_parity.log" | cut -c1-200 | tail -24
for o in 0 1; do python3 - "$OUT/pp2_overlap$o.json" <<'PY'
import json, sys
try:
    r = json.load(open(sys.argv[1]))
except Exception as e:
    print(sys.argv[1], "missing", e); sys.exit()
r = r[0] if isinstance(r, list) else r
print(sys.argv[1], {k: r.get(k) for k in ("tokens_per_sec", "tflops_per_gpu", "mfu", "peak_mem_gib")}, r.get("pipeline"))
PY
done
