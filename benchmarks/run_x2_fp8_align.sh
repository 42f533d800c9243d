#!/usr/bin/env bash
# Two GPUs (fifth session of 2026-11-25, last call): the FP8 dispatch's packed rows padded to 16 bytes (aligned
# all-to-all chunks): the pack/unpack GPU test, then bench_ep --fp8-dispatch (EP2) at the qwen3 and mixtral shapes.
# Usage (repo root): OUT=dir bash THIS
set -uo pipefail
OUT=${OUT:-/tmp/lmoe_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
nvidia-smi --query-gpu=name --format=csv,noheader | head -2
CUDA_VISIBLE_DEVICES=0 timeout 100 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_fp8_quant.py -k pack \
  2>&1 | tail -1
for s in qwen3 mixtral; do
  timeout 120 python3 benchmarks/bench_ep.py --ep 2 --shape $s --fp8-dispatch --iters 10 --out "$OUT/ep_$s.json" \
    > /dev/null 2>>"$OUT/err.log"
  python3 - "$OUT/ep_$s.json" $s <<'PY' || echo "$s: no result"
import json, sys
d = json.load(open(sys.argv[1]))
for k in ("ep2", "ep2_fp8_dispatch"):
    r = d["ranks"][0][k]
    print(sys.argv[2], k, round(r["fwd_bwd_ms"], 3), "dispatch", round(r["fwd_token_dispatch_ms"], 3),
          r.get("fwd_bwd_speedup"), r.get("token_dispatch_speedup"))
PY
done
tail -c 600 "$OUT/err.log"
